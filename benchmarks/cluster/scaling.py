"""``make cluster-scaling``: bytes per worker per step as hosts are added, measured on the
network-namespace cluster and predicted by the traffic model.

    python -m benchmarks.cluster.scaling [--hosts 2,4,8] [--methods dgc,dgc-sar]
        [--out results/scaling] [BENCHMARK FLAGS ...]

For each host count, one unshaped cluster (``netns.py``) runs ``step.py`` on ResNet-50's
parameter set with a small batch (bytes do not depend on the compute; 8 workers share 2
cores). Each method's interface bytes per worker per step (``tx_bytes``) are set beside:

* the model: the message layouts and the ring collectives (``benchmarks/traffic_model.py``,
  the same figure as ``stats()``);
* the model plus Horovod's negotiation: the host's idle send rate, measured in the same
  launch once the method's steps are done (its collective names registered), times the
  method's median step time (Horovod's background loop negotiates every
  ``HOROVOD_CYCLE_TIME`` whatever is sent). Each method runs in a launch of its own.

Writes ``scaling.md`` (table and claims), ``scaling.png`` and the raw records under ``--out``.
Needs root; every namespace is removed on exit.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional

from horovod_dgc.core.methods import BY_NAME

from ..traffic_model import per_worker_bytes, resnet50_shapes
from .job import ROOT
from .netns import NetnsCluster, parse_link
from .report import load_records, negotiation_bytes
from .run import BENCH, DEFAULT_CYCLE_TIME_MS, in_namespaces, launch
from .step import COMPRESSOR_OPTIONS, VARIANTS

# The sparse all-reduce's bytes at the most hosts over the fewest: every all-reduce's (N - 1)/N
# alone grows 1.75x from 2 to 8 workers, and each stage's N headers per bucket grow too.
FLAT_LIMIT = 2.0
MODEL_TOLERANCE = 0.15   # |model / interface bytes - 1| allowed
BENCH_FLAGS = ["--batch-size", "2", "--image-size", "32", "--warmup-steps", "2", "--steps", "4"]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="Other flags go to benchmarks/cluster/step.py.")
    p.add_argument("--hosts", default="2,4,8", help="comma-separated host counts")
    p.add_argument("--methods", default="dgc,dgc-sar", help="step.py methods to run")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "scaling")
    p.add_argument("--timeout-s", type=float, default=1500.0, help="limit for each launch")
    args, args.bench_flags = p.parse_known_args(argv)
    args.hosts = [int(h) for h in args.hosts.split(",")]
    if any(h < 2 for h in args.hosts):
        p.error("--hosts: at least 2 each")
    return args


def model_bytes(model: str, method: str, workers: int) -> Optional[float]:
    """The traffic model's bytes per worker per step for a step.py method on ResNet-50, or
    None (another model, or a method the model does not know)."""
    if model != "resnet50":
        return None
    if method == "dense":
        return per_worker_bytes(None, resnet50_shapes(), workers)
    name, options, _ = VARIANTS.get(method, (method, {}, ""))
    if name not in BY_NAME:
        return None
    options = {key: value for key, value in options.items() if key not in COMPRESSOR_OPTIONS}
    return per_worker_bytes(BY_NAME[name].build(**options), resnet50_shapes(), workers)


def measure(args: argparse.Namespace) -> List[dict]:
    rows = []
    link = parse_link("unshaped")
    for hosts in args.hosts:
        records = args.out / f"records_{hosts}.jsonl"
        records.unlink(missing_ok=True)
        with NetnsCluster(hosts, f"hdgcs{os.getpid()}n{hosts}") as cluster:
            for method in args.methods.split(","):  # one launch each, as in run.py
                command = [sys.executable, str(BENCH), *BENCH_FLAGS, *args.bench_flags,
                           "--methods", method, "--link", link.name, "--out", str(records)]
                launch(cluster, link, command, args.out / "logs" / str(hosts) / method,
                       args.timeout_s, DEFAULT_CYCLE_TIME_MS)
        rows += load_records(records)
    return rows


def table(rows: List[dict]) -> Dict[str, object]:
    """The markdown table, the claims (text, passed) and the series for the plot."""
    lines = ["| workers | method | MB sent per worker per step | model MB | model / sent | "
             "model + negotiation MB | (model + negotiation) / sent | median step (s) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    series: Dict[str, List[tuple]] = {}
    within = []
    for row in rows:
        sent = row["tx_bytes_per_step"]
        model = model_bytes(row["model"], row["method"], row["workers"])
        negotiation = negotiation_bytes(row)
        full = None if model is None else model + negotiation
        series.setdefault(row["method"], []).append((row["workers"], sent, model, full))
        if full is not None:
            within.append((row, full / sent))
        cells = [str(row["workers"]), row["method"], f"{sent / 1e6:.3f}",
                 "" if model is None else f"{model / 1e6:.3f}",
                 "" if model is None else f"{model / sent:.3f}",
                 "" if full is None else f"{full / 1e6:.3f}",
                 "" if full is None else f"{full / sent:.3f}", f"{row['median_step_s']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    claims = []
    for method, points in series.items():
        points.sort()
        (n0, first, _, _), (n1, last, _, _) = points[0], points[-1]
        growth = last / first
        if method == "dgc-sar":
            claims.append((f"dgc-sar: bytes at {n1} hosts within {FLAT_LIMIT}x of {n0} hosts: "
                           f"{growth:.2f}x", growth <= FLAT_LIMIT))
        else:
            claims.append((f"{method}: bytes at {n1} hosts over {n0} hosts: {growth:.2f}x "
                           f"(N - 1 grows {(n1 - 1) / (n0 - 1):.1f}x)", None))
    for row, ratio in within:
        claims.append((f"{row['method']} at {row['workers']} hosts: model + negotiation within "
                       f"{MODEL_TOLERANCE:.0%} of the interface bytes: {ratio:.3f}",
                       abs(ratio - 1) <= MODEL_TOLERANCE))
    return {"markdown": "\n".join(lines), "claims": claims, "series": series}


def plot(series: Dict[str, List[tuple]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for method, points in series.items():
        workers = [p[0] for p in points]
        line, = ax.plot(workers, [p[1] / 1e6 for p in points], marker="o", label=f"{method} sent")
        if all(p[3] is not None for p in points):
            ax.plot(workers, [p[3] / 1e6 for p in points], "--", color=line.get_color(),
                    label=f"{method} model + negotiation")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({p[0] for points in series.values() for p in points}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("hosts (one worker each)")
    ax.set_ylabel("MB sent per worker per step")
    ax.set_title("ResNet-50, unshaped network-namespace cluster")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    rows: List[dict] = []

    def work() -> None:
        args.out.mkdir(parents=True, exist_ok=True)
        rows.extend(measure(args))

    failed, left = in_namespaces("cluster-scaling", work)
    if failed is not None:
        return failed
    result = table(rows)
    claims = "\n".join(f"- {'PASS' if ok else 'FAIL' if ok is False else 'INFO'}: {text}"
                       for text, ok in result["claims"])
    report = f"{result['markdown']}\n\n{claims}\n"
    (args.out / "scaling.md").write_text(report)
    plot(result["series"], args.out / "scaling.png")
    print("\n" + report)
    print(f"cluster-scaling: wrote {args.out}/scaling.md, scaling.png")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
