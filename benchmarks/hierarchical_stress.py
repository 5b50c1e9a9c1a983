"""``hierarchical=True``'s test jobs again and again, to catch a step that stalls
(docs/guide/many-hosts.md: workers that share cores).

Runs the test jobs of 2 hosts x 2 workers again and again, PyTorch's
(``tests/workers/hierarchy_torch.py``, both Horovod paths) and TensorFlow's
(``tests/workers/hierarchy_tensorflow.py``) alternating, each through the run lists of its
test in turn. Every output line is stamped with the time. Gloo's timeout is Horovod's
default, 30 s (``--gloo-timeout-s``): a step that stalls past it ends the run with "Timed out
waiting 30000ms", counted as a failure, as it would end a user's job; a shorter stall shows in
the run's longest kind. A run still going after ``--dump-after-s`` (a wait that no timeout
ends) gets every worker's Python and native stacks (py-spy, when it is installed) written
beside its log, and is then stopped. One line per run, then a summary::

    python -m benchmarks.hierarchical_stress [--runs 20] [--frameworks torch,tensorflow]
        [--no-bytecode] [--out DIR]

``--no-bytecode`` compiles every module from source in every worker (an empty
``PYTHONPYCACHEPREFIX``), as a machine without compiled packages does: the workers start
more slowly and unevenly.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Dict, List, Optional, Sequence, Tuple

from benchmarks import ROOT, worker_env

# The run lists of each job, taken in turn here; the hierarchical tests of
# tests/test_torch_multiprocess.py and tests/test_tensorflow_multiprocess.py run each once.
RUN_LISTS = ("topk/stock,scalecom/own,blocksign/stock,dgc-sar/own,blocksign-bf16/own",
             "topk/own,scalecom/stock,blocksign/own,dgc-sar/stock,blocksign-bf16/stock")
TF_KIND_LISTS = ("topk,scalecom", "dgc-sar,blocksign-bf16")


@dataclass(frozen=True)
class Job:
    """One framework's hierarchical test job: its worker script, the flag that takes a run
    list, and its run lists."""

    worker: Path
    list_flag: str
    run_lists: Tuple[str, ...]


JOBS: Dict[str, Job] = {
    "torch": Job(ROOT / "tests" / "workers" / "hierarchy_torch.py", "--runs", RUN_LISTS),
    "tensorflow": Job(ROOT / "tests" / "workers" / "hierarchy_tensorflow.py", "--kinds", TF_KIND_LISTS),
}
WORKERS = 4
OK_LINE = re.compile(r"^(\d+:\d+:[\d.]+) \[\d+\]<stdout>:rank \d+/\d+ (.+) hierarchical ok")
TIMEOUT_LINE = re.compile(r"^\S+ \[(\d+)\]<stderr>:.*Timed out waiting \d+ms for (send|recv) operation")


@dataclass(frozen=True)
class RunResult:
    """What one run's stamped log shows."""

    oks: int  # "hierarchical ok" lines (4 workers x 4 kinds when all passed)
    expected_oks: int
    timeouts: List[str]  # "rank R: send|recv", one per Gloo timeout reported
    last_ok: Optional[str]  # the last "... hierarchical ok" line
    # The longest time from a kind's last ok line to the next kind's first (its build, its
    # references and its steps; a stalled step shows here below Gloo's timeout)
    longest_kind_s: Optional[float] = None

    @property
    def passed(self) -> bool:
        return self.oks == self.expected_oks and not self.timeouts


def classify(log: str, run_list: str) -> RunResult:
    """The outcome of one run from its stamped log (``run_list``: the kinds it ran)."""
    lines = log.splitlines()
    oks = [line for line in lines if "hierarchical ok" in line]
    timeouts = [f"rank {m.group(1)}: {m.group(2)}" for m in map(TIMEOUT_LINE.match, lines) if m]
    return RunResult(oks=len(oks), expected_oks=WORKERS * len(run_list.split(",")),
                     timeouts=timeouts, last_ok=oks[-1] if oks else None,
                     longest_kind_s=_longest_kind_s(oks))


def _longest_kind_s(oks: List[str]) -> Optional[float]:
    kinds: List[Tuple[str, List[float]]] = []  # (kind, its ok lines' times), in log order
    for line in oks:
        match = OK_LINE.match(line)
        if match is None:
            continue
        hours, minutes, seconds = match.group(1).split(":")
        time_s = int(hours) * 3600 + int(minutes) * 60 + float(seconds)
        if not kinds or kinds[-1][0] != match.group(2):
            kinds.append((match.group(2), []))
        kinds[-1][1].append(time_s)
    return max((min(times) - max(before) for (_, before), (_, times) in zip(kinds, kinds[1:])),
               default=None)


def _stamp(source: IO[str], sink: IO[str]) -> None:
    for line in source:
        sink.write(f"{datetime.datetime.now():%H:%M:%S.%f} {line}")
        sink.flush()


