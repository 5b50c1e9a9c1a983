"""core/hosts.py: which workers share a host, and the process sets added once per job."""
import pytest

from horovod_dgc.core import hosts as hosts_module
from horovod_dgc.core.collectives import ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST
from horovod_dgc.core.hosts import group_hosts, hosts_of, received_numel


def test_hosts_are_ordered_by_their_lowest_rank_whatever_horovods_host_ids():
    # Horovod's cross rank numbers hosts; ranks need not be consecutive on a host.
    placement = [(7, 0), (3, 1), (7, 2), (3, 3)]
    assert group_hosts(placement) == [[0, 2], [1, 3]]


@pytest.mark.parametrize("placement, message", [
    ([(0, 0), (0, 1)], "every worker runs on one host"),
    ([(0, 0), (1, 1)], "each of the 2 hosts runs one worker"),
    ([(0, 0), (0, 1), (1, 2)], r"the same number of workers on every host; the hosts hold \[2, 1\]"),
])
def test_placements_with_nothing_to_gain_are_refused(placement, message):
    with pytest.raises(ValueError, match=message):
        group_hosts(placement)


def test_process_sets_are_added_once_per_job_and_describe_this_worker(monkeypatch):
    monkeypatch.setattr(hosts_module, "_HOSTS", {})
    added = []

    def add_process_set(ranks):
        added.append(list(ranks))
        return f"set{len(added)}"

    placement = [(0, 0), (0, 1), (1, 2), (1, 3)]
    hosts = hosts_of(placement, 3, add_process_set)
    assert added == [[0, 1], [2, 3], [0, 2]]
    assert (hosts.local, hosts.leaders) == ("set2", "set3")
    assert (hosts.index, hosts.count, hosts.leader, hosts.leader_ranks) == (1, 2, 2, (0, 2))
    assert not hosts.is_leader
    assert hosts_of(placement, 3, add_process_set) is hosts and len(added) == 3


def test_a_process_set_horovod_refuses_becomes_a_clear_error(monkeypatch):
    monkeypatch.setattr(hosts_module, "_HOSTS", {})

    def refuse(ranks):  # what Horovod raises after a plain hvd.init()
        raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding process sets "
                         "after Horovod initialization.")

    with pytest.raises(ValueError, match=r'hvd.init\(process_sets="dynamic"\)'):
        hosts_of([(0, 0), (0, 1), (1, 2), (1, 3)], 0, refuse)


@pytest.mark.parametrize("kind, expected", [(ALLGATHER, 36), (ALLREDUCE, 12), (ALLTOALL, 12),
                                            (BROADCAST, 12)])
def test_what_a_hosts_other_workers_allocate_for_the_leaders_broadcast(kind, expected):
    assert received_numel(kind, 12, 3) == expected


@pytest.mark.parametrize("index, expected", [(0, 6), (1, 18), (2, 12)])
def test_an_alltoall_of_uneven_chunks_delivers_every_hosts_chunk_for_it(index, expected):
    """Every host sends host i the same chunk: the 3 hosts' chunks of 2, 6 and 4 elements."""
    assert received_numel(ALLTOALL, 12, 3, index, (2, 6, 4)) == expected


def test_hosts_are_ordered_by_their_lowest_rank_not_their_highest():
    """Host 0 holds ranks 0 and 3, host 1 ranks 1 and 2: host 0 comes first (its leader, rank
    0, is the lower). Catches hosts sorted by their last rank."""
    assert group_hosts([(0, 0), (1, 1), (1, 2), (0, 3)]) == [[0, 3], [1, 2]]
