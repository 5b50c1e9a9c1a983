"""Horovod collectives by kind (the kinds of core/collectives.py), named uniquely."""
from __future__ import annotations

import threading
import time
from typing import Any, Dict, Optional, Sequence, Tuple

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError

from ..core.collectives import ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST

PREFIX = "horovod_dgc."

# Each launched collective's (kind, name) by its handle, so that a failed wait names it.
_LAUNCHED: Dict[int, Tuple[str, str]] = {}
_LAUNCHED_LOCK = threading.Lock()

# Horovod's own wait (hvd.synchronize) spins on a core until the collective is done. Where
# workers outnumber cores, the waiting workers' spins starve the workers still computing and
# the background threads that do the work, and now and then a step stalls for tens of seconds
# (past Gloo's 30 s timeout). So a wait sleeps between polls, the pause doubling from the
# first to the longest (at most one of Horovod's 1 ms cycles late).
POLL_PAUSE_S = (5e-5, 1e-3)


def launch(kind: str, message: torch.Tensor, name: str, root: int = 0,
           chunks: Optional[Sequence[int]] = None, process_set: Any = hvd.global_process_set) -> int:
    """Start collective ``kind`` on ``message`` under the unique name ``PREFIX + name``,
    among ``process_set`` (``root``: a broadcast's sender, a global rank; ``chunks``: an
    alltoall's elements for each destination, where they are not equal)."""
    name = PREFIX + name
    if kind == BROADCAST:
        handle = hvd.broadcast_async(message, root_rank=root, name=name, process_set=process_set)
    elif kind == ALLREDUCE:
        handle = hvd.allreduce_async(message, op=hvd.Average, name=name, process_set=process_set)
    elif kind == ALLTOALL:
        splits = None if chunks is None else torch.tensor(chunks, dtype=torch.int32)
        handle = hvd.alltoall_async(message, splits=splits, name=name, process_set=process_set)
    elif kind == ALLGATHER:
        handle = hvd.allgather_async(message, name=name, process_set=process_set)
    else:
        raise ValueError(f"unknown collective {kind!r}")
    with _LAUNCHED_LOCK:
        _LAUNCHED[handle] = (kind, name)
    return handle


def wait(handle: int) -> torch.Tensor:
    """The result of a launched collective (alltoall's received splits dropped), waited for
    asleep between polls (``POLL_PAUSE_S``). If Horovod shuts down while this rank waits (a
    peer stopped, died or was cut off, and Gloo's timeout ran out), the HorovodInternalError
    raised names the collective and its tensors (the same type: Horovod's elastic training
    recovers from it as before)."""
    with _LAUNCHED_LOCK:
        kind, name = _LAUNCHED.pop(handle, ("collective", "?"))
    try:
        _sleep_until_done(handle)
        result = hvd.synchronize(handle)
    except HorovodInternalError as error:
        raise HorovodInternalError(
            f"rank {hvd.rank()} of {hvd.size()}: the {kind} {name!r} did not complete, since Horovod "
            f"shut down: a peer stopped answering (a stalled or stopped process, a host cut off) "
            f"for longer than Gloo's timeout (horovodrun --gloo-timeout-seconds, "
            f"HOROVOD_GLOO_TIMEOUT_SECONDS; 30 s by default), or one died. Horovod said: {error}") from error
    return result[0] if isinstance(result, tuple) else result


def _sleep_until_done(handle: int) -> None:
    pause_s, longest_s = POLL_PAUSE_S
    while not hvd.poll(handle):
        time.sleep(pause_s)
        pause_s = min(2 * pause_s, longest_s)


class HorovodTransport:
    """These collectives as a :class:`~horovod_dgc.core.collectives.Transport`: the one the
    compressors use unless told otherwise (``MethodCompressor.use_transport``)."""

    @staticmethod
    def size() -> int:
        return hvd.size()

    @staticmethod
    def rank() -> int:
        return hvd.rank()

    launch = staticmethod(launch)
    wait = staticmethod(wait)


HOROVOD = HorovodTransport()
