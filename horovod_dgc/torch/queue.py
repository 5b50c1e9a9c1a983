"""Buckets on the stock path: the tensors ``hvd.DistributedOptimizer`` hands to ``compress``
one by one, exchanged a bucket at a time.

Membership is fixed once, from the parameters in registration order reversed (about the
order backward produces their gradients, as DDP's ``Reducer`` fixes its buckets), cut into
buckets of about ``cap_bytes`` of gradient; every rank computes the same. ``compress`` queues
a tensor and launches its bucket as soon as the bucket's last tensor arrives, so the
exchange overlaps the rest of the backward pass; the first ``decompress`` of a step launches
whatever is left (the buckets of parameters that got no gradient: frozen ones, or a bucket
whose last tensor Horovod hands over only in ``synchronize``). Each tensor's ``ctx`` is its
place in a bucket; the bucket's exchange is finished once, by the first ``decompress`` that
needs it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .engine import Entry


@dataclass
class QueuedBucket:
    """One bucket of one step: its tensors as they arrive, then its exchange and averages."""

    label: str
    members: Tuple[str, ...]
    entries: Dict[str, Entry] = field(default_factory=dict)
    exchange: Any = None
    averaged: Optional[Dict[str, torch.Tensor]] = None

    @property
    def complete(self) -> bool:
        return len(self.entries) == len(self.members)


@dataclass(frozen=True)
class Queued:
    """``compress``'s ctx for a queued tensor: its name, its bucket of this step and the
    queue that gives its result."""

    name: str
    bucket: QueuedBucket
    queue: "StockQueue"


class StockQueue:
    """Collects one step's tensors into fixed buckets and exchanges each bucket as one.

    Args:
        buckets: the names of the tensors each bucket takes (``collectives.backward_buckets``).
        launch: starts a bucket's exchange, ``launch(label, entries)``; ``finish(exchange)``
            returns its averaged gradients in the entries' order.
    """

    def __init__(self, buckets: Sequence[Tuple[str, ...]], launch: Callable[[str, Sequence[Entry]], Any],
                 finish: Callable[[Any], List[torch.Tensor]]) -> None:
        self._buckets = [tuple(bucket) for bucket in buckets]
        self._bucket_of = {name: i for i, members in enumerate(self._buckets) for name in members}
        self._launch, self._finish = launch, finish
        self._lock = threading.Lock()
        self._open: Dict[int, QueuedBucket] = {}

    def takes(self, name: str) -> bool:
        """Whether ``name`` belongs to one of the buckets."""
        return name in self._bucket_of

    def add(self, name: str, grad: torch.Tensor, param: Optional[torch.nn.Parameter]) -> Queued:
        """Queue a tensor; launch its bucket if it is the last to arrive."""
        index = self._bucket_of[name]
        with self._lock:
            bucket = self._open.setdefault(index, QueuedBucket(f"bucket.{self._buckets[index][0]}",
                                                               self._buckets[index]))
            if name in bucket.entries:
                raise RuntimeError(f"the gradient of {name!r} was handed to compress() twice in one "
                                   f"step, before its bucket was exchanged")
            bucket.entries[name] = (name, grad, param)
            ready = bucket.complete
            if ready:
                del self._open[index]
        if ready:
            self._start(bucket)
        return Queued(name, bucket, self)

    def result(self, ctx: Queued) -> torch.Tensor:
        """The averaged gradient of a queued tensor: its bucket launched (with every bucket
        still open, in bucket order) and finished first where it was not."""
        if ctx.bucket.exchange is None:
            self.launch_open()
        bucket = ctx.bucket
        if bucket.averaged is None:
            names = [name for name in bucket.members if name in bucket.entries]
            bucket.averaged = dict(zip(names, self._finish(bucket.exchange)))
        return bucket.averaged.pop(ctx.name)

    def launch_open(self) -> None:
        """Launch every bucket still waiting for tensors, with the tensors it has."""
        with self._lock:
            waiting = [self._open.pop(i) for i in sorted(self._open)]
        for bucket in waiting:
            self._start(bucket)

    def forget(self) -> None:
        """Drop the step's queued tensors (an elastic reset)."""
        with self._lock:
            self._open.clear()

    def _start(self, bucket: QueuedBucket) -> None:
        entries = [bucket.entries[name] for name in bucket.members if name in bucket.entries]
        bucket.exchange = self._launch(bucket.label, entries)
