"""How large the averaged gradient a compressor hands back is, against the dense average of
the same step's gradients: what a ``clip_grad_norm_`` after ``synchronize()`` would see.

Each step, before ``synchronize()``, every rank copies its raw gradients; after it, the
ratio of the norm of what the compressor installed to the norm of the dense all-reduce of the
copies. DGC's result carries its momentum, so it clips far more than the dense job would.

    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m benchmarks.update_norms
"""
from __future__ import annotations

import argparse
import statistics
from typing import List

import horovod.torch as hvd
import torch

import horovod_dgc.torch as hdgc


def ratios(method: str, steps: int, density: float) -> List[float]:
    """Per step: ||installed update|| / ||dense average||, a 256-512-10 MLP on a fixed task."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    options = {} if method == "blocksign" else {"density": density}
    compression = getattr(hdgc.Compression, method)(named_parameters=net.named_parameters(), **options)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05),
                                         named_parameters=net.named_parameters(), compression=compression)
    inputs = torch.randn(2048, 256)
    labels = inputs[:, :10].argmax(1)
    out = []
    for step in range(steps):
        batch = torch.randint(2048, (32,), generator=torch.Generator().manual_seed(10 * step + hvd.rank()))
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(inputs[batch]), labels[batch]).backward()
        raw = [p.grad.clone() for p in net.parameters()]
        optimizer.synchronize()
        dense = [hvd.allreduce(g, name=f"update_norms.{method}.{step}.{i}") for i, g in enumerate(raw)]
        installed = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in net.parameters()))
        out.append(float(installed / torch.sqrt(sum((g.double() ** 2).sum() for g in dense))))
        with optimizer.skip_synchronize():
            optimizer.step()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="dgc,topk,scalecom,blocksign")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--density", type=float, default=0.01)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    for method in args.methods.split(","):
        found = ratios(method, args.steps, args.density)
        if hvd.rank() == 0:
            last = found[-20:]
            print(f"{method}: installed / dense norm, steps 1-5 {[round(r, 2) for r in found[:5]]}, "
                  f"last 20 median {statistics.median(last):.2f} (min {min(last):.2f}, "
                  f"max {max(last):.2f})", flush=True)


if __name__ == "__main__":
    main()
