"""Dense training next to every compression method: accuracy and loss curves, one table.

Runs ``examples/pytorch_mnist1d.py`` once per method with ``horovodrun`` (same seed, epochs and
workers; offline MNIST-1D data), collects each run's per-epoch metrics, and writes to
``--out`` (default ``results/convergence/``):

* ``<method>.json``: the run's metrics (what the example writes with ``--json``);
* ``convergence.md``: final accuracy, its difference to dense, traffic ratio and wall time;
* ``convergence.png``: training loss and test accuracy per epoch, every method in one figure.

    .venv/bin/python -m benchmarks.convergence [--np 4] [--epochs 30] [--methods ...]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _flags import METHODS  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pytorch_mnist1d.py"
DEFAULT_OUT = Path("results") / "convergence"


def parse_args(argv: Sequence[str] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=4, help="workers (local Gloo ranks)")
    p.add_argument("--epochs", type=int, default=30, help="epochs of every run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                   help="methods to run (dense always runs first)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for the results")
    p.add_argument("--timeout-s", type=float, default=1800, help="limit for one run, seconds")
    p.add_argument("--reuse", action="store_true",
                   help="keep the runs whose <method>.json is already in --out (after a failure)")
    return p.parse_args(argv)


def run_method(args: argparse.Namespace, method: str) -> Dict:
    """One training run; its metrics with the wall time of the whole launch added."""
    metrics_path = args.out / f"{method}.json"
    log_path = args.out / f"{method}.log"
    command = [str(Path(sys.executable).parent / "horovodrun"), "-np", str(args.np),
               "-H", f"localhost:{args.np}", "--gloo", sys.executable, str(EXAMPLE),
               "--compression", method, "--epochs", str(args.epochs), "--seed", str(args.seed),
               "--json", str(metrics_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3")
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                              timeout=args.timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"{method}: horovodrun exited {proc.returncode}; see {log_path}")
    metrics = json.loads(metrics_path.read_text())
    metrics["launch_wall_s"] = time.perf_counter() - started
    metrics_path.write_text(json.dumps(metrics, indent=2))
    return metrics


def table(results: Dict[str, Dict]) -> str:
    """Markdown table of final accuracies, dense first."""
    dense = results["dense"]["accuracy"]
    lines = ["| method | final test accuracy | vs dense (points) | last-epoch traffic ratio "
             "| whole-run ratio | wall time (s) |", "|---|---|---|---|---|---|"]
    for method, m in results.items():
        lines.append(f"| {method} | {m['accuracy']:.4f} | {100 * (m['accuracy'] - dense):+.2f} "
                     f"| {m['ratio']:.1f}x | {m['ratio_whole_run']:.1f}x | {m['launch_wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(results: Dict[str, Dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for method, m in results.items():
        epochs = [h["epoch"] for h in m["history"]]
        style = dict(linewidth=2.5, color="black") if method == "dense" else dict(linewidth=1.2)
        loss_ax.plot(epochs, [h["loss"] for h in m["history"]], label=method, **style)
        acc_ax.plot(epochs, [h["accuracy"] for h in m["history"]], label=method, **style)
    loss_ax.set(xlabel="epoch", ylabel="training loss (mean over ranks)", yscale="log")
    acc_ax.set(xlabel="epoch", ylabel="test accuracy")
    acc_ax.legend(loc="lower right")
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
    fig.suptitle(f"MNIST-1D, {next(iter(results.values()))['epochs']} epochs: dense vs compressed")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    methods: List[str] = ["dense"] + [m for m in args.methods if m != "dense"]
    results: Dict[str, Dict] = {}
    bar = tqdm(methods, desc="methods", unit="run")
    for method in bar:
        bar.set_postfix(running=method)
        finished = args.out / f"{method}.json"
        if args.reuse and finished.exists():
            results[method] = json.loads(finished.read_text())
            continue
        results[method] = run_method(args, method)
        tqdm.write(f"{method:10s} accuracy {results[method]['accuracy']:.4f} "
                   f"({results[method]['launch_wall_s']:.0f} s)")
    markdown = table(results)
    (args.out / "convergence.md").write_text(markdown)
    plot(results, args.out / "convergence.png")
    print(f"\n{args.np} workers, {args.epochs} epochs, seed {args.seed}\n\n{markdown}")
    print(f"wrote {args.out / 'convergence.md'} and {args.out / 'convergence.png'}")


if __name__ == "__main__":
    main(parse_args())
