"""``make demo``: what DGC is for, the same accuracy sooner on a slow link.

Two workers, each in a network namespace of its own, joined by a 100 Mbit/s link
(``benchmarks/cluster/netns.py``), train the Fashion-MNIST CNN of
``examples/pytorch_fashion_mnist.py`` (1.03M parameters) twice on the same images, batches,
seed and peak learning rate: dense (Horovod's all-reduce, 4.1 MB a step) for 3 epochs, and
dgc at density 0.001 (4.3 kB a step, about 950x fewer) for 4, since its steps are the cheap
ones on that link. Per epoch it prints each run's test accuracy (the 10,000 test images), the
wall-clock seconds of training so far (rank 0's clock around the steps; the test
evaluations, which both runs pay alike, left out) and the bytes per step; at the end the
time each run took to reach dense's final accuracy, read off those measured epochs (the
first at or above it, or "not reached"), the bytes host 0's link sent, and whether dgc ended
within 1.0 point of dense and reached dense's final accuracy at least 3x sooner. It writes
``demo.png`` (test accuracy against seconds of training) and the runs' logs to ``--out``.

    .venv/bin/python -m benchmarks.demo [--link 100mbit] [--epochs 3] [--dgc-epochs 4]
        [--loopback] [--check]

Network namespaces need root; without it (or with ``--loopback``) the demo says so and runs
both on loopback through ``horovodrun``, where no link is slow: the claims are not judged.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from benchmarks import worker_env
from benchmarks.cluster.job import ClusterJob
from benchmarks.cluster.netns import (HOST_IFACE, ClusterError, NetnsCluster, parse_link,
                                      require_root_and_tools)
from benchmarks.cluster.run import in_namespaces
from benchmarks.convergence import EXAMPLE, Run, example_flags, horovodrun, run_logged

WORKERS = 2
DEFAULT_OUT = Path("build") / "demo"
# The claims the demo shows (judged only on a shaped link).
MAX_GAP_POINTS = 1.0
MIN_SPEEDUP = 3.0
TOOL = "demo"
# Horovod's background loop starts the collectives handed to it once a cycle; dgc's steps
# hand it several in turn, each waiting for the next cycle: 0.2 ms instead of Horovod's 1 ms
# made dgc's steps 40% shorter here, and dense's, bound by the link, no longer.
CYCLE_TIME_MS = 0.2

EPOCH_LINE = re.compile(r"epoch (?P<epoch>\d+)/(?P<epochs>\d+): loss \S+, test accuracy "
                        r"(?P<accuracy>\d+(?:\.\d+)?) after (?P<wall>\d+(?:\.\d+)?) s of "
                        r"training, density [^,]+, (?P<kb>\d+(?:\.\d+)?) kB/step to ")
HEADER_LINE = re.compile(r"(?P<params>[\d,]+) parameters .* (?P<steps>\d+) steps per epoch$")


@dataclass(frozen=True)
class Point:
    """One epoch of a run, as rank 0 printed it."""

    epoch: int
    epochs: int
    accuracy: float
    wall_s: float        # wall-clock seconds of training so far (the test evaluations excluded)
    kb_per_step: float   # kB handed to Horovod per step (the compressor's, or the dense tensors)


def parse_epoch_line(line: str) -> Optional[Point]:
    """The epoch line of ``examples/pytorch_fashion_mnist.py`` as a Point; None for any other
    line."""
    match = EPOCH_LINE.search(line)
    if match is None:
        return None
    return Point(int(match["epoch"]), int(match["epochs"]), float(match["accuracy"]),
                 float(match["wall"]), float(match["kb"]))


def time_to_accuracy(points: Sequence[Point], target: float) -> Optional[float]:
    """Wall-clock seconds at the end of the first epoch whose test accuracy is at least
    ``target``; None when no epoch reaches it."""
    for point in points:
        if point.accuracy >= target:
            return point.wall_s
    return None


def link_label(link) -> str:
    """``100 Mbit/s``, ``1 Gbit/s``, ``100 Mbit/s + 2 ms``: a link shape for people."""
    rate = link.rate_mbit
    label = ("unlimited" if rate is None else
             f"{rate / 1000:g} Gbit/s" if rate >= 1000 else f"{rate:g} Mbit/s")
    return label + (f" + {link.delay_ms:g} ms" if link.delay_ms else "")


def network_choice(loopback: bool) -> Tuple[bool, str]:
    """(whether the runs go on network namespaces, the sentence that says where they go)."""
    if loopback:
        return False, (f"{TOOL}: --loopback: both runs on loopback through horovodrun, no slow "
                       f"link, so dgc saves little time here")
    try:
        require_root_and_tools()
    except ClusterError as error:
        return False, (f"{TOOL}: {error} Running both on loopback through horovodrun instead: "
                       f"no slow link, so dgc saves little time here")
    return True, ""


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--link", default="100mbit", help="the link between the two hosts: "
                   "100mbit, 1gbit, <R>mbit, <R>gbit, optionally +<D>ms (netns.parse_link)")
    p.add_argument("--epochs", type=int, default=3, help="dense's epochs")
    p.add_argument("--dgc-epochs", type=int, default=4,
                   help="dgc's epochs (0: as many as dense's); its steps are the cheap ones")
    p.add_argument("--train-images", type=int, default=3000, help="the first N training images")
    p.add_argument("--batch-size", type=int, default=16, help="images per step, per worker")
    p.add_argument("--lr", type=float, default=0.05, help="peak learning rate of both runs "
                   "(SGD with momentum 0.9, cosine to 0)")
    p.add_argument("--density", type=float, default=0.001, help="dgc's density after warm-up")
    p.add_argument("--warmup-epochs", type=int, default=1,
                   help="dgc's warm-up densities, one per --warmup-steps steps")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="steps per warm-up density (default: one epoch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cycle-time-ms", type=float, default=CYCLE_TIME_MS,
                   help="HOROVOD_CYCLE_TIME of both runs' workers")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--loopback", action="store_true",
                   help="run on loopback through horovodrun even as root")
    p.add_argument("--prefix", default=None, help="start of the namespace names (default: "
                   "demo<pid>)")
    p.add_argument("--timeout-s", type=float, default=600, help="limit for one run, seconds")
    p.add_argument("--check", action="store_true",
                   help="exit 1 when a claim fails (on a shaped link only)")
    args = p.parse_args(argv)
    try:
        args.link = parse_link(args.link)
    except ValueError as error:
        p.error(f"--link: {error}")
    if not args.link.shaped:
        p.error("--link: the demo needs a slow link (unshaped shows nothing)")
    args.dgc_epochs = args.dgc_epochs or args.epochs
    args.np = WORKERS
    return args


def epochs_of(args: argparse.Namespace, run: Run) -> int:
    return args.dgc_epochs if run.name == "dgc" else args.epochs


def flags_of(args: argparse.Namespace, run: Run, metrics: Path) -> List[str]:
    """The example's flags for ``run`` (convergence.example_flags with the run's epochs)."""
    return example_flags(argparse.Namespace(**{**vars(args), "epochs": epochs_of(args, run)}),
                         run, metrics)


def runs(args: argparse.Namespace) -> List[Run]:
    """Dense, then dgc: the same data, batches and learning rate."""
    common = {"batch-size": str(args.batch_size), "lr": str(args.lr)}
    dgc = {"compression": "dgc", "density": str(args.density),
           "warmup-epochs": str(args.warmup_epochs)}
    if args.warmup_steps:
        dgc["steps-per-epoch"] = str(args.warmup_steps)
    return [Run("dense", {"compression": "dense", **common}, reference=None),
            Run("dgc", {**dgc, **common})]


class Echo:
    """Rank 0's lines, one at a time: the epoch lines reprinted short, the points and the
    steps per epoch kept. A file-like ``write`` for ClusterJob, a callable for run_logged."""

    def __init__(self, name: str):
        self.name = name
        self.points: List[Point] = []
        self.steps_per_epoch: Optional[int] = None
        self.parameters: Optional[int] = None

    def __call__(self, line: str) -> None:
        header = HEADER_LINE.search(line.rstrip())
        if header is not None:
            self.steps_per_epoch = int(header["steps"])
            self.parameters = int(header["params"].replace(",", ""))
        point = parse_epoch_line(line)
        if point is not None:
            self.points.append(point)
            print(f"  {self.name:5s} epoch {point.epoch}/{point.epochs}: test accuracy "
                  f"{point.accuracy:.4f} after {point.wall_s:5.1f} s of training, "
                  f"{point.kb_per_step:6.1f} kB/step",
                  flush=True)

    write = __call__

    def flush(self) -> None:
        pass


def link_bytes(cluster: NetnsCluster, rank: int) -> int:
    """Bytes host ``rank``'s interface has sent so far (its kernel's counter)."""
    out = subprocess.run(["ip", "-n", cluster.host_ns[rank], "-s", "-j", "link", "show",
                          HOST_IFACE], capture_output=True, text=True, check=True).stdout
    stats = json.loads(out)[0]["stats64"]
    return stats["tx"]["bytes"]


def run_on_cluster(cluster: NetnsCluster, args: argparse.Namespace, run: Run, echo: Echo) -> Dict:
    """``run`` with one worker per namespace; what its host 0's link carried."""
    metrics = args.out / f"{run.name}.json"
    command = [sys.executable, str(EXAMPLE), *flags_of(args, run, metrics)]
    before = link_bytes(cluster, 0)
    ClusterJob(cluster, command, args.out / "logs" / run.name, args.timeout_s,
               env={"HOROVOD_CYCLE_TIME": f"{args.cycle_time_ms:g}"}, echo_to=echo).run()
    return {"link_bytes": link_bytes(cluster, 0) - before}


