"""Every method through the stock ``hvd.DistributedOptimizer`` with and without
``named_parameters=`` given to the compressor (and to the optimizer): the compressor takes
the optimizer's names on its own, and the parameters after 20 steps are identical. Rank 1
reaches the tensors in the reverse order of rank 0, and one parameter (large enough to be
compressed) takes no part in the loss, so Horovod hands it a zero gradient at synchronize().
Then what cannot work is refused with the tensor or the sharing named.
"""
from typing import Tuple

import horovod.torch as hvd
import torch

import horovod_dgc.torch as hdgc
from horovod_dgc.core.methods import METHODS
from paths_torch import LAYER_SCALE, OPTIONS, STEPS, gradient
from paths_torch import net as used_layers


def net() -> torch.nn.Module:
    """paths_torch's two layers, and a third that no loss uses (5,000 weights: compressed)."""
    model = used_layers()
    model.append(torch.nn.Linear(100, 50))
    return model


def train(method: str, names_to_compressor: bool, names_to_optimizer: bool) -> Tuple[torch.Tensor, int]:
    """The parameters after the steps, and how many tensors have a memory."""
    model = net()
    named = dict(named_parameters=model.named_parameters()) if names_to_compressor else {}
    compression = getattr(hdgc.Compression, method)(**named, **OPTIONS[method])
    named = dict(named_parameters=model.named_parameters()) if names_to_optimizer else {}
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         compression=compression, **named)
    compression.set_epoch(0)
    used = [(n, p) for n, p in model.named_parameters() if n in LAYER_SCALE]
    if hvd.rank() == 1:
        used.reverse()
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = sum((p * gradient(hvd.rank(), step, n, p.shape)).sum() for n, p in used)
        loss.backward()
        optimizer.step()
    return (torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            len(compression.state_dict()["states"]))


def expect_error(fragment: str, action) -> None:
    try:
        action()
    except ValueError as error:
        assert fragment in str(error), f"expected {fragment!r} in: {error}"
        return
    raise AssertionError(f"no ValueError with {fragment!r}")


def misuse() -> None:
    shared = hdgc.Compression.topk()
    models = [net(), net()]
    optimizers = [hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                           compression=shared) for m in models]
    loss = models[0][0](torch.ones(1, 64)).sum()
    expect_error("2 optimizers share one Compression.topk", loss.backward)
    del optimizers
    model = net()
    alone = hdgc.Compression.dgc()
    expect_error("Compression.dgc(named_parameters=", lambda: alone.compress(torch.ones(5000)))
    named = hdgc.Compression.topk(named_parameters=model.named_parameters())
    expect_error("not the .grad of any parameter", lambda: named.compress(torch.ones(5000)))


if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    for spec in METHODS:
        given, memories = train(spec.name, True, True)
        assert memories >= 3, f"{spec.name}: {memories} memories (the three weights have one)"
        for to_optimizer in (True, False):
            found, found_memories = train(spec.name, False, to_optimizer)
            assert found_memories == memories, (spec.name, to_optimizer, found_memories, memories)
            assert torch.equal(given, found), \
                f"{spec.name}: names found (optimizer named: {to_optimizer}) differ by " \
                f"{float((given - found).abs().max())}"
        print(f"rank {hvd.rank()} {spec.name} names found ok", flush=True)
    misuse()
    print(f"rank {hvd.rank()} misuse ok", flush=True)
