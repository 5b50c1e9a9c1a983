"""Per-tensor state and the core calls for PyTorch, shared by both Horovod paths.

An :class:`Engine` knows nothing of Horovod: it turns a named gradient into either a sparse
message (bytes) or a dense tensor to all-reduce, and turns gathered messages back into the
averaged dense gradient. ``compression.py`` (stock ``hvd.DistributedOptimizer``) and
``optimizer.py`` (our own, fused) put the collectives around it.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..core.method import CompressCall, Method
from ..core.state import check_loadable, state_frame
from ..core.stats import CompressionStats, StatsRecorder
from ..core.twostage import StageHandover
from ..core.wire import MessageLayout
from .ops import TorchOps, dtype_name


@dataclass
class OutgoingMessage:
    """A compressed tensor's sparse message, and what decompress needs to rebuild it."""

    name: str
    message: torch.Tensor
    layout: MessageLayout
    step: int
    shape: torch.Size
    dtype: torch.dtype


class Engine:
    """Holds a method, the per-tensor memories, the step counters and the statistics."""

    def __init__(self, method: Method, world_size: int, rank: int):
        self.method = method
        self.ops = TorchOps()
        self.world_size = world_size
        self.rank = rank
        self.epoch = 0.0
        self._states: Dict[str, dict] = {}
        self._steps: Dict[str, int] = {}
        self._lock = threading.Lock()
        self._stats = StatsRecorder()

    @property
    def config(self):
        return self.method.config

    # -- schedule and statistics ------------------------------------------------------------
    def set_epoch(self, epoch: float) -> None:
        self.epoch = float(epoch)

    @property
    def density(self) -> float:
        """Density in force now (after warm-up)."""
        return self.config.density_at(self.epoch)

    def stats(self) -> CompressionStats:
        return self._stats.snapshot()

    def reset_stats(self) -> None:
        self._stats.reset()

    # -- which path -------------------------------------------------------------------------
    def compresses(self, tensor: torch.Tensor) -> bool:
        return self.config.compresses(tuple(tensor.shape), dtype_name(tensor.dtype))

    @staticmethod
    def passes_through(tensor: torch.Tensor) -> bool:
        """Zero-element and non-floating tensors are handed on untouched."""
        return tensor.numel() == 0 or not tensor.is_floating_point()

    def _next_step(self, name: str) -> int:
        with self._lock:
            step = self._steps.get(name, 0)
            self._steps[name] = step + 1
            return step

    def _state(self, name: str, flat: torch.Tensor, compressed: bool) -> dict:
        with self._lock:
            if name not in self._states:
                self._states[name] = self.method.init_state(self.ops, flat, compressed,
                                                            self.world_size)
            return self._states[name]

    def _call(self, name: str, step: int, param: Optional[torch.Tensor]) -> CompressCall:
        flat_param = None if param is None else param.detach().reshape(-1)
        return CompressCall(name=name, rank=self.rank, world_size=self.world_size, step=step,
                           density=self.density, param=flat_param)

    # -- the two paths ------------------------------------------------------------------------
    def compress(self, name: str, grad: torch.Tensor, param: Optional[torch.Tensor]) -> OutgoingMessage:
        """Sparse message for a tensor that :meth:`compresses`."""
        started = time.perf_counter()
        flat = grad.detach().reshape(-1)
        step = self._next_step(name)
        result = self.method.compress(self.ops, self._state(name, flat, True), flat,
                                      self._call(name, step, param))
        with self._lock:
            self._states[name] = result.state
        elapsed = time.perf_counter() - started
        self._stats.record(step=step, bytes_sent=result.layout.nbytes,
                           dense_bytes=grad.numel() * grad.element_size(),
                           elements_sent=int(result.count), elements_compressed=grad.numel(),
                           selection_time_s=elapsed)
        return OutgoingMessage(name, result.message, result.layout, step, grad.shape, grad.dtype)

    def dense(self, name: str, grad: torch.Tensor, param: Optional[torch.Tensor]) -> torch.Tensor:
        """What to all-reduce for a tensor that does not compress (a new tensor)."""
        flat = grad.detach().reshape(-1)
        step = self._next_step(name)
        update, state = self.method.dense(self.ops, self._state(name, flat, False), flat,
                                          self._call(name, step, param))
        with self._lock:
            self._states[name] = state
        update = update.to(grad.dtype).reshape(grad.shape)
        if update.data_ptr() == grad.data_ptr():
            update = update.clone()
        self._stats.record(step=step, bytes_sent=update.numel() * update.element_size(),
                           dense_bytes=grad.numel() * grad.element_size())
        return update

    def first(self, name: str, grad: torch.Tensor,
              param: Optional[torch.Tensor]) -> Tuple[torch.Tensor, StageHandover]:
        """Stage 1 of a two-stage method: (message for its FIRST collective, handover)."""
        started = time.perf_counter()
        flat = grad.detach().reshape(-1)
        step = self._next_step(name)
        message, state, handover = self.method.first(self.ops, self._state(name, flat, True), flat,
                                                    self._call(name, step, param))
        with self._lock:
            self._states[name] = state
        self._stats.record(step=step, bytes_sent=message.numel() * message.element_size(),
                           dense_bytes=grad.numel() * grad.element_size(),
                           elements_sent=round(grad.numel() * handover.call.density),
                           elements_compressed=grad.numel(),
                           selection_time_s=time.perf_counter() - started)
        return message, handover

    def second(self, name: str, received: torch.Tensor, handover: StageHandover) -> torch.Tensor:
        """Stage 2: the message for the SECOND collective."""
        started = time.perf_counter()
        message, state = self.method.second(self.ops, self._states[name], received, handover)
        with self._lock:
            self._states[name] = state
        self._stats.record(step=handover.call.step, bytes_sent=message.numel() * message.element_size(),
                           dense_bytes=0, selection_time_s=time.perf_counter() - started)
        return message

    def finish(self, received: torch.Tensor, handover: StageHandover, shape: torch.Size) -> torch.Tensor:
        """The averaged update of a two-stage method, shaped like the gradient."""
        return self.method.finish(self.ops, received, handover).reshape(shape)

    def record_placeholder(self, step: int, nbytes: int) -> None:
        """Count the bytes of the placeholder Horovod all-reduces beside a sparse message."""
        self._stats.record(step=step, bytes_sent=nbytes, dense_bytes=0)

    def decompress(self, gathered: torch.Tensor, outgoing: Sequence[OutgoingMessage]) -> List[torch.Tensor]:
        """Averaged dense gradients of ``outgoing`` from the allgather of every rank's
        messages (concatenated in the same order on every rank)."""
        layouts = [o.layout for o in outgoing]
        dtypes = [dtype_name(o.dtype) for o in outgoing]
        steps = {o.step for o in outgoing}
        if len(steps) != 1:
            raise RuntimeError(f"tensors of one fused message are at different steps: {sorted(steps)}")
        flats = self.method.decompress(self.ops, gathered, layouts, self.world_size, steps.pop(), dtypes)
        return [flat.reshape(o.shape) for flat, o in zip(flats, outgoing)]

    # -- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's part: memories, step counters and epoch, tagged with the method, its
        config and the world they belong to (checked by :meth:`load_state_dict`)."""
        with self._lock:
            return state_frame(self.method, world_size=self.world_size, rank=self.rank,
                               epoch=self.epoch, steps=self._steps,
                               states={n: {k: v.clone() for k, v in s.items()}
                                       for n, s in self._states.items()})

    def load_state_dict(self, state: dict, numels: Dict[str, int]) -> None:
        """Restore this rank's part saved by :meth:`state_dict`.

        Args:
            state: the part saved by this rank (same world size and rank).
            numels: elements of every tensor this compressor may keep a memory for; a state
                holding another tensor, or one of another size, is refused.
        """
        check_loadable(self.ops, state, self.method, numels, self.world_size, self.rank,
                       "load every rank's part with horovod_dgc.torch.checkpoint.redistribute"
                       "(parts, world_size, rank) instead")
        with self._lock:
            self.epoch = float(state["epoch"])
            self._steps = dict(state["steps"])
            self._states = {n: {k: v.clone() for k, v in s.items()} for n, s in state["states"].items()}

    def join(self, world_size: int, rank: int) -> None:
        """Take a new place in a resized world (elastic reset); load a matching state next."""
        with self._lock:
            self.world_size, self.rank = world_size, rank

