"""One worker (``horovodrun -np 1``): Horovod's own ``DistributedOptimizer`` registers no
hooks and never calls the compressor. A compressor that applies momentum (DGC; blocksign
with momentum) is refused at the first step, before a step without its momentum; one that
keeps a plain residual is warned of once, and the run is exactly plain SGD (a reference loop
without Horovod). Our fused optimizer runs the method on one worker: no warning, and it
compresses. On two workers (``-np 2``) nothing warns and every method compresses.
"""
import warnings

import horovod.torch as hvd
import torch

import horovod_dgc.torch as hdgc

STEPS = 3
SAID = "with one worker (hvd.size() == 1)"


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def steps(model, optimizer) -> list:
    """Run the steps; the warnings each step raised that speak of one worker."""
    said = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + hvd.rank())
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(16, 64, generator=gen)),
                                          torch.randint(10, (16,), generator=gen)).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.step()
        said.append([str(w.message) for w in caught if SAID in str(w.message)])
    return said


def train(method: str, path: str, **options):
    model = net()
    compression = getattr(hdgc.Compression, method)(named_parameters=model.named_parameters(), **options)
    wrap = hvd.DistributedOptimizer if path == "stock" else hdgc.DistributedOptimizer
    optimizer = wrap(torch.optim.SGD(model.parameters(), lr=0.1),
                     named_parameters=model.named_parameters(), compression=compression)
    said = steps(model, optimizer)
    return model, compression, said


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def plain_sgd() -> torch.Tensor:
    """The reference: the same steps with torch's SGD and no Horovod."""
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(16, 64, generator=gen)),
                                          torch.randint(10, (16,), generator=gen)).backward()
        optimizer.step()
    return flat(model)


def refused(method: str, applied: str, **options) -> None:
    try:
        train(method, "stock", **options)
    except ValueError as error:
        message = str(error)
        assert SAID in message and applied in message and "DistributedOptimizer" in message, message
        return
    raise AssertionError(f"{method} {options} on one worker was not refused")


def one_worker() -> None:
    refused("dgc", "momentum=0.9")
    refused("dgc", "weight_decay=0.0001", momentum=0.0, weight_decay=1e-4)
    refused("blocksign", "momentum=0.5", momentum=0.5)
    reference = plain_sgd()
    for method, options in (("topk", {}), ("scalecom", {}), ("dgc", dict(momentum=0.0))):
        model, compression, said = train(method, "stock", density=0.01, **options)
        assert len(said[0]) == 1 and "uncompressed" in said[0][0], said
        assert not any(said[1:]), f"{method}: warned again: {said}"
        assert torch.equal(flat(model), reference), f"{method}: not the plain SGD run"
        assert compression.stats().steps == 0
    for method in ("dgc", "topk"):
        model, compression, said = train(method, "own", density=0.01)
        assert not any(said), said
        stats = compression.stats()
        assert stats.steps == STEPS and 0 < stats.elements_sent < stats.elements_compressed, stats
        assert not torch.equal(flat(model), reference)
    print("one worker ok", flush=True)


def two_workers() -> None:
    for method in ("dgc", "topk"):
        for path in ("stock", "own"):
            _, compression, said = train(method, path, density=0.01)
            assert not any(said), f"{method}/{path}: {said}"
            assert compression.stats().steps == STEPS
    print(f"rank {hvd.rank()} two workers ok", flush=True)


if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    one_worker() if hvd.size() == 1 else two_workers()
