"""``make cluster-adaptive``: the adaptive switch following a link that changes under a
training job, on a network-namespace cluster.

    python -m benchmarks.cluster.adaptive_link [--hosts 2] [--method blocksign]
        [--slow-link 10mbit] [--slow-at 35] [--fast-at 60] [--steps 90] [--cycle-time-ms 10]
        [--out results/adaptive] [--plot PATH] [--check] [TRAINING FLAGS ...]

One job of ``benchmarks/cluster/adaptive_train.py`` (``--method`` with ``adaptive=`` on the
fused optimizer) on unshaped links; once rank 0 has printed step ``--slow-at``, every link is
shaped as ``--slow-link``, and once it has printed step ``--fast-at`` the shaping is removed.
Expected, and checked with ``--check`` (exit 1 otherwise):

* every rank shows the same bucket modes at every step, and ends with the same parameters;
* on the unshaped link before the change, at least one bucket is dense (else the run shows
  nothing: choose a method whose compute and collectives outweigh the unshaped link's time,
  such as blocksign, whose two collectives per bucket each wait for a Horovod cycle);
* within ``--recheck-steps`` steps of the link slowing down every bucket is compressed, and
  within as many of its return the modes are those before the change.

Writes ``results.json``, ``results.md`` and ``logs/`` under ``--out``, and a plot of rank 0's
step time and each bucket's mode over the steps (``--plot``, default ``--out``/adaptive.png).
Needs root.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

from .faults import parameters_identical, read_log
from .job import ROOT, ClusterJob
from .netns import ClusterError, NetnsCluster, parse_link
from .run import in_namespaces

TRAIN = ROOT / "benchmarks" / "cluster" / "adaptive_train.py"
STEP_LINE = re.compile(r"^step (\d+) done in ([0-9.]+) s modes ([cd]*)$", re.M)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="Other flags go to benchmarks/cluster/adaptive_train.py.")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--method", default="blocksign")
    p.add_argument("--slow-link", type=parse_link, default=parse_link("10mbit"))
    p.add_argument("--slow-at", type=int, default=35, help="the link slows down after this step")
    p.add_argument("--fast-at", type=int, default=60, help="and is unshaped again after this one")
    p.add_argument("--steps", type=int, default=90)
    p.add_argument("--recheck-steps", type=int, default=20)
    p.add_argument("--cycle-time-ms", type=float, default=10.0,
                   help="HOROVOD_CYCLE_TIME of the workers: every collective waits for a cycle, "
                        "so a method of two collectives per bucket pays it twice, which the "
                        "unshaped link's bytes do not repay")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "adaptive")
    p.add_argument("--prefix", default=f"hdgca{os.getpid()}", help="start of the namespace names")
    p.add_argument("--plot", type=Path, default=None, help="the plot's path (default: OUT/adaptive.png)")
    p.add_argument("--check", action="store_true", help="exit 1 when an expectation fails")
    args, args.train_flags = p.parse_known_args(argv)
    args.plot = args.plot or args.out / "adaptive.png"
    if not 0 < args.slow_at < args.fast_at < args.steps:
        p.error("expected 0 < --slow-at < --fast-at < --steps")
    if min(args.fast_at - args.slow_at, args.steps - 1 - args.fast_at) <= args.recheck_steps:
        p.error("each link's phase must last longer than --recheck-steps (a change right after a "
                "decision waits for the next one)")
    return args


class LinkChanger:
    """A :class:`ClusterJob` watch: shapes every link once rank 0's log shows ``slow_at``,
    unshapes it at ``fast_at``."""

    def __init__(self, cluster: NetnsCluster, args: argparse.Namespace, log: Path):
        self.cluster, self.args, self.log = cluster, args, log
        self.slowed = self.restored = False

    def __call__(self) -> None:
        steps = [int(s) for s, _, _ in STEP_LINE.findall(read_log(self.log))]
        last = max(steps, default=-1)
        if not self.slowed and last >= self.args.slow_at:
            self.cluster.shape(self.args.slow_link)
            self.slowed = True
        if not self.restored and last >= self.args.fast_at:
            self.cluster.shape(parse_link("unshaped"))
            self.restored = True


@dataclass(frozen=True)
class Phase:
    """One link's span of steps and what the switch did in it."""

    link: str
    first_step: int
    modes_before: str  # at the phase's first step
    modes_after: str  # at its last step
    settled_at: Optional[int]  # the first step showing the modes expected on this link
    lag_steps: Optional[int]
    median_step_s: float


def steps_of(log: Path) -> Dict[int, tuple]:
    return {int(s): (float(t), modes) for s, t, modes in STEP_LINE.findall(read_log(log))}


