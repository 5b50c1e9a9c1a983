"""PyTorch adapter: ``Compression`` for ``hvd.DistributedOptimizer`` and our own fused
``DistributedOptimizer``."""
from .compression import Compression, SparseCompressor
from .ops import TorchOps
from .optimizer import DistributedOptimizer

__all__ = ["Compression", "DistributedOptimizer", "SparseCompressor", "TorchOps"]
