"""Framework-free core of horovod_dgc: selection, error feedback, warm-up, wire format.

Imports neither NumPy, CuPy, PyTorch nor TensorFlow; the adapters implement
:class:`~horovod_dgc.core.ops.TensorOps`. ``methods.METHODS`` lists every method.
"""
from .blocksign import BlockSign, BlockSignConfig
from .config import CompressionConfig, SparseConfig
from .dgc import DGC, DGCConfig
from .gaussiank import GaussianK, GaussianKConfig
from .method import CompressCall, Method, StateLayout
from .methods import METHODS, MethodSpec
from .scalecom import ScaleCom, ScaleComConfig
from .nonfinite import NonFiniteGradientError
from .sparse import SparseMethod
from .topk import TopK, TopKConfig
from .twostage import TwoStageMethod
from .warmup import DensitySchedule
from .wire import MessageError

__all__ = ["BlockSign", "BlockSignConfig", "CompressCall", "CompressionConfig", "DGC", "DGCConfig",
           "DensitySchedule", "GaussianK", "GaussianKConfig", "METHODS", "MessageError", "Method",
           "MethodSpec", "NonFiniteGradientError", "ScaleCom", "ScaleComConfig", "SparseConfig",
           "SparseMethod", "StateLayout", "TopK", "TopKConfig", "TwoStageMethod"]
