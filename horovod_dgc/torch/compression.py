"""``compression=`` for the stock ``hvd.DistributedOptimizer`` (unmodified Horovod).

Horovod calls ``compress(p.grad)`` on the autograd thread and all-reduces what it returns;
later ``decompress(result, ctx)`` on the caller's thread. A sparse compressor therefore
launches its own allgather of the message from ``compress`` (named after the parameter, so
ranks that reach tensors in different orders still match) and hands Horovod a one-element
placeholder; ``decompress`` waits for the allgather and rebuilds the averaged gradient.
"""
from __future__ import annotations

import dataclasses
import gc
import threading
from typing import Dict, Iterable, Optional, Tuple

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compression as HorovodCompression
from horovod.torch.compression import Compressor

from ..core import DGC, DGCConfig, GaussianK, GaussianKConfig, SparseMethod, TopK, TopKConfig
from ..core.stats import CompressionStats
from .engine import Engine, SparseOutcome

NamedParameters = Iterable[Tuple[str, torch.nn.Parameter]]
ALLGATHER_PREFIX = "horovod_dgc."


class _Pending:
    """Context between compress and decompress: the allgather handle and the outcome."""

    __slots__ = ("handle", "outcome")

    def __init__(self, handle: int, outcome: SparseOutcome):
        self.handle, self.outcome = handle, outcome


class SparseCompressor(Compressor):
    """A sparse method as a Horovod compressor; built by ``Compression.dgc()`` and friends.

    Args:
        method: the core method (config included).
        named_parameters: the model's ``named_parameters()``, used to key each tensor's
            memory by parameter name and to read parameters for weight decay. Pass a fresh
            ``model.named_parameters()`` (a generator can be consumed only once).
    """

    def __init__(self, method: SparseMethod, named_parameters: Optional[NamedParameters] = None):
        self.method = method
        self.config = method.config
        self._params: Dict[str, torch.nn.Parameter] = {}
        self._by_grad: Dict[int, Tuple[str, torch.nn.Parameter]] = {}
        self._lock = threading.Lock()
        self._engine: Optional[Engine] = None
        self._optimizer_checked = False
        if named_parameters is not None:
            self.bind(named_parameters)

    # -- set-up ------------------------------------------------------------------------------
    def bind(self, named_parameters: NamedParameters) -> None:
        """Key the per-tensor memories by these parameter names."""
        params = list(named_parameters)
        names = [name for name, _ in params]
        if len(set(names)) != len(names):
            raise ValueError("named_parameters holds duplicate names")
        if not params:
            raise ValueError("named_parameters is empty (a generator already consumed? pass a "
                             "fresh model.named_parameters())")
        self._params = dict(params)

    def reconfigure(self, **changes) -> None:
        """Replace settings of the method's config (validated again); only before training."""
        self.method = type(self.method)(dataclasses.replace(self.config, **changes))
        self.config = self.method.config
        if self._engine is not None:
            self._engine.method = self.method

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = Engine(self.method, world_size=hvd.size(), rank=hvd.rank())
        return self._engine

    # -- the user's controls -----------------------------------------------------------------------
    def set_epoch(self, epoch: float) -> None:
        """Drive the warm-up schedule: the density of ``floor(epoch)`` applies from now on.
        Call it at the start of every epoch, with the same value on every rank."""
        self.engine.epoch = float(epoch)

    def set_step(self, step: int, steps_per_epoch: int) -> None:
        """Step-based form of :meth:`set_epoch`."""
        self.set_epoch(step / steps_per_epoch)

    @property
    def density(self) -> float:
        return self.engine.density

    def stats(self) -> CompressionStats:
        """Bytes handed to Horovod, dense-equivalent bytes, density, compress time."""
        return self.engine.stats()

    def reset_stats(self) -> None:
        self.engine.reset_stats()

    def state_dict(self) -> dict:
        """Memories, step counters and epoch, for checkpoints."""
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state)

    # -- Horovod's interface -----------------------------------------------------------------------
    def _lookup(self, tensor: torch.Tensor) -> Tuple[str, torch.nn.Parameter]:
        if not self._params:
            raise ValueError(f"{type(self.method).__name__} keeps a memory per tensor and needs "
                             f"the parameters: Compression.{type(self.method).__name__.lower()}"
                             f"(named_parameters=model.named_parameters(), ...)")
        with self._lock:
            entry = self._by_grad.get(id(tensor))
            if entry is None or entry[1].grad is not tensor:
                self._by_grad = {id(p.grad): (n, p) for n, p in self._params.items()
                                 if p.grad is not None}
                entry = self._by_grad.get(id(tensor))
        if entry is None:
            raise ValueError(f"compress() got a tensor of shape {tuple(tensor.shape)} that is not "
                             f"the .grad of any parameter in named_parameters")
        return entry

    def compress(self, tensor: torch.Tensor):
        if Engine.passes_through(tensor):
            return tensor, None
        name, param = self._lookup(tensor)
        engine = self.engine
        if not engine.compresses(tensor):
            return engine.dense(name, tensor, param), None
        outcome = engine.compress(name, tensor, param)
        handle = hvd.allgather_async(outcome.message, name=ALLGATHER_PREFIX + name)
        placeholder = tensor.new_zeros(1)
        engine.record_placeholder(outcome.step, placeholder.element_size())
        return placeholder, _Pending(handle, outcome)

    def decompress(self, tensor: torch.Tensor, ctx: Optional[_Pending]) -> torch.Tensor:
        if not self._optimizer_checked:
            self._check_wrapping_optimizer()
        if ctx is None:
            return tensor
        gathered = hvd.synchronize(ctx.handle)
        return self.engine.decompress(gathered, [ctx.outcome])[0]

    # -- guarding against momentum applied twice -------------------------------------------------
    def _check_wrapping_optimizer(self) -> None:
        """Refuse an hvd.DistributedOptimizer around an optimizer that would apply momentum
        or weight decay a second time, or an op other than Average."""
        self._optimizer_checked = True
        for optimizer in _optimizers_holding(self):
            check_optimizer_compatible(optimizer, self.config, getattr(optimizer, "op", hvd.Average))


