"""Helpers of the PyTorch workers that import no Horovod: the DDP worker (ddp_torch.py) runs
with Horovod's import blocked, as where it is not installed."""
from typing import Callable, Tuple

import torch


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
