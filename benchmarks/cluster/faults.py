"""``make cluster-faults``: faults injected into dgc training on a network-namespace cluster,
and what every rank does about them.

    python -m benchmarks.cluster.faults [--hosts 4] [--faults stall:1@4,split:2@4,slow:3]
        [--steps 12] [--checkpoint-every 3] [--gloo-timeout-s 30] [--slow-link 10mbit+200ms]
        [--model tiny] [--out results/faults] [--check]

Each fault gets a cluster of its own and a run of ``benchmarks/cluster/fault_train.py``
(dgc, fused optimizer, a checkpoint every ``--checkpoint-every`` steps):

* ``stall:RANK@STEP``: once RANK has printed ``step STEP done``, every process on its host
  is stopped (SIGSTOP: a stuck data loader, a swapping host);
* ``split:HOST@STEP``: once HOST's worker has printed ``step STEP done``, its link goes down
  (cut off from every other host, still running);
* ``slow:HOST``: HOST's link alone is shaped as ``--slow-link`` for the whole run (a delay
  needs the kernel's netem qdisc; without it give a rate only, e.g. ``--slow-link 10mbit``);
* ``none``: no fault, the reference for step times.

Every step lasts at least ``--min-step-s`` (the worker sleeps the rest), so that a fault
injected on a step's line lands in the next step; the step times reported leave that sleep out.

A stall or a split must end the job (every rank stopped, the first failed rank's error
naming a collective of horovod_dgc) within ``--deadline-s``; then the fault is undone and a
second run on the same checkpoint directory must resume from the last complete checkpoint
and finish with the same parameters on every rank. A slow link or no fault must finish with
the same parameters on every rank. Every checkpoint left behind must load.

Writes ``results.jsonl``, ``results.md`` and ``logs/<fault>/{run,resume}/`` under ``--out``;
``--check`` exits 1 when a fault's outcome is not the expected one. Needs root.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, List, Optional

import torch

from .fault_train import MODEL_FILE, last_complete
from .job import ROOT, ClusterJob
from .netns import ClusterError, NetnsCluster, parse_link
from .run import in_namespaces

TRAIN = ROOT / "benchmarks" / "cluster" / "fault_train.py"
KINDS = ("none", "stall", "split", "slow")
DEFAULT_FAULTS = "none,stall:1@4,split:2@4,slow:3"
DEFAULT_DEADLINE_S = 60.0
DEFAULT_TIMEOUT_S = 600.0
# Several times the injector's poll (0.2 s) and the tiny model's step (0.03 s).
DEFAULT_MIN_STEP_S = 1.0
# The table shows an error up to here; results.jsonl holds it whole.
ERROR_SHOWN = ", since Horovod shut down"
STEP_LINE = re.compile(r"^step (\d+) done in ([0-9.]+) s$", re.M)
DIGEST_LINE = re.compile(r"^parameters sha256 ([0-9a-f]{64})$", re.M)
RESUMED_LINE = re.compile(r"^resumed from step (\d+)$", re.M)


@dataclass(frozen=True)
class Fault:
    """What to do to the cluster: ``kind`` (one of KINDS) to host or rank ``target`` once
    it has finished step ``step`` (0 for a fault present from the start)."""

    kind: str
    target: int = 0
    step: int = 0

    @property
    def name(self) -> str:
        if self.kind == "none":
            return "none"
        return f"{self.kind}:{self.target}" + (f"@{self.step}" if self.step else "")

    @property
    def ends_the_job(self) -> bool:
        return self.kind in ("stall", "split")


def parse_fault(text: str) -> Fault:
    """``none``, ``stall:RANK@STEP``, ``split:HOST@STEP`` or ``slow:HOST``."""
    kind, _, rest = text.partition(":")
    target, _, step = rest.partition("@")
    timed = kind in ("stall", "split")
    if not (text == "none" or (timed and target.isdigit() and step.isdigit())
            or (kind == "slow" and target.isdigit() and not step)):
        raise ValueError(f"fault {text!r}: expected none, stall:RANK@STEP, split:HOST@STEP or slow:HOST")
    return Fault(kind, int(target or 0), int(step or 0))


@dataclass(frozen=True)
class Outcome:
    """What one fault did (times in seconds from the fault's injection)."""

    fault: str
    hosts: int
    gloo_timeout_s: float
    injected_after_step: Optional[int]
    error_after_s: Optional[float]  # the first failed rank seen to end
    ended_after_s: Optional[float]  # every process of the job stopped
    error: Optional[str]  # the first line of the first failed rank's error
    error_names_a_collective: bool
    last_complete_checkpoint: Optional[int]
    checkpoints_load: bool
    resumed_from: Optional[int]
    parameters_identical: bool
    median_step_s: Optional[float]
    expected: bool


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--faults", default=DEFAULT_FAULTS, help="comma-separated, each run in turn")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--checkpoint-every", type=int, default=3)
    p.add_argument("--model", choices=("tiny", "resnet50"), default="tiny")
    p.add_argument("--min-step-s", type=float, default=DEFAULT_MIN_STEP_S,
                   help="each step lasts at least this long, so that a fault lands in the step "
                        "after its line")
    p.add_argument("--gloo-timeout-s", type=float, default=30.0,
                   help="HOROVOD_GLOO_TIMEOUT_SECONDS of the workers (Horovod's default: 30)")
    p.add_argument("--slow-link", type=parse_link, default=parse_link("10mbit+200ms"),
                   help="the shape of a slow:HOST link (a delay needs netem)")
    p.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S,
                   help="a stall or a split must end the job within this, from the fault")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="limit of each run")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "faults")
    p.add_argument("--prefix", default=f"hdgcf{os.getpid()}",
                   help="start of the namespace names (unique per run)")
    p.add_argument("--check", action="store_true", help="exit 1 when a fault's outcome is not the expected one")
    args = p.parse_args(argv)
    try:
        args.faults = [parse_fault(t.strip()) for t in args.faults.split(",") if t.strip()]
    except ValueError as error:
        p.error(str(error))
    if not args.faults:
        p.error("--faults names no fault")
    if args.hosts < 2:
        p.error("--hosts must be >= 2")
    for fault in args.faults:
        if fault.target >= args.hosts:
            p.error(f"fault {fault.name}: there are only {args.hosts} hosts (0..{args.hosts - 1})")
        if fault.ends_the_job and not 1 <= fault.step < args.steps:
            p.error(f"fault {fault.name}: the step must be in 1..{args.steps - 1}")
    return args


