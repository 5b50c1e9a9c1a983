"""The frame of a compressor's saved state, the same in every framework: the method, its
config and the world a part belongs to, around the adapter's memories; and the checks every
load starts with."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping

STATE_FORMAT = 1
STATE_KEYS = ("format", "method", "config", "world_size", "rank", "epoch", "steps", "states")


def state_frame(method: Any, *, world_size: int, rank: int, epoch: float,
                steps: Mapping[str, int], states: Dict[str, Dict[str, Any]]) -> dict:
    """A state as the adapters' ``state_dict()`` return it: ``states`` holds the memories."""
    return {"format": STATE_FORMAT, "method": type(method).__name__,
            "config": dataclasses.asdict(method.config), "world_size": world_size, "rank": rank,
            "epoch": epoch, "steps": dict(steps), "states": states}


def check_format(state: Any) -> None:
    """Raise ValueError unless ``state`` has the frame of :func:`state_frame`."""
    missing = set(STATE_KEYS) - set(state) if isinstance(state, dict) else {"everything"}
    if missing:
        raise ValueError(f"not a horovod_dgc compressor state (missing {sorted(missing)})")
    if state["format"] != STATE_FORMAT:
        raise ValueError(f"compressor state format {state['format']} is not {STATE_FORMAT}")


def check_method(state: dict, method: Any) -> None:
    """Raise ValueError unless ``state`` was saved by ``method``'s class with its config."""
    check_format(state)
    mine = type(method).__name__
    if state["method"] != mine:
        raise ValueError(f"compressor state is from method {state['method']}, this compressor "
                         f"runs {mine}")
    config = dataclasses.asdict(method.config)
    if state["config"] != config:
        listed = ", ".join(f"{k}: saved {state['config'].get(k)!r}, now {config.get(k)!r}"
                           for k in sorted(set(config) | set(state["config"]))
                           if state["config"].get(k) != config.get(k))
        raise ValueError(f"compressor state of {mine} was saved with another config ({listed})")