def run_on_loopback(args: argparse.Namespace, run: Run, echo: Echo) -> Dict:
    metrics, log = args.out / f"{run.name}.json", args.out / f"{run.name}.log"
    command = horovodrun(WORKERS, [sys.executable, str(EXAMPLE), *flags_of(args, run, metrics)])
    with open(log, "w") as out:
        code = run_logged(command, worker_env(HOROVOD_CYCLE_TIME=f"{args.cycle_time_ms:g}"), out,
                          args.timeout_s, True, echo)
    if code != 0:
        raise SystemExit(f"{TOOL}: run {run.name} failed (exit {code}); end of {log}:\n"
                         f"{log.read_text()[-3000:]}")
    return {}


@dataclass
class Outcome:
    """One finished run."""

    run: Run
    points: List[Point]
    launch_s: float
    link_bytes: Optional[int] = None  # what host 0's interface sent during the launch

    @property
    def final(self) -> Point:
        return self.points[-1]


def summary(outcomes: Dict[str, Outcome], shaped: bool, link_name: str) -> Tuple[List[str], bool]:
    """The closing lines, and whether the claims hold (True on loopback: not judged)."""
    dense, dgc = outcomes["dense"], outcomes["dgc"]
    target = dense.final.accuracy
    reached = {name: time_to_accuracy(o.points, target) for name, o in outcomes.items()}
    lines = [f"{'run':5s}  {'final accuracy':>14s}  {'training s':>10s}  {'launch s':>8s}  "
             f"{'kB/step':>8s}  {'host 0 sent':>11s}  time to {target:.4f} (dense's final)"]
    for name, o in outcomes.items():
        sent = "" if o.link_bytes is None else f"{o.link_bytes / 1e6:.1f} MB"
        to = "not reached" if reached[name] is None else f"{reached[name]:.1f} s"
        lines.append(f"{name:5s}  {o.final.accuracy:14.4f}  {o.final.wall_s:10.1f}  "
                     f"{o.launch_s:8.1f}  {o.final.kb_per_step:8.1f}  {sent:>11s}  {to}")
    gap = 100 * (dgc.final.accuracy - target)
    fewer = dense.final.kb_per_step / dgc.final.kb_per_step
    speedup = (None if reached["dgc"] is None or reached["dense"] is None
               else reached["dense"] / reached["dgc"])
    lines.append(f"dgc: {gap:+.2f} points against dense, {fewer:.0f}x fewer bytes per step, "
                 + ("dense's final accuracy not reached" if speedup is None else
                    f"dense's final accuracy reached {speedup:.1f}x sooner "
                    f"({reached['dgc']:.1f} s against {reached['dense']:.1f} s)"))
    if not shaped:
        lines.append("claims not judged: on loopback no link is slow")
        return lines, True
    close = -gap <= MAX_GAP_POINTS
    sooner = speedup is not None and speedup >= MIN_SPEEDUP
    lines.append(f"{'PASS' if close else 'FAIL'}: dgc within {MAX_GAP_POINTS} point of dense's "
                 f"final accuracy ({gap:+.2f})")
    lines.append(f"{'PASS' if sooner else 'FAIL'}: dgc at dense's final accuracy at least "
                 f"{MIN_SPEEDUP:g}x sooner at {link_name} "
                 + ("(not reached)" if speedup is None else f"({speedup:.1f}x)"))
    return lines, close and sooner


