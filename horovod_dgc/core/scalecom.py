"""ScaleCom's cyclic local top-k (Chen et al., NeurIPS 2020), ALGORITHMS.md section 4.

Every worker sends values at the **same** k indices, chosen by the leader ``t mod N`` from its
own error-compensated gradient, so the values are all-reduced and each worker's traffic stays
O(k) whatever N is:

    p_i = m_i + g_i;  I_t = topk(|p_l|, k) on leader l, broadcast;  G[I_t] = mean_i p_i[I_t]
    m_i = (1 - beta) * m_i + beta * (p_i - p_i masked to I_t)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

from . import wire
from .config import SparseConfig, require_choice, require_fraction, require_positive_int
from .exchange import ALLREDUCE, BROADCAST, Pending, TwoStageMethod
from .memory import LowPassMemory, State
from .ops import Tensor, TensorOps
from .selection import (MAX_RETRIES, RETRY_FACTOR, SAMPLE_RATIO, select_exact, select_sampled,
                        top_count)
from .sparse import StepContext, check_finite, state_dtype

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
    """

    density: float = 0.001
    beta: float = 1.0
    leader_selection: str = "exact"
    chunks: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        require_fraction("beta", self.beta)
        require_choice("leader_selection", self.leader_selection, LEADER_SELECTIONS)
        require_positive_int("chunks", self.chunks)


def allreduce_value_dtype(grad_dtype: str, value_dtype: str) -> str:
    """Horovod all-reduces float16 and float32, not bfloat16."""
    dtype = wire.wire_value_dtype(grad_dtype, value_dtype)
    return "float32" if dtype == "bfloat16" else dtype


class ScaleCom(TwoStageMethod):
    method_id = 4
    FIRST = BROADCAST
    SECOND = ALLREDUCE
    config: ScaleComConfig

    def __init__(self, config: ScaleComConfig = ScaleComConfig()):
        super().__init__(config)
        self.memory = LowPassMemory(config.beta)

    def root(self, ctx: StepContext) -> int:
        return ctx.step % ctx.world_size

    def state_names(self, compressed: bool) -> Tuple[str, ...]:
        return self.memory.state_names if compressed else ()

    def index_layout(self, name: str, numel: int, density: float) -> wire.PartsLayout:
        k = top_count(density, numel)
        return wire.PartsLayout(name=name, method_id=self.method_id, numel=numel, capacity=k,
                                part_list=((wire.index_dtype(numel), k),))

    def leader_indices(self, ops: TensorOps, p: Tensor, k: int, ctx: StepContext) -> Tensor:
        """The leader's choice: exact top-k, or the top of each chunk."""
        if self.config.leader_selection == "exact":
            return select_sampled(ops, p, k, SAMPLE_RATIO, ctx.step, MAX_RETRIES, RETRY_FACTOR)
        n = ops.numel(p)
        chunks = min(self.config.chunks, k)
        size = math.ceil(n / chunks)
        picks = []
        for c in range(chunks):
            length = min(size, n - c * size)
            share = min(length, math.ceil(k * length / n))
            picks.append(select_exact(ops, ops.slice(p, c * size, length), share) + c * size)
        chosen = ops.concat(picks)
        return ops.gather(chosen, ops.topk_abs(ops.gather(p, chosen), k))

    def first(self, ops: TensorOps, state: State, grad: Tensor,
              ctx: StepContext) -> Tuple[Tensor, State, Pending]:
        n = ops.numel(grad)
        finite = check_finite(ops, self.config.nonfinite, grad, ctx)
        grad = ops.cond(finite, lambda: grad, lambda: ops.zeros(n, ops.dtype(grad), like=grad))
        p, state = self.memory.accumulate(ops, state, grad)
        layout = self.index_layout(ctx.name, n, ctx.density)

        def leader_message() -> Tensor:
            indices = ops.cast(self.leader_indices(ops, p, layout.capacity, ctx), layout.parts[0][0])
            header = layout.header(ctx.rank, ctx.step, layout.capacity, 0)
            return wire.encode_parts(ops, layout, header, [indices])

        # ops.cond: in a TensorFlow graph the step, hence the leader, is known only at run time.
        message = ops.cond(ctx.rank == self.root(ctx), leader_message,
                           lambda: ops.zeros(layout.nbytes, "uint8", like=grad))
        pending = Pending(ctx, n, ops.dtype(grad), {"p": p, "layout": layout})
        return message, state, pending

    def second(self, ops: TensorOps, state: State, received: Tensor,
               pending: Pending) -> Tuple[Tensor, State]:
        layout, ctx = pending.data["layout"], pending.ctx
        header, (indices,) = wire.split_parts(ops, received, layout)
        leader = self.root(ctx)
        ops.inspect(header, lambda words: layout.check(words, leader, ctx.step))
        values = ops.cast(ops.gather(pending.data["p"], indices),
                          allreduce_value_dtype(pending.dtype, self.config.value_dtype))
        state = self.memory.update(ops, state, indices, ops.cast(values, state_dtype(pending.dtype)))
        pending.data["indices"] = indices
        return values, state

    def finish(self, ops: TensorOps, received: Tensor, pending: Pending) -> Tensor:
        dense = ops.zeros(pending.numel, state_dtype(pending.dtype), like=received)
        dense = ops.scatter_add(dense, pending.data["indices"], ops.cast(received, ops.dtype(dense)))
        return ops.cast(dense, pending.dtype)
