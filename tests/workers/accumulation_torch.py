"""Gradient accumulation (``backward_passes_per_step=2``) on real ranks, every method, both
paths: two backward passes of gradients G1 and G2 before each step give the parameters that
one backward pass of G1 + G2 gives with ``backward_passes_per_step=1`` (autograd sums the two
passes with the same rounding), after 12 steps, also with ``model.zero_grad(set_to_none=False)``,
where each pass accumulates into the ``.grad`` the last step left: on both paths a view of
its bucket's buffer, where the average was written. Catches a compressor that runs on each
backward pass instead of once a step, counts its step (ScaleCom's leader, the header's step,
DGC's warm-up) per pass, keeps only the last pass's gradient, or writes into a bucket's
buffer before it has read the gradients that lie there.
"""
import horovod.torch as hvd
import torch

import horovod_dgc.torch as hdgc
from horovod_dgc.core.methods import METHODS

STEPS = 12
OPTIONS = {"dgc": dict(density=0.01, momentum=0.9), "topk": dict(density=0.01),
           "gaussiank": dict(density=0.01), "scalecom": dict(density=0.01),
           "blocksign": dict(momentum=0.5)}


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 50))


def gradient(step: int, micro: int, name: str, shape) -> torch.Tensor:
    """Micro-batch ``micro``'s gradient for parameter ``name`` on this rank."""
    gen = torch.Generator().manual_seed(100_000 * hvd.rank() + 1000 * step + 10 * micro + len(name))
    return torch.randn(shape, generator=gen)


def train(method: str, path: str, passes: int, set_to_none: bool = True) -> torch.Tensor:
    model = net()
    compression = getattr(hdgc.Compression, method)(named_parameters=model.named_parameters(),
                                                    **OPTIONS[method])
    wrap = hvd.DistributedOptimizer if path == "stock" else hdgc.DistributedOptimizer
    optimizer = wrap(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                     compression=compression, backward_passes_per_step=passes)
    compression.set_epoch(0)
    for step in range(STEPS):
        model.zero_grad(set_to_none=set_to_none)  # Horovod's optimizer takes no set_to_none
        if passes == 2:
            for micro in range(2):
                sum((p * gradient(step, micro, n, p.shape)).sum() for n, p in model.named_parameters()).backward()
        else:
            sum((p * (gradient(step, 0, n, p.shape) + gradient(step, 1, n, p.shape))).sum()
                for n, p in model.named_parameters()).backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    for spec in METHODS:
        for path in ("stock", "own"):
            summed = train(spec.name, path, 1)
            moved = float((summed - torch.cat([p.detach().reshape(-1) for p in net().parameters()])).abs().max())
            assert moved > 0.01, f"{spec.name} {path}: the parameters did not move"
            for set_to_none in (True, False):
                accumulated = train(spec.name, path, 2, set_to_none)
                difference = float((accumulated - summed).abs().max())
                assert difference <= 1e-6, \
                    f"{spec.name} {path} (set_to_none={set_to_none}): accumulation differs by {difference}"
            print(f"rank {hvd.rank()} {spec.name} {path} accumulation ok ({difference:.1e})", flush=True)