def _worker_pids() -> List[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(arg.endswith(job.worker.name.encode()) for job in JOBS.values() for arg in cmdline[1:2]):
                pids.append(int(entry.name))
    return pids


def _rank_of(pid: int) -> str:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return "?"
    return next((v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"HOROVOD_RANK=")), "?")


def dump_stacks(path: Path) -> None:
    """Every worker's stacks (py-spy --native) into ``path``; a line saying why not otherwise."""
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    with path.open("w") as out:
        if py_spy is None:
            out.write("py-spy is not installed (pip install py-spy): no stacks\n")
            return
        for pid in _worker_pids():
            out.write(f"=== pid {pid}, rank {_rank_of(pid)}\n")
            out.flush()
            subprocess.run([py_spy, "dump", "--native", "--pid", str(pid)], stdout=out,
                           stderr=subprocess.STDOUT, timeout=60)


def planned(index: int, frameworks: Sequence[str]) -> Tuple[str, Job, str]:
    """(framework, job, run list) of run ``index``: the frameworks' jobs alternating, each
    job's run lists in turn."""
    framework = frameworks[index % len(frameworks)]
    job = JOBS[framework]
    return framework, job, job.run_lists[index // len(frameworks) % len(job.run_lists)]


def run_once(index: int, frameworks: Sequence[str], out_dir: Path, env: dict, dump_after_s: float,
             gloo_timeout_s: int) -> Tuple[bool, Optional[float]]:
    """Run ``index`` of :func:`planned`; whether it passed (every ok, no timeout, ended on its
    own), and its longest kind after the first (s)."""
    framework, job, run_list = planned(index, frameworks)
    bin_dir = Path(sys.executable).parent
    cmd = [str(bin_dir / "horovodrun"), "-np", str(WORKERS), "-H", "localhost:2,127.0.0.1:2",
           "--gloo", "--gloo-timeout-seconds", str(gloo_timeout_s), sys.executable, str(job.worker),
           job.list_flag, run_list]
    log_path = out_dir / f"run{index:03d}.log"
    started = time.monotonic()
    with log_path.open("w") as log:
        job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
        stamper = threading.Thread(target=_stamp, args=(job.stdout, log), daemon=True)
        stamper.start()
        stacks = None
        try:
            job.wait(timeout=dump_after_s)
        except subprocess.TimeoutExpired:
            stacks = out_dir / f"run{index:03d}.stacks.txt"
            dump_stacks(stacks)
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        stamper.join(timeout=10)
    result = classify(log_path.read_text(), run_list)
    passed = result.passed and stacks is None
    print(f"run {index:3d} ({framework:10s}): {'passed' if passed else 'FAILED'} in {time.monotonic() - started:5.0f} s, "
          f"{result.oks} of {result.expected_oks} ok; longest kind after the first: "
          f"{'-' if result.longest_kind_s is None else f'{result.longest_kind_s:.1f} s'}; Gloo timeouts: "
          f"{', '.join(result.timeouts) or 'none'}; log {log_path}"
          + ("" if passed else f"; last ok line: {result.last_ok}")
          + ("" if stacks is None else f"; stopped after {dump_after_s:.0f} s, stacks in {stacks}"),
          flush=True)
    return passed, result.longest_kind_s


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--frameworks", type=lambda text: text.split(","), default=list(JOBS),
                   help="the jobs to alternate, comma-separated (default: torch,tensorflow)")
    p.add_argument("--dump-after-s", type=float, default=240.0,
                   help="dump the stacks of a run still going after this long, then stop it "
                        "(a passing run takes 15-60 s on 2 cores, the longer ones with --no-bytecode)")
    p.add_argument("--gloo-timeout-s", type=int, default=30,
                   help="Horovod's Gloo timeout (its default: 30 s); a larger one lets a stalled "
                        "step finish late and pass")
    p.add_argument("--no-bytecode", action="store_true",
                   help="compile every module from source in every worker")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "hierarchical-stress")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env = worker_env()
    if args.no_bytecode:
        env.update(PYTHONPYCACHEPREFIX=tempfile.mkdtemp(prefix="no-bytecode-"),
                   PYTHONDONTWRITEBYTECODE="1")
    unknown = set(args.frameworks) - set(JOBS)
    if unknown:
        print(f"hierarchical_stress: unknown framework(s) {sorted(unknown)}; choose from {list(JOBS)}",
              file=sys.stderr)
        return 2
    results = [run_once(i, args.frameworks, args.out, env, args.dump_after_s, args.gloo_timeout_s)
               for i in range(args.runs)]
    failed = [i for i, (passed, _) in enumerate(results) if not passed]
    longest_s = max((s for _, s in results if s is not None), default=None)
    print(f"\n{len(results) - len(failed)} of {len(results)} runs passed"
          + ("" if longest_s is None else f"; the longest kind after a run's first took {longest_s:.1f} s")
          + (f"; failed: {', '.join(map(str, failed))} (logs and stacks in {args.out})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
