"""The convergence runs of several seeds side by side: is a gap to the reference real, or one
seed's luck?

Each directory holds one seed's result files, as ``benchmarks.convergence --seed S --out DIR``
writes them (``<run>.json``). For every run found in all of them, the table gives each seed's
final test accuracy and its gap to the same seed's reference run, then the means, and judges
the issue's bound (``convergence.judged``) on the mean gap.

    .venv/bin/python -m benchmarks.seeds DIR [DIR ...] [--runs NAME ...]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Dict, List, Sequence

from .convergence import Run, all_runs, gap_points, judged


def load(directory: Path, runs: Sequence[Run]) -> Dict[str, Dict]:
    """The results of ``runs`` that ``directory`` holds, by run name."""
    return {run.name: json.loads((directory / f"{run.name}.json").read_text())
            for run in runs if (directory / f"{run.name}.json").exists()}


def table(runs: Sequence[Run], per_seed: Sequence[Dict[str, Dict]]) -> str:
    """Markdown: per seed the final accuracy (and gap), then the mean and the mean gap, and a
    verdict on the mean gap for every run with a reference."""
    seeds = [str(results[runs[0].name]["seed"]) for results in per_seed]
    rows = ["| run | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | mean gap (points) |",
            "|---|" + "---:|" * (len(seeds) + 2)]
    verdicts = []
    for run in runs:
        cells = []
        for results in per_seed:
            cell = f"{results[run.name]['accuracy']:.4f}"
            if run.reference is not None:
                cell += f" ({gap_points(results, run):+.2f})"
            cells.append(cell)
        mean = statistics.fmean(results[run.name]["accuracy"] for results in per_seed)
        mean_gap = ""
        if run.reference is not None:
            # Rounded: a mean of whole hundredths must not fail the bound by a float's last bit.
            gap = round(statistics.fmean(gap_points(results, run) for results in per_seed), 6)
            mean_gap = f"{gap:+.2f}"
            verdicts.append(judged(run, gap, "on average", f"over {len(per_seed)} seeds"))
        rows.append(f"| {run.name} | " + " | ".join(cells) + f" | {mean:.4f} | {mean_gap} |")
    return "\n".join(rows) + "\n\n" + "\n".join(verdicts) + "\n"


def main(argv: Sequence[str] = None) -> None:
    names = [run.name for run in all_runs()]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directories", type=Path, nargs="+", help="one seed's result files each")
    p.add_argument("--runs", nargs="+", choices=names, help="runs to show (default: all found)")
    args = p.parse_args(argv)
    runs: List[Run] = [run for run in all_runs() if args.runs is None or run.name in args.runs]
    per_seed = [load(directory, runs) for directory in args.directories]
    found = [run for run in runs if all(run.name in results for results in per_seed)
             and (run.reference is None or all(run.reference in results for results in per_seed))]
    if not found:
        raise SystemExit("no run has result files (and its reference's) in every directory")
    print(table(found, per_seed), end="")


if __name__ == "__main__":
    main()
