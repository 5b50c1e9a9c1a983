"""The pipeline every sparse method shares: accumulate, select, encode; decode, average.

A :class:`SparseMethod` is a memory (what is kept of unsent gradient, :mod:`.memory`) plus a
selector (which entries to send, :mod:`.selection`). This module runs them on one tensor:

    compress:   grad -> memory.accumulate -> select k -> values rounded to the wire dtype
                -> memory.update(what receivers will decode) -> message bytes
    decompress: N messages (one per rank, from an allgather) -> checked headers
                -> (1/N) * sum_r scatter_add(indices_r, values_r)
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, List, Sequence, Tuple

from . import wire
from .config import SparseConfig
from .method import CompressCall, Method, State, StateLayout, state_dtype
from .ops import Scalar, Tensor, TensorOps
from .selection import top_count


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds NaN or Inf; the residual was left untouched."""


@dataclass(frozen=True)
class Compressed:
    """One tensor's outgoing message and what it says, for statistics."""

    message: Tensor
    state: State
    count: Scalar
    layout: wire.MessageLayout


def check_finite(ops: TensorOps, policy: str, grad: Tensor, call: CompressCall) -> Scalar:
    """Whether ``grad`` is finite; with ``policy == "raise"`` a non-finite one raises
    :class:`NonFiniteGradientError` naming the tensor, before any memory changes."""
    finite = ops.is_finite(ops.sum(grad))
    if policy == "raise":
        ops.check(finite, NonFiniteGradientError(
            f"gradient of tensor {call.name!r} holds NaN or Inf at step {call.step} on rank "
            f"{call.rank}; its memory was left untouched"))
    return finite


class SparseMethod(Method):
    """A sparse compression method; subclasses give the memory, selector and wire id."""

    family: ClassVar[str] = "sparse"
    config: SparseConfig

    def __init__(self, config: SparseConfig):
        super().__init__(config)
        self.memory = self.make_memory()

    @abstractmethod
    def make_memory(self) -> Any:
        """The error-feedback memory (an object of :mod:`.memory`)."""

    @abstractmethod
    def select(self, ops: TensorOps, x: Tensor, k: int, call: CompressCall) -> Tensor:
        """Positions (int64) of the entries of ``x`` to send."""

    def capacity(self, k: int, numel: int) -> int:
        """Slots in the message for a target of k entries."""
        return k

    def prepare(self, ops: TensorOps, grad: Tensor, call: CompressCall) -> Tuple[Tensor, Scalar]:
        """The gradient the memory accumulates, and a factor to scale it by."""
        return grad, 1.0

    # -- per-tensor layout and state ----------------------------------------------------------
    def layout(self, name: str, numel: int, grad_dtype: str, density: float) -> wire.MessageLayout:
        k = top_count(density, numel)
        return wire.MessageLayout(name=name, method_id=self.method_id, numel=numel,
                                  capacity=self.capacity(k, numel),
                                  value_dtype=wire.wire_value_dtype(grad_dtype, self.config.value_dtype))

    def state_layout(self, compressed: bool) -> StateLayout:
        return StateLayout(self.memory.state_names if compressed else self.memory.dense_state_names)

    # -- the two halves ---------------------------------------------------------------------
    def compress(self, ops: TensorOps, state: State, grad: Tensor, call: CompressCall) -> Compressed:
        """Message for a flat gradient, and the memory after sending it."""
        numel = ops.numel(grad)
        layout = self.layout(call.name, numel, ops.dtype(grad), call.density)
        k = top_count(call.density, numel)
        finite = check_finite(ops, self.config.nonfinite, grad, call)

        def send():
            x, new_state = self.memory.accumulate(ops, state, *self.prepare(ops, grad, call))
            indices = self.select(ops, x, k, call)
            wire_values = ops.cast(ops.gather(x, indices), layout.value_dtype)
            new_state = self.memory.update(ops, new_state, indices,
                                           ops.cast(wire_values, ops.dtype(x)))
            return (new_state, ops.cast(indices, layout.index_dtype), wire_values,
                    ops.size(indices), 0)

        def skip():
            return (state, ops.zeros(0, layout.index_dtype, like=grad),
                    ops.zeros(0, layout.value_dtype, like=grad), 0, wire.FLAG_SKIPPED)

        new_state, indices, values, count, flags = ops.cond(finite, send, skip)
        header = layout.header(call.rank, call.step, count, flags)
        message = wire.encode(ops, layout, header, ops.pad(indices, layout.capacity),
                              ops.pad(values, layout.capacity))
        return Compressed(message=message, state=new_state, count=count, layout=layout)

    def dense(self, ops: TensorOps, state: State, grad: Tensor, call: CompressCall) -> Tuple[Tensor, State]:
        """What to all-reduce for a tensor that is not compressed, and the new state."""
        return self.memory.dense(ops, state, *self.prepare(ops, grad, call))

    def decompress(self, ops: TensorOps, gathered: Tensor, layouts: Sequence[wire.MessageLayout],
                   world_size: int, step: Any, out_dtypes: Sequence[str]) -> List[Tensor]:
        """Average the messages of all ranks. ``gathered`` is the allgather of each rank's
        messages for ``layouts``, concatenated in that order; returns one flat dense tensor
        per layout: ``(sum over ranks r = 0..N-1 of scatter_add) * (1 / N)``."""
        return decode_and_average(ops, gathered, layouts, world_size, step, out_dtypes)


def decode_and_average(ops: TensorOps, gathered: Tensor, layouts: Sequence[wire.MessageLayout],
                       world_size: int, step: Any, out_dtypes: Sequence[str]) -> List[Tensor]:
    """See :meth:`SparseMethod.decompress`; shared by every sparse method."""
    expected = [(layout, rank) for rank in range(world_size) for layout in layouts]
    messages = wire.receive(ops, gathered, expected, step)
    sums = [ops.zeros(layout.numel, state_dtype(dtype), like=gathered)
            for layout, dtype in zip(layouts, out_dtypes)]
    for i, (indices, values) in enumerate(messages):
        t = i % len(layouts)
        sums[t] = ops.scatter_add(sums[t], indices, ops.cast(values, ops.dtype(sums[t])))
    return [ops.cast(ops.scale(s, 1.0 / world_size), dtype) for s, dtype in zip(sums, out_dtypes)]
