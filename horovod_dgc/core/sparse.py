"""The pipeline every sparse method shares: accumulate, select, encode; decode, average.

A :class:`SparseMethod` is a memory (what is kept of unsent gradient, :mod:`.memory`) plus a
selector (which entries to send, :mod:`.selection`). This module runs them on one tensor:

    compress:   grad -> memory.accumulate -> select k -> values rounded to the wire dtype
                -> memory.update(what receivers will decode) -> message bytes
    decompress: N messages (one per rank, from an allgather) -> checked headers
                -> (1/N) * sum_r scatter_add(indices_r, values_r)
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from . import wire
from .config import SparseConfig
from .memory import State
from .ops import Scalar, Tensor, TensorOps
from .selection import top_count


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds NaN or Inf; the residual was left untouched."""


@dataclass(frozen=True)
class StepContext:
    """What one compress call knows besides the gradient.

    Attributes:
        name: the tensor's name, identical on every rank (the parameter name).
        rank, world_size: this worker and the number of workers.
        step: how many times this tensor was compressed before (0-based).
        density: density in force for this step (after warm-up).
        param: the parameter tensor (flat), needed only for weight decay.
    """

    name: str
    rank: int
    world_size: int
    step: int
    density: float
    param: Optional[Tensor] = None


@dataclass(frozen=True)
class Compressed:
    """One tensor's outgoing message and what it says, for statistics."""

    message: Tensor
    state: State
    count: Scalar
    layout: wire.MessageLayout


def check_finite(ops: TensorOps, policy: str, grad: Tensor, ctx: StepContext) -> Scalar:
    """Whether ``grad`` is finite; with ``policy == "raise"`` a non-finite one raises
    :class:`NonFiniteGradientError` naming the tensor, before any memory changes."""
    finite = ops.is_finite(ops.sum(grad))
    if policy == "raise":
        ops.check(finite, NonFiniteGradientError(
            f"gradient of tensor {ctx.name!r} holds NaN or Inf at step {ctx.step} on rank "
            f"{ctx.rank}; its memory was left untouched"))
    return finite


def state_dtype(grad_dtype: str) -> str:
    """Memories of 16-bit gradients are kept in float32 so small updates are not lost."""
    return "float32" if grad_dtype in ("float16", "bfloat16") else grad_dtype


