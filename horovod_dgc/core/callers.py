"""What the adapters read from their callers' frames.

Horovod's ``compress(tensor)`` never sees the optimizer, the loss scaler or the process set.
Where a check needs them, an adapter looks once among the functions that called it: Horovod's
own frames, and the training loop's variables.
"""
from __future__ import annotations

import itertools
import sys
import threading
from typing import Any, Callable, Iterator, Optional


def _outward(frame: Any) -> Iterator[Any]:
    """``frame`` and the frames of its callers, innermost first."""
    while frame is not None:
        yield frame
        frame = frame.f_back


def caller_frames() -> Iterator[Any]:
    """The frames of the callers of the function calling this one, innermost first (a
    generator: the frames are those above whoever first iterates it)."""
    yield from _outward(sys._getframe(2))


def calling_object(accepts: Callable[[Any], bool]) -> Optional[Any]:
    """The ``self`` of the innermost caller whose ``self`` ``accepts``, or None."""
    for frame in caller_frames():
        owner = frame.f_locals.get("self")
        if owner is not None and accepts(owner):
            return owner
    return None


def other_threads_frames() -> Iterator[Any]:
    """Every frame of every other thread, each thread's innermost first."""
    this_thread = threading.get_ident()
    for ident, frame in sys._current_frames().items():
        if ident != this_thread:
            yield from _outward(frame)


def values_among_callers(every_thread: bool = False) -> Iterator[Any]:
    """The callers' local variables and the attributes of their ``self``, innermost first:
    where a training loop keeps its optimizer or scaler (a local, a global, a trainer's
    attribute). ``every_thread`` adds the frames of the other threads, after the callers':
    for code that runs on a thread the training loop waits on (the autograd engine's thread
    of a GPU, which runs a DDP hook while the loop's thread waits in ``backward()``)."""
    frames = caller_frames()
    if every_thread:
        frames = itertools.chain(frames, other_threads_frames())
    for frame in frames:
        local = frame.f_locals
        yield from local.values()
        yield from getattr(local.get("self"), "__dict__", {}).values()
