"""Compression between hosts only (``Compression.<method>(..., hierarchical=True)``) for
TensorFlow; what it does is in :mod:`horovod_dgc.core.hosts`.

In a graph the three steps are chained by their data: the host average feeds the method,
the leader's collective between hosts feeds the broadcast inside the host. Horovod's ops are
asynchronous kernels, so tensors never wait on each other's steps.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import horovod.tensorflow as hvd
import tensorflow as tf

from ..core.hosts import Hosts, hosts_of, received_numel
from .collectives import PREFIX, run
from .engine import REDUCIBLE


def find_hosts() -> Hosts:
    """The hosts of this job, from every worker's Horovod cross rank; a collective call
    (every rank builds its compressors in the same order), run eagerly even while tracing."""
    if not hvd.is_initialized():
        raise ValueError("hierarchical=True needs Horovod initialized first: call "
                         "hvd.init(process_sets=\"dynamic\") before building the compressor")
    with tf.init_scope():
        mine = tf.constant([[hvd.cross_rank(), hvd.rank()]], tf.int64)
        placement = hvd.allgather(mine, name=f"{PREFIX}hosts").numpy().tolist()
    return hosts_of([tuple(p) for p in placement], hvd.rank(), hvd.add_process_set)


def host_average(hosts: Hosts, grad: tf.Tensor, name: str) -> tf.Tensor:
    """``grad`` averaged over the workers of this host (a bfloat16 gradient in float32, the
    average then rounded back to bfloat16)."""
    wide = tf.cast(grad, REDUCIBLE.get(grad.dtype, grad.dtype))
    average = hvd.allreduce(wide, op=hvd.Average, name=f"{PREFIX}in_host.{name}",
                            ignore_name_scope=True, process_set=hosts.local)
    return tf.cast(average, grad.dtype)


class BetweenHosts:
    """A collective of :func:`~horovod_dgc.tensorflow.collectives.run`'s signature whose
    workers are the hosts: the leader runs it among the leaders and broadcasts what it
    received to its host; the other workers (same message) receive that broadcast."""

    def __init__(self, hosts: Hosts):
        self.hosts = hosts

    def __call__(self, kind: str, message: tf.Tensor, name: str, root: Any = 0,
                 chunks: Optional[Sequence[int]] = None) -> tf.Tensor:
        hosts = self.hosts
        if hosts.is_leader:
            received = run(kind, message, f"{PREFIX}hosts.{name}", root,
                           process_set=hosts.leaders, rank=hosts.index, chunks=chunks)
        else:
            # Chunks come with a message of a size known when traced (a bucket's).
            size = tf.size(message) if chunks is None else message.shape.num_elements()
            numel = received_numel(kind, size, hosts.count, hosts.index, chunks)
            # Made of the message's run-time values (only the leader's are broadcast): Grappler
            # runs a collective of anything it can fold (zeros of a known shape) while
            # optimizing the graph, before the leader can answer.
            filler = tf.tile(message[:1], tf.reshape(numel, [1]))
            # Of unknown length, as the leader's collective returns it: decoding traces
            # differently for a static length (and much more slowly).
            received = tf.compat.v1.placeholder_with_default(filler, [None])
        return hvd.broadcast(received, root_rank=hosts.leader, name=f"{PREFIX}host.{name}",
                             ignore_name_scope=True, process_set=hosts.local)
