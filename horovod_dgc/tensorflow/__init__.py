"""TensorFlow adapter: ``Compression`` for Horovod's ``DistributedGradientTape`` (and Keras's
``DistributedOptimizer``), and a tape that takes Keras 3 variables."""
from .compression import Compression, MethodCompressor, SparseCompressor, TwoStageCompressor
from .ops import TFOps
from .tape import DistributedGradientTape

__all__ = ["Compression", "DistributedGradientTape", "MethodCompressor", "SparseCompressor", "TFOps",
           "TwoStageCompressor"]
