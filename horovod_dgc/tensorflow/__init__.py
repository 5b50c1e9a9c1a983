"""TensorFlow adapter: ``Compression`` for Horovod's ``DistributedGradientTape``."""
from .compression import Compression, SparseCompressor
from .ops import TFOps

__all__ = ["Compression", "SparseCompressor", "TFOps"]
