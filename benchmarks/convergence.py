"""Dense training next to every compression method on Fashion-MNIST: final accuracy, curves,
wall time and traffic, in one run.

Runs ``examples/pytorch_fashion_mnist.py`` (a 1.03M-parameter CNN, 99.9% of it in compressed
tensors) once per configuration with ``horovodrun`` (same seed, epochs, data and workers):
dense; every method of the table at the papers' settings (density 0.001 with warm-up for
the sparse ones) on the stock and on the fused path; dgc through the DDP hook; dgc with
8-bit values; dgc with its small tensors dense (the paper's choice); dgc under bfloat16
autocast and under float16 autocast with a GradScaler; dense, and topk at its default
density (0.01), under Adam. Writes to ``--out`` (default ``results/convergence/``) one
``<run>.json`` and ``<run>.log`` per run, ``convergence.md`` (the table and the checks) and
``convergence.png`` (test accuracy per epoch).

    .venv/bin/python -m benchmarks.convergence [--np 4] [--epochs 4] [--runs NAME ...] [--reuse]

The checks: every method within 1.0 point of dense's final accuracy (blocksign 1.5), and the
16-bit dgc runs within 1.0 point of dense float32; Adam runs are compared with dense Adam.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from benchmarks import ROOT, worker_env
from horovod_dgc.core.methods import METHODS

EXAMPLE = ROOT / "examples" / "pytorch_fashion_mnist.py"
DEFAULT_OUT = Path("results") / "convergence"
# Points of accuracy a run may lose against its reference (the bounds).
TOLERANCE = {"blocksign": 1.5}
DEFAULT_TOLERANCE = 1.0
RANK0_PREFIX = "[0]<stdout>:"


@dataclass(frozen=True)
class Run:
    """One training run: its name, the example's flags, and the run it is compared with."""

    name: str
    flags: Dict[str, str] = field(default_factory=dict)
    reference: Optional[str] = "dense"

    @property
    def method(self) -> str:
        return self.flags.get("compression", "dense")


def all_runs() -> List[Run]:
    runs = [Run("dense", {"compression": "dense"}, reference=None)]
    for spec in METHODS:
        for path in ("stock", "fused"):
            runs.append(Run(f"{spec.name}-{path}", {"compression": spec.name, "path": path}))
    runs += [Run("dgc-ddp", {"compression": "dgc", "path": "ddp"}),
             Run("dgc-int8", {"compression": "dgc", "value-dtype": "int8"}),
             Run("dgc-small-dense", {"compression": "dgc", "small-density": "dense"}),
             Run("dgc-sparse-allreduce", {"compression": "dgc", "aggregation": "sparse_allreduce"}),
             Run("dgc-adaptive", {"compression": "dgc", "path": "fused", "adaptive": "on"}),
             Run("dgc-bf16", {"compression": "dgc", "precision": "bf16"}),
             Run("dgc-fp16-gradscaler", {"compression": "dgc", "precision": "fp16"}),
             Run("dense-adam", {"compression": "dense", "optimizer": "adam"}, reference=None),
             # Top-k's own default density: at 0.001 error feedback starves Adam's
             # second-moment estimate (2.00 points lost, docs/benchmarks.md).
             Run("topk-adam", {"compression": "topk", "optimizer": "adam", "density": "0.01"},
                 reference="dense-adam")]
    return runs


def parse_args(argv: Sequence[str] = None) -> argparse.Namespace:
    names = [run.name for run in all_runs()]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--np", type=int, default=4, help="workers (local Gloo ranks)")
    p.add_argument("--epochs", type=int, default=4, help="epochs of every run")
    p.add_argument("--train-images", type=int, default=60000, help="training images used")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", nargs="+", choices=names, default=names,
                   help="runs to do (with their references)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for the results")
    p.add_argument("--timeout-s", type=float, default=3600, help="limit for one run, seconds")
    p.add_argument("--reuse", action="store_true",
                   help="keep the runs whose <run>.json is already in --out (after a failure)")
    p.add_argument("--show", action="store_true",
                   help="also print rank 0's lines of every run as they come (the demo)")
    p.add_argument("--no-bounds", action="store_true",
                   help="do not judge the accuracy bounds (a run too short for them: the demo)")
    return p.parse_args(argv)


def show_line(line: str) -> None:
    """``--show``'s echo of one of rank 0's lines."""
    print("   " + line, end="", flush=True)


def run_logged(command: List[str], env: Dict[str, str], log, timeout_s: float, show: bool,
               echo: Callable[[str], None] = show_line) -> int:
    """Run ``command`` with its output in ``log``; with ``show``, rank 0's standard output
    lines also go to ``echo`` (by default to ours) without ``horovodrun``'s prefix. Returns
    the exit status."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            cwd=ROOT, text=True)
    watchdog = threading.Timer(timeout_s, proc.kill)
    watchdog.start()
    try:
        for line in proc.stdout:
            log.write(line)
            log.flush()  # a slow run's progress shows in its log
            if show and line.startswith(RANK0_PREFIX):
                echo(line[len(RANK0_PREFIX):])
        return proc.wait()
    finally:
        watchdog.cancel()


def example_flags(args: argparse.Namespace, run: Run, metrics: Path) -> List[str]:
    """The example's command-line flags for ``run``, its metrics written to ``metrics``."""
    return [*(f"--{key}={value}" for key, value in run.flags.items()),
            "--epochs", str(args.epochs), "--train-images", str(args.train_images),
            "--seed", str(args.seed), "--json", str(metrics)]


def horovodrun(np: int, command: List[str]) -> List[str]:
    """``command`` on ``np`` local Gloo ranks under this environment's ``horovodrun``."""
    return [str(Path(sys.executable).parent / "horovodrun"), "-np", str(np),
            "-H", f"localhost:{np}", "--gloo", *command]