class SparseMethod(ABC):
    """A sparse compression method; subclasses give the memory, selector and wire id."""

    method_id: int
    config: SparseConfig

    def __init__(self, config: SparseConfig):
        self.config = config
        self.memory = self.make_memory()

    @abstractmethod
    def make_memory(self) -> Any:
        """The error-feedback memory (an object of :mod:`.memory`)."""

    @abstractmethod
    def select(self, ops: TensorOps, x: Tensor, k: int, ctx: StepContext) -> Tensor:
        """Positions (int64) of the entries of ``x`` to send."""

    def capacity(self, k: int, numel: int) -> int:
        """Slots in the message for a target of k entries."""
        return k

    def prepare(self, ops: TensorOps, grad: Tensor, ctx: StepContext) -> Tuple[Tensor, Scalar]:
        """The gradient the memory accumulates, and a factor to scale it by."""
        return grad, 1.0

    # -- per-tensor layout and state ----------------------------------------------------------
    def layout(self, name: str, numel: int, grad_dtype: str, density: float) -> wire.MessageLayout:
        k = top_count(density, numel)
        return wire.MessageLayout(name=name, method_id=self.method_id, numel=numel,
                                  capacity=self.capacity(k, numel),
                                  value_dtype=wire.wire_value_dtype(grad_dtype, self.config.value_dtype))

    def init_state(self, ops: TensorOps, grad: Tensor, compressed: bool) -> State:
        names = self.memory.state_names if compressed else self.memory.dense_state_names
        dtype = state_dtype(ops.dtype(grad))
        return {name: ops.zeros(ops.numel(grad), dtype, like=grad) for name in names}

    # -- the two halves ---------------------------------------------------------------------
    def compress(self, ops: TensorOps, state: State, grad: Tensor, ctx: StepContext) -> Compressed:
        """Message for a flat gradient, and the memory after sending it."""
        numel = ops.numel(grad)
        layout = self.layout(ctx.name, numel, ops.dtype(grad), ctx.density)
        k = top_count(ctx.density, numel)
        finite = check_finite(ops, self.config.nonfinite, grad, ctx)

        def send():
            x, new_state = self.memory.accumulate(ops, state, *self.prepare(ops, grad, ctx))
            indices = self.select(ops, x, k, ctx)
            wire_values = ops.cast(ops.gather(x, indices), layout.value_dtype)
            new_state = self.memory.update(ops, new_state, indices,
                                           ops.cast(wire_values, ops.dtype(x)))
            return (new_state, ops.cast(indices, layout.index_dtype), wire_values,
                    ops.size(indices), 0)

        def skip():
            return (state, ops.zeros(0, layout.index_dtype, like=grad),
                    ops.zeros(0, layout.value_dtype, like=grad), 0, wire.FLAG_SKIPPED)

        new_state, indices, values, count, flags = ops.cond(finite, send, skip)
        header = layout.header(ctx.rank, ctx.step, count, flags)
        message = wire.encode(ops, layout, header, ops.pad(indices, layout.capacity),
                              ops.pad(values, layout.capacity))
        return Compressed(message=message, state=new_state, count=count, layout=layout)

    def dense(self, ops: TensorOps, state: State, grad: Tensor, ctx: StepContext) -> Tuple[Tensor, State]:
        """What to all-reduce for a tensor that is not compressed, and the new state."""
        return self.memory.dense(ops, state, *self.prepare(ops, grad, ctx))

    def decompress(self, ops: TensorOps, gathered: Tensor, layouts: Sequence[wire.MessageLayout],
                   world_size: int, step: int, out_dtypes: Sequence[str]) -> List[Tensor]:
        """Average the messages of all ranks. ``gathered`` is the allgather of each rank's
        messages for ``layouts``, concatenated in that order; returns one flat dense tensor
        per layout: ``(sum over ranks r = 0..N-1 of scatter_add) * (1 / N)``."""
        return decode_and_average(ops, gathered, layouts, world_size, step, out_dtypes)


def decode_and_average(ops: TensorOps, gathered: Tensor, layouts: Sequence[wire.MessageLayout],
                       world_size: int, step: int, out_dtypes: Sequence[str]) -> List[Tensor]:
    """See :meth:`SparseMethod.decompress`; shared by every sparse method."""
    per_rank = sum(layout.nbytes for layout in layouts)
    total = ops.numel(gathered)
    if total != per_rank * world_size:
        sizes = (f"allgather returned {total} bytes, expected {world_size} ranks x {per_rank} "
                 f"(a different density or tensor set on some rank?)")
        _check_headers(ops, gathered, layouts, world_size, step, sizes)
        raise wire.MessageError(f"{sizes} for tensors {[l.name for l in layouts]}")
    sums = [ops.zeros(layout.numel, "float32" if dtype in ("float16", "bfloat16") else dtype,
                      like=gathered) for layout, dtype in zip(layouts, out_dtypes)]
    for rank in range(world_size):
        offset = rank * per_rank
        for i, layout in enumerate(layouts):
            message = ops.slice(gathered, offset, layout.nbytes)
            header, indices, values = wire.split(ops, message, layout)
            ops.inspect(header, lambda words, layout=layout, rank=rank: layout.check(words, rank, step))
            sums[i] = ops.scatter_add(sums[i], indices, ops.cast(values, ops.dtype(sums[i])))
            offset += layout.nbytes
    return [ops.cast(ops.scale(s, 1.0 / world_size), dtype) for s, dtype in zip(sums, out_dtypes)]


def _check_headers(ops: TensorOps, gathered: Tensor, layouts: Sequence[wire.MessageLayout],
                   world_size: int, step: int, context: str) -> None:
    """Check the headers found where they should be, to name the first rank that differs."""
    total, offset = ops.numel(gathered), 0
    for rank in range(world_size):
        for layout in layouts:
            if offset + wire.HEADER_WORDS * 4 > total:
                return
            header = ops.from_bytes(ops.slice(gathered, offset, wire.HEADER_WORDS * 4), "int32")
            try:
                ops.inspect(header, lambda words: layout.check(words, rank, step))
            except wire.MessageError as error:
                raise wire.MessageError(f"{error}; {context}") from None
            offset += layout.nbytes