class Injector:
    """A :class:`ClusterJob` watch: applies ``fault`` once its target's log shows the step."""

    def __init__(self, cluster: NetnsCluster, fault: Fault, logs: Path):
        self.cluster, self.fault = cluster, fault
        self.log = logs / f"rank{fault.target}.log"
        self.injected_at: Optional[float] = None

    def __call__(self) -> None:
        if self.injected_at is not None or not self.fault.ends_the_job:
            return
        steps = [int(s) for s, _ in STEP_LINE.findall(read_log(self.log))]
        if self.fault.step not in steps:
            return
        if self.fault.kind == "stall":
            for pid in _pids(self.cluster.host_ns[self.fault.target]):
                os.kill(pid, signal.SIGSTOP)
        else:
            self.cluster.set_link_up(self.fault.target, False)
        self.injected_at = time.monotonic()

    def undo(self) -> None:
        if self.fault.kind == "split":
            self.cluster.set_link_up(self.fault.target, True)


def _pids(ns: str) -> List[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def read_log(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def parameters_identical(logs: Path, hosts: int) -> bool:
    """Whether every rank's log under ``logs`` ends with the same parameters' digest."""
    digests = {m[1] if (m := DIGEST_LINE.search(read_log(logs / f"rank{r}.log"))) else None
               for r in range(hosts)}
    return None not in digests and len(digests) == 1


def first_error_line(message: str) -> Optional[str]:
    """The first line of a Python error among the last lines a failed rank printed."""
    lines = [line.split("<stderr>:")[-1].strip() for line in message.splitlines()]
    return next((line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)), None)


def _checkpoints_load(folder: Path) -> bool:
    """Whether every complete checkpoint's files load (and no partial file is left in one)."""
    for directory in sorted(folder.glob("step-*")):
        if (directory / MODEL_FILE).is_file():
            if any(directory.glob("*.partial")):
                return False
            for path in directory.glob("*.pt"):
                torch.load(path)
    return True


class FaultRun:
    """One fault on a cluster of its own: the faulty run and, after a stall or split, the
    resume."""

    def __init__(self, args: argparse.Namespace, fault: Fault):
        self.args, self.fault = args, fault
        self.logs = args.out / "logs" / fault.name.replace(":", "-").replace("@", "-at-")
        self.checkpoints = args.out / "checkpoints" / self.logs.name

    def command(self) -> List[str]:
        a = self.args
        return [sys.executable, str(TRAIN), "--checkpoint-dir", str(self.checkpoints), "--steps", str(a.steps),
                "--checkpoint-every", str(a.checkpoint_every), "--model", a.model,
                "--min-step-s", f"{a.min_step_s:g}"]

    def job(self, cluster: NetnsCluster, logs: Path, watch: Optional[Callable[[], None]] = None) -> ClusterJob:
        return ClusterJob(cluster, self.command(), logs, self.args.timeout_s, echo_rank0=False,
                          env={"HOROVOD_GLOO_TIMEOUT_SECONDS": f"{self.args.gloo_timeout_s:g}"}, watch=watch)

    def run(self) -> Outcome:
        a, fault = self.args, self.fault
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        prefix = f"{a.prefix}{KINDS.index(fault.kind)}t{fault.target}"
        with NetnsCluster(a.hosts, prefix) as cluster:
            if fault.kind == "slow":
                cluster.shape(a.slow_link, hosts=[fault.target])
            injector = Injector(cluster, fault, self.logs / "run")
            job = self.job(cluster, self.logs / "run", injector)
            error = None
            try:
                job.run()
            except ClusterError as failure:
                error = str(failure)
            injector.undo()
            last = last_complete(self.checkpoints)
            loads = _checkpoints_load(self.checkpoints)
            resumed, final_logs = None, self.logs / "run"
            if fault.ends_the_job and error is not None:
                final_logs = self.logs / "resume"
                try:
                    self.job(cluster, final_logs).run()
                    resumed = _resumed_from(final_logs, a.hosts)
                except ClusterError as failure:
                    print(f"cluster-faults: {fault.name}: the resumed run failed: {failure}", file=sys.stderr)
        return self._outcome(injector, job, error, last, loads, resumed, final_logs)

    def _outcome(self, injector: Injector, job: ClusterJob, error: Optional[str], last: Optional[int],
                 loads: bool, resumed: Optional[int], final_logs: Path) -> Outcome:
        a, fault = self.args, self.fault
        at = injector.injected_at
        identical = parameters_identical(final_logs, a.hosts)
        steps = [float(s) for _, s in STEP_LINE.findall(read_log(self.logs / "run" / "rank0.log"))]
        line = first_error_line(error) if error else None
        names = bool(line) and "horovod_dgc." in line
        error_after = job.failed_at - at if at is not None and job.failed_at is not None else None
        ended_after = job.ended_at - at if at is not None and error is not None else None
        if fault.ends_the_job:
            expected = (error is not None and at is not None and names and ended_after <= a.deadline_s
                        and loads and resumed == last and identical)
        else:
            expected = error is None and loads and identical
        return Outcome(fault=fault.name, hosts=a.hosts, gloo_timeout_s=a.gloo_timeout_s,
                       injected_after_step=fault.step if at is not None else None,
                       error_after_s=error_after, ended_after_s=ended_after,
                       error=line or (error.splitlines()[0] if error else None),
                       error_names_a_collective=names, last_complete_checkpoint=last,
                       checkpoints_load=loads, resumed_from=resumed, parameters_identical=identical,
                       median_step_s=statistics.median(steps) if steps else None, expected=bool(expected))


def _resumed_from(logs: Path, hosts: int) -> Optional[int]:
    """The step every rank of a run says it resumed from (None unless they all agree)."""
    found = {m[1] if (m := RESUMED_LINE.search(read_log(logs / f"rank{r}.log"))) else None for r in range(hosts)}
    return int(found.pop()) if len(found) == 1 and None not in found else None


def markdown(outcomes: List[Outcome], args: argparse.Namespace) -> str:
    def seconds(value: Optional[float], digits: int = 1) -> str:
        return "" if value is None else f"{value:.{digits}f}"

    def shown(error: Optional[str]) -> str:
        return "none" if error is None else f"`{error.split(ERROR_SHOWN)[0]}`"

    rows = [f"| {o.fault} | {'' if o.injected_after_step is None else o.injected_after_step} | "
            f"{seconds(o.error_after_s)} | {seconds(o.ended_after_s)} | {shown(o.error)} | "
            f"{'' if o.last_complete_checkpoint is None else o.last_complete_checkpoint} | "
            f"{'' if o.resumed_from is None else o.resumed_from} | "
            f"{'yes' if o.parameters_identical else 'NO'} | {seconds(o.median_step_s, 3)} | "
            f"{'yes' if o.expected else 'NO'} |" for o in outcomes]
    return "\n".join([
        f"# Faults on the cluster\n\n{args.hosts} hosts (network namespaces), one worker each; dgc "
        f"on the fused optimizer, model {args.model}, {args.steps} steps, a checkpoint every "
        f"{args.checkpoint_every}; Gloo timeout {args.gloo_timeout_s:g} s; slow link "
        f"{args.slow_link.name}.\n",
        "| fault | after step | first error (s) | every rank ended (s) | error | last complete "
        "checkpoint | resumed from | parameters identical | median step (s) | as expected |",
        "|---|---|---|---|---|---|---|---|---|---|", *rows, ""])


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    outcomes: List[Outcome] = []

    def work() -> None:
        args.out.mkdir(parents=True, exist_ok=True)
        for fault in args.faults:
            outcome = FaultRun(args, fault).run()
            outcomes.append(outcome)
            print(json.dumps(asdict(outcome)), flush=True)

    failed, left = in_namespaces("cluster-faults", work)
    if failed is not None:
        return failed
    (args.out / "results.jsonl").write_text("".join(json.dumps(asdict(o)) + "\n" for o in outcomes))
    report = markdown(outcomes, args)
    (args.out / "results.md").write_text(report)
    print("\n" + report)
    if left or (args.check and not all(o.expected for o in outcomes)):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
