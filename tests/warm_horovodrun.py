"""``horovodrun`` for the tests, launched from a process that has already asked Horovod
whether Gloo is built.

Horovod's launcher asks afresh at every launch, by importing its first framework extension,
TensorFlow, in a child process: 6 to 7 s of a 2-core machine before any worker starts, paid
by each of the 70-odd launches of ``make test``. This server asks once
(``horovod.common.util.gloo_built`` keeps the answer) and runs each launch in a fork of
itself: Horovod's own ``run_commandline`` on the test's arguments, nothing of it changed.

Protocol, one JSON object per line: a request ``{"argv", "env", "cwd", "output", "timeout_s"}``
on standard input; the reply ``{"status", "timed_out"}`` on standard output once the launch
has ended (killed after ``timeout_s``), its output (standard output and error) in the file
``output``.
"""
import atexit
import json
import os
import select
import signal
import sys
import time

from horovod.common.util import gloo_built
from horovod.runner.launch import run_commandline

POLL_S = 0.05


def _launch(request: dict) -> None:
    """In the fork: become ``horovodrun`` with the request's arguments, then exit."""
    status = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        sys.argv = ["horovodrun", *request["argv"]]
        run_commandline()
        status = 0
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # what horovodrun itself would print before exiting 1
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        atexit._run_exitfuncs()  # multiprocessing's clean-up, as at horovodrun's own exit
        os._exit(status)


def _wait(pid: int, timeout_s: float) -> dict:
    """The launch's end; killed (as ``subprocess.run`` kills on a timeout) after ``timeout_s``,
    or at once if the tests end first (standard input closed: the client sends nothing else
    while a launch runs)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"status": os.waitstatus_to_exitcode(status), "timed_out": False}
        if select.select([sys.stdin], [], [], POLL_S)[0]:
            os.kill(pid, signal.SIGKILL)
            sys.exit(0)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return {"status": os.waitstatus_to_exitcode(status), "timed_out": True}


def main() -> None:
    gloo_built(verbose=False)  # the key horovodrun asks with
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _launch(request)
        print(json.dumps(_wait(pid, request["timeout_s"])), flush=True)


if __name__ == "__main__":
    main()
