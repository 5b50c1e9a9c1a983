"""The network-namespace cluster (benchmarks/cluster/netns.py, benchmarks/cluster/run.py): real
namespaces, real tc shaping, real Horovod workers started by ``python -m horovod_dgc.cluster``.

Needs root and iproute2 (skipped otherwise); every test checks that ``ip netns list`` and
``/etc/netns`` are as they were before it.
"""
import csv
import json
import os
import pwd
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from conftest import ROOT, worker_env

from benchmarks.cluster.job import ClusterJob
from benchmarks.cluster.netns import ClusterError, NetnsCluster, netns_names, parse_link

HAVE_ROOT_AND_IP = os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")
pytestmark = pytest.mark.skipif(not HAVE_ROOT_AND_IP,
                                reason="needs root and iproute2 (ip, tc) for network namespaces")
ETC_NETNS = Path("/etc/netns")
TINY_RUN = ["--hosts", "2", "--methods", "dense,dgc", "--model", "tiny", "--batch-size", "8"]
# A killed worker or an interrupt ends the run, its workers and its namespaces within this.
STOP_DEADLINE_S = 30.0


# Every namespace of these tests' clusters starts with it.
PREFIX = "hdgct"


def unique_prefix() -> str:
    return f"{PREFIX}{uuid.uuid4().hex[:10]}"


def ours(names) -> set:
    """The names among ``names`` of these tests' namespaces: make test runs another file's
    tests beside these, which may add and remove namespaces of their own meanwhile."""
    return {name for name in names if name.startswith(PREFIX)}


def etc_netns_entries() -> set:
    return ours(os.listdir(ETC_NETNS)) if ETC_NETNS.is_dir() else set()


@pytest.fixture
def netns_unchanged():
    """Fail the test if it leaves a namespace or an /etc/netns entry behind."""
    namespaces, etc = ours(netns_names()), etc_netns_entries()
    yield
    assert ours(netns_names()) == namespaces
    assert etc_netns_entries() == etc


def bench_args(out: Path, *extra: str) -> list:
    return [sys.executable, "-m", "benchmarks.cluster.run", "--out", str(out),
            "--prefix", unique_prefix(), *extra]


def test_interleaved_methods_share_one_launch_per_link_and_keep_their_own_bytes(tmp_path, netns_unchanged):
    """--interleave: one launch per link, the methods' timed steps alternating in it; each
    method's record has its own steps and the bytes its own steps sent (dgc's a fraction of
    dense's, as when each runs alone)."""
    methods = "dense,dgc,dgc-adaptive"
    proc = subprocess.run(bench_args(tmp_path, *TINY_RUN, "--methods", methods, "--links", "unshaped",
                                     "--warmup-steps", "3", "--steps", "3", "--interleave"),
                          cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [p.name for p in (tmp_path / "logs" / "unshaped").iterdir()] == ["dense+dgc+dgc-adaptive"]
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in records] == methods.split(",")
    assert all(r["interleaved"] and len(r["step_s"]) == 3 for r in records), records
    dense, dgc, adaptive = records
    assert dgc["tx_bytes_per_step"] < dense["tx_bytes_per_step"] / 3, (dense, dgc)
    assert adaptive["buckets"], adaptive  # decided after the warm-up
    assert "timed steps interleaved" in (tmp_path / "results.md").read_text()


def test_smoke_cluster_dense_and_dgc(tmp_path, netns_unchanged):
    """A shaped link (the unshaped one runs in the interleaved job below)."""
    proc = subprocess.run(bench_args(tmp_path, *TINY_RUN, "--links", "100mbit",
                                     "--warmup-steps", "1", "--steps", "3"),
                          cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["link"], r["method"]) for r in rows] == [("100mbit", "dense"), ("100mbit", "dgc")]
    for link in ("100mbit",):
        dense, dgc = (next(r for r in rows if r["link"] == link and r["method"] == m)
                      for m in ("dense", "dgc"))
        gradient_bytes = 4 * int(dense["params"])
        # A 2-worker ring all-reduce sends each worker's whole gradient once.
        assert float(dense["tx_bytes_per_step"]) >= 0.9 * gradient_bytes, dense
        assert float(dgc["tx_bytes_per_step"]) < float(dense["tx_bytes_per_step"]) / 3, dgc
        assert all(int(r["workers"]) == 2 and float(r["median_step_s"]) > 0 for r in (dense, dgc))
    table = (tmp_path / "results.md").read_text()
    assert "| 100mbit | dgc | horovod_dgc.torch.DistributedOptimizer | density 0.001 |" in table
    assert "| 100mbit | dgc |" in proc.stdout
    for plot in ("step_time.png", "bytes_per_step.png"):
        assert (tmp_path / plot).stat().st_size > 1000


