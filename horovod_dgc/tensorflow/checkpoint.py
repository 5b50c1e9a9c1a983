"""Compressor state across a change in the number of workers, without losing gradient mass:
the core's redistribution (:mod:`horovod_dgc.core.state`) on the NumPy arrays that
``compression.state_dict()`` returns. Call it eagerly."""
from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from ..core import state
from .ops import TFOps


def redistribute(parts: Sequence[dict], world_size: int, rank: int) -> dict:
    """The state rank ``rank`` of ``world_size`` workers resumes from, given every rank's
    saved part (``parts[r]`` saved by rank r): with the same number of workers, this rank's
    own part unchanged; with another, the average of the saved memories (what is still owed
    to the parameters) and this rank's slice of every sharded memory (blocksign's server
    residual), as NumPy arrays."""
    state.check_parts(parts)
    if world_size == len(parts):
        return parts[rank]
    tensors = [_with_memories(part, lambda value: tf.constant(value)) for part in parts]
    mine = state.redistribute(TFOps(), tensors, world_size, rank)
    return _with_memories(mine, lambda value: value.numpy())


def _with_memories(part: dict, convert) -> dict:
    return {**part, "states": {name: {key: convert(value) for key, value in memories.items()}
                               for name, memories in part["states"].items()}}
