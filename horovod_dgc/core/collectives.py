"""The collectives a method exchanges through, by kind, framework-free: what each worker
receives (:func:`emulate`, the reference for tests), and how several tensors' messages share
one collective (:func:`cut_buckets`, :func:`join`, :func:`split`: the fused optimizer's buckets).

The adapters' collectives modules launch the real ones under the same kinds, each as a
:class:`Transport` (Horovod's; for PyTorch also ``torch.distributed``'s), so that a family's
exchange is written once whatever carries it.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Any, List, Optional, Protocol, Sequence, Tuple, TypeVar

from .ops import Tensor, TensorOps
from .wire import MessageError

T = TypeVar("T")

BROADCAST = "broadcast"  # everyone receives the root's message
ALLREDUCE = "allreduce"  # everyone receives the average of all messages
ALLTOALL = "alltoall"    # worker j receives chunk j of every worker's message, in rank order
# (equal chunks, or ``chunks``: each chunk's elements, the same on every rank)
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


def backward_buckets(items: Sequence[T], sizes_bytes: Sequence[int],
                     cap_bytes: float = DEFAULT_BUCKET_CAP_MB * 2 ** 20) -> List[Tuple[T, ...]]:
    """The buckets of both Horovod paths: ``items`` (tensors or their names, in the order the
    model registers them, ``sizes_bytes`` of gradient each) reversed, roughly as backward
    produces them, and cut into buckets of about ``cap_bytes`` (:func:`cut_buckets`)."""
    items, sizes_bytes = list(items)[::-1], list(sizes_bytes)[::-1]
    return [tuple(items[i] for i in bucket) for bucket in cut_buckets(sizes_bytes, cap_bytes)]


class Transport(Protocol):
    """What a family's exchange needs from a framework's collectives: the world, and the
    collectives of :data:`KINDS` started without waiting (``launch``) and awaited
    (``wait``). Launches must happen in the same order on every rank unless the transport
    matches collectives by ``name`` (Horovod does; ``torch.distributed`` does not)."""

    def size(self) -> int:
        """Number of workers."""

    def rank(self) -> int:
        """This worker's place among them, 0-based."""

    def launch(self, kind: str, message: Tensor, name: str, root: int = 0,
               chunks: Optional[Sequence[int]] = None) -> Any:
        """Start collective ``kind`` on ``message`` (``root``: a broadcast's sender;
        ``chunks``: an alltoall's elements for each destination, the same on every rank,
        where they are not equal) under ``name``, identical on every rank; returns a handle
        for :meth:`wait`."""

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


def emulate(ops: TensorOps, kind: str, messages: Sequence[Tensor], root: int = 0,
            chunks: Optional[Sequence[int]] = None) -> List[Tensor]:
    """What each of ``len(messages)`` workers receives from collective ``kind``
    (``chunks``: as :meth:`Transport.launch`'s)."""
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
        sizes = alltoall_chunks(ops.numel(messages[0]), n, chunks)
        starts = _starts(sizes)
        return [ops.concat([ops.slice(m, starts[j], sizes[j]) for m in messages]) for j in range(n)]
    raise ValueError(f"unknown collective {kind!r}")


def alltoall_chunks(numel: int, world_size: int, chunks: Optional[Sequence[int]] = None) -> List[int]:
    """Each destination's elements of an alltoall message of ``numel`` elements: ``chunks``,
    or equal ones."""
    if chunks is None:
        return [numel // world_size] * world_size
    if len(chunks) != world_size or sum(chunks) != numel:
        raise ValueError(f"an alltoall message of {numel} elements cut into chunks {list(chunks)} "
                         f"for {world_size} workers")
    return list(chunks)


def _starts(sizes: Sequence[int]) -> List[int]:
    return [0, *accumulate(sizes)][:-1]


def join(ops: TensorOps, kind: str, messages: Sequence[Tensor], world_size: int,
         chunks: Optional[Sequence[Optional[Sequence[int]]]] = None) -> Tensor:
    """One collective's input carrying the messages of several tensors. For an alltoall,
    chunk j of every message goes to worker j, so the chunks are regrouped by destination
    (``chunks[t]``: message t's, as :meth:`Transport.launch`'s; :func:`joined_chunks` gives
    the joined message's)."""
    if len(messages) == 1:
        return messages[0]
    if kind != ALLTOALL:
        return ops.concat(messages)
    sizes = _chunks_of(ops, messages, world_size, chunks)
    starts = [_starts(s) for s in sizes]
    return ops.concat([ops.slice(m, start[j], size[j]) for j in range(world_size)
                       for m, start, size in zip(messages, starts, sizes)])


def joined_chunks(ops: TensorOps, kind: str, messages: Sequence[Tensor], world_size: int,
                  chunks: Sequence[Optional[Sequence[int]]]) -> Optional[List[int]]:
    """The chunks of :func:`join`'s message: None where every message's are equal."""
    if kind != ALLTOALL or all(c is None for c in chunks):
        return None
    sizes = _chunks_of(ops, messages, world_size, chunks)
    return [sum(s[j] for s in sizes) for j in range(world_size)]


def _chunks_of(ops: TensorOps, messages: Sequence[Tensor], world_size: int,
               chunks: Optional[Sequence[Optional[Sequence[int]]]]) -> List[List[int]]:
    given = chunks if chunks is not None else [None] * len(messages)
    return [alltoall_chunks(ops.numel(m), world_size, c) for m, c in zip(messages, given)]


def split(ops: TensorOps, kind: str, received: Tensor, sizes: Sequence[int], world_size: int,
          names: Sequence[str], rank: Optional[int] = None,
          chunks: Optional[Sequence[Optional[Sequence[int]]]] = None) -> List[Tensor]:
    """For each tensor whose message of ``sizes[t]`` elements (``chunks[t]``: an alltoall's,
    as :func:`join` took them) went into :func:`join`, what a collective of that message alone
    would have delivered to worker ``rank`` (its headers are checked later, by the method).
    ``rank`` is needed for an alltoall only, whose share depends on the receiver."""
    if kind == ALLTOALL and rank is None:
        raise ValueError("split() of an alltoall needs the receiving rank")
    if len(sizes) == 1:
        return [received]
    given = chunks if chunks is not None else [None] * len(sizes)
    shares_of = ([alltoall_chunks(s, world_size, c)[rank] for s, c in zip(sizes, given)]
                 if kind == ALLTOALL else list(sizes))
    per_sender = sum(shares_of)
    senders = 1 if kind in (BROADCAST, ALLREDUCE) else world_size
    total = per_sender * senders
    received = ops.verify(ops.size(received) == total, [ops.size(received)],
                          lambda got: _wrong_size(kind, got, total, names),
                          ops.fit(received, total))
    shares: List[List[Tensor]] = [[] for _ in sizes]
    for sender in range(senders):
        offset = sender * per_sender
        for t, share in enumerate(shares_of):
            shares[t].append(ops.slice(received, offset, share))
            offset += share
    return [parts[0] if len(parts) == 1 else ops.concat(parts) for parts in shares]


def _wrong_size(kind: str, got: Any, expected: int, names: Sequence[str]) -> None:
    raise MessageError(f"the {kind} of tensors {list(names)} delivered {got} elements, "
                       f"expected {expected} (a different tensor set or setting on some rank?)")
