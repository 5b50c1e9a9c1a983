"""Gaussian-k (Shi et al., arXiv 1911.08772), docs/algorithms.md#gaussiank.

Error feedback as Top-k, but the threshold comes from the mean and standard deviation of
``p = g + e`` instead of a sort, adjusted at most three times towards [2k/3, 4k/3] entries.
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Tuple

from . import bucket
from .bucket import GaussianPlan, Plan
from .config import GatheredConfig
from .memory import Accumulated, ResidualMemory
from .ops import Scalar, Tensor, TensorOps
from .selection import gaussian_capacity, select_gaussian
from .method import CompressCall
from .sparse import SparseMethod


@dataclass(frozen=True)
class GaussianKConfig(GatheredConfig):
    """Gaussian threshold; see :class:`GatheredConfig` for the fields. Messages have room for
    ``ceil(4k/3)`` entries; the count sent varies from step to step."""

    density: float = 0.001


class GaussianK(SparseMethod):
    method_id = 3
    filters_blocks = True
    selects_buckets = True

    def __init__(self, config: GaussianKConfig = GaussianKConfig()):
        super().__init__(config)

    def make_memory(self) -> ResidualMemory:
        return ResidualMemory()

    def capacity(self, k: int, numel: int) -> int:
        return gaussian_capacity(k, numel)

    def select(self, ops: TensorOps, x: Tensor, k: int, call: CompressCall,
               accumulated: Accumulated) -> Tensor:
        return select_gaussian(ops, x, k, accumulated.block_max)

    def top_plan(self, plan: Plan) -> Plan:
        """Each segment's ``capacity + 1`` largest, in which its counts are taken
        (:func:`~.bucket.select_gaussian`)."""
        return GaussianPlan.of(plan).reach

    def pick_from_top(self, ops: TensorOps, x: Tensor, plan: Plan, top: Tensor) -> Tuple[Tensor, Scalar]:
        positions = bucket.select_gaussian(ops, x, GaussianPlan.of(plan), top)
        return positions, ops.size(positions)

    def bucket_capacity(self, plan: Plan) -> int:
        return GaussianPlan.of(plan).total