def _optimizers_holding(compressor: SparseCompressor):
    """The optimizers whose ``_compression`` is ``compressor`` (found through the GC)."""
    for ref in gc.get_referrers(compressor):
        owners = [ref]
        if isinstance(ref, dict) and ref.get("_compression") is compressor:
            owners = [o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref]
        for owner in owners:
            if isinstance(owner, torch.optim.Optimizer) and getattr(owner, "_compression", None) is compressor:
                yield owner


def check_optimizer_compatible(optimizer: torch.optim.Optimizer, config, op) -> None:
    """Raise ValueError if ``optimizer`` would apply what the compressor already applies."""
    if op != hvd.Average:
        raise ValueError("horovod_dgc compressors average the gradients: use op=hvd.Average")
    if not isinstance(config, DGCConfig):
        return
    for group in optimizer.param_groups:
        for key in ("momentum", "weight_decay"):
            if group.get(key, 0.0):
                raise ValueError(
                    f"the wrapped optimizer has {key}={group[key]} but Compression.dgc applies "
                    f"momentum correction (momentum={config.momentum}, weight_decay="
                    f"{config.weight_decay}) itself: give the optimizer {key}=0 and pass it to "
                    f"Compression.dgc, or use horovod_dgc.torch.DistributedOptimizer, which "
                    f"moves them over")


class Compression:
    """Horovod's ``Compression`` namespace plus the sparse methods.

    ``none`` and ``fp16`` are Horovod's own. The factories take ``named_parameters=`` (the
    model's ``named_parameters()``) and the method's options by name; every default lives in
    the method's config class (:class:`~horovod_dgc.core.DGCConfig` and friends).
    """

    none = HorovodCompression.none
    fp16 = HorovodCompression.fp16

    @staticmethod
    def dgc(named_parameters: Optional[NamedParameters] = None, **options) -> SparseCompressor:
        """Deep Gradient Compression; options: :class:`~horovod_dgc.core.DGCConfig`."""
        return SparseCompressor(DGC(DGCConfig(**options)), named_parameters)

    @staticmethod
    def topk(named_parameters: Optional[NamedParameters] = None, **options) -> SparseCompressor:
        """Exact top-k with error feedback; options: :class:`~horovod_dgc.core.TopKConfig`."""
        return SparseCompressor(TopK(TopKConfig(**options)), named_parameters)

    @staticmethod
    def gaussiank(named_parameters: Optional[NamedParameters] = None, **options) -> SparseCompressor:
        """Gaussian-k with error feedback; options: :class:`~horovod_dgc.core.GaussianKConfig`."""
        return SparseCompressor(GaussianK(GaussianKConfig(**options)), named_parameters)
