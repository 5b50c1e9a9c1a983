"""``make cluster-bench``: the training-step benchmark on a network-namespace cluster.

    python -m benchmarks.cluster.run [--hosts 4] [--links unshaped,1gbit,100mbit]
        [--out results/cluster] [--interleave] [--quick] [--check] [BENCHMARK FLAGS ...]

Builds ``--hosts`` namespaces (``netns.py``), then for each link shape and each of
``--methods`` launches ``benchmarks/cluster/step.py`` on every host through ``python -m
horovod_dgc.cluster`` (``job.py``). One launch per method: Horovod negotiates every cycle over a
bit vector with one bit per collective name it has seen, so a method run after others would
pay, in every cycle, for their names too (about 3x the idle bytes of a fresh launch after
dense's 161 names on ResNet-50). ``--interleave``: one launch per link instead, the methods'
timed steps alternating in it (step.py's ``--interleave``): their medians then compare pair
by pair on a machine whose load moves from launch to launch, each method paying for the
others' names.
Flags this script does not know (``--model``, ``--steps``, ...) go to the benchmark
unchanged: its ``--help`` lists them and their defaults. Writes ``results.jsonl``,
``results.csv``, ``results.md`` (table and claims), ``step_time.png``, ``bytes_per_step.png``
and ``logs/<link>/`` under ``--out``.

``--quick``: 2 hosts, unshaped and 100 Mbit/s, dense and dgc, 1+3 steps. ``--check``: exit 1
when a claim the run measured fails (at 100 Mbit/s dgc at least 3x faster than dense, or just
faster with ``--quick``; dgc at 1 Gbit/s within 1.3x of dense unshaped; 300x fewer bytes;
``stats()``'s network estimate within 15% of the interface bytes).

Needs root. Every namespace is removed on exit, Ctrl-C, SIGTERM and failure; the script
checks that ``ip netns list`` is back to what it was.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from ..interrupts import interrupt_on_signals
from .job import ROOT, ClusterJob
from .netns import (ClusterError, LinkShape, NetnsCluster, netns_names, parse_link,
                    require_root_and_tools)

BENCH = ROOT / "benchmarks" / "cluster" / "step.py"
QUICK_HOSTS = 2
QUICK_LINKS = "unshaped,100mbit"
QUICK_METHODS = "dense,dgc"
QUICK_BENCH_FLAGS = ["--warmup-steps", "1", "--steps", "3"]
DEFAULT_TIMEOUT_S = 1500.0
# Horovod's background loop negotiates every cycle even when idle (``idle kB/s`` in the
# report): at 5 ms that was 40% of dgc's bytes per ResNet-50 step. 25 ms made no step slower
# in our runs.
DEFAULT_CYCLE_TIME_MS = 25.0
MIN_SPEEDUP_100MBIT = 3.0
MIN_SPEEDUP_100MBIT_QUICK = 1.0


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """This script's flags; the rest, in ``args.bench_flags``, go to the benchmark."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Other flags go to benchmarks/cluster/step.py (see its --help).")
    p.add_argument("--hosts", type=int, default=4, help="namespaces")
    p.add_argument("--workers-per-host", type=int, default=1,
                   help="workers in each namespace (their traffic inside it never reaches "
                        "the link)")
    p.add_argument("--links", default="unshaped,1gbit,100mbit",
                   help="comma-separated: unshaped, 100mbit, 1gbit, <R>mbit, <R>gbit, "
                        "optionally +<D>ms of delay per direction (needs netem)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "cluster")
    p.add_argument("--prefix", default=f"hdgc{os.getpid()}",
                   help="start of the namespace names (unique per run)")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                   help="limit for each launch (one link, one method)")
    p.add_argument("--methods", default=None,
                   help="comma-separated methods of step.py, one launch each (default: all "
                        "that the workers per host allow)")
    p.add_argument("--interleave", action="store_true",
                   help="one launch per link, the methods' timed steps alternating in it")
    p.add_argument("--cycle-time-ms", type=float, default=DEFAULT_CYCLE_TIME_MS,
                   help="HOROVOD_CYCLE_TIME of the workers (Horovod's default: 1 ms)")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_HOSTS} hosts, links {QUICK_LINKS}, {' '.join(QUICK_BENCH_FLAGS)}")
    p.add_argument("--check", action="store_true", help="exit 1 when a measured claim fails")
    args, args.bench_flags = p.parse_known_args(argv)
    for flag in ("--link", "--out", "--iface", "--interleave"):
        if any(f == flag or f.startswith(flag + "=") for f in args.bench_flags):
            p.error(f"{flag} is set by this script for each launch")
    if not args.cycle_time_ms > 0:
        p.error("--cycle-time-ms must be > 0")
    if args.workers_per_host < 1:
        p.error("--workers-per-host must be >= 1")
    if args.quick:
        args.hosts, args.links = QUICK_HOSTS, QUICK_LINKS
        args.methods = args.methods or QUICK_METHODS
        args.bench_flags = QUICK_BENCH_FLAGS + args.bench_flags
    try:
        args.links = [parse_link(text.strip()) for text in args.links.split(",") if text.strip()]
    except ValueError as error:
        p.error(f"--links: {error}")
    if len({link.name for link in args.links}) != len(args.links) or not args.links:
        p.error("--links must name at least one link, each once")
    from .step import DEFAULT_METHODS, METHODS

    # Methods that reduce inside a host need several workers on it (the library refuses).
    usable = METHODS if args.workers_per_host > 1 else DEFAULT_METHODS
    args.methods = [m.strip() for m in (args.methods or ",".join(usable)).split(",") if m.strip()]
    unknown = sorted(set(args.methods) - set(usable))
    if unknown or not args.methods or len(set(args.methods)) != len(args.methods):
        p.error(f"--methods: unknown, repeated or needing --workers-per-host 2 or more: "
                f"{unknown}; choose from {','.join(usable)}")
    return args


