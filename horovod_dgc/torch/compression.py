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

from ..core import DGC, DGCConfig, GaussianK, GaussianKConfig, TopK, TopKConfig
from ..core.blocksign import BlockSign, BlockSignConfig
from ..core.exchange import ALLGATHER
from ..core.scalecom import ScaleCom, ScaleComConfig
from ..core.controls import CompressorControls
from .collectives import PREFIX, launch, wait
from .engine import Engine, SparseOutcome

NamedParameters = Iterable[Tuple[str, torch.nn.Parameter]]


class _Pending:
    """Context between compress and decompress: the allgather handle and the outcome."""

    __slots__ = ("handle", "outcome")

    def __init__(self, handle: int, outcome: SparseOutcome):
        self.handle, self.outcome = handle, outcome

    @property
    def step(self) -> int:
        return self.outcome.step


class MethodCompressor(CompressorControls, Compressor):
    """A core method as a Horovod compressor: what every horovod_dgc compressor shares.

    Args:
        method: the core method (config included).
        named_parameters: the model's ``named_parameters()``, used to key each tensor's
            memory by parameter name and to read parameters for weight decay. Pass a fresh
            ``model.named_parameters()`` (a generator can be consumed only once).
    """

    def __init__(self, method, named_parameters: Optional[NamedParameters] = None):
        self.method = method
        self.config = method.config
        self._params: Dict[str, torch.nn.Parameter] = {}
        self._by_grad: Dict[int, Tuple[str, torch.nn.Parameter]] = {}
        self._lock = threading.Lock()
        self._engine: Optional[Engine] = None
        self._optimizer_checked = False
        self._memory_numels: Optional[Dict[str, int]] = None
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

    def state_dict(self) -> dict:
        """This rank's memories, step counters and epoch, for checkpoints: save every rank's."""
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore this rank's part (same method, config, world size and rank, and tensors
        of the same sizes; ValueError otherwise)."""
        numels = self._memory_numels or {name: p.numel() for name, p in self._params.items()}
        self.engine.load_state_dict(state, numels)

    def expect_memories(self, numels: Dict[str, int]) -> None:
        """Name the tensors this compressor keeps memories for, when they are not the bound
        parameters (the fused optimizer's buckets), with their elements."""
        self._memory_numels = dict(numels)

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
        if not self.engine.compresses(tensor):
            return self.engine.dense(name, tensor, param), None
        ctx = self.start_exchange(name, tensor, param)
        placeholder = tensor.new_zeros(1)
        self.engine.record_placeholder(ctx.step, placeholder.element_size())
        return placeholder, ctx

    def decompress(self, tensor: torch.Tensor, ctx) -> torch.Tensor:
        if not self._optimizer_checked:
            self._check_wrapping_optimizer()
        if ctx is None:
            return tensor
        return self.finish_exchange(ctx)

    def start_exchange(self, name: str, tensor: torch.Tensor, param: torch.nn.Parameter):
        """Launch the exchange of a compressed tensor; returns the context for decompress."""
        raise NotImplementedError

    def abandon_exchanges(self) -> None:
        """Forget the exchanges of a step interrupted by an elastic reset."""

    def finish_exchange(self, ctx) -> torch.Tensor:
        raise NotImplementedError

    # -- guarding against momentum applied twice -------------------------------------------------
    def _check_wrapping_optimizer(self) -> None:
        """Refuse an hvd.DistributedOptimizer around an optimizer that would apply momentum
        or weight decay a second time, or an op other than Average (best effort: the
        optimizer is found through the garbage collector's referrers)."""
        self._optimizer_checked = True
        for optimizer in _optimizers_holding(self):
            check_optimizer_compatible(optimizer, self.config, getattr(optimizer, "op", hvd.Average))


class SparseCompressor(MethodCompressor):
    """A sparse method (DGC, Top-k, Gaussian-k): one allgather of (index, value) messages
    per tensor, named after the parameter."""

    def start_exchange(self, name: str, tensor: torch.Tensor, param: torch.nn.Parameter) -> _Pending:
        outcome = self.engine.compress(name, tensor, param)
        return _Pending(launch(ALLGATHER, outcome.message, name), outcome)

    def finish_exchange(self, ctx: _Pending) -> torch.Tensor:
        return self.engine.decompress(wait(ctx.handle), [ctx.outcome])[0]


class _Stages:
    """One tensor's progress through a two-stage exchange."""

    __slots__ = ("name", "pending", "first", "second", "shape", "step")

    def __init__(self, name: str, pending, first: int, shape: torch.Size):
        self.name, self.pending, self.first, self.second = name, pending, first, None
        self.shape, self.step = shape, pending.ctx.step


class TwoStageCompressor(MethodCompressor):
    """A two-stage method (ScaleCom, blocksign) as a Horovod compressor.

    compress launches stage 1 without waiting. The first decompress of a step waits for
    every pending stage 1 and launches every stage 2, in parameter-name order, before it
    waits for any stage 2: ranks that decompress tensors in different orders never wait
    on a collective another rank has not launched.
    """

    def __init__(self, method, named_parameters: Optional[NamedParameters] = None):
        super().__init__(method, named_parameters)
        self._in_flight: Dict[str, _Stages] = {}

    def start_exchange(self, name: str, tensor: torch.Tensor, param: torch.nn.Parameter) -> _Stages:
        message, pending = self.engine.first(name, tensor, param)
        handle = launch(self.method.FIRST, message, f"1.{name}", self.method.root(pending.ctx))
        stages = _Stages(name, pending, handle, tensor.shape)
        with self._lock:
            self._in_flight[name] = stages
        return stages

    def abandon_exchanges(self) -> None:
        with self._lock:
            self._in_flight.clear()

    def launch_second_stages(self) -> None:
        """Stage 2 of every tensor whose stage 1 is in flight, in name order."""
        with self._lock:
            waiting = sorted((s for s in self._in_flight.values() if s.second is None),
                             key=lambda s: s.name)
        for stages in waiting:
            message = self.engine.second(stages.name, wait(stages.first), stages.pending)
            stages.second = launch(self.method.SECOND, message, f"2.{stages.name}",
                                   self.method.root(stages.pending.ctx))

    def finish_exchange(self, ctx: _Stages) -> torch.Tensor:
        if ctx.second is None:
            self.launch_second_stages()
        with self._lock:
            self._in_flight.pop(ctx.name, None)
        return self.engine.finish(wait(ctx.second), ctx.pending, ctx.shape)


def _optimizers_holding(compressor: MethodCompressor):
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
    for key in ("momentum", "weight_decay"):
        mine = getattr(config, key, 0.0)
        theirs = [g.get(key, 0.0) for g in optimizer.param_groups]
        if mine and any(theirs):
            raise ValueError(
                f"the wrapped optimizer has {key}={max(theirs)} but the compressor applies "
                f"{key}={mine} itself: give the optimizer {key}=0 (the compressor applies it), "
                f"or use horovod_dgc.torch.DistributedOptimizer, which moves SGD's momentum and "
                f"weight decay into a DGC compressor")


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

    @staticmethod
    def scalecom(named_parameters: Optional[NamedParameters] = None, **options) -> TwoStageCompressor:
        """ScaleCom's cyclic local top-k, values all-reduced; options:
        :class:`~horovod_dgc.core.scalecom.ScaleComConfig`."""
        return TwoStageCompressor(ScaleCom(ScaleComConfig(**options)), named_parameters)

    @staticmethod
    def blocksign(named_parameters: Optional[NamedParameters] = None, **options) -> TwoStageCompressor:
        """Blockwise scaled 1-bit sign with worker and server error feedback; options:
        :class:`~horovod_dgc.core.blocksign.BlockSignConfig`."""
        return TwoStageCompressor(BlockSign(BlockSignConfig(**options)), named_parameters)
