"""The adaptive switch in real Horovod jobs, on both Horovod paths.

Forced switches: every method (each with a memory whose conservation law is a plain sum),
60 steps of fixed per-rank gradients through plain SGD, every bucket forced dense for steps
20-39 and compressed again after. Every rank ends with the same parameters, and no gradient
mass is lost: the parameters moved by exactly ``lr`` times (every mean gradient minus what
the memories still owe), the memories' share all-reduced across the ranks.

Decisions: ``adaptive=`` with the link given by hand (a slow one: every bucket stays
compressed; a fast one: every bucket goes dense) and with the link probed on loopback: every
rank takes the same decisions at the same steps, and ``stats()`` says which.
"""
import horovod.torch as hvd
import torch

import horovod_dgc.torch as hdgc
from horovod_dgc.core.adaptive import COMPRESSED, DENSE, Adaptive
from shared_torch import PLAIN, conservation_error, memories_empty

STEPS, LR = 60, 0.1
DENSE_STEPS = range(20, 40)


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 50))


def gradient(rank: int, step: int, name: str, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10_000 * rank + 100 * step + len(name))
    return torch.randn(shape, generator=gen)


def wrapped(model, compression, path: str, lr: float = LR):
    wrap = hvd.DistributedOptimizer if path == "stock" else hdgc.DistributedOptimizer
    return wrap(torch.optim.SGD(model.parameters(), lr=lr), named_parameters=model.named_parameters(),
                compression=compression)


def step(model, optimizer, t: int) -> None:
    optimizer.zero_grad()
    loss = sum((p * gradient(hvd.rank(), t, n, p.shape)).sum() for n, p in model.named_parameters())
    loss.backward()
    optimizer.step()


def mean_gradient_sum(name: str, shape) -> torch.Tensor:
    return sum(gradient(r, t, name, shape).double() for r in range(hvd.size()) for t in range(STEPS)) / hvd.size()


def forced_switches(kind: str, path: str) -> None:
    method, options = PLAIN[kind]
    model = net()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    compression = getattr(hdgc.Compression, method)(named_parameters=model.named_parameters(), **options)
    optimizer = wrapped(model, compression, path)
    for t in range(STEPS):
        if t in (DENSE_STEPS.start, DENSE_STEPS.stop):
            compression.force_mode(DENSE if t == DENSE_STEPS.start else None)
        step(model, optimizer, t)
        if t in DENSE_STEPS:  # a dense step sends every float32 memory's content
            assert memories_empty(compression, model.named_parameters()), (kind, path, t)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(hvd.broadcast(flat, 0, name=f"params.{kind}.{path}"), flat), f"{kind} {path}: ranks differ"
    errors = conservation_error(compression, start, model.named_parameters(), mean_gradient_sum, LR,
                                lambda t, name: hvd.allreduce(t, op=hvd.Average, name=name),
                                lambda t, name: hvd.allgather(t, name=name))
    assert max(errors.values()) < 1e-5, f"{kind} {path}: {errors}"
    print(f"rank {hvd.rank()} {kind} {path} forced switches ok", flush=True)


def decisions(settings: Adaptive, path: str):
    """Each decision's modes, by label, over 16 steps of dgc with ``settings``."""
    model = net()
    compression = hdgc.Compression.dgc(named_parameters=model.named_parameters(), adaptive=settings)
    optimizer = wrapped(model, compression, path, lr=0.01)
    for t in range(16):
        step(model, optimizer, t)
    lines = compression.stats().buckets
    assert lines and all(line.startswith("bucket.") for line in lines), lines
    modes = [line.split(": ")[1].split(",")[0] for line in lines]
    # The same decisions on every rank: one bit per bucket, compared with rank 0's.
    # Every rank decided on the same numbers: the same predictions, to the digit.
    assert hvd.broadcast_object(lines, 0, name=f"lines.{path}.{settings}") == lines, (hvd.rank(), lines)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(hvd.broadcast(flat, 0, name=f"params.{path}.{settings}"), flat)
    return modes, lines


if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    for path in ("own", "stock"):
        for kind in PLAIN:
            forced_switches(kind, path)
        every = dict(recheck_steps=5, first_decision_step=4, sample_steps=2)
        slow, _ = decisions(Adaptive(link_bytes_per_s=1e3, **every), path)
        assert set(slow) == {COMPRESSED}, slow
        fast, lines = decisions(Adaptive(link_bytes_per_s=1e15, **every), path)
        assert set(fast) == {DENSE}, lines
        probed, lines = decisions(Adaptive(**every), path)
        print(f"rank {hvd.rank()} {path} decisions agree: {lines}", flush=True)
