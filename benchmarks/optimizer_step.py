"""What one optimizer step costs with compression against Horovod's dense all-reduce, on one
host's loopback (``make bench-optimizer-step``): where compression cannot save network time,
its whole cost shows.

Run by every worker (``horovodrun -np 2 -H localhost:2 --gloo python -m
benchmarks.optimizer_step``), one thread each. The parameters are ResNet-50's 161 tensors
(25,557,032 entries); each step puts fresh ``randn`` gradients in place (no forward or
backward pass, so every tensor reaches the optimizer at ``step()``) and times
``optimizer.step()`` on the slowest rank, for:

* ``dense``: the stock ``hvd.DistributedOptimizer``, Horovod's ``Compression.none``;
* ``<method>-stock``: the stock ``hvd.DistributedOptimizer`` with ``compression=`` the method;
* ``<method>-fused``: ``horovod_dgc.torch.DistributedOptimizer``;
* ``<method>-adaptive``: the same with ``adaptive=`` (first decision within the untimed
  steps: ``ADAPTIVE``), each bucket's mode printed.

Every optimizer is plain SGD (lr 0, so the parameters stay as they are). Rounds interleave
the optimizers (one step of each per round, the order reversed every other round); rank 0
prints the median milliseconds per step and the ratio to ``dense`` of the same run.
``--methods`` also takes ``dgc-sar`` (dgc with ``aggregation="sparse_allreduce"``).

``--count-ops`` then takes one more step of each optimizer with the choices TorchOps makes on
a GPU (``benchmarks.host_syncs.HostReadCounter``) and prints the ATen operations rank 0
dispatched in it (views included, and a Triton kernel as one, as ``benchmarks.model_step``
counts them: start the workers with ``TRITON_INTERPRET=1`` to run the GPU's Triton kernels on
the CPU, as ``make bench-optimizer-step`` does), those of ``dense`` subtracted (Horovod's own
and the SGD's), and its host reads::

    TRITON_INTERPRET=1 python -m benchmarks.optimizer_step [--methods dgc ...] [--steps 10] [--warmup 20] [--count-ops]
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path
import sys
from typing import Callable, Dict, List, Sequence, Tuple

import horovod.torch as hvd
import torch

import horovod_dgc.torch as hdgc
from horovod_dgc.core.adaptive import Adaptive

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from _resnet import resnet50  # noqa: E402
from benchmarks.host_syncs import HostReadCounter  # noqa: E402
from benchmarks.model_step import VARIANTS, OpCounter, kernels_counted, large_interpreted_programs  # noqa: E402


# Decided on the 10th step, from the 5 before it: within the default 20 untimed steps.
ADAPTIVE = Adaptive(first_decision_step=10, sample_steps=5)


def optimizers(methods: Sequence[str]) -> Dict[str, Callable[[], torch.optim.Optimizer]]:
    """Each run's name and a factory of its optimizer over a model of its own."""
    def build(wrap: Callable, compression: Callable) -> Callable[[], torch.optim.Optimizer]:
        def made() -> torch.optim.Optimizer:
            model = resnet50()
            sgd = torch.optim.SGD(model.parameters(), lr=0.0)
            return wrap(sgd, named_parameters=model.named_parameters(), compression=compression(model))
        return made

    runs = {"dense": build(hvd.DistributedOptimizer, lambda model: hvd.Compression.none)}
    for name in methods:
        method, options = VARIANTS.get(name, (name, {}))
        factory = functools.partial(getattr(hdgc.Compression, method), **options)
        runs[f"{name}-stock"] = build(hvd.DistributedOptimizer,
                                      lambda model, f=factory: f(named_parameters=model.named_parameters()))
        runs[f"{name}-fused"] = build(hdgc.DistributedOptimizer, lambda model, f=factory: f())
        runs[f"{name}-adaptive"] = build(hdgc.DistributedOptimizer, lambda model, f=factory: f(adaptive=ADAPTIVE))
    return runs


def put_gradients(optimizer: torch.optim.Optimizer, gen: torch.Generator) -> None:
    """Fresh gradients in place, then a barrier: every rank starts the step together."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.randn(p.shape, generator=gen)
    hvd.allreduce(torch.zeros(1), name="optimizer_step.start")


def timed_step(optimizer: torch.optim.Optimizer, gen: torch.Generator) -> float:
    """Seconds of one ``step()`` on the slowest rank, gradients put in place before it."""
    put_gradients(optimizer, gen)
    started = time.perf_counter()
    optimizer.step()
    elapsed = torch.tensor([time.perf_counter() - started])
    return float(hvd.allreduce(elapsed, op=hvd.Max, name="optimizer_step.elapsed"))


def counted_step(optimizer: torch.optim.Optimizer, gen: torch.Generator) -> Tuple[int, int]:
    """(ATen operations, host reads) this rank dispatched in one ``step()``, with a GPU's
    choices."""
    put_gradients(optimizer, gen)
    with HostReadCounter() as reads, OpCounter() as ops:
        optimizer.step()
    return ops.count, reads.total


def main(argv: Sequence[str] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["dgc"])
    p.add_argument("--steps", type=int, default=10, help="timed steps of each optimizer")
    p.add_argument("--warmup", type=int, default=20,
                   help="untimed steps of each optimizer (candidate bounds settle within about 15 steps "
                        "of randn gradients)")
    p.add_argument("--count-ops", action="store_true",
                   help="then count one step of each optimizer's operations with a GPU's choices")
    args = p.parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    large_interpreted_programs()
    gen = torch.Generator().manual_seed(hvd.rank())
    runs = {name: made() for name, made in optimizers(args.methods).items()}
    times: Dict[str, List[float]] = {name: [] for name in runs}
    for r in range(args.warmup + args.steps):
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            seconds = timed_step(runs[name], gen)
            if r >= args.warmup:
                times[name].append(seconds)
    if hvd.rank() == 0 and args.steps:
        dense = statistics.median(times["dense"])
        print(f"ResNet-50's 161 tensors, {hvd.size()} workers on loopback, one thread each, torch "
              f"{torch.__version__}; optimizer.step() with gradients in place, median of {args.steps}\n")
        print("| run | ms per step | x dense |")
        print("|---|---:|---:|")
        for name, seconds in times.items():
            median = statistics.median(seconds)
            print(f"| {name} | {median * 1e3:.1f} | {median / dense:.2f} |")
        for name, optimizer in runs.items():
            if name.endswith("-adaptive"):
                print(f"\n{name}'s buckets:\n" + "\n".join(optimizer._compression.stats().buckets))
    if args.count_ops:
        counts = {name: counted_step(optimizer, gen) for name, optimizer in runs.items()}
        if hvd.rank() == 0:
            tensors = sum(len(group["params"]) for group in runs["dense"].param_groups)
            print(f"\nOne step of each with a GPU's choices and {kernels_counted(torch.device('cpu'))}, "
                  f"rank 0 ({tensors} tensors):\n")
            print("| run | ATen operations | less dense's | host reads |")
            print("|---|---:|---:|---:|")
            for name, (ops, reads) in counts.items():
                print(f"| {name} | {ops:,} | {ops - counts['dense'][0]:,} | {reads} |")


if __name__ == "__main__":
    main()
