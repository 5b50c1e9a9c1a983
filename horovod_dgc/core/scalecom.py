"""ScaleCom's cyclic local top-k (Chen et al., NeurIPS 2020), docs/algorithms.md#scalecom.

Every worker sends values at the **same** k indices, chosen by the leader ``t mod N`` from its
own error-compensated gradient, so the values are all-reduced and each worker's traffic stays
O(k) whatever N is:

    p_i = m_i + g_i;  I_t = topk(|p_l|, k) on leader l, broadcast;  G[I_t] = mean_i p_i[I_t]
    m_i = (1 - beta) * m_i + beta * (p_i - p_i masked to I_t)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from . import wire
from .codecs import value_coding
from .collectives import ALLREDUCE, BROADCAST
from .config import SparseConfig
from .memory import LowPassMemory
from .method import CompressCall, State, StateLayout, state_dtype
from .nonfinite import flag, nan_like, settle
from .ops import Scalar, Tensor, TensorOps
from .selection import (MAX_RETRIES, RETRY_FACTOR, SAMPLE_RATIO, filter_block, select_exact,
                        select_sampled, top_count)
from .twostage import StageHandover, TwoStageMethod
from .validation import require_choice, require_fraction, require_positive_int

LEADER_SELECTIONS = ("exact", "chunked")


@dataclass(frozen=True)
class ScaleComConfig(SparseConfig):
    """ScaleCom's settings (and :class:`SparseConfig`'s).

    Attributes:
        density: fraction of each compressed tensor sent per step.
        beta: low-pass filter of the memory, in (0, 1]; 1 is plain error feedback.
        leader_selection: ``"exact"`` top-k on the leader, or ``"chunked"``: the top
            ``k / chunks`` of each of ``chunks`` equal slices (approximate, cheaper).
        chunks: number of slices for ``"chunked"``.
        value_dtype: ``"float32"`` only: the values are summed by Horovod's all-reduce in
            the format they travel in, and a float16 sum rounds away mass that no residual
            keeps, and overflows where the workers' values add up past 65504.
    """

    density: float = 0.001
    value_dtype: str = "float32"
    beta: float = 1.0
    leader_selection: str = "exact"
    chunks: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        require_fraction("beta", self.beta)
        require_choice("leader_selection", self.leader_selection, LEADER_SELECTIONS)
        require_positive_int("chunks", self.chunks)
        if self.value_dtype != "float32":
            raise ValueError(f"value_dtype must be 'float32' for ScaleCom, not "
                             f"{self.value_dtype!r}: its values are summed by an all-reduce in "
                             "the format they travel in, where float16 would round away "
                             "gradient mass and overflow, and int8 would mix each rank's scale")


class ScaleCom(TwoStageMethod):
    method_id = 4
    FIRST = BROADCAST
    SECOND = ALLREDUCE
    config: ScaleComConfig

    def __init__(self, config: ScaleComConfig = ScaleComConfig()):
        super().__init__(config)
        self.memory = LowPassMemory(config.beta)

    def root(self, call: CompressCall) -> int:
        return call.step % call.world_size

    def state_layout(self, compressed: bool) -> StateLayout:
        return StateLayout(self.memory.state_names if compressed else ())

    def index_layout(self, name: str, numel: int, density: float) -> wire.MessageLayout:
        """The leader's message: its k positions, coded (no values)."""
        return wire.MessageLayout(name=name, method_id=self.method_id, numel=numel,
                                  capacity=top_count(density, numel), value_format=None)

    def exchanges(self, numel: int, grad_dtype: str, density: float,
                  world_size: int) -> Tuple[Tuple[str, int], ...]:
        indices = self.index_layout("", numel, density)
        values = wire.DTYPE_BYTES[self.config.value_dtype] * indices.capacity
        return (BROADCAST, indices.nbytes), (ALLREDUCE, values)

    def leader_block(self, k: int, numel: int) -> int:
        """Block length whose maxima the leader's selection filters by (0: none)."""
        return filter_block(k, numel) if self.config.leader_selection == "exact" else 0

    def leader_indices(self, ops: TensorOps, p: Tensor, k: int, call: CompressCall,
                       block_max: Optional[Tensor] = None) -> Tensor:
        """The leader's choice, ascending: exact top-k (``block_max``: max ``|p|`` per block of
        :meth:`leader_block` entries, if known), or the top of each chunk."""
        if self.config.leader_selection == "exact":
            return select_sampled(ops, p, k, SAMPLE_RATIO, call.step, MAX_RETRIES, RETRY_FACTOR,
                                  block_max)
        n = ops.numel(p)
        chunks = min(self.config.chunks, k)
        # Near-equal slices that are never empty (ceil-sized slices can run out before the last).
        bounds = [c * n // chunks for c in range(chunks + 1)]
        picks = []
        for start, end in zip(bounds, bounds[1:]):
            share = min(end - start, math.ceil(k * (end - start) / n))
            picks.append(select_exact(ops, ops.slice(p, start, end - start), share) + start)
        chosen = ops.concat(picks)
        return ops.sort(ops.gather(chosen, ops.topk_abs(ops.gather(p, chosen), k)))[0]

    def first(self, ops: TensorOps, state: State, grad: Tensor,
              call: CompressCall) -> Tuple[Tensor, State, StageHandover]:
        n = ops.numel(grad)
        layout = self.index_layout(call.name, n, call.density)
        # Every rank computes the block maxima: the leader is known only at run time in a graph,
        # and a fused accumulation takes them without reading the memory again.
        accumulated = self.memory.accumulate(ops, state, grad, call.unscale, spare=call.spare,
                                             block=self.leader_block(layout.capacity, n))
        p, state, finite = accumulated.x, accumulated.state, accumulated.finite

        def leader_message() -> Tensor:
            def chosen() -> Tensor:
                positions = self.leader_indices(ops, p, layout.capacity, call, accumulated.block_max)
                header = layout.header(call.rank, call.step, layout.capacity, 0)
                return layout.encode(ops, header, positions, layout.capacity)[0]

            header = layout.header(call.rank, call.step, 0, flag(ops, False))
            return ops.cond(finite, chosen, lambda: layout.empty(ops, header, like=grad))

        # ops.cond: in a TensorFlow graph the step, hence the leader, is known only at run time.
        message = ops.cond(call.rank == self.root(call), leader_message,
                           lambda: ops.zeros(layout.nbytes, "uint8", like=grad))
        handover = StageHandover(call, n, ops.dtype(grad), {"p": p, "layout": layout, "finite": finite})
        return message, state, handover

    def second(self, ops: TensorOps, state: State, received: Tensor,
               handover: StageHandover) -> Tuple[Tensor, State]:
        """Everyone's values at the leader's indices. A rank whose gradient is not finite
        sends NaN values, so that the all-reduce tells every rank (the leader's flag alone
        would not: only the leader's message is broadcast)."""
        layout, call = handover.data["layout"], handover.call
        expected = [(layout, self.root(call))]
        received = wire.receive(ops, received, expected, call.step, call.rank)
        positions, _, consistent = layout.decode(ops, received.parts[0],
                                                 ops.gather(received.counts, 0), "float32")
        (indices,) = wire.checked_positions(ops, [(positions, consistent)], expected, call.step)
        dtype = self.config.value_dtype
        (values,), decoded = value_coding(dtype, layout.capacity).encode(
            ops, ops.gather(handover.data["p"], indices))
        state = self.memory.update(ops, state, indices, ops.cast(decoded, state_dtype(handover.dtype)))
        values = ops.cond(handover.data["finite"], lambda: values,
                          lambda: nan_like(ops, ops.numel(values), dtype, values))
        handover.data["indices"] = indices
        return values, state

    def finish(self, ops: TensorOps, received: Tensor, handover: StageHandover) -> Tuple[Tensor, Scalar]:
        call = handover.call
        finite = settle(ops, self.config.nonfinite, ops.all_finite(received), [],
                        lambda: f"tensor {call.name!r} on some rank", call.step)
        dense = ops.zeros(handover.numel, state_dtype(handover.dtype), like=received)
        dense = ops.scatter_add(dense, handover.data["indices"], ops.cast(received, ops.dtype(dense)))
        update = ops.cast(dense, handover.dtype)
        return ops.cond(finite, lambda: update,
                        lambda: nan_like(ops, handover.numel, handover.dtype, update)), finite
