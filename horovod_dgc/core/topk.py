"""Top-k sparsification with error feedback (TopK-SGD), docs/algorithms.md#topk.

``p = g + e; s = topk(p, k); e = p - s``: nothing is lost, only delayed.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import GatheredConfig
from .memory import Accumulated, ResidualMemory
from .ops import Tensor, TensorOps
from .selection import select_exact
from .method import CompressCall
from .sparse import SparseMethod


@dataclass(frozen=True)
class TopKConfig(GatheredConfig):
    """Exact top-k by magnitude, per tensor; see :class:`GatheredConfig` for the fields."""

    density: float = 0.01


class TopK(SparseMethod):
    method_id = 1

    def __init__(self, config: TopKConfig = TopKConfig()):
        super().__init__(config)

    def make_memory(self) -> ResidualMemory:
        return ResidualMemory()

    def select(self, ops: TensorOps, x: Tensor, k: int, call: CompressCall,
               accumulated: Accumulated) -> Tensor:
        return select_exact(ops, x, k)