def test_negotiation_grows_with_the_names_horovod_has_seen(tmp_path, netns_unchanged):
    """make cluster-negotiation on 2 hosts: idle traffic per worker, before and after 161
    collective names are registered (one bit each in every cycle's bit vector)."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cluster.negotiation", "--hosts", "2",
                           "--cycle-times-ms", "25", "--names", "0,161", "--idle-s", "1.5",
                           "--out", str(tmp_path)],
                          cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "negotiation.jsonl").read_text().splitlines()]
    assert [(r["workers"], r["cycle_time_ms"], r["names"]) for r in records] == [(2, 25.0, 0), (2, 25.0, 161)]
    few, many = (statistics.mean(r["bytes_per_s"]) for r in records)
    # 40 cycles a second of a few small packets each: some kB/s, never nothing, never MB/s.
    assert 2e3 < few < 200e3, records
    assert many > 1.5 * few, records
    assert "| 2 | 25 | 161 |" in (tmp_path / "negotiation.md").read_text()


class LineReader:
    """Collects a process's output lines in a thread; waits for one that contains a text."""

    def __init__(self, proc: subprocess.Popen):
        self.lines, self._found = [], threading.Event()
        self._marker = None
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append(line)
            if self._marker and self._marker in line:
                self._found.set()

    def wait_for(self, marker: str, timeout_s: float) -> bool:
        self._marker = marker
        if any(marker in line for line in self.lines):
            return True
        return self._found.wait(timeout_s)

    def text(self) -> str:
        self._thread.join(timeout=10)
        return "".join(self.lines)


