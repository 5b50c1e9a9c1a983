"""Every method, 20 steps through the stock ``hvd.DistributedOptimizer`` and through the fused
``horovod_dgc.torch.DistributedOptimizer``, on fixed per-rank gradients whose two layers differ
100x in scale. A bucket is a transport unit only (each tensor is selected, scaled and
remembered on its own), so both paths end with the same parameters, within 1e-6; a path that
compressed a bucket as one tensor would give the small layer updates of the large one's scale.
The fused path's dense tensors (blocksign's biases) share one all-reduce name per bucket.
Rank 1 computes no gradient for the first layer's weight: both paths send zeros for it there
(a path that waited for it would hang, one that skipped it would leave the ranks apart).
"""
import horovod.torch as hvd
import torch

import horovod_dgc.torch as hdgc
from horovod_dgc.core.methods import METHODS

STEPS = 20
OPTIONS = {"dgc": dict(density=0.01), "topk": dict(density=0.01), "gaussiank": dict(density=0.01),
           "scalecom": dict(density=0.01), "blocksign": dict(momentum=0.5)}
LAYER_SCALE = {"0.weight": 1.0, "0.bias": 1.0, "1.weight": 0.01, "1.bias": 0.01}
UNUSED = ("0.weight", 1)  # rank 1 computes no gradient for it: it sends zeros


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 50))


def gradient(rank: int, step: int, name: str, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10_000 * rank + 100 * step + len(name))
    return torch.randn(shape, generator=gen) * LAYER_SCALE[name]


def noting_names(launch, launched: set):
    """``launch`` (hvd.allreduce_async_, the fused path's dense all-reduces), noting each name."""
    def noting(tensor, name=None, **kwargs):
        launched.add(name)
        return launch(tensor, name=name, **kwargs)
    return noting


def train(method: str, path: str) -> torch.Tensor:
    model = net()
    compression = getattr(hdgc.Compression, method)(named_parameters=model.named_parameters(),
                                                    **OPTIONS[method])
    wrap = hvd.DistributedOptimizer if path == "stock" else hdgc.DistributedOptimizer
    optimizer = wrap(torch.optim.SGD(model.parameters(), lr=0.1),
                     named_parameters=model.named_parameters(), compression=compression)
    compression.set_epoch(0)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = sum((p * gradient(hvd.rank(), step, n, p.shape)).sum() for n, p in model.named_parameters()
                   if (n, hvd.rank()) != UNUSED)
        loss.backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    allreduce_async_ = hvd.allreduce_async_
    for spec in METHODS:
        stock, launched = train(spec.name, "stock"), set()
        hvd.allreduce_async_ = noting_names(allreduce_async_, launched)
        fused = train(spec.name, "own")
        hvd.allreduce_async_ = allreduce_async_
        difference = float((stock - fused).abs().max())
        assert difference <= 1e-6, f"{spec.name}: the paths differ by {difference}"
        # Both biases (and blocksign's, dense) share one bucket: one name, not one per tensor.
        assert len(launched) <= 1, f"{spec.name}: dense all-reduces under {sorted(launched)}"
        print(f"rank {hvd.rank()} {spec.name} paths agree ({difference:.1e})", flush=True)
