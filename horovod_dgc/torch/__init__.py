"""PyTorch adapter: ``Compression`` for ``hvd.DistributedOptimizer`` and our own fused
``DistributedOptimizer``.

The names that need Horovod are imported on first use, so that the engine and the ops
(``horovod_dgc.torch.engine``, ``horovod_dgc.torch.ops``) work where PyTorch is installed
without Horovod, as on a GPU machine used to test and time them.
"""
from importlib import import_module
from typing import Any

from .ops import TorchOps

_LAZY = {"Compression": ".compression", "SparseCompressor": ".compression",
         "DistributedOptimizer": ".optimizer"}

__all__ = ["Compression", "DistributedOptimizer", "SparseCompressor", "TorchOps"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value
