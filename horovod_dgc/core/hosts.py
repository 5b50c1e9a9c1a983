"""Which workers share a host, for compression between hosts only (``hierarchical=True``).

With several workers per host, the workers of a host first average each compressed gradient
densely among themselves (a Horovod process set per host: memory or loopback, not the
network). Every worker of the host then runs the method on that same host average, so their
memories stay identical, and the method's collectives run between hosts: the host's leader
(its lowest rank) exchanges the messages with the other hosts' leaders (a process set of the
leaders) and broadcasts what it received to the workers of its host. To the method the world
is the hosts: its ``world_size`` is the number of hosts and its ``rank`` the host's place
among them, so ``stats()`` counts the bytes between hosts.

Framework-free: the adapters gather every worker's host and add the process sets through
the functions they pass in.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .collectives import ALLGATHER, ALLTOALL, alltoall_chunks


@dataclass(frozen=True)
class Hosts:
    """This worker's host among the hosts of the job.

    Attributes:
        local: Horovod process set of the workers of this host.
        leaders: Horovod process set of the lowest rank of every host.
        index: this host's place among the hosts, 0-based (the order of their leaders).
        count: the number of hosts.
        rank: this worker's global rank.
        leader_ranks: every host's leader, by host index (a broadcast's root is a global rank).
    """

    local: Any
    leaders: Any
    index: int
    count: int
    rank: int
    leader_ranks: Tuple[int, ...]

    @property
    def leader(self) -> int:
        """The global rank of this host's leader."""
        return self.leader_ranks[self.index]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader


def group_hosts(placement: Sequence[Tuple[int, int]]) -> List[List[int]]:
    """The ranks of each host, hosts ordered by their lowest rank, from every worker's
    ``(host id, rank)`` (Horovod's cross rank identifies the host).

    Raises:
        ValueError: a single host, one worker per host, or hosts of different sizes.
    """
    by_host: Dict[int, List[int]] = {}
    for host, rank in placement:
        by_host.setdefault(host, []).append(rank)
    members = sorted((sorted(ranks) for ranks in by_host.values()), key=lambda m: m[0])
    sizes = sorted({len(m) for m in members})
    if len(members) == 1:
        raise ValueError("hierarchical=True: every worker runs on one host, so nothing crosses "
                         "a network; leave hierarchical off")
    if sizes == [1]:
        raise ValueError(f"hierarchical=True: each of the {len(members)} hosts runs one worker "
                         f"(hvd.local_size() is 1), so there is nothing to reduce inside a "
                         f"host; leave hierarchical off")
    if len(sizes) > 1:
        raise ValueError(f"hierarchical=True needs the same number of workers on every host; "
                         f"the hosts hold {[len(m) for m in members]} workers")
    return members


_HOSTS: Dict[Tuple[Tuple[int, ...], ...], Hosts] = {}
_LOCK = threading.Lock()


def hosts_of(placement: Sequence[Tuple[int, int]], rank: int,
             add_process_set: Callable[[List[int]], Any]) -> Hosts:
    """This worker's :class:`Hosts`; the process sets are added (``add_process_set``, a
    collective call) once per job, on the first call, in the same order on every rank."""
    members = group_hosts(placement)
    key = tuple(tuple(m) for m in members)
    with _LOCK:
        if key not in _HOSTS:
            _HOSTS[key] = _add_process_sets(members, rank, add_process_set)
        return _HOSTS[key]


def _add_process_sets(members: List[List[int]], rank: int,
                      add_process_set: Callable[[List[int]], Any]) -> Hosts:
    try:
        local_sets = [add_process_set(m) for m in members]
        leaders = add_process_set([m[0] for m in members])
    except ValueError as error:
        raise ValueError(f"hierarchical=True could not add Horovod process sets ({error}): call "
                         f"hvd.init(process_sets=\"dynamic\") and add no process set with the "
                         f"same ranks yourself") from error
    index = next(i for i, m in enumerate(members) if rank in m)
    return Hosts(local=local_sets[index], leaders=leaders, index=index, count=len(members),
                 rank=rank, leader_ranks=tuple(m[0] for m in members))


def received_numel(kind: str, message_numel: int, hosts: int, index: int = 0,
                   chunks: Optional[Sequence[int]] = None) -> int:
    """What a collective between hosts delivers to host ``index``, for a message of the same
    size on every host (``chunks``: an alltoall's, as ``Transport.launch`` takes them): what
    a host's other workers allocate to receive the leader's broadcast."""
    if kind == ALLGATHER:
        return message_numel * hosts
    if kind == ALLTOALL:
        return hosts * alltoall_chunks(message_numel, hosts, chunks)[index]
    return message_numel
