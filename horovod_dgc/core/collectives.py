"""The collectives a method exchanges through, by kind, framework-free: what each worker
receives (:func:`emulate`, the reference for tests), and how several tensors' messages share
one collective (:func:`cut_buckets`, :func:`join`, :func:`split`: the fused optimizer's buckets).

The adapters' collectives modules launch the real ones under the same kinds, each as a
:class:`Transport` (Horovod's; for PyTorch also ``torch.distributed``'s), so that a family's
exchange is written once whatever carries it.
"""
from __future__ import annotations

from typing import Any, List, Protocol, Sequence

from .ops import Tensor, TensorOps
from .wire import MessageError

BROADCAST = "broadcast"  # everyone receives the root's message
ALLREDUCE = "allreduce"  # everyone receives the average of all messages
ALLTOALL = "alltoall"    # worker j receives chunk j of every worker's message, in rank order
ALLGATHER = "allgather"  # everyone receives all messages, concatenated in rank order
KINDS = (BROADCAST, ALLREDUCE, ALLTOALL, ALLGATHER)


# Megabytes of dense gradient per bucket, on every path that buckets (DDP's default too).
DEFAULT_BUCKET_CAP_MB = 25.0


def cut_buckets(sizes_bytes: Sequence[int], cap_bytes: float) -> List[List[int]]:
    """The indices of consecutive items of ``sizes_bytes``, cut into buckets of about
    ``cap_bytes``: a bucket closes before the item that would take it past the cap, and an
    item larger than the cap has a bucket of its own."""
    buckets: List[List[int]] = [[]]
    size = 0
    for i, nbytes in enumerate(sizes_bytes):
        if buckets[-1] and size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return [b for b in buckets if b]


class Transport(Protocol):
    """What a family's exchange needs from a framework's collectives: the world, and the
    collectives of :data:`KINDS` started without waiting (``launch``) and awaited
    (``wait``). Launches must happen in the same order on every rank unless the transport
    matches collectives by ``name`` (Horovod does; ``torch.distributed`` does not)."""

    def size(self) -> int:
        """Number of workers."""

    def rank(self) -> int:
        """This worker's place among them, 0-based."""

    def launch(self, kind: str, message: Tensor, name: str, root: int = 0) -> Any:
        """Start collective ``kind`` on ``message`` (``root``: a broadcast's sender) under
        ``name``, identical on every rank; returns a handle for :meth:`wait`."""

    def wait(self, handle: Any) -> Tensor:
        """What the collective delivered to this worker (see :func:`emulate`)."""


def network_bytes(kind: str, nbytes: int, world_size: int) -> float:
    """Bytes one worker sends on the network, averaged over the workers, when each worker
    hands ``nbytes`` to collective ``kind`` among ``world_size`` workers (Gloo's ring
    algorithms; packet headers and Horovod's own negotiation not counted):

    * allgather: the N - 1 other workers' messages pass through every worker once;
    * allreduce: a ring reduce-scatter and all-gather, 2 (N - 1) / N of the message;
    * alltoall: each worker keeps its own chunk, (N - 1) / N;
    * broadcast: the root sends the message to N - 1 workers, (N - 1) / N on average.
    """
    n = world_size
    if kind == ALLGATHER:
        return (n - 1) * nbytes
    if kind == ALLREDUCE:
        return 2 * (n - 1) / n * nbytes
    if kind in (ALLTOALL, BROADCAST):
        return (n - 1) / n * nbytes
    raise ValueError(f"unknown collective {kind!r}")


def emulate(ops: TensorOps, kind: str, messages: Sequence[Tensor], root: int = 0) -> List[Tensor]:
    """What each of ``len(messages)`` workers receives from collective ``kind``."""
    n = len(messages)
    if kind == BROADCAST:
        return [messages[root]] * n
    if kind == ALLREDUCE:
        total = ops.copy(messages[0])
        for message in messages[1:]:
            total = ops.scale_add(total, 1.0, message)
        return [ops.scale(total, 1.0 / n)] * n
    if kind == ALLGATHER:
        return [ops.concat(messages)] * n
    if kind == ALLTOALL:
        chunk = ops.numel(messages[0]) // n
        return [ops.concat([ops.slice(m, j * chunk, chunk) for m in messages]) for j in range(n)]
    raise ValueError(f"unknown collective {kind!r}")


def join(ops: TensorOps, kind: str, messages: Sequence[Tensor], world_size: int) -> Tensor:
    """One collective's input carrying the messages of several tensors. For an alltoall,
    chunk j of every message goes to worker j, so the chunks are regrouped by destination."""
    if len(messages) == 1:
        return messages[0]
    if kind != ALLTOALL:
        return ops.concat(messages)
    chunks = [ops.numel(m) // world_size for m in messages]
    return ops.concat([ops.slice(m, j * c, c) for j in range(world_size)
                       for m, c in zip(messages, chunks)])


def split(ops: TensorOps, kind: str, received: Tensor, sizes: Sequence[int], world_size: int,
          names: Sequence[str]) -> List[Tensor]:
    """For each tensor whose message of ``sizes[t]`` elements went into :func:`join`, what a
    collective of that message alone would have delivered (its headers are checked later,
    by the method)."""
    if len(sizes) == 1:
        return [received]
    per_sender = sum(sizes) if kind != ALLTOALL else sum(s // world_size for s in sizes)
    senders = 1 if kind in (BROADCAST, ALLREDUCE) else world_size
    total = per_sender * senders
    received = ops.verify(ops.size(received) == total, [ops.size(received)],
                          lambda got: _wrong_size(kind, got, total, names),
                          ops.fit(received, total))
    shares: List[List[Tensor]] = [[] for _ in sizes]
    for sender in range(senders):
        offset = sender * per_sender
        for t, size in enumerate(sizes):
            share = size if kind != ALLTOALL else size // world_size
            shares[t].append(ops.slice(received, offset, share))
            offset += share
    return [parts[0] if len(parts) == 1 else ops.concat(parts) for parts in shares]


def _wrong_size(kind: str, got: Any, expected: int, names: Sequence[str]) -> None:
    raise MessageError(f"the {kind} of tensors {list(names)} delivered {got} elements, "
                       f"expected {expected} (a different tensor set or setting on some rank?)")
