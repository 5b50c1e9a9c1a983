"""Horovod collectives by kind (the kinds of core/collectives.py), named uniquely."""
from __future__ import annotations

from typing import Any

import horovod.torch as hvd
import torch

from ..core.collectives import ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST

PREFIX = "horovod_dgc."


def launch(kind: str, message: torch.Tensor, name: str, root: int = 0,
           process_set: Any = hvd.global_process_set) -> int:
    """Start collective ``kind`` on ``message`` under the unique name ``PREFIX + name``,
    among ``process_set`` (``root``: a broadcast's sender, a global rank)."""
    name = PREFIX + name
    if kind == BROADCAST:
        return hvd.broadcast_async(message, root_rank=root, name=name, process_set=process_set)
    if kind == ALLREDUCE:
        return hvd.allreduce_async(message, op=hvd.Average, name=name, process_set=process_set)
    if kind == ALLTOALL:
        return hvd.alltoall_async(message, name=name, process_set=process_set)
    if kind == ALLGATHER:
        return hvd.allgather_async(message, name=name, process_set=process_set)
    raise ValueError(f"unknown collective {kind!r}")


def wait(handle: int) -> torch.Tensor:
    """The result of a launched collective (alltoall's received splits dropped)."""
    result = hvd.synchronize(handle)
    return result[0] if isinstance(result, tuple) else result


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
