"""Compressor state across a change in the number of workers, without losing gradient mass:
the core's redistribution (:mod:`horovod_dgc.core.state`) on PyTorch tensors."""
from __future__ import annotations

from typing import Sequence

from ..core import state
from .ops import TorchOps


def redistribute(parts: Sequence[dict], world_size: int, rank: int) -> dict:
    """The state rank ``rank`` of ``world_size`` workers resumes from, given every rank's
    saved part (``parts[r]`` saved by rank r): with the same number of workers, this rank's
    own part unchanged; with another, the average of the saved memories (what is still owed
    to the parameters) and this rank's slice of every sharded memory."""
    return state.redistribute(TorchOps(), parts, world_size, rank)


def shard(pooled: dict, world_size: int, rank: int) -> dict:
    """Rank ``rank``'s part of a pooled state in a world of ``world_size`` workers."""
    return state.shard(TorchOps(), pooled, world_size, rank)
