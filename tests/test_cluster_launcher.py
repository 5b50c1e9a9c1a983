"""``python -m horovod_dgc.cluster``: settings from the environment, and a real 2-worker job
through the rendezvous server on the loopback interface (no root needed)."""
import socket
import subprocess
import sys

import pytest

from horovod_dgc.cluster import RendezvousSettings, WorkerSettings
from horovod_dgc.cluster.rendezvous import slot_plan
from horovod_dgc.cluster.worker import host_name_address

from conftest import ROOT, WORKERS, worker_env

ENV = {"HOROVOD_DGC_RANK": "1", "HOROVOD_DGC_SIZE": "4",
       "HOROVOD_DGC_RENDEZVOUS_ADDR": "198.18.0.254", "HOROVOD_DGC_RENDEZVOUS_PORT": "29601",
       "HOROVOD_DGC_IFACE": "eth1"}


def test_worker_settings_become_horovods_variables():
    env = WorkerSettings.from_env(ENV).horovod_env()
    assert env["HOROVOD_RANK"] == "1" and env["HOROVOD_SIZE"] == "4"
    assert (env["HOROVOD_LOCAL_RANK"], env["HOROVOD_LOCAL_SIZE"]) == ("0", "1")
    assert (env["HOROVOD_CROSS_RANK"], env["HOROVOD_CROSS_SIZE"]) == ("1", "4")
    assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "198.18.0.254"
    assert env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "29601"
    assert env["HOROVOD_GLOO_IFACE"] == env["GLOO_SOCKET_IFNAME"] == "eth1"
    assert env["HOROVOD_CONTROLLER"] == env["HOROVOD_CPU_OPERATIONS"] == "gloo"


def test_rendezvous_plan_sizes_each_hosts_scopes():
    plan = slot_plan(3)
    assert [s.rank for s in plan] == [0, 1, 2]
    assert {s.hostname for s in plan} == {"host0", "host1", "host2"}
    assert all(s.local_size == 1 and s.cross_size == 3 and s.cross_rank == s.rank for s in plan)


def test_workers_per_host_place_consecutive_ranks_on_one_host():
    env = WorkerSettings.from_env({**ENV, "HOROVOD_DGC_RANK": "3",
                                   "HOROVOD_DGC_LOCAL_SIZE": "2"}).horovod_env()
    assert (env["HOROVOD_LOCAL_RANK"], env["HOROVOD_LOCAL_SIZE"]) == ("1", "2")
    assert (env["HOROVOD_CROSS_RANK"], env["HOROVOD_CROSS_SIZE"]) == ("1", "2")
    assert env["HOROVOD_HOSTNAME"] == "host1"
    plan = slot_plan(4, local_size=2)
    assert [(s.hostname, s.local_rank, s.cross_rank) for s in plan] == [
        ("host0", 0, 0), ("host0", 1, 0), ("host1", 0, 1), ("host1", 1, 1)]
    assert all(s.local_size == 2 and s.cross_size == 2 for s in plan)


@pytest.mark.parametrize("change, message", [
    ({"HOROVOD_DGC_RANK": "4"}, "HOROVOD_DGC_RANK must be in 0..3"),
    ({"HOROVOD_DGC_LOCAL_SIZE": "3"}, "HOROVOD_DGC_LOCAL_SIZE must be >= 1 and divide"),
    ({"HOROVOD_DGC_RANK": "x"}, "HOROVOD_DGC_RANK must be an integer"),
    ({"HOROVOD_DGC_SIZE": ""}, "HOROVOD_DGC_SIZE is not set"),
    ({"HOROVOD_DGC_RENDEZVOUS_PORT": "70000"}, "HOROVOD_DGC_RENDEZVOUS_PORT must be in"),
    ({"HOROVOD_DGC_TIMEOUT_S": "0"}, "HOROVOD_DGC_TIMEOUT_S must be > 0"),
])
def test_bad_worker_settings_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        WorkerSettings.from_env({**ENV, **change})


def test_rendezvous_settings_default_to_every_interface():
    settings = RendezvousSettings.from_env({"HOROVOD_DGC_SIZE": "2"})
    assert (settings.listen_addr, settings.port) == ("0.0.0.0", 29600)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launcher(mode_args, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "horovod_dgc.cluster", *mode_args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.skipif(host_name_address() != "127.0.0.1",
                    reason="the host name must resolve to 127.0.0.1 to run Gloo on loopback")
def test_two_workers_through_the_launcher_on_loopback():
    env = {**worker_env(), "HOROVOD_DGC_SIZE": "2", "HOROVOD_DGC_RENDEZVOUS_ADDR": "127.0.0.1",
           "HOROVOD_DGC_RENDEZVOUS_PORT": str(free_port()), "HOROVOD_DGC_IFACE": "lo"}
    server = launcher(["rendezvous"], env)
    try:
        workers = [launcher(["worker", "--", sys.executable, str(WORKERS / "smoke.py"), "torch"],
                            {**env, "HOROVOD_DGC_RANK": str(rank)}) for rank in range(2)]
        outputs = [w.communicate(timeout=120)[0] for w in workers]
    finally:
        server.terminate()
        server.wait(timeout=10)
    for rank, (worker, output) in enumerate(zip(workers, outputs)):
        assert worker.returncode == 0, output
        assert f"torch rank {rank}/2 ok mpi=False gloo=True" in output


def test_worker_without_rendezvous_server_fails_in_bounded_time():
    env = {**worker_env(), "HOROVOD_DGC_SIZE": "2", "HOROVOD_DGC_RANK": "0",
           "HOROVOD_DGC_RENDEZVOUS_ADDR": "127.0.0.1", "HOROVOD_DGC_RENDEZVOUS_PORT": str(free_port()),
           "HOROVOD_DGC_IFACE": "lo", "HOROVOD_DGC_TIMEOUT_S": "1"}
    proc = launcher(["worker", "--", "true"], env)
    output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 1
    assert "worker rank 0: no rendezvous server answered at 127.0.0.1" in output
