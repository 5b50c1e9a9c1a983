"""The engine's CPU time per rank per step on a whole model's tensors: the fixed cost per
tensor that a single large gradient (``make bench-compress``) does not show.

Each method takes ResNet-50's 161 gradient tensors through the fused path's order, with
``--world`` ranks emulated in this process (``benchmarks.host_syncs``: every tensor
compressed, the collectives emulated, every rank decodes each tensor's messages on its own, as
the stock path does; the fused path decodes a bucket's in one call), on the CPU with the C kernels,
one thread. Gradients are fresh ``randn`` draws every step; after the first ``--warmup``
steps (not timed) each step's candidate bound fits the next, as in training
(docs/benchmarks.md, "Candidates collected in the pass"). Rounds alternate between methods
and the median is reported::

    python -m benchmarks.model_step [--methods dgc scalecom ...] [--world 2] [--rounds 7]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List, Sequence

import torch

from benchmarks.host_syncs import compress_all, decode_all, resnet50
from horovod_dgc.core.methods import BY_NAME, METHODS
from horovod_dgc.torch.engine import Engine


class Run:
    """One method's engines and gradients, stepped on demand."""

    def __init__(self, method: str, shapes: Sequence[tuple], world: int, seed: int = 0) -> None:
        self.engines = [Engine(BY_NAME[method].build(), world_size=world, rank=r) for r in range(world)]
        self.shapes = shapes
        self.names = [f"t{i}" for i in range(len(shapes))]
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> Dict[str, float]:
        """Seconds per rank of this step's compress and decode."""
        world = len(self.engines)
        grads = [[torch.randn(s, generator=self.gen) for s in self.shapes] for _ in range(world)]
        started = time.perf_counter()
        outputs = compress_all(self.engines, self.names, grads)
        compressed = time.perf_counter()
        decode_all(self.engines, self.names, self.shapes, outputs)
        done = time.perf_counter()
        return {"compress_s": (compressed - started) / world, "decode_s": (done - compressed) / world}


def measure(methods: Sequence[str], world: int, warmup: int, rounds: int,
            steps: int) -> Dict[str, Dict[str, float]]:
    shapes = [tuple(p.shape) for p in resnet50().parameters()]
    runs = {m: Run(m, shapes, world) for m in methods}
    for run in runs.values():
        for _ in range(warmup):
            run.step()
    timed: Dict[str, List[Dict[str, float]]] = {m: [] for m in methods}
    for _ in range(rounds):
        for method, run in runs.items():
            timed[method] += [run.step() for _ in range(steps)]
    return {m: {key: statistics.median(t[key] for t in timed[m]) for key in ("compress_s", "decode_s")}
            for m in methods}


def parse_args(argv: Sequence[str] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=[spec.name for spec in METHODS],
                   choices=[spec.name for spec in METHODS])
    p.add_argument("--world", type=int, default=2, help="ranks emulated in this process")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps per method")
    p.add_argument("--rounds", type=int, default=7, help="rounds over the methods")
    p.add_argument("--steps", type=int, default=2, help="timed steps per method per round")
    return p.parse_args(argv)


def main(argv: Sequence[str] = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    results = measure(args.methods, args.world, args.warmup, args.rounds, args.steps)
    print(f"ResNet-50's 161 tensors, {args.world} ranks emulated, one thread, torch {torch.__version__}; "
          f"medians of {args.rounds * args.steps} steps per method\n")
    print("| method | compress ms per rank | decode ms per rank | both, ms per rank |")
    print("|---|---:|---:|---:|")
    for method, r in results.items():
        print(f"| {method} | {r['compress_s'] * 1e3:.1f} | {r['decode_s'] * 1e3:.1f} | "
              f"{(r['compress_s'] + r['decode_s']) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