def plot(outcomes: Dict[str, Outcome], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = outcomes["dense"].final.accuracy
    fig, ax = plt.subplots(figsize=(8, 5))
    for (name, o), color in zip(outcomes.items(), ("black", "tab:red")):
        ax.plot([p.wall_s for p in o.points], [p.accuracy for p in o.points],
                marker="o", markersize=4, color=color,
                label=f"{name} ({o.final.kb_per_step:.1f} kB/step)")
        reached = time_to_accuracy(o.points, target)
        if reached is not None:
            ax.axvline(reached, color=color, linestyle=":", linewidth=1)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"dense's final {target:.4f}")
    low = min(p.accuracy for o in outcomes.values() for p in o.points)
    ax.set_ylim(max(0.0, low - 0.05), min(1.0, target + 0.03))
    ax.set_xlim(left=0)
    ax.set(xlabel="wall-clock seconds of training (the test evaluations excluded)",
           ylabel="test accuracy after each epoch", title=title)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    shaped, why = network_choice(args.loopback)
    where = (f"{WORKERS} workers in {WORKERS} network namespaces joined by a "
             f"{link_label(args.link)} link" if shaped else f"{WORKERS} workers on loopback")
    if why:
        print(why, flush=True)
    print(f"{TOOL}: {where}; the Fashion-MNIST CNN on the first {args.train_images:,} training "
          f"images, batch {args.batch_size} per worker, learning rate {args.lr:g}, seed "
          f"{args.seed}", flush=True)
    outcomes: Dict[str, Outcome] = {}

    def train(launch: Callable[[Run, Echo], Dict]) -> None:
        for run in runs(args):
            flags = " ".join(f"--{k}={v}" for k, v in run.flags.items())
            print(f"-- {run.name}, {epochs_of(args, run)} epochs: {flags}", flush=True)
            echo = Echo(run.name)
            begun = time.perf_counter()
            extra = launch(run, echo)
            if len(echo.points) != epochs_of(args, run) or echo.steps_per_epoch is None:
                raise SystemExit(f"{TOOL}: run {run.name} printed {len(echo.points)} of "
                                 f"{epochs_of(args, run)} epoch lines; logs in {args.out}")
            outcomes[run.name] = Outcome(run, echo.points, time.perf_counter() - begun, **extra)

    if shaped:
        def on_cluster() -> None:
            with NetnsCluster(WORKERS, args.prefix or f"demo{os.getpid()}") as cluster:
                cluster.shape(args.link)
                train(lambda run, echo: run_on_cluster(cluster, args, run, echo))

        failed, _ = in_namespaces(TOOL, on_cluster)
        if failed is not None:
            return failed
    else:
        train(lambda run, echo: run_on_loopback(args, run, echo))

    lines, held = summary(outcomes, shaped, link_label(args.link))
    png = args.out / "demo.png"
    plot(outcomes, png, f"Fashion-MNIST CNN, {where}")
    print("\n" + "\n".join(lines))
    print(f"wrote {png}; logs in {args.out}; {TOOL} took {time.perf_counter() - started:.0f} s",
          flush=True)
    return 1 if args.check and not held else 0


if __name__ == "__main__":
    sys.exit(main())
