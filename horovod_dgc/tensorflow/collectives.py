"""Horovod collectives by kind (the kinds of core/collectives.py), as graph ops."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import horovod.tensorflow as hvd
import tensorflow as tf

from ..core.collectives import ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST

PREFIX = "horovod_dgc."


def run(kind: str, message: tf.Tensor, name: str, root: Any = 0,
        process_set: Any = hvd.global_process_set, rank: Optional[int] = None,
        chunks: Optional[Sequence[int]] = None) -> tf.Tensor:
    """What this rank receives from Horovod's collective ``kind`` on ``message``, named
    ``name``, among ``process_set`` (where this worker is ``rank``: default, its global rank).
    A broadcast whose root is known only at run time (ScaleCom's leader) is an allgather to
    which only the root contributes. ``chunks``: an alltoall's elements for each destination,
    where they are not equal (the same from every sender)."""
    if kind == BROADCAST:
        me = hvd.rank() if rank is None else rank
        mine = tf.cond(tf.equal(tf.cast(root, tf.int64), me), lambda: message, lambda: message[:0])
        return hvd.allgather(mine, name=name, ignore_name_scope=True, process_set=process_set)
    if kind == ALLREDUCE:
        return hvd.allreduce(message, op=hvd.Average, name=name, ignore_name_scope=True,
                             process_set=process_set)
    if kind == ALLTOALL:
        if chunks is not None:
            return hvd.alltoall(message, splits=list(chunks), name=name, ignore_name_scope=True,
                                process_set=process_set)[0]
        return hvd.alltoall(message, name=name, ignore_name_scope=True, process_set=process_set)
    if kind == ALLGATHER:
        return hvd.allgather(message, name=name, ignore_name_scope=True, process_set=process_set)
    raise ValueError(f"unknown collective {kind!r}")
