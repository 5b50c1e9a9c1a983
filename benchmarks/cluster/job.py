"""Run one job on a :class:`~.netns.NetnsCluster`: the rendezvous server in the bridge's
namespace, ``workers_per_host`` workers on every host, all through ``python -m
horovod_dgc.cluster`` (the entrypoint a Docker Compose cluster runs too), supervised until
every worker has finished.

The first worker that fails ends the job: the others and the rendezvous server are stopped and
:class:`~.netns.ClusterError` names the failed rank, how it ended and the end of its log.
A job that outlives ``timeout_s`` ends the same way.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from benchmarks import ROOT, worker_env

from .netns import HOST_IFACE, ClusterError, NetnsCluster

POLL_INTERVAL_S = 0.2
STOP_GRACE_S = 3.0
LOG_TAIL_LINES = 15


@dataclass
class _Process:
    """A process of the job, its log and how it ended."""

    label: str
    popen: subprocess.Popen
    log_path: Path
    ended_at: Optional[float] = None


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:]) or "(empty log)"


def _copy_lines(source: IO[str], log: IO[str], echo: IO[str]) -> None:
    with log:
        for line in source:
            log.write(line)
            log.flush()
            echo.write(line)
            echo.flush()


class ClusterJob:
    """One command on every host of ``cluster``; call :meth:`run` once.

    Args:
        cluster: the namespaces to run in (entered).
        command: the worker command, e.g. ``[sys.executable, "benchmarks/cluster/step.py"]``.
        log_dir: where ``rendezvous.log`` and ``rank<r>.log`` go.
        timeout_s: wall-clock limit of the whole job.
        echo_rank0: also copy rank 0's output to this process's stdout (or to ``echo_to``).
        env: extra environment variables for the workers (e.g. ``HOROVOD_CYCLE_TIME``).
        workers_per_host: ranks ``h * workers_per_host`` onwards run on host ``h``.
        echo_to: where ``echo_rank0`` copies rank 0's lines (anything with ``write`` and
            ``flush``; default: this process's stdout).
        watch: called at every poll while the workers run (a fault injector reading their
            logs); an exception it raises stops every process and propagates.

    After :meth:`run`, ``failed_at`` is when the first failed worker was seen to end and
    ``ended_at`` when every process of the job was stopped (``time.monotonic()``; None
    before).
    """

    def __init__(self, cluster: NetnsCluster, command: Sequence[str], log_dir: Path,
                 timeout_s: float, echo_rank0: bool = True,
                 env: Optional[Mapping[str, str]] = None, workers_per_host: int = 1,
                 echo_to: Optional[IO[str]] = None, watch: Optional[Callable[[], None]] = None):
        if not command:
            raise ValueError("no worker command")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if workers_per_host < 1:
            raise ValueError(f"workers_per_host must be >= 1, got {workers_per_host}")
        self.workers_per_host = workers_per_host
        self.cluster, self.command, self.log_dir = cluster, list(command), Path(log_dir)
        self.timeout_s, self.echo_rank0, self.echo_to = timeout_s, echo_rank0, echo_to
        self.worker_env = dict(env or {})
        self.watch = watch
        self.failed_at: Optional[float] = None
        self.ended_at: Optional[float] = None
        self._processes: List[_Process] = []
        self._threads: List[threading.Thread] = []

    def _env(self, extra: Dict[str, str]) -> Dict[str, str]:
        return worker_env(HOROVOD_DGC_SIZE=str(self.cluster.hosts * self.workers_per_host),
                          HOROVOD_DGC_LOCAL_SIZE=str(self.workers_per_host),
                          HOROVOD_DGC_RENDEZVOUS_ADDR=self.cluster.rendezvous_addr, **extra)

    def _start(self, label: str, ns: str, mode_args: List[str], env: Dict[str, str],
               echo: bool) -> _Process:
        log_path = self.log_dir / f"{label}.log"
        args = self.cluster.exec_args(ns, [sys.executable, "-m", "horovod_dgc.cluster", *mode_args])
        if echo:
            popen = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
            log = open(log_path, "w")
            thread = threading.Thread(target=_copy_lines,
                                      args=(popen.stdout, log, self.echo_to or sys.stdout),
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        else:
            with open(log_path, "w") as log:
                popen = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        process = _Process(label, popen, log_path)
        self._processes.append(process)
        return process

    def run(self) -> None:
        """Start everything, wait for every worker to exit 0; raise ClusterError otherwise.
        Every process of the job is stopped on the way out, whatever happens."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            rendezvous = self._start("rendezvous", self.cluster.bridge_ns, ["rendezvous"],
                                     self._env({}), echo=False)
            workers = [self._start(f"rank{rank}", ns, ["worker", "--", *self.command],
                                   self._env({**self.worker_env, "HOROVOD_DGC_RANK": str(rank),
                                              "HOROVOD_DGC_IFACE": HOST_IFACE}),
                                   echo=self.echo_rank0 and rank == 0)
                       for rank, ns in self._placement()]
            self._supervise(rendezvous, workers)
        finally:
            self._stop_all()
            self.ended_at = time.monotonic()

    def _placement(self) -> List[Tuple[int, str]]:
        """(rank, namespace) of every worker."""
        per_host = self.workers_per_host
        return [(host * per_host + local, ns) for host, ns in enumerate(self.cluster.host_ns)
                for local in range(per_host)]

    def _supervise(self, rendezvous: _Process, workers: List[_Process]) -> None:
        started = time.monotonic()
        while True:
            now = time.monotonic()
            for process in workers:
                if process.ended_at is None and process.popen.poll() is not None:
                    process.ended_at = now
            failed = [p for p in workers if p.ended_at is not None and p.popen.returncode != 0]
            if failed:
                self.failed_at = now
                raise ClusterError(self._failure_message(failed, now - started))
            if all(p.ended_at is not None for p in workers):
                return
            if rendezvous.popen.poll() is not None:
                raise ClusterError(f"the rendezvous server {_describe_exit(rendezvous.popen.returncode)}"
                                   f"; its log {rendezvous.log_path}:\n{_tail(rendezvous.log_path)}")
            if now - started > self.timeout_s:
                running = [p.label for p in workers if p.ended_at is None]
                raise ClusterError(f"the job ran past its {self.timeout_s:g} s limit "
                                   f"({', '.join(running)} still running); stopped every worker. "
                                   f"Logs: {self.log_dir}")
            if self.watch is not None:
                self.watch()
            time.sleep(POLL_INTERVAL_S)

    @staticmethod
    def _failure_message(failed: List[_Process], elapsed_s: float) -> str:
        first = min(failed, key=lambda p: (p.ended_at, p.popen.returncode >= 0))
        others = [p for p in failed if p is not first]
        message = (f"worker {first.label} {_describe_exit(first.popen.returncode)} after "
                   f"{elapsed_s:.0f} s; stopped the other workers.")
        if others:
            message += " Also ended: " + ", ".join(
                f"{p.label} ({_describe_exit(p.popen.returncode)})" for p in others) + "."
        return message + f"\nLast lines of {first.log_path}:\n{_tail(first.log_path)}"

    def _stop_all(self) -> None:
        """SIGTERM every process group still running, SIGKILL after a grace period."""
        alive = [p for p in self._processes if p.popen.poll() is None]
        for process in alive:
            _signal_group(process.popen, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for process in alive:
            try:
                process.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(process.popen, signal.SIGKILL)
                process.popen.wait()
        for thread in self._threads:
            thread.join(timeout=STOP_GRACE_S)


def _signal_group(popen: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(popen.pid, signum)
    except ProcessLookupError:
        pass
