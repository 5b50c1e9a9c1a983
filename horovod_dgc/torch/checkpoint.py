"""Compressor state across a change in the number of workers, without losing gradient mass.

Every worker applies the average of what all workers send, so what is still owed to the
parameters is the *average* of the workers' memories (residuals, DGC's momentum and
velocity), plus blocksign's server residual, which is sharded: rank j holds shard j.

:func:`pool` turns every rank's part into one world-size-free state: per-worker memories
averaged, server shards concatenated. :func:`shard` gives each rank of a new world its part:
the averaged memories (N' copies of the mean average back to the same mean) and its slice of
the server residual. The pending update is unchanged, so no gradient mass is lost; every rank
of the new world starts from the same memories.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from ..core.blocksign import shard_length
from ..core.state import check_format
from .engine import SHARDED_KEYS


def redistribute(parts: Sequence[dict], world_size: int, rank: int) -> dict:
    """The state rank ``rank`` of ``world_size`` workers resumes from, given every rank's
    saved part (``parts[r]`` saved by rank r). Same world size: this rank's own part,
    unchanged. Another: the pooled memories, re-sharded (see the module docstring)."""
    check_parts(parts)
    if world_size == len(parts):
        return parts[rank]
    return shard(pool(parts), world_size, rank)


def check_parts(parts: Sequence[dict]) -> None:
    """Raise ValueError unless ``parts`` are the parts of ranks 0..N-1 of one N-worker run."""
    if not parts:
        raise ValueError("no compressor state parts given")
    first = parts[0]
    for r, part in enumerate(parts):
        check_format(part)
        if (part["rank"], part["world_size"]) != (r, len(parts)):
            raise ValueError(f"part {r} was saved by rank {part['rank']} of {part['world_size']} "
                             f"workers; expected rank {r} of {len(parts)} (pass every rank's part, "
                             f"in rank order)")
        if (part["method"], part["config"]) != (first["method"], first["config"]):
            raise ValueError(f"part {r} is from {part['method']} {part['config']}, part 0 from "
                             f"{first['method']} {first['config']}")
        if part["steps"] != first["steps"] or set(part["states"]) != set(first["states"]):
            raise ValueError(f"rank {r}'s part is at other steps or holds other tensors than "
                             f"rank 0's: the parts come from different points of training")


def pool(parts: Sequence[dict]) -> dict:
    """One world-size-free state from every rank's part (``world_size`` and ``rank`` None)."""
    check_parts(parts)
    states: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, first in parts[0]["states"].items():
        numel = _numel(name, first)
        states[name] = {key: (_concatenate([p["states"][name][key] for p in parts], numel)
                              if key in SHARDED_KEYS else
                              mean([p["states"][name][key] for p in parts]))
                        for key in first}
    return with_states(parts[0], None, None, states)


def shard(pooled: dict, world_size: int, rank: int) -> dict:
    """Rank ``rank``'s part of a pooled state in a world of ``world_size`` workers."""
    block_size = pooled["config"].get("block_size")
    states = {}
    for name, tensors in pooled["states"].items():
        numel = _numel(name, tensors)
        states[name] = {}
        for key, value in tensors.items():
            if key in SHARDED_KEYS:
                length = shard_length(numel, world_size, block_size)
                padded = torch.nn.functional.pad(value, (0, world_size * length - value.numel()))
                value = padded[rank * length:(rank + 1) * length]
            states[name][key] = value.clone()
    return with_states(pooled, world_size, rank, states)


def mean(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Elementwise mean, summed in float64 so it rounds once."""
    total = torch.zeros_like(tensors[0], dtype=torch.float64)
    for t in tensors:
        total += t.double()
    return (total / len(tensors)).to(tensors[0].dtype)


def _concatenate(shards: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
    return torch.cat(list(shards))[:numel].clone()


def _numel(name: str, tensors: Dict[str, torch.Tensor]) -> int:
    """Elements of the tensor, read from a per-worker memory (0 when it has no memory)."""
    for key, value in tensors.items():
        if key not in SHARDED_KEYS:
            return value.numel()
    if not tensors:
        return 0
    raise ValueError(f"compressor state of {name!r} holds only sharded keys {sorted(tensors)}")


def with_states(state: dict, world_size: Optional[int], rank: Optional[int],
                states: Dict[str, Dict[str, torch.Tensor]]) -> dict:
    """``state``'s frame (method, config, epoch, steps) around other memories, for the given
    place in the world (None, None: pooled, of no world)."""
    return {**state, "steps": dict(state["steps"]), "world_size": world_size, "rank": rank,
            "states": states}
