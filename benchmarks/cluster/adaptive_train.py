"""The training job of ``make cluster-adaptive`` (``benchmarks/cluster/adaptive_link.py``):
a method with ``adaptive=`` on the fused optimizer, training a multi-layer perceptron on
synthetic data while the driver changes the link under it.

Run by every worker (``python -m horovod_dgc.cluster worker -- python
benchmarks/cluster/adaptive_train.py ...``)::

    python benchmarks/cluster/adaptive_train.py [--method blocksign] [--steps 90] [--width 512]
        [--layers 4] [--recheck-steps 20] [--watch-steps 5] [--min-step-s 0.3]

Every rank prints ``step S done in T s modes M`` after each step (``M``: one letter per
bucket in label order, ``c`` compressed, ``d`` dense), each decision's lines
(``decision S: ...``), and ``parameters sha256 <hex>`` last.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import List, Optional

import horovod.torch as hvd
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step import parameters_digest  # noqa: E402

import horovod_dgc.torch as hdgc  # noqa: E402
from horovod_dgc.core.adaptive import DENSE  # noqa: E402

BATCH = 16


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", default="blocksign", help="a factory of horovod_dgc.torch.Compression")
    p.add_argument("--steps", type=int, default=90)
    p.add_argument("--width", type=int, default=512, help="units per hidden layer")
    p.add_argument("--layers", type=int, default=4, help="hidden layers")
    p.add_argument("--first-decision-step", type=int, default=5)
    p.add_argument("--recheck-steps", type=int, default=20)
    p.add_argument("--watch-steps", type=int, default=5)
    p.add_argument("--min-step-s", type=float, default=0.3,
                   help="each step lasts at least this long (the driver's change of the link then "
                        "lands in the step after the line it watched for)")
    p.add_argument("--bucket-cap-mb", type=float, default=1.0,
                   help="the fused optimizer's buckets (small, so that the model has several)")
    return p.parse_args(argv)


def build_model(width: int, layers: int) -> torch.nn.Module:
    """``layers`` hidden layers and a classifier into ``width`` classes: every weight of the
    same size, so that each bucket weighs as much on the link (a small classifier's bucket
    costs its collectives' latency whatever the link)."""
    torch.manual_seed(0)
    blocks: List[torch.nn.Module] = []
    for i in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, width))


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    model = build_model(args.width, args.layers)
    settings = hdgc.Adaptive(first_decision_step=args.first_decision_step, sample_steps=3,
                             recheck_steps=args.recheck_steps, watch_steps=args.watch_steps)
    compression = getattr(hdgc.Compression, args.method)(adaptive=settings)
    optimizer = hdgc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                          named_parameters=model.named_parameters(),
                                          compression=compression, bucket_cap_mb=args.bucket_cap_mb)
    for step in range(args.steps):
        started = time.perf_counter()
        generator = torch.Generator().manual_seed(1000 * step + hvd.rank())
        inputs = torch.randn(BATCH, args.width, generator=generator)
        labels = torch.randint(0, args.width, (BATCH,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        for line in compression.stats().buckets:
            if line.endswith(f"decided at step {step})"):
                print(f"decision {step}: {line}", flush=True)
        modes = "".join("d" if mode == DENSE else "c" for _, mode in sorted(compression.bucket_modes().items()))
        elapsed = time.perf_counter() - started
        print(f"step {step} done in {elapsed:.3f} s modes {modes}", flush=True)
        time.sleep(max(0.0, args.min_step_s - elapsed))
    print(f"parameters sha256 {parameters_digest(model)}", flush=True)


if __name__ == "__main__":
    main()
