"""PyTorch adapter: ``Compression`` for ``hvd.DistributedOptimizer`` and our own fused
``DistributedOptimizer``."""
from .compression import Compression, SparseCompressor
from .ops import TorchOps

__all__ = ["Compression", "SparseCompressor", "TorchOps"]