def start_long_run(tmp_path: Path, methods: str = "dense,dgc", **env: str) -> tuple:
    """A cluster run far longer than the test (``env`` added to every worker's); returns once
    rank 0 has started benchmarking."""
    args = bench_args(tmp_path, *TINY_RUN, "--links", "unshaped", "--steps", "100000")
    args[args.index("--methods") + 1] = methods
    proc = subprocess.Popen(args, cwd=ROOT, env=worker_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    reader = LineReader(proc)
    if not reader.wait_for("cluster step: 2 workers", timeout_s=120):
        proc.kill()
        pytest.fail("the workers did not start:\n" + reader.text()[-3000:])
    time.sleep(1.0)
    return proc, reader, args[args.index("--prefix") + 1]


def no_process_mentions(text: str) -> bool:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return text not in out


def signal_host_and_wait(proc: subprocess.Popen, reader: LineReader, prefix: str, signum: int,
                         deadline_s: float) -> str:
    """Send ``signum`` to every process in host 1's namespace; the run's output once it has
    ended, exit status 1, within ``deadline_s``."""
    pids = subprocess.run(["ip", "netns", "pids", f"{prefix}-h1"], capture_output=True,
                          text=True).stdout.split()
    assert pids, "no process in host 1's namespace"
    sent_at = time.monotonic()
    for pid in pids:
        os.kill(int(pid), signum)
    try:
        proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the run did not end within {deadline_s} s of {signal.Signals(signum).name}")
    output = reader.text()
    assert proc.returncode == 1, output[-3000:]
    assert time.monotonic() - sent_at < deadline_s
    return output


def test_killing_a_worker_ends_the_run_with_a_clear_error(tmp_path, netns_unchanged):
    proc, reader, prefix = start_long_run(tmp_path)
    output = signal_host_and_wait(proc, reader, prefix, signal.SIGKILL, STOP_DEADLINE_S)
    assert "cluster-bench: ERROR: worker rank1 was killed by SIGKILL" in output, output[-3000:]
    assert no_process_mentions(str(tmp_path))


def run_faults(tmp_path, faults: str, gloo_timeout_s: int = 5) -> dict:
    """Each fault's outcome of make cluster-faults on 4 hosts, shorter (6 steps, a checkpoint
    every 2, Gloo's timeout ``gloo_timeout_s``)."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cluster.faults", "--hosts", "4",
                           "--faults", faults, "--slow-link", "10mbit",
                           "--steps", "6", "--checkpoint-every", "2", "--gloo-timeout-s",
                           str(gloo_timeout_s), "--out", str(tmp_path), "--prefix", unique_prefix()],
                          cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    outcomes = {o["fault"]: o for o in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    assert list(outcomes) == faults.split(","), outcomes
    assert no_process_mentions(str(tmp_path))
    return outcomes


def test_a_stall_or_a_split_ends_every_rank_and_training_resumes(tmp_path, netns_unchanged):
    """A rank stopped without dying (SIGSTOP) and a host cut off (its link down) each end the
    job within Gloo's timeout (5 s here) and a few seconds, the error naming the collective it
    waited for; the last complete checkpoint loads and a new run resumes from it, ending with
    the same parameters on every rank."""
    gloo_timeout_s = 5
    outcomes = run_faults(tmp_path, "stall:1@3,split:2@3", gloo_timeout_s)
    for name in ("stall:1@3", "split:2@3"):
        o = outcomes[name]
        assert o["injected_after_step"] == 3, o
        assert o["error"].startswith("horovod.common.exceptions.HorovodInternalError: rank "), o
        assert " of 4: the allgather 'horovod_dgc." in o["error"], o
        assert gloo_timeout_s <= o["error_after_s"] <= o["ended_after_s"] < gloo_timeout_s + STOP_DEADLINE_S, o
        # The fault struck in step 4: the checkpoint of step 2 is the last one written.
        assert (o["last_complete_checkpoint"], o["resumed_from"]) == (2, 2), o
        assert o["checkpoints_load"] and o["parameters_identical"] and o["expected"], o
    assert "| split:2@3 | 3 |" in (tmp_path / "results.md").read_text()


@pytest.mark.slow  # a job without a fault, longer: the stall and split above keep the harness in make test
def test_a_slow_link_only_slows_the_job(tmp_path, netns_unchanged):
    """One host at 10 Mbit/s: the job ends without an error, every checkpoint written, the
    parameters identical on every rank."""
    slow = run_faults(tmp_path, "slow:3")["slow:3"]
    assert slow["error"] is None and slow["last_complete_checkpoint"] == 6, slow
    assert slow["parameters_identical"] and slow["expected"], slow


@pytest.mark.slow  # timed phases on a shaped link (make cluster-adaptive); the decisions, identical
# on every rank, and the forced switches stay in make test (test_adaptive.py, adaptive_torch.py)
def test_the_adaptive_switch_follows_a_link_that_slows_down_and_recovers(tmp_path, netns_unchanged):
    """make cluster-adaptive, shorter: blocksign with adaptive= on 2 hosts sends every bucket
    dense on the unshaped link, compressed within a re-check interval (20 steps) of the link
    falling to 10 Mbit/s, and dense again within one of its recovery; every rank shows the
    same modes at every step and ends with the same parameters. A Horovod cycle of 40 ms (the
    target's is 10) widens the unshaped link's margin (blocksign's two collectives per bucket
    wait two cycles, a dense bucket one) past what a loaded machine's step times vary: at 10 ms,
    with the rest of the suite beside it, a re-check once measured the dense steps 21 ms against
    17 ms predicted compressed and went back to compressed on the unshaped link."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cluster.adaptive_link", "--steps", "75",
                           "--slow-at", "30", "--fast-at", "52", "--cycle-time-ms", "40",
                           "--out", str(tmp_path), "--prefix", unique_prefix(), "--check"],
                          cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["modes_alike"] and report["parameters_identical"] and report["as_expected"], report
    unshaped, slow, recovered = report["phases"]
    assert "d" in unshaped["modes_after"] and set(slow["modes_after"]) == {"c"}, report
    assert recovered["modes_after"] == unshaped["modes_after"], report
    assert slow["lag_steps"] <= 20 and recovered["lag_steps"] <= 20, report
    assert (tmp_path / "adaptive.png").read_bytes().startswith(b"\x89PNG"), "no plot"
    assert no_process_mentions(str(tmp_path))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_run_removes_everything(tmp_path, netns_unchanged, signum):
    proc, reader, _ = start_long_run(tmp_path)
    proc.send_signal(signum)
    try:
        proc.wait(timeout=STOP_DEADLINE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the run did not end within {STOP_DEADLINE_S} s of "
                    f"{signal.Signals(signum).name}:\n{reader.text()[-3000:]}")
    output = reader.text()
    assert proc.returncode == 130, output[-3000:]
    assert "cluster-bench: interrupted; the namespaces were removed" in output
    assert no_process_mentions(str(tmp_path))


def test_a_job_past_its_time_limit_is_stopped(tmp_path, netns_unchanged):
    # sleep adds up its arguments: a fraction of its own tells this job's sleep from any other
    # process's (a `sleep 600` of someone else's beside the test once failed it).
    job = ["sleep", "600", f"0.{uuid.uuid4().int % 10 ** 9:09d}"]
    started = time.monotonic()
    with NetnsCluster(2, unique_prefix()) as cluster:
        with pytest.raises(ClusterError, match="the job ran past its 3 s limit"):
            ClusterJob(cluster, job, tmp_path, timeout_s=3, echo_rank0=False).run()
    assert time.monotonic() - started < 20
    assert no_process_mentions(" ".join(job))


def test_without_root_it_refuses_in_one_sentence(tmp_path):
    nobody = str(pwd.getpwnam("nobody").pw_uid)
    before = ours(netns_names())
    proc = subprocess.run(["setpriv", f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups",
                           *bench_args(tmp_path, "--quick")],
                          cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr == ("cluster-bench: ERROR: creating network namespaces needs root: run "
                           "this command as root (for example with sudo).\n")
    assert ours(netns_names()) == before


TRANSFER_SERVER = """
import socket, sys
with socket.create_server((sys.argv[1], 5001)) as server:
    print("listening", flush=True)
    conn, _ = server.accept()
    while conn.recv(1 << 16):
        pass
    conn.sendall(b"k")
"""
TRANSFER_CLIENT = """
import socket, sys, time
for _ in range(100):
    try:
        conn = socket.create_connection((sys.argv[1], 5001))
        break
    except OSError:
        time.sleep(0.1)
start = time.perf_counter()
conn.sendall(bytes(int(sys.argv[2])))
conn.shutdown(socket.SHUT_WR)
conn.recv(1)
print(time.perf_counter() - start)
"""


def transfer_s(cluster: NetnsCluster, nbytes: int) -> float:
    """Seconds to send ``nbytes`` from host 1 to host 0 over TCP."""
    server = subprocess.Popen(cluster.exec_args(cluster.host_ns[0], [
        sys.executable, "-c", TRANSFER_SERVER, cluster.address(0)]), stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        client = subprocess.run(cluster.exec_args(cluster.host_ns[1], [
            sys.executable, "-c", TRANSFER_CLIENT, cluster.address(0), str(nbytes)]),
            capture_output=True, text=True, timeout=60)
        assert client.returncode == 0, client.stderr
        return float(client.stdout)
    finally:
        server.wait(timeout=10)


def qdiscs(ns: str, dev: str) -> str:
    return subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True,
                          text=True, check=True).stdout


def test_links_are_shaped_in_both_directions(netns_unchanged):
    nbytes = 4_000_000
    with NetnsCluster(2, unique_prefix()) as cluster:
        cluster.shape(parse_link("100mbit"))
        for rank in range(2):
            for ns, dev in ((cluster.host_ns[rank], "eth0"), (cluster.bridge_ns, f"port{rank}")):
                assert "tbf" in qdiscs(ns, dev) and "rate 100Mbit" in qdiscs(ns, dev)
        shaped = transfer_s(cluster, nbytes)
        cluster.shape(parse_link("unshaped"))
        assert "tbf" not in qdiscs(cluster.host_ns[0], "eth0")
        unshaped = transfer_s(cluster, nbytes)
    ideal = nbytes * 8 / 100e6
    assert 0.8 * ideal <= shaped <= 3 * ideal, (shaped, ideal)
    assert unshaped < shaped / 2, (unshaped, shaped)


def test_a_delay_needs_netem_or_says_so(netns_unchanged):
    with NetnsCluster(1, unique_prefix()) as cluster:
        try:
            cluster.shape(parse_link("100mbit+2ms"))
        except ClusterError as error:
            assert "this kernel has no netem qdisc" in str(error)
        else:
            shown = qdiscs(cluster.host_ns[0], "eth0")
            assert "netem" in shown and "delay 2ms" in shown, shown
