"""Helpers of the PyTorch workers that import no Horovod: the DDP worker (ddp_torch.py) runs
with Horovod's import blocked, as where it is not installed."""
from typing import Callable, Dict, Iterable, Tuple

import torch

# The adaptive switch's runs: every method with a memory whose conservation law is a plain sum
# (no momentum), as (factory, options).
PLAIN = {"topk": ("topk", {}), "gaussiank": ("gaussiank", {}), "dgc": ("dgc", {"momentum": 0.0}),
         "dgc-sar": ("dgc", {"momentum": 0.0, "aggregation": "sparse_allreduce"}),
         "scalecom": ("scalecom", {"beta": 1.0}), "blocksign": ("blocksign", {"momentum": 0.0})}


def sent_values(compression, name: str, grad: torch.Tensor) -> torch.Tensor:
    """What this rank sent for ``name``: the gradient minus what its memory kept."""
    state = compression.engine.memories(name)
    kept = state["velocity"] if "velocity" in state else state["residual"]
    return grad - kept.reshape(grad.shape)


def exact_topk_dense(grad: torch.Tensor, k: int) -> torch.Tensor:
    flat = grad.reshape(-1)
    order = sorted(range(flat.numel()), key=lambda i: -abs(float(flat[i])))
    out = torch.zeros_like(flat)
    out[order[:k]] = flat[order[:k]]
    return out.reshape(grad.shape)


def compiled_fresh(module: torch.nn.Module) -> Tuple[torch.nn.Module, Callable[[], int]]:
    """(``torch.compile(module)`` with the ``aot_eager`` backend, a count of the graphs
    dynamo compiled since this call). Dynamo is reset first, so that no recompile limit left
    by earlier compiles makes it run ``module`` eagerly, silently; its counters are not."""
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return (torch.compile(module, backend="aot_eager"),
            lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)


def owed(compression, name: str, numel: int, mean: Callable[[torch.Tensor, str], torch.Tensor],
         gather: Callable[[torch.Tensor, str], torch.Tensor]) -> torch.Tensor:
    """What the memories of every rank still owe tensor ``name``'s average (float64, flat);
    ``mean`` and ``gather``: the job's averaging all-reduce and all-gather, (tensor, name)."""
    method = compression.method
    memories = compression.engine.memories(name)
    pending = mean(memories[method.pending_memory].double(), f"owed.{name}")
    for key in method.state_layout(True).sharded:
        pending = pending + gather(memories[key].double(), f"shards.{name}")[:numel]
    return pending


def conservation_error(compression, start: Dict[str, torch.Tensor],
                       named_parameters: Iterable[Tuple[str, torch.nn.Parameter]],
                       mean_gradients: Callable[[str, torch.Size], torch.Tensor], lr: float,
                       mean: Callable[[torch.Tensor, str], torch.Tensor],
                       gather: Callable[[torch.Tensor, str], torch.Tensor]) -> Dict[str, float]:
    """Per parameter, how far plain SGD's parameters lie from ``start - lr * (the sum of the
    mean gradients - what the memories owe)``, relative to ``lr`` times that sum: no gradient
    mass lost or counted twice where this is float32 rounding."""
    errors = {}
    for name, p in named_parameters:
        mean_grads = mean_gradients(name, p.shape).double()
        owes = (owed(compression, name, p.numel(), mean, gather).reshape(p.shape)
                if compression.engine.compresses(p) else 0.0)
        want = start[name].double() - lr * (mean_grads - owes)
        errors[name] = float((p.detach().double() - want).norm() / (lr * mean_grads).norm())
    return errors


def memories_empty(compression, named_parameters: Iterable[Tuple[str, torch.nn.Parameter]]) -> bool:
    """Whether every compressed tensor's float32 pending memory is all zeros (after a dense
    step, which sends it)."""
    return all(not compression.engine.memories(n)[compression.method.pending_memory].any()
               for n, p in named_parameters if compression.engine.compresses(p))