def phases(steps: Dict[int, tuple], args: argparse.Namespace, settled: str) -> List[Phase]:
    """The three phases (unshaped, slow, unshaped again) of rank 0's ``steps``. Expected: on the
    slow link every bucket compressed, on the unshaped link again the modes ``settled`` (those
    of the first phase's last step)."""
    spans = [("unshaped", 0, args.slow_at + 1, None),
             (args.slow_link.name, args.slow_at + 1, args.fast_at + 1, "compressed"),
             ("unshaped", args.fast_at + 1, args.steps, settled)]
    found = []
    for link, start, end, want in spans:
        span = [s for s in range(start, end) if s in steps]
        if not span:
            continue
        if want == "compressed":
            want = "c" * len(steps[span[0]][1])
        hit = next((s for s in span if want is not None and steps[s][1] == want), None)
        found.append(Phase(link, start, steps[span[0]][1], steps[span[-1]][1], hit,
                           None if hit is None else hit - start,
                           statistics.median(steps[s][0] for s in span)))
    return found


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    report: Dict[str, object] = {}

    def work() -> None:
        logs = args.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, str(TRAIN), "--method", args.method, "--steps", str(args.steps),
                   "--recheck-steps", str(args.recheck_steps), *args.train_flags]
        with NetnsCluster(args.hosts, args.prefix) as cluster:
            changer = LinkChanger(cluster, args, logs / "rank0.log")
            ClusterJob(cluster, command, logs, args.timeout_s, echo_rank0=False, watch=changer,
                       env={"HOROVOD_CYCLE_TIME": f"{args.cycle_time_ms:g}"}).run()
        per_rank = [steps_of(logs / f"rank{r}.log") for r in range(args.hosts)]
        modes = [{s: m for s, (_, m) in ranks.items()} for ranks in per_rank]
        settled = per_rank[0][args.slow_at][1] if args.slow_at in per_rank[0] else ""
        found = phases(per_rank[0], args, settled)
        report.update(hosts=args.hosts, method=args.method, slow_link=args.slow_link.name,
                      slow_at=args.slow_at, fast_at=args.fast_at, recheck_steps=args.recheck_steps,
                      modes_alike=all(m == modes[0] for m in modes[1:]),
                      parameters_identical=parameters_identical(logs, args.hosts),
                      dense_before=("d" in settled), phases=[asdict(p) for p in found])
        plot(per_rank[0], args)

    failed, left = in_namespaces("cluster-adaptive", work)
    if failed is not None:
        return failed
    expected = (report["modes_alike"] and report["parameters_identical"] and report["dense_before"]
                and all(p["lag_steps"] is not None and p["lag_steps"] <= args.recheck_steps
                        for p in report["phases"][1:]))
    report["as_expected"] = bool(expected)
    (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (args.out / "results.md").write_text(text)
    print(text)
    return 1 if left or (args.check and not expected) else 0


def plot(steps: Dict[int, tuple], args: argparse.Namespace) -> None:
    """Rank 0's step time over the steps, above each bucket's mode, the slow link shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    order = sorted(steps)
    if not order:
        return
    buckets = len(steps[order[0]][1])
    fig, (time_ax, mode_ax) = plt.subplots(2, 1, sharex=True, figsize=(7.5, 4.2),
                                           gridspec_kw={"height_ratios": [2, 1]})
    time_ax.plot(order, [steps[s][0] * 1e3 for s in order], marker="o", markersize=2, linewidth=1)
    time_ax.set_yscale("log")
    time_ax.set_ylabel("step (ms), rank 0")
    modes = [[1.0 if steps[s][1][b] == "d" else 0.0 for s in order] for b in range(buckets)]
    mode_ax.imshow(modes, aspect="auto", interpolation="nearest", cmap=ListedColormap(["#4c72b0", "#dd8452"]),
                   vmin=0, vmax=1, extent=(order[0] - 0.5, order[-1] + 0.5, buckets - 0.5, -0.5))
    mode_ax.set_yticks(range(buckets))
    mode_ax.set_ylabel("bucket")
    mode_ax.set_xlabel("step (blue: compressed, orange: dense)")
    for ax in (time_ax, mode_ax):
        ax.axvspan(args.slow_at + 0.5, args.fast_at + 0.5, color="grey", alpha=0.2, linewidth=0)
    time_ax.set_title(f"{args.method} with adaptive=, {args.hosts} hosts: the link at "
                      f"{args.slow_link.name} in the shaded steps", fontsize=9)
    time_ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=120)
    plt.close(fig)


def markdown(report: Dict[str, object]) -> str:
    rows = [f"| {p['link']} | {p['first_step']} | {p['modes_before']} | {p['modes_after']} | "
            f"{'' if p['settled_at'] is None else p['settled_at']} | "
            f"{'' if p['lag_steps'] is None else p['lag_steps']} | {p['median_step_s']:.3f} |"
            for p in report["phases"]]
    return "\n".join([
        f"# The adaptive switch on a changing link\n\n{report['hosts']} hosts, {report['method']} with "
        f"adaptive= (re-check every {report['recheck_steps']} steps); the link slows to "
        f"{report['slow_link']} after step {report['slow_at']} and is unshaped again after step "
        f"{report['fast_at']}. Modes: one letter per bucket, c compressed, d dense.\n",
        "| link | from step | modes then | modes at its end | settled at step | steps to settle | median step (s) |",
        "|---|---:|---|---|---:|---:|---:|", *rows, "",
        f"- every rank showed the same modes at every step: {'yes' if report['modes_alike'] else 'NO'}",
        f"- parameters identical on every rank: {'yes' if report['parameters_identical'] else 'NO'}",
        f"- a bucket dense on the unshaped link: {'yes' if report['dense_before'] else 'NO'}",
        f"- as expected: {'yes' if report.get('as_expected') else 'NO'}", ""])


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ClusterError as error:
        print(f"cluster-adaptive: ERROR: {error}", file=sys.stderr)
        sys.exit(1)
