"""``python -m horovod_dgc.cluster {rendezvous | worker -- COMMAND ...}``; settings come from
the environment variables listed in :mod:`horovod_dgc.cluster`."""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from .settings import RendezvousSettings, WorkerSettings


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m horovod_dgc.cluster",
        description="One Horovod worker per host, configured by HOROVOD_DGC_* environment "
                    "variables (see the module's docstring).")
    modes = parser.add_subparsers(dest="mode", required=True)
    modes.add_parser("rendezvous", help="serve the Gloo rendezvous until stopped")
    worker = modes.add_parser("worker", help="run COMMAND as this host's Horovod worker")
    worker.add_argument("command", nargs=argparse.REMAINDER,
                        help="the training command, after '--'")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    try:
        if args.mode == "rendezvous":
            from .rendezvous import serve

            serve(RendezvousSettings.from_env(os.environ))
            return
        from .worker import exec_worker

        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        exec_worker(WorkerSettings.from_env(os.environ), command, os.environ)
    except (ValueError, TimeoutError, OSError) as error:
        sys.exit(f"horovod_dgc.cluster {args.mode}: {error}")


if __name__ == "__main__":
    main()
