"""Shared fixtures: the device the in-process tests run on, and launching real multi-process
Horovod jobs from tests."""
from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

import pytest
import torch

from horovod_dgc.core.collectives import emulate
from horovod_dgc.torch.kernels import triton_memory
from horovod_dgc.torch.ops import TorchOps

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the benchmarks package, imported by some tests
WORKERS = Path(__file__).resolve().parent / "workers"
BIN = Path(sys.executable).parent

from benchmarks import worker_env  # noqa: E402  (re-exported for the tests that launch workers)


def _run(cmd: List[str], timeout_s: float, **env: str) -> str:
    return _succeeded(subprocess.run(cmd, cwd=ROOT, env=worker_env(**env), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, timeout=timeout_s))


def _succeeded(proc: subprocess.CompletedProcess) -> str:
    """The output of a launch that exited 0; the test fails otherwise."""
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(proc.args)} exited {proc.returncode}:\n{proc.stdout[-6000:]}")
    return proc.stdout


# The files of multi-process jobs, longest first: make test's two processes take whole files
# in collection order, so these start at once instead of ending the run on one process.
LONGEST_FILES = ("test_tensorflow_multiprocess.py", "test_torch_multiprocess.py", "test_ddp_torch.py",
                 "test_cluster_netns.py", "test_elastic_torch.py")


def pytest_collection_modifyitems(items: List[pytest.Item]) -> None:
    first = {name: place for place, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(LONGEST_FILES)))


_warm_server: Optional[subprocess.Popen] = None
_warm_server_errors = tempfile.TemporaryFile("w+")  # what it prints itself (its launches' output goes to files)


def run_horovodrun(args: Sequence[str], timeout_s: float, **env: str) -> subprocess.CompletedProcess:
    """``horovodrun args`` from this repository's root, ``env`` added to the workers'
    environment, through tests/warm_horovodrun.py (Horovod's launcher without its 6 s check
    of the build at every launch); standard error in the output."""
    global _warm_server
    if _warm_server is None or _warm_server.poll() is not None:
        _warm_server = subprocess.Popen([sys.executable, str(Path(__file__).parent / "warm_horovodrun.py")],
                                        cwd=ROOT, env=worker_env(), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=_warm_server_errors, text=True)
        atexit.register(_warm_server.stdin.close)  # its end
    with tempfile.NamedTemporaryFile("r", prefix="horovodrun-", suffix=".out") as output:
        request = dict(argv=list(args), env=worker_env(**env), cwd=str(ROOT), output=output.name,
                       timeout_s=timeout_s)
        _warm_server.stdin.write(json.dumps(request) + "\n")
        _warm_server.stdin.flush()
        reply = _warm_server.stdout.readline()
        if not reply:
            _warm_server_errors.seek(0)
            raise RuntimeError(f"tests/warm_horovodrun.py ended (exit {_warm_server.wait()}):\n"
                               f"{_warm_server_errors.read()[-6000:]}")
        reply, out = json.loads(reply), output.read()
    cmd = ["horovodrun", *args]
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(cmd, timeout_s, out)
    return subprocess.CompletedProcess(cmd, reply["status"], out)


DEVICES = ("cpu", "cuda")


@pytest.fixture(params=DEVICES)
def device(request):
    """Where a test's tensors live: every test that takes it runs on the CPU, and on CUDA
    where a GPU is present (skipped otherwise). Tests create their inputs on the CPU from a
    seeded generator and move them, so both devices see the same values."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(request.param)


def randn(*shape, device, generator=None):
    """``torch.randn`` drawn on the CPU (the same values on every device), then moved to
    ``device``."""
    return torch.randn(*shape, generator=generator, device="cpu").to(device)


class WaitingOps(TorchOps):
    """TorchOps choosing as on a GPU (sizes read back are taken to cost a wait), on CPU
    tensors: the fixed-size selection, no candidate bounds kept, checks deferred if asked."""

    def sizes_cost_a_wait(self, x):
        return True


@pytest.fixture(params=["own-choice", "as-on-a-gpu"])
def choices(request, monkeypatch):
    """TorchOps' own choices, and the ones it makes on a GPU (where reading a size back waits
    for the device: fixed-size selection and decoding) taken on whatever device a test runs."""
    if request.param == "as-on-a-gpu":
        monkeypatch.setattr(TorchOps, "sizes_cost_a_wait", lambda self, x: True)
    return request.param


def exchange(engine, grad: torch.Tensor) -> torch.Tensor:
    """The update a one-worker PyTorch engine decodes from its own message(s) for ``grad`` (a
    copy: the engine may write the update over the gradient it is given)."""
    grad = grad.clone()
    if engine.method.family == "sparse":
        message = engine.compress("w", grad, None)
        return engine.decompress(message.message, [message])[0]
    first, handover = engine.first("w", grad, None)
    return engine.finish(engine.second("w", first, handover), handover, grad.shape)


# Two names of this machine that Horovod takes for two hosts (both are local, so no SSH).
TWO_HOSTS = ("localhost", "127.0.0.1")


# Where the Triton kernel tests run: CPU tensors under Triton's interpreter, else CUDA ones.
TRITON_DEVICE = "cpu" if triton_memory.INTERPRETED else "cuda"
runs_on_the_triton_device = pytest.mark.skipif(TRITON_DEVICE == "cuda" and not torch.cuda.is_available(),
                                               reason="no CUDA device (the interpreted run covers the CPU)")


def check_under_the_triton_interpreter(test_file: str) -> None:
    """Run ``test_file``'s tests again in a process where Triton interprets kernels on the CPU
    (Triton reads the switch when it is imported, so it takes a process of its own), and
    require them to pass."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


