"""A compressor's saved state, the same in every framework: its frame (the method, its config
and the world a part belongs to, around the memories), the checks every load starts with, and
the redistribution of the memories to another number of workers.

Every worker applies the average of what all workers send, so what is still owed to the
parameters is the *average* of the workers' memories (residuals, DGC's momentum and velocity),
plus the sharded memories a method declares (blocksign's server residual: rank j holds shard
j). :func:`pool` turns every rank's part into one world-size-free state (per-worker memories
averaged, shards concatenated); :func:`shard` gives each rank of a new world its part (the
averaged memories, whose N' copies average back to the same mean, and its slice of every
sharded memory). The pending update is unchanged, so no gradient mass is lost, and every rank
of the new world starts from the same memories.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional, Sequence

from .method import Method
from .methods import from_saved
from .ops import Tensor, TensorOps

# 2: messages with coded indices and 16/8-bit values (configs gained value_dtype and
# small_density); a format-1 state is refused rather than loaded under other defaults.
STATE_FORMAT = 2
STATE_KEYS = ("format", "method", "config", "world_size", "rank", "epoch", "steps", "states")
Memories = Dict[str, Dict[str, Tensor]]


def state_frame(method: Method, *, world_size: Optional[int], rank: Optional[int], epoch: float,
                steps: Mapping[str, int], states: Memories) -> dict:
    """A state as the adapters' ``state_dict()`` return it: ``states`` holds the memories."""
    return {"format": STATE_FORMAT, "method": method.table_class,
            "config": dataclasses.asdict(method.config), "world_size": world_size, "rank": rank,
            "epoch": epoch, "steps": dict(steps), "states": states}


def check_format(state: Any) -> None:
    """Raise ValueError unless ``state`` has the frame of :func:`state_frame`."""
    missing = set(STATE_KEYS) - set(state) if isinstance(state, dict) else {"everything"}
    if missing:
        raise ValueError(f"not a horovod_dgc compressor state (missing {sorted(missing)})")
    if state["format"] != STATE_FORMAT:
        older = isinstance(state["format"], int) and state["format"] < STATE_FORMAT
        raise ValueError(
            f"compressor state format {state['format']} is not {STATE_FORMAT}: "
            + ("it was saved by an earlier horovod_dgc whose configs had other fields and "
               "defaults; resume with that version, or start the compressor afresh (drop "
               "its entry from the checkpoint)" if older else "saved by a newer horovod_dgc?"))


def check_method(state: dict, method: Method) -> None:
    """Raise ValueError unless ``state`` was saved by ``method``'s class with its config."""
    check_format(state)
    mine = method.table_class
    if state["method"] != mine:
        raise ValueError(f"compressor state is from method {state['method']}, this compressor "
                         f"runs {mine}")
    config = dataclasses.asdict(method.config)
    if state["config"] != config:
        listed = ", ".join(f"{k}: saved {state['config'].get(k)!r}, now {config.get(k)!r}"
                           for k in sorted(set(config) | set(state["config"]))
                           if state["config"].get(k) != config.get(k))
        raise ValueError(f"compressor state of {mine} was saved with another config ({listed})")


def check_loadable(ops: TensorOps, state: dict, method: Method, numels: Mapping[str, int],
                   world_size: int, rank: int, redistribute_hint: str) -> None:
    """Raise ValueError unless ``state`` is this rank's part for ``method``: same method and
    config, same place in the world, and memories of tensors among ``numels`` (name ->
    elements) with the lengths the method's state layout gives them."""
    check_method(state, method)
    if (state["world_size"], state["rank"]) != (world_size, rank):
        raise ValueError(
            f"compressor state was saved by rank {state['rank']} of {state['world_size']} "
            f"workers; this is rank {rank} of {world_size}: {redistribute_hint}")
    unknown = sorted(set(state["states"]) - set(numels))
    if unknown:
        raise ValueError(f"compressor state holds tensors this model does not have: {unknown[:5]}"
                         f"{' ...' if len(unknown) > 5 else ''} (another model?)")
    sharded = set(method.state_layout(True).sharded)
    for name, memories in state["states"].items():
        for key, value in memories.items():
            want = (method.shard_length(numels[name], world_size) if key in sharded
                    else numels[name])
            if ops.numel(value) != want:
                raise ValueError(f"compressor state of tensor {name!r} has {ops.numel(value)} "
                                 f"elements in {key!r}, expected {want}")


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


