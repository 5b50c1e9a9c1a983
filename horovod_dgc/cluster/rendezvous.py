"""Horovod's Gloo rendezvous server on a fixed address and port."""
from __future__ import annotations

import signal
import sys
from typing import List

from horovod.runner.common.util.hosts import SlotInfo
from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

from .settings import RendezvousSettings, host_label


def slot_plan(size: int, local_size: int = 1) -> List[SlotInfo]:
    """``local_size`` slots per host: rank r runs on ``host_label(r // local_size)``."""
    return [SlotInfo(hostname=host_label(rank // local_size), rank=rank,
                     local_rank=rank % local_size, cross_rank=rank // local_size, size=size,
                     local_size=local_size, cross_size=size // local_size)
            for rank in range(size)]


def _stop_on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt


def serve(settings: RendezvousSettings) -> None:
    """Serve the rendezvous until SIGINT or SIGTERM."""
    try:
        server = RendezvousHTTPServer((settings.listen_addr, settings.port), RendezvousHandler,
                                      verbose=0)
    except OSError as error:
        raise SystemExit(f"rendezvous: cannot listen on {settings.listen_addr}:{settings.port}: "
                         f"{error.strerror}") from None
    server.init(slot_plan(settings.size, settings.local_size))
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    print(f"rendezvous: serving {settings.size} workers on {settings.listen_addr}:{settings.port}",
          file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
