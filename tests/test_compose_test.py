"""The logic of ``make compose-test`` (benchmarks/compose/compose_test.py) that needs no Docker:
reading ``docker inspect``, deciding when a run has finished or failed (a killed worker), the
FORWARD-policy verdict, the Debian mirror, the checks on the workers' records and the table.
The run itself needs root, a daemon and minutes: ``make compose-test``."""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from benchmarks.compose import compose_test as ct
from benchmarks.compose.compose_test import ComposeTestError, ContainerState

from conftest import ROOT

# Trimmed from `docker inspect` of a real run (Docker 20.10): worker2 killed with `docker kill`
# while worker1 trained on.
KILLED = {"Name": "/hdgc12985_worker2_1",
          "State": {"Status": "exited", "Running": False, "Paused": False, "Restarting": False,
                    "OOMKilled": False, "Dead": False, "Pid": 0, "ExitCode": 137, "Error": "",
                    "StartedAt": "2026-11-25T05:24:53.238702349Z",
                    "FinishedAt": "2026-11-25T05:25:16.412555563Z"},
          "Config": {"Labels": {"com.docker.compose.project": "hdgc12985",
                                "com.docker.compose.service": "worker2"}}}
RUNNING = {"Name": "/hdgc12985_worker1_1",
           "State": {"Status": "running", "Running": True, "Paused": False, "Restarting": False,
                     "OOMKilled": False, "Dead": False, "Pid": 15572, "ExitCode": 0, "Error": "",
                     "StartedAt": "2026-11-25T05:24:53.22274009Z",
                     "FinishedAt": "0001-01-01T00:00:00Z"},
           "Config": {"Labels": {"com.docker.compose.project": "hdgc12985",
                                 "com.docker.compose.service": "worker1"}}}


def container(service: str, status: str = "running", exit_code: int = 0, oom: bool = False,
              finished: str = "2026-11-25T05:25:16.4Z") -> dict:
    item = copy.deepcopy(RUNNING)
    item["Name"] = f"/hdgc1_{service}_1"
    item["Config"]["Labels"]["com.docker.compose.service"] = service
    item["State"].update(Status=status, Running=status == "running", ExitCode=exit_code,
                         OOMKilled=oom)
    if status != "running":
        item["State"]["FinishedAt"] = finished
    return item


def states(*items: dict) -> list:
    return [ContainerState.from_inspect(json.loads(json.dumps(item))) for item in items]


def cluster(worker_status: dict, rendezvous: str = "running") -> list:
    """rendezvous + worker0..3; ``worker_status``: rank -> (status, exit code)."""
    items = [container("rendezvous", rendezvous)]
    for rank in range(4):
        status, code = worker_status.get(rank, ("running", 0))
        items.append(container(f"worker{rank}", status, code))
    return states(*items)


def test_inspect_of_a_killed_container_reads_as_killed_by_sigkill():
    killed, running = states(KILLED, RUNNING)
    assert (killed.name, killed.service, killed.ended, killed.exit_code) == \
        ("hdgc12985_worker2_1", "worker2", True, 137)
    assert not running.ended
    assert ct.describe_exit(killed) == "was killed (SIGKILL, exit 137)"


def test_a_killed_worker_ends_the_run_with_its_name_while_the_others_still_run():
    with pytest.raises(ComposeTestError, match=r"worker container hdgc12985_worker2_1 \(service "
                                               r"worker2\) was killed \(SIGKILL, exit 137\)"):
        ct.judge(states(container("rendezvous"), RUNNING, KILLED), workers=4)


def test_the_first_worker_to_end_is_named_not_the_first_by_name():
    # worker3 was killed; worker0 crashed 0.3 s later when its peer went away.
    killed = container("worker3", "exited", 137, finished="2026-11-25T05:25:16.412555563Z")
    crashed = container("worker0", "exited", 139, finished="2026-11-25T05:25:16.7Z")
    with pytest.raises(ComposeTestError, match=r"^worker container hdgc1_worker3_1 .*SIGKILL.*"
                                               r"also hdgc1_worker0_1 \(was killed \(SIGSEGV"):
        ct.judge(states(crashed, killed), 4)