def redistribute(ops: TensorOps, parts: Sequence[dict], world_size: int, rank: int) -> dict:
    """The state rank ``rank`` of ``world_size`` workers resumes from, given every rank's
    saved part (``parts[r]`` saved by rank r). Same world size: this rank's own part,
    unchanged. Another: the pooled memories, re-sharded (see the module docstring)."""
    check_parts(parts)
    if world_size == len(parts):
        return parts[rank]
    return shard(ops, pool(ops, parts), world_size, rank)


def pool(ops: TensorOps, parts: Sequence[dict]) -> dict:
    """One world-size-free state from every rank's part (``world_size`` and ``rank`` None)."""
    check_parts(parts)
    sharded = _sharded_keys(parts[0])
    states: Memories = {}
    for name, first in parts[0]["states"].items():
        numel = _numel(ops, name, first, sharded)
        states[name] = {key: (_concatenate(ops, [p["states"][name][key] for p in parts], numel)
                              if key in sharded else
                              mean(ops, [p["states"][name][key] for p in parts]))
                        for key in first}
    return with_states(parts[0], None, None, states)


def shard(ops: TensorOps, pooled: dict, world_size: int, rank: int) -> dict:
    """Rank ``rank``'s part of a pooled state in a world of ``world_size`` workers."""
    method = from_saved(pooled["method"], pooled["config"], world_size)
    sharded = set(method.state_layout(True).sharded)
    states: Memories = {}
    for name, memories in pooled["states"].items():
        numel = _numel(ops, name, memories, sharded)
        states[name] = {}
        for key, value in memories.items():
            if key in sharded:
                length = method.shard_length(numel, world_size)
                value = ops.slice(ops.pad(value, world_size * length), rank * length, length)
            states[name][key] = ops.copy(value)
    return with_states(pooled, world_size, rank, states)


def mean(ops: TensorOps, tensors: Sequence[Tensor]) -> Tensor:
    """Elementwise mean, summed in float64 so it rounds once."""
    total = ops.cast(tensors[0], "float64")
    total = ops.copy(total) if total is tensors[0] else total
    for t in tensors[1:]:
        total = ops.scale_add(total, 1.0, ops.cast(t, "float64"))
    return ops.cast(ops.scale(total, 1.0 / len(tensors)), ops.dtype(tensors[0]))


def with_states(state: dict, world_size: Optional[int], rank: Optional[int], states: Memories) -> dict:
    """``state``'s frame (method, config, epoch, steps) around other memories, for the given
    place in the world (None, None: pooled, of no world)."""
    return {**state, "steps": dict(state["steps"]), "world_size": world_size, "rank": rank,
            "states": states}


def _sharded_keys(state: dict) -> set:
    method = from_saved(state["method"], state["config"], state["world_size"])
    return set(method.state_layout(True).sharded)


def _concatenate(ops: TensorOps, shards: Sequence[Tensor], numel: int) -> Tensor:
    return ops.copy(ops.slice(ops.concat(list(shards)), 0, numel))


def _numel(ops: TensorOps, name: str, memories: Mapping[str, Tensor], sharded: set) -> int:
    """Elements of the tensor, read from a per-worker memory (0 when it has no memory)."""
    for key, value in memories.items():
        if key not in sharded:
            return ops.numel(value)
    if not memories:
        return 0
    raise ValueError(f"compressor state of {name!r} holds only sharded memories {sorted(memories)}")
