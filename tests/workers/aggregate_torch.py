"""One training step with fixed per-rank gradients through a Horovod path; every rank checks
that its aggregated gradient equals the dense reference built from all ranks' sent values.

Ranks produce their gradients in different orders (reversed on odd ranks) and one layer is
unused (its gradient is created in synchronize(), where Horovod iterates a set), so tensors
reach the compressor in different orders on different ranks.
"""
import argparse

import horovod.torch as hvd
import torch

import horovod_dgc.torch as hdgc
from horovod_dgc.core.selection import top_count
from shared_torch import exact_topk_dense, sent_values

DENSITY = 0.01


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(64, 300)   # weight compressed, bias small (its own density)
        self.second = torch.nn.Linear(300, 50)  # weight compressed
        self.unused = torch.nn.Linear(10, 40)   # small; never gets a gradient


def gradients(rank: int, model: Net) -> dict:
    gen = torch.Generator().manual_seed(1000 + rank)
    return {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()
            if not n.startswith("unused")}


def run(method: str, path: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = Net()
    # float32 values: the sent values are then exactly the selected gradient entries.
    compression = getattr(hdgc.Compression, method)(named_parameters=model.named_parameters(),
                                                    density=DENSITY, value_dtype="float32")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    wrap = hvd.DistributedOptimizer if path == "stock" else hdgc.DistributedOptimizer
    optimizer = wrap(sgd, named_parameters=model.named_parameters(), compression=compression)
    compression = optimizer._compression if path == "own" else compression

    grads = gradients(rank, model)
    params = dict(model.named_parameters())
    order = sorted(grads) if rank % 2 == 0 else sorted(grads, reverse=True)
    loss = sum((params[n] * grads[n]).sum() for n in order)
    loss.backward()
    optimizer.synchronize()

    for name, grad in grads.items():
        compressed = compression.engine.compresses(grad)
        mine = sent_values(compression, name, grad) if compressed else grad
        if compressed and method in ("topk", "dgc"):
            k = top_count(compression.config.density_floor(tuple(grad.shape)) or DENSITY,
                          grad.numel())
            assert torch.equal(mine, exact_topk_dense(grad, k)), f"{name}: not the exact top-k"
        everyone = hvd.allgather_object(mine, name=f"check.{method}.{path}.{name}")
        reference = torch.zeros_like(grad)
        for sent in everyone:
            reference = reference + sent
        reference = reference * (1.0 / size)
        got = params[name].grad
        if compressed:
            assert torch.equal(got, reference), f"rank {rank} {method}/{path} {name}: not bit-exact"
        else:
            torch.testing.assert_close(got, reference, rtol=1e-6, atol=1e-7)
    assert torch.count_nonzero(params["unused.weight"].grad) == 0
    print(f"rank {rank}/{size} {method} {path} aggregate ok", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", choices=["stock", "own"], required=True)
    parser.add_argument("--methods", default="topk,dgc,gaussiank")
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    for method in args.methods.split(","):
        run(method, args.path)