def launch(args: argparse.Namespace, run: Run) -> Dict:
    """One training run; its metrics with the wall time of the whole launch added."""
    metrics, log = args.out / f"{run.name}.json", args.out / f"{run.name}.log"
    flags = [f"--{key}={value}" for key, value in run.flags.items()]
    command = horovodrun(args.np, [sys.executable, str(EXAMPLE), *example_flags(args, run, metrics)])
    env = worker_env()
    started = time.perf_counter()
    if args.show:
        print(f"-- {run.name}: {' '.join(flags) or 'defaults'}", flush=True)
    with open(log, "w") as out:
        returncode = run_logged(command, env, out, args.timeout_s, args.show)
    if returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"run {run.name} failed (exit {returncode}); end of {log}:\n{tail}")
    result = json.loads(metrics.read_text())
    result["launch_wall_s"] = time.perf_counter() - started
    metrics.write_text(json.dumps(result, indent=2))
    return result


def checks(args: argparse.Namespace, runs: List[Run], results: Dict[str, Dict]) -> List[str]:
    if args.no_bounds:
        return [f"- accuracy bounds not judged: {args.epochs} epochs on {args.train_images} images "
                "are too few (DGC warms up through the first); `make bench-convergence` "
                "judges them"]
    lines = []
    for run in runs:
        if run.reference is None or run.reference not in results:
            continue
        # Accuracies on 10,000 test images are whole hundredths of a point.
        lines.append(judged(run, round(gap_points(results, run), 2)))
    return lines


def gap_points(results: Dict[str, Dict], run: Run) -> float:
    """``run``'s final accuracy minus its reference's, in points."""
    return 100 * (results[run.name]["accuracy"] - results[run.reference]["accuracy"])


def judged(run: Run, gap: float, how: str = "", over: str = "") -> str:
    """One check line: PASS when ``gap`` (``run``'s accuracy minus its reference's, in points)
    is at most the method's tolerance below 0. ``how`` and ``over`` qualify the gap ("on
    average", "over 3 seeds")."""
    tolerance = TOLERANCE.get(run.method, DEFAULT_TOLERANCE)
    return (f"- {'PASS' if -gap <= tolerance else 'FAIL'}: {run.name} {gap:+.2f} points "
            f"{how + ' ' if how else ''}against {run.reference}{' ' + over if over else ''} "
            f"(at most {tolerance} below)")


def table(runs: List[Run], results: Dict[str, Dict]) -> str:
    rows = ["| run | final test accuracy | vs reference (points) | last-epoch kB/step to Horovod "
            "| handed vs dense | network vs dense | wall time (s) |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        r = results[run.name]
        last = r["history"][-1]
        gap = ("" if run.reference is None else
               f"{100 * (r['accuracy'] - results[run.reference]['accuracy']):+.2f} vs {run.reference}")
        kb = "" if last["bytes_per_step"] is None else f"{last['bytes_per_step'] / 1e3:.1f}"
        rows.append(f"| {run.name} | {r['accuracy']:.4f} | {gap} | {kb} "
                    f"| {last.get('handed_ratio', last['ratio']):.0f}x | {last['ratio']:.0f}x "
                    f"| {r['launch_wall_s']:.0f} |")
    return "\n".join(rows) + "\n"


def plot(runs: List[Run], results: Dict[str, Dict], path: Path, epochs: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.get_cmap("tab20").colors  # 20 distinct colours: every run its own
    for i, run in enumerate(runs):
        history = results[run.name]["history"]
        style = (dict(linewidth=2.5, color="black", linestyle="-" if i == 0 else ":")
                 if run.reference is None else
                 dict(linewidth=1.2, color=colors[i % len(colors)],
                      linestyle="--" if run.flags.get("path") == "fused" else "-"))
        ax.plot([h["epoch"] for h in history], [h["accuracy"] for h in history], label=run.name,
                marker="o", markersize=3, **style)
    ax.set_xticks(range(1, epochs + 1))
    ax.set(xlabel="epoch", ylabel="test accuracy",
           title=f"Fashion-MNIST, {epochs} epochs, {results[runs[0].name]['workers']} workers")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def selected(args: argparse.Namespace) -> List[Run]:
    """The runs asked for, with the references they need, in the table's order."""
    wanted = set(args.runs)
    runs = all_runs()
    wanted |= {run.reference for run in runs if run.name in wanted and run.reference}
    return [run for run in runs if run.name in wanted]


def main(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    runs, results = selected(args), {}
    started = time.perf_counter()
    for run in runs:
        finished = args.out / f"{run.name}.json"
        if args.reuse and finished.exists():
            results[run.name] = json.loads(finished.read_text())
        else:
            results[run.name] = launch(args, run)
        r = results[run.name]
        print(f"{run.name:22s} accuracy {r['accuracy']:.4f} ({r['launch_wall_s']:.0f} s)", flush=True)
    share = results[runs[0].name].get("compressed_share")
    report = (f"{args.np} workers, {args.epochs} epochs, {args.train_images} training images, seed "
              f"{args.seed}; "
              + (f"{share:.2%} of the parameters in tensors compressed at the full density; "
                 if share is not None else "")
              + f"benchmark wall time {time.perf_counter() - started:.0f} s\n\n"
              f"{table(runs, results)}\n" + "\n".join(checks(args, runs, results)) + "\n")
    (args.out / "convergence.md").write_text(report)
    plot(runs, results, args.out / "convergence.png", args.epochs)
    print(f"\n{report}\nwrote {args.out / 'convergence.md'} and {args.out / 'convergence.png'}")


if __name__ == "__main__":
    main(parse_args())
