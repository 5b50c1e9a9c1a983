"""Top-k sparsification with error feedback (TopK-SGD), docs/algorithms.md#topk.

``p = g + e; s = topk(p, k); e = p - s``: nothing is lost, only delayed. The exact top-k is
found as DGC's is (:func:`~.selection.select_sampled`), not by sorting the whole tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import GatheredConfig
from .memory import Accumulated, ResidualMemory
from .ops import Tensor, TensorOps
from .method import CompressCall
from .selection import MAX_RETRIES, RETRY_FACTOR, SAMPLE_RATIO, sampling_offset, select_sampled
from .sparse import SparseMethod


@dataclass(frozen=True)
class TopKConfig(GatheredConfig):
    """Exact top-k by magnitude, per tensor; see :class:`GatheredConfig` for the fields."""

    density: float = 0.01


class TopK(SparseMethod):
    method_id = 1
    filters_blocks = True
    collects_candidates = True
    selects_buckets = True

    def __init__(self, config: TopKConfig = TopKConfig()):
        super().__init__(config)

    def make_memory(self) -> ResidualMemory:
        return ResidualMemory()

    def select(self, ops: TensorOps, x: Tensor, k: int, call: CompressCall,
               accumulated: Accumulated) -> Tensor:
        return select_sampled(ops, x, k, SAMPLE_RATIO, sampling_offset(call.step, call.tensor_id),
                              MAX_RETRIES, RETRY_FACTOR, accumulated.block_max, accumulated.candidates)