def horovodrun(script: str, np: int, args: Sequence[str] = (), timeout_s: float = 300,
               hosts: Sequence[str] = ("localhost",), cli: bool = False) -> str:
    """Run tests/workers/<script> on ``np`` local ranks with Gloo, spread evenly over
    ``hosts`` (e.g. :data:`TWO_HOSTS`: Horovod sees two hosts); return the output. Through
    :func:`run_horovodrun`, or the ``horovodrun`` executable itself if ``cli``."""
    slots = ",".join(f"{host}:{np // len(hosts)}" for host in hosts)
    args = ["-np", str(np), "-H", slots, "--gloo", sys.executable, str(WORKERS / script), *args]
    if cli:
        return _run([str(BIN / "horovodrun"), *args], timeout_s)
    return _succeeded(run_horovodrun(args, timeout_s))


def mpirun(script: str, np: int, args: Sequence[str] = (), timeout_s: float = 300) -> str:
    """Run tests/workers/<script> on ``np`` local ranks with OpenMPI's mpirun."""
    cmd = ["mpirun", "--oversubscribe", "-np", str(np), "-x", "PYTHONPATH", "-x",
           "TF_CPP_MIN_LOG_LEVEL", sys.executable, str(WORKERS / script), *args]
    return _run(cmd, timeout_s)


def torchrun(script: str, nproc: int, args: Sequence[str] = (), timeout_s: float = 300,
             **env: str) -> str:
    """Run tests/workers/<script> (or the script at an absolute path) on ``nproc`` local ranks
    with ``torchrun --standalone`` (a free rendezvous port on this host), ``env`` added to
    the workers' environment; return the output."""
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nproc),
           str(WORKERS / script), *args]
    return _run(cmd, timeout_s, **env)


def traffic_figures(out: str) -> dict:
    """The figures a traffic worker's rank 0 printed after ``TRAFFIC ``."""
    return json.loads(out.split("TRAFFIC ", 1)[1].splitlines()[0])


def check_dgc_hands_300x_fewer_bytes(figures: dict, label: str) -> None:
    """DGC hands Horovod at least 300x fewer bytes per step than dense on a model of over 1M
    parameters, and its ``stats()`` counts the same bytes as the wrapped collectives."""
    dense, dgc = figures["dense"], figures["dgc"]
    assert dense["params"] >= 1_000_000
    ratio = dense["bytes_per_step"] / dgc["bytes_per_step"]
    print(f"{label}: dense {dense['bytes_per_step']:.0f} B/step, dgc "
          f"{dgc['bytes_per_step']:.0f} B/step, {ratio:.0f}x fewer")
    assert ratio >= 300, figures
    assert dgc["stats_bytes_per_step"] == pytest.approx(dgc["bytes_per_step"]), "stats() disagrees"


def check_one_worker_job(framework: str, np: int) -> None:
    """tests/workers/one_worker_<framework>.py on ``np`` workers: on one, Horovod's own paths
    skip the compressor (DGC refused, the others warned of and equal to plain SGD); on two,
    neither happens."""
    out = horovodrun(f"one_worker_{framework}.py", np)
    assert out.count("one worker ok" if np == 1 else "two workers ok") == np, out


# -- two-stage exchanges between engines emulated in this process -----------------------------
def two_stages(engines, firsts, second, finish):
    """The two collectives of a two-stage method between ``engines``, in this process:
    each rank's ``finish(rank, received, handover)`` after stage 1's ``firsts`` (message,
    handover) per rank and ``second(rank, received, handover)``."""
    ops, method = engines[0].ops, engines[0].method
    root = method.root(firsts[0][1].call)
    received = emulate(ops, method.FIRST, [m for m, _ in firsts], root, firsts[0][1].chunks)
    seconds = [second(r, got, h) for r, (got, (_, h)) in enumerate(zip(received, firsts))]
    received = emulate(ops, method.SECOND, seconds, root)
    return [finish(r, got, h) for r, (got, (_, h)) in enumerate(zip(received, firsts))]


def two_stage_bucket(engines, names, grads, params):
    """Every rank's averages of a two-stage method, its tensors as one bucket."""
    buckets = [e.bucket("layer", list(zip(names, gs))) for e, gs in zip(engines, grads)]
    firsts = [e.first_bucket(b, [g.clone() for g in gs], params) for e, b, gs in zip(engines, buckets, grads)]
    return two_stages(engines, firsts, lambda r, got, h: engines[r].second(buckets[r].key, got, h),
                       lambda r, got, h: [t.clone() for t in engines[r].finish_bucket(
                           got, h, buckets[r], [g.shape for g in grads[r]])])


class OneRankTransport:
    """The collectives of a world of one rank, for a compressor's ``use_transport`` in this
    process without Horovod: each delivers its own message."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def launch(self, kind, message, name, root=0, chunks=None):
        return message.clone()

    def wait(self, handle):
        return handle
