"""What the adapters read from their callers' frames.

Horovod's ``compress(tensor)`` never sees the optimizer, the loss scaler or the process set.
Where a check needs them, an adapter looks once among the functions that called it: Horovod's
own frames, and the training loop's variables.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Iterator, Optional


def caller_frames() -> Iterator[Any]:
    """The frames of the callers of the function calling this one, innermost first."""
    frame = sys._getframe(2)
    while frame is not None:
        yield frame
        frame = frame.f_back


def calling_object(accepts: Callable[[Any], bool]) -> Optional[Any]:
    """The ``self`` of the innermost caller whose ``self`` ``accepts``, or None."""
    for frame in caller_frames():
        owner = frame.f_locals.get("self")
        if owner is not None and accepts(owner):
            return owner
    return None


def values_among_callers() -> Iterator[Any]:
    """The callers' local variables and the attributes of their ``self``, innermost first:
    where a training loop keeps its optimizer or scaler (a local, a global, a trainer's
    attribute)."""
    for frame in caller_frames():
        local = frame.f_locals
        yield from local.values()
        yield from getattr(local.get("self"), "__dict__", {}).values()
