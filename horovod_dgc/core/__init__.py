"""Framework-free core of horovod_dgc: selection, error feedback, warm-up, wire format.

Imports neither NumPy, CuPy, PyTorch nor TensorFlow; the adapters implement
:class:`~horovod_dgc.core.ops.TensorOps`.
"""
from .config import SparseConfig
from .dgc import DGC, DGCConfig
from .gaussiank import GaussianK, GaussianKConfig
from .sparse import NonFiniteGradientError, SparseMethod, StepContext
from .topk import TopK, TopKConfig
from .warmup import DensitySchedule
from .wire import MessageError

__all__ = ["DGC", "DGCConfig", "DensitySchedule", "GaussianK", "GaussianKConfig", "MessageError",
           "NonFiniteGradientError", "SparseConfig", "SparseMethod", "StepContext", "TopK",
           "TopKConfig"]