def test_docker_times_read_to_the_nanosecond():
    assert ct.epoch_seconds("1970-01-01T00:00:01.5Z") == 1.5
    assert ct.epoch_seconds("2026-11-25T05:25:16.41255Z") < ct.epoch_seconds("2026-11-25T05:25:16.4126Z")
    assert ct.epoch_seconds("0001-01-01T00:00:00Z") == 0.0
    assert states(RUNNING)[0].finished_s == 0.0
    assert states(KILLED)[0].finished_s == pytest.approx(1795584316.412555563, abs=1e-6)


def test_the_run_goes_on_until_every_worker_exited_zero():
    assert ct.judge(cluster({}), 4) is None
    assert ct.judge(cluster({0: ("exited", 0), 1: ("exited", 0), 2: ("exited", 0)}), 4) is None
    done = {rank: ("exited", 0) for rank in range(4)}
    assert ct.judge(cluster(done), 4) == "finished"
    # Before compose has created every container, nothing is finished.
    assert ct.judge(cluster(done)[:3], 4) is None


def test_every_way_a_worker_can_end_badly_is_named():
    with pytest.raises(ComposeTestError, match="worker3.*exited with status 1"):
        ct.judge(cluster({3: ("exited", 1)}), 4)
    with pytest.raises(ComposeTestError, match=r"was killed \(SIGTERM, exit 143\)"):
        ct.judge(cluster({0: ("exited", 143)}), 4)
    oom = states(container("worker1", "exited", 137, oom=True))
    with pytest.raises(ComposeTestError, match="lack of memory"):
        ct.judge(oom, 4)
    with pytest.raises(ComposeTestError, match=r"worker0.*; also hdgc1_worker1_1"):
        ct.judge(cluster({0: ("exited", 137), 1: ("dead", 137)}), 4)


def test_a_rendezvous_that_ends_first_fails_the_run_but_not_after_the_workers():
    with pytest.raises(ComposeTestError, match="rendezvous container .* before the workers"):
        ct.judge(cluster({}, rendezvous="exited"), 4)
    done = {rank: ("exited", 0) for rank in range(4)}
    assert ct.judge(cluster(done, rendezvous="exited"), 4) == "finished"


def test_forward_policy_blocks_bridges_only_when_drop_and_bridged_through_iptables():
    assert ct.forward_blocks_bridges("DROP", True)
    assert not ct.forward_blocks_bridges("DROP", False)
    assert not ct.forward_blocks_bridges("ACCEPT", True)
    assert not ct.forward_blocks_bridges(None, True)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("iptables") is None or shutil.which("ip") is None,
                    reason="a namespace with its own firewall needs root, ip and iptables")
def test_a_drop_forward_policy_is_found_and_named_in_a_namespace_of_its_own():
    """The real iptables and sysctl, read inside a network namespace whose FORWARD policy is
    set there (the host's firewall is not touched)."""
    namespace = f"hdgc-fw-{uuid.uuid4().hex[:8]}"
    check = [sys.executable, "-c", "from benchmarks.compose import compose_test as ct; "
                                   "ct.check_forward_policy()"]

    def in_namespace(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", namespace, *cmd], cwd=ROOT,
                              capture_output=True, text=True)

    subprocess.run(["ip", "netns", "add", namespace], check=True)
    try:
        assert in_namespace(*check).returncode == 0
        assert in_namespace("iptables", "-P", "FORWARD", "DROP").returncode == 0
        bridged = in_namespace("sysctl", "-n", "net.bridge.bridge-nf-call-iptables").stdout.strip()
        if bridged == "1":
            out = in_namespace(*check)
            assert out.returncode != 0
            assert "FORWARD policy is DROP" in out.stderr and "iptables -P FORWARD ACCEPT" in out.stderr
            in_namespace("sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0")
        out = in_namespace(*check)
        assert out.returncode == 0 and "bridged traffic bypasses iptables" in out.stdout
    finally:
        subprocess.run(["ip", "netns", "delete", namespace], check=True)


