"""Compression between hosts only (``Compression.<method>(..., hierarchical=True)``) for
PyTorch; what it does is in :mod:`horovod_dgc.core.hosts`.

The three steps of an exchange depend on each other, and the stock path finishes tensors
in an order that may differ between ranks (Horovod iterates a set for parameters without a
gradient). So no step ever waits for a collective that another rank may not have launched:
``compress`` only launches the host reduction; the first ``finish`` of a step waits for
every pending host reduction and starts every exchange in label order; and the hand-over
inside a host is launched for every exchange in launch order, once, at the first wait.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import horovod.torch as hvd
import torch

from ..core.hosts import Hosts, hosts_of, received_numel
from .collectives import PREFIX, launch, wait
from .engine import REDUCIBLE, Entry


def find_hosts() -> Hosts:
    """The hosts of this job, from every worker's Horovod cross rank; a collective call
    (every rank builds its compressors in the same order)."""
    if not hvd.is_initialized():
        raise ValueError("hierarchical=True needs Horovod initialized first: call "
                         "hvd.init(process_sets=\"dynamic\") before building the compressor")
    mine = torch.tensor([[hvd.cross_rank(), hvd.rank()]], dtype=torch.int64, device="cpu")
    placement = hvd.allgather(mine, name=f"{PREFIX}hosts").tolist()
    return hosts_of([tuple(p) for p in placement], hvd.rank(), hvd.add_process_set)


@dataclass
class _Exchange:
    """One collective between hosts, and the hand-over of its result inside the host."""

    kind: str
    message: torch.Tensor
    name: str
    between_hosts: Optional[int]
    chunks: Optional[Sequence[int]] = None
    handover: Optional[int] = None


class HostTransport:
    """The method's collectives between hosts, as a
    :class:`~horovod_dgc.core.collectives.Transport` whose workers are the hosts. Every
    worker of a host hands in the same message; the leader's goes between hosts."""

    def __init__(self, hosts: Hosts):
        self.hosts = hosts
        self._lock = threading.Lock()
        self._not_handed_over: List[_Exchange] = []

    def size(self) -> int:
        return self.hosts.count

    def rank(self) -> int:
        return self.hosts.index

    def launch(self, kind: str, message: torch.Tensor, name: str, root: int = 0,
               chunks: Optional[Sequence[int]] = None) -> _Exchange:
        hosts = self.hosts
        between = None
        if hosts.is_leader:
            between = launch(kind, message, f"hosts.{name}", root=hosts.leader_ranks[root], chunks=chunks,
                             process_set=hosts.leaders)
        exchange = _Exchange(kind, message, name, between, chunks)
        with self._lock:
            self._not_handed_over.append(exchange)
        return exchange

    def wait(self, exchange: _Exchange) -> torch.Tensor:
        if exchange.handover is None:
            self._hand_over()
        return wait(exchange.handover)

    def _hand_over(self) -> None:
        """Launch the hand-over of every exchange launched so far, in launch order (the
        same on every rank): the leader waits for what came from the other hosts."""
        with self._lock:
            exchanges, self._not_handed_over = self._not_handed_over, []
        hosts = self.hosts
        for exchange in exchanges:
            if hosts.is_leader:
                received = wait(exchange.between_hosts)
            else:
                received = exchange.message.new_empty(
                    received_numel(exchange.kind, exchange.message.numel(), hosts.count, hosts.index,
                                   exchange.chunks))
            exchange.handover = hvd.broadcast_async(received, root_rank=hosts.leader,
                                                    name=f"{PREFIX}host.{exchange.name}",
                                                    process_set=hosts.local)

    def forget(self) -> None:
        """Drop exchanges not handed over (a step abandoned by an elastic reset)."""
        with self._lock:
            self._not_handed_over.clear()



@dataclass
class HostReduction:
    """The dense average of some tensors among the workers of a host, in flight; then the
    exchange between hosts started from it (``exchange``)."""

    label: str
    entries: List[Entry]
    averages: List[Tuple[int, torch.Tensor]]
    dtypes: List[torch.dtype]
    exchange: Any = None

    @property
    def step(self) -> int:
        """The tensors' step (known once the exchange between hosts has started)."""
        return self.exchange.step


@dataclass
class HostReductions:
    """The host reductions of a step not yet turned into exchanges between hosts."""

    hosts: Hosts
    pending: Dict[str, HostReduction] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def launch(self, label: str, entries: Sequence[Entry]) -> HostReduction:
        """Start averaging ``entries``' gradients among the workers of this host."""
        averages = []
        for name, grad, _ in entries:
            tensor = grad.detach().to(REDUCIBLE.get(grad.dtype, grad.dtype), copy=True)
            averages.append((hvd.allreduce_async_(tensor, op=hvd.Average,
                                                  name=f"{PREFIX}in_host.{name}",
                                                  process_set=self.hosts.local), tensor))
        reduction = HostReduction(label, list(entries), averages, [g.dtype for _, g, _ in entries])
        with self.lock:
            self.pending[label] = reduction
        return reduction

    def start_exchanges(self, launch: Callable[[str, Sequence[Entry]], Any]) -> None:
        """Wait for every pending host reduction and start its exchange between hosts with
        ``launch`` (the family's), in label order."""
        with self.lock:
            waiting, self.pending = sorted(self.pending.items()), {}
        for label, reduction in waiting:
            entries = [(name, wait(handle).view_as(grad), param) for (name, grad, param), (handle, _)
                       in zip(reduction.entries, reduction.averages)]
            reduction.exchange = launch(label, entries)

    def forget(self) -> None:
        with self.lock:
            self.pending.clear()
