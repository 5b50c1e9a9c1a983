"""``make cluster-negotiation``: what Horovod's own negotiation sends while nothing is trained,
against the number of workers, ``HOROVOD_CYCLE_TIME`` and the collective names seen so far.

    python -m benchmarks.cluster.negotiation [--hosts 2,4,8] [--cycle-times-ms 1,5,25]
        [--names 0,10,161,322] [--idle-s 3] [--out results/negotiation]

Horovod's background loop runs every ``HOROVOD_CYCLE_TIME`` whether or not a collective is
waiting, and each cycle the workers agree over a bit vector with one bit per collective name
in the response cache. None of it is in ``stats()``, which counts the bytes of the collectives
a method launches: this is the rest of what a worker's interface carries, and for a sparse
method it can be as large as the messages. The name counts of the default ``--names`` are those
of real jobs on ResNet-50 (161 tensors): dgc on the fused ``DistributedOptimizer`` uses 5
names, ScaleCom 10; dgc on the stock ``hvd.DistributedOptimizer`` 161 (one per tensor), as does
a dense job; ScaleCom there 322.

For each host count, one unshaped cluster (``netns.py``); for each cycle time, one launch of
this module with ``--worker`` on every host. A worker registers names (a 1-element
all-reduce under each new name) up to each count of ``--names`` in turn, then, after a
barrier, reads its interface's ``tx_bytes`` and ``tx_packets`` around ``--idle-s`` seconds of
sleep. Writes ``negotiation.md`` and the raw records (``negotiation.jsonl``) under ``--out``.
Needs root; every namespace is removed on exit.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .job import ROOT
from .netns import NetnsCluster, parse_link
from .run import in_namespaces, launch

DEFAULT_NAMES = "0,10,161,322"
NAME_PREFIX = "negotiation.name"


def _ints(text: str) -> List[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", default="2,4,8", help="comma-separated host counts (one worker each)")
    p.add_argument("--cycle-times-ms", default="1,5,25",
                   help="comma-separated HOROVOD_CYCLE_TIME values, one launch each")
    p.add_argument("--names", default=DEFAULT_NAMES,
                   help="comma-separated, increasing: collective names registered before each "
                        "idle reading")
    p.add_argument("--idle-s", type=float, default=3.0, help="seconds of each idle reading")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "negotiation")
    p.add_argument("--timeout-s", type=float, default=600.0, help="limit for each launch")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.hosts, args.names = _ints(args.hosts), _ints(args.names)
    args.cycle_times_ms = [float(v) for v in args.cycle_times_ms.split(",") if v.strip()]
    if any(h < 2 for h in args.hosts) or not args.hosts:
        p.error("--hosts: at least 2 each")
    if not args.names or args.names != sorted(set(args.names)) or args.names[0] < 0:
        p.error("--names: increasing counts, from 0 up")
    if not args.cycle_times_ms or any(c <= 0 for c in args.cycle_times_ms):
        p.error("--cycle-times-ms: positive values")
    if not args.idle_s > 0:
        p.error("--idle-s must be > 0")
    return args


def work_as_worker(args: argparse.Namespace) -> None:
    """One launch on every host: a reading per count of names; rank 0 appends the records."""
    import horovod.torch as hvd
    import torch

    from .step import idle_per_s

    hvd.init()
    iface = os.environ["HOROVOD_DGC_IFACE"]
    readings, registered = [], 0
    for names in args.names:
        for i in range(registered, names):
            hvd.allreduce(torch.ones(1), name=f"{NAME_PREFIX}{i}")
        registered = names
        bytes_per_s, packets_per_s = idle_per_s(iface, args.idle_s, ("tx_bytes", "tx_packets"))
        readings.append({"names": names, "bytes_per_s": bytes_per_s, "packets_per_s": packets_per_s})
    everyone = hvd.allgather_object(readings, name="negotiation.readings")
    if hvd.rank() == 0:
        cycle_ms = float(os.environ["HOROVOD_CYCLE_TIME"])
        with open(args.out / "negotiation.jsonl", "a") as f:
            for i, names in enumerate(args.names):
                f.write(json.dumps({"workers": hvd.size(), "cycle_time_ms": cycle_ms,
                                    "names": names,
                                    "bytes_per_s": [r[i]["bytes_per_s"] for r in everyone],
                                    "packets_per_s": [r[i]["packets_per_s"] for r in everyone]})
                        + "\n")


def measure(args: argparse.Namespace) -> None:
    command = [sys.executable, "-m", "benchmarks.cluster.negotiation", "--worker",
               "--names", ",".join(map(str, args.names)), "--idle-s", str(args.idle_s),
               "--out", str(args.out)]
    for hosts in args.hosts:
        with NetnsCluster(hosts, f"hdgcn{os.getpid()}n{hosts}") as cluster:
            for cycle_ms in args.cycle_times_ms:
                launch(cluster, parse_link("unshaped"), command,
                       args.out / "logs" / f"{hosts}-{cycle_ms:g}", args.timeout_s, cycle_ms)


def table(records: List[Dict]) -> str:
    """kB/s per worker (mean over the workers, and the busiest), packets/s and bytes per
    packet, one row per (workers, cycle time, names)."""
    lines = ["| workers | HOROVOD_CYCLE_TIME (ms) | names | kB/s per worker (mean) | "
             "busiest worker kB/s | packets/s per worker | bytes per packet | "
             "bytes per worker per cycle (mean) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(records, key=lambda r: (r["workers"], r["cycle_time_ms"], r["names"])):
        mean_bytes = statistics.mean(r["bytes_per_s"])
        mean_packets = statistics.mean(r["packets_per_s"])
        per_packet = mean_bytes / mean_packets if mean_packets else float("nan")
        per_cycle = mean_bytes * r["cycle_time_ms"] / 1e3
        lines.append(f"| {r['workers']} | {r['cycle_time_ms']:g} | {r['names']} | "
                     f"{mean_bytes / 1e3:.1f} | {max(r['bytes_per_s']) / 1e3:.1f} | "
                     f"{mean_packets:.0f} | {per_packet:.0f} | {per_cycle:.0f} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        work_as_worker(args)
        return 0
    records_path = args.out / "negotiation.jsonl"

    def work() -> None:
        args.out.mkdir(parents=True, exist_ok=True)
        records_path.unlink(missing_ok=True)
        measure(args)

    failed, left = in_namespaces("cluster-negotiation", work)
    if failed is not None:
        return failed
    records = [json.loads(line) for line in records_path.read_text().splitlines() if line]
    report = table(records) + "\n"
    (args.out / "negotiation.md").write_text(report)
    print("\n" + report)
    print(f"cluster-negotiation: wrote {args.out}/negotiation.md")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