def test_debian_mirror_from_deb822_and_one_line_sources(tmp_path):
    deb822 = tmp_path / "debian.sources"
    deb822.write_text("Types: deb\nURIs: http://mirror.example/debian-security\n"
                      "Suites: bookworm-security\nComponents: main\n\n"
                      "Types: deb\nURIs: http://mirror.example/debian/\n"
                      "Suites: bookworm bookworm-updates\nComponents: main\n")
    assert ct.debian_mirror([deb822]) == "http://mirror.example/debian"
    one_line = tmp_path / "sources.list"
    one_line.write_text("# comment\ndeb [arch=amd64] http://other.example/debian bookworm main\n")
    disabled = tmp_path / "off.sources"
    disabled.write_text("Enabled: no\nURIs: http://off.example/debian\nSuites: bookworm\n")
    assert ct.debian_mirror([disabled, one_line, deb822]) == "http://other.example/debian"
    assert ct.debian_mirror([tmp_path / "missing.list"]) == ct.DEFAULT_MIRROR


def record(label: str, method: str, rank: int, sent: float, digest: str = "abc") -> dict:
    return {"link": label, "method": method, "rank": rank, "tx_bytes_per_step": sent,
            "params_sha256": digest, "step_s": [1.0 + rank, 2.0, 3.0]}


def records(dgc_sent: float = 1e6, digest_of_rank3: str = "abc", ranks: int = 4) -> dict:
    out = {}
    for run in ct.RUNS:
        out[(run.label, "dense")] = [record(run.label, "dense", r, 150e6) for r in range(ranks)]
        out[(run.label, "dgc")] = [record(run.label, "dgc", r, dgc_sent,
                                          digest_of_rank3 if r == 3 else "abc")
                                   for r in range(ranks)]
    return out


def failed(checks) -> list:
    return [c.name for c in checks if not c.passed]


def test_checks_pass_on_complete_identical_and_sparse_records():
    assert failed(ct.check_records(records())) == []


def test_checks_fail_on_bytes_parameters_or_a_missing_worker():
    assert failed(ct.check_records(records(dgc_sent=2e6))) == [
        f"{run.label}: dgc sends >= 100x fewer bytes per worker per step than dense" for run in ct.RUNS]
    assert failed(ct.check_records(records(digest_of_rank3="def"))) == [
        f"{run.label} dgc: parameters identical across workers" for run in ct.RUNS]
    missing = failed(ct.check_records(records(ranks=3)))
    assert f"{ct.RUNS[0].label} dense: every worker finished" in missing
    assert f"{ct.RUNS[0].label}: dgc sends >= 100x fewer bytes per worker per step than dense" in missing


def test_table_rows_follow_the_runs_dense_first_with_the_slowest_workers_median():
    data = records()
    shuffled = dict(reversed(list(data.items())))
    rows = ct.table(shuffled).splitlines()[2:]
    assert [row.split("|")[1:3] for row in rows] == [
        [f" {run.label} ", f" {method} "] for run in ct.RUNS for method in ("dense", "dgc")]
    # Slowest worker per step: 4.0, 2.0, 3.0 -> median 3.0; 150 MB / 1 MB -> 150x.
    assert "| 3.00 |" in rows[1] and "| 150x |" in rows[1] and rows[1].endswith("| yes |")


def test_snapshot_changes_name_what_appeared_and_what_disappeared():
    before = {"docker ps -a": ["a"], "docker network ls": ["n1", "n2"], "ip netns list": []}
    after = {"docker ps -a": ["a", "b"], "docker network ls": ["n1"], "ip netns list": []}
    assert ct.snapshot_changes(before, after) == [
        "docker ps -a: added ['b'], removed nothing",
        "docker network ls: added nothing, removed ['n2']"]
    assert ct.snapshot_changes(before, before) == []