def bench_command(args: argparse.Namespace, link_name: str, methods: List[str],
                  records: Path) -> List[str]:
    return [sys.executable, str(BENCH), *args.bench_flags, "--methods", ",".join(methods),
            "--link", link_name, "--out", str(records), *(["--interleave"] if args.interleave else [])]


def launch(cluster: NetnsCluster, link: LinkShape, command: List[str], logs: Path, timeout_s: float,
           cycle_time_ms: float, workers_per_host: int = 1) -> None:
    """Shape ``cluster``'s links as ``link`` and run ``command`` once on every host."""
    cluster.shape(link)
    ClusterJob(cluster, command, logs, timeout_s, env={"HOROVOD_CYCLE_TIME": f"{cycle_time_ms:g}"},
               workers_per_host=workers_per_host).run()


def run_links(args: argparse.Namespace, records: Path) -> None:
    with NetnsCluster(args.hosts, args.prefix) as cluster:
        for link in args.links:
            launches = [args.methods] if args.interleave else [[method] for method in args.methods]
            for methods in launches:
                launch(cluster, link, bench_command(args, link.name, methods, records),
                       args.out / "logs" / link.name / "+".join(methods), args.timeout_s,
                       args.cycle_time_ms, args.workers_per_host)


def in_namespaces(tool: str, work: Callable[[], None]) -> Tuple[Optional[int], bool]:
    """Run ``work`` (which builds namespace clusters) as root, removing what it built on
    SIGTERM too: (the exit status when it could not run or failed, else None; whether
    namespaces were left behind). Errors are printed under ``tool``'s name."""
    try:
        require_root_and_tools()
    except ClusterError as error:
        print(f"{tool}: ERROR: {error}", file=sys.stderr)
        return 1, False
    interrupt_on_signals()
    before = set(netns_names())
    failed = None
    try:
        work()
    except ClusterError as error:
        print(f"{tool}: ERROR: {error}", file=sys.stderr)
        failed = 1
    except KeyboardInterrupt:
        print(f"{tool}: interrupted; the namespaces were removed", file=sys.stderr)
        failed = 130
    finally:
        left = sorted(set(netns_names()) - before)
        if left:
            print(f"{tool}: ERROR: namespaces left behind: {left}", file=sys.stderr)
    return failed, bool(left)


def header(args: argparse.Namespace, first: dict, wall_s: float, load: tuple) -> str:
    workers = "one worker" if args.workers_per_host == 1 else f"{args.workers_per_host} workers"
    return (f"# Cluster benchmark\n\n{args.hosts} hosts (network namespaces), {workers} each; "
            f"model {first['model']}, batch {first['batch_size']} of "
            f"{first['image_size']}x{first['image_size']} per worker, {first['warmup_steps']}+"
            f"{first['steps']} steps per method"
            f"{' (timed steps interleaved, one launch per link)' if args.interleave else ''}, "
            f"HOROVOD_CYCLE_TIME={args.cycle_time_ms:g} ms. "
            f"Wall time {wall_s:.0f} s on {os.cpu_count()} CPU cores; load average "
            f"{load[0]:.2f} at the start.")


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    records = args.out / "results.jsonl"
    load, started = os.getloadavg(), time.monotonic()

    def work() -> None:
        args.out.mkdir(parents=True, exist_ok=True)
        records.unlink(missing_ok=True)
        run_links(args, records)

    failed, left = in_namespaces("cluster-bench", work)
    if failed is not None:
        return failed
    from .report import load_records, write_report

    rows = load_records(records)
    minimum = MIN_SPEEDUP_100MBIT_QUICK if args.quick else MIN_SPEEDUP_100MBIT
    report = write_report(rows, args.out, header(args, rows[0], time.monotonic() - started, load),
                          minimum)
    print("\n" + report["markdown"])
    print(f"cluster-bench: wrote {args.out}/results.csv, results.md, "
          f"{', '.join(p.name for p in report['plots'])}")
    if left:
        return 1
    if args.check and any(c.passed is False for c in report["claims"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
