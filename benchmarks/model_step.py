"""The engine's CPU time per rank per step on a whole model's tensors: the fixed cost per
tensor that a single large gradient (``make bench-compress``) does not show.

Each method takes ResNet-50's 161 gradient tensors through the fused path's order, with
``--world`` ranks emulated in this process (``benchmarks.host_syncs``: every tensor
compressed, the collectives emulated), on the CPU with the C kernels, one thread. Every rank
decodes each step's messages twice, in alternating order: each tensor's on their own, as the
stock path does, and each bucket's (about 25 MB of gradient, as ``DistributedOptimizer``
cuts them) in one call, as our fused optimizer does; ScaleCom and blocksign finish each
tensor on its own either way. Gradients are fresh ``randn`` draws every step; after the
first ``--warmup`` steps (not timed) each step's candidate bound fits the next, as in training
(docs/benchmarks.md, "Candidates collected in the pass"). Rounds alternate between methods
and the median is reported::

    python -m benchmarks.model_step [--methods dgc scalecom ...] [--world 2] [--rounds 7]
                                    [--composed-messages]

``--composed-messages`` adds, for each method, engines whose messages are encoded and decoded
by the core's composition of torch operations instead of the C kernels that write and read a
whole message at once (``TorchOps.encode_message``, ``decode_sums``, ``decode_positions``),
alternating with the others in the same process: what those kernels save.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List, Sequence

import torch

from benchmarks.host_syncs import compress_all, decode_all, decode_buckets, resnet50
from horovod_dgc.core.methods import BY_NAME, METHODS
from horovod_dgc.torch.engine import Engine
from horovod_dgc.torch.ops import TorchOps
from horovod_dgc.torch.optimizer import DEFAULT_BUCKET_CAP_MB

COLUMNS = ("compress_s", "decode_s", "bucket_decode_s")


class ComposedMessages(TorchOps):
    """The engine's operations without the whole-message kernels: the composition encodes
    and decodes."""

    def encode_message(self, *args):
        return None

    def decode_sums(self, *args):
        return None

    def decode_positions(self, *args):
        return None


class Run:
    """One method's engines and gradients, stepped on demand."""

    def __init__(self, method: str, shapes: Sequence[tuple], world: int, seed: int = 0,
                 composed: bool = False) -> None:
        self.engines = [Engine(BY_NAME[method].build(), world_size=world, rank=r) for r in range(world)]
        if composed:
            for engine in self.engines:
                engine.ops = ComposedMessages(defer_checks=True)
        self.shapes = shapes
        self.names = [f"t{i}" for i in range(len(shapes))]
        self.gen = torch.Generator().manual_seed(seed)
        self.steps = 0

    def step(self) -> Dict[str, float]:
        """Seconds per rank of this step's compress, its decode tensor by tensor, and its
        decode bucket by bucket (the same for tensors that are not sent as sparse messages)."""
        world = len(self.engines)
        grads = [[torch.randn(s, generator=self.gen) for s in self.shapes] for _ in range(world)]
        started = time.perf_counter()
        outputs = compress_all(self.engines, self.names, grads)
        seconds = {"compress_s": (time.perf_counter() - started) / world}
        sparse = [i for i, per_rank in enumerate(outputs) if per_rank[0][0] == "sparse"]
        others = sorted(set(range(len(outputs))) - set(sparse))

        def pick(items, chosen):
            return [items[i] for i in chosen]

        started = time.perf_counter()
        decode_all(self.engines, pick(self.names, others), pick(self.shapes, others), pick(outputs, others))
        either = (time.perf_counter() - started) / world
        decodes = {"decode_s": lambda: decode_all(self.engines, pick(self.names, sparse),
                                                  pick(self.shapes, sparse), pick(outputs, sparse)),
                   "bucket_decode_s": lambda: decode_buckets(self.engines, pick(outputs, sparse),
                                                             pick(self.shapes, sparse),
                                                             DEFAULT_BUCKET_CAP_MB * 2 ** 20)}
        self.steps += 1
        for key in sorted(decodes, reverse=self.steps % 2 == 1):  # each first every other step
            started = time.perf_counter()
            decodes[key]()
            seconds[key] = either + (time.perf_counter() - started) / world
        return seconds


COMPOSED = ", composed messages"


def measure(methods: Sequence[str], world: int, warmup: int, rounds: int,
            steps: int, composed: bool = False) -> Dict[str, Dict[str, float]]:
    shapes = [tuple(p.shape) for p in resnet50().parameters()]
    runs = {m: Run(m, shapes, world) for m in methods}
    if composed:
        runs.update({m + COMPOSED: Run(m, shapes, world, composed=True) for m in methods})
    for run in runs.values():
        for _ in range(warmup):
            run.step()
    timed: Dict[str, List[Dict[str, float]]] = {m: [] for m in runs}
    for _ in range(rounds):
        for method, run in runs.items():
            timed[method] += [run.step() for _ in range(steps)]
    return {m: {key: statistics.median(t[key] for t in timed[m]) for key in COLUMNS}
            for m in sorted(runs, key=lambda m: (methods.index(m.removesuffix(COMPOSED)), m))}


def parse_args(argv: Sequence[str] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=[spec.name for spec in METHODS],
                   choices=[spec.name for spec in METHODS])
    p.add_argument("--world", type=int, default=2, help="ranks emulated in this process")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps per method")
    p.add_argument("--rounds", type=int, default=7, help="rounds over the methods")
    p.add_argument("--steps", type=int, default=2, help="timed steps per method per round")
    p.add_argument("--composed-messages", action="store_true",
                   help="also each method without the whole-message kernels, alternating")
    return p.parse_args(argv)


def main(argv: Sequence[str] = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    results = measure(args.methods, args.world, args.warmup, args.rounds, args.steps,
                      args.composed_messages)
    print(f"ResNet-50's 161 tensors, {args.world} ranks emulated, one thread, torch {torch.__version__}; "
          f"medians of {args.rounds * args.steps} steps per method\n")
    print("| method | compress ms per rank | decode, tensor by tensor | decode, bucket by bucket | "
          "compress and bucket decode |")
    print("|---|---:|---:|---:|---:|")
    for method, r in results.items():
        print(f"| {method} | {r['compress_s'] * 1e3:.1f} | {r['decode_s'] * 1e3:.1f} | "
              f"{r['bucket_decode_s'] * 1e3:.1f} | {(r['compress_s'] + r['bucket_decode_s']) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
