"""PyTorch adapter: ``Compression`` for ``hvd.DistributedOptimizer`` and our own fused
``DistributedOptimizer``.

Modules are imported on first use, and Horovod only by the paths that run through it, so
that ``Compression`` with the DDP hook (``horovod_dgc.torch.ddp``), the engine and the ops work
where PyTorch is installed without Horovod (a ``torchrun`` job, a GPU machine used to test and
time them); ``DistributedOptimizer`` needs Horovod.
"""
from importlib import import_module
from typing import Any

from ..core.adaptive import Adaptive
from .ops import TorchOps

_LAZY = {"Compression": ".compression", "SparseCompressor": ".compression",
         "DistributedOptimizer": ".optimizer"}

__all__ = ["Adaptive", "Compression", "DistributedOptimizer", "SparseCompressor", "TorchOps"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value
