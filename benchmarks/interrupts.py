"""Ctrl-C and SIGTERM as KeyboardInterrupt, for the runners that must clean up what they built
(network namespaces, containers) however they are stopped."""
from __future__ import annotations

import signal


def interrupt_on_signals() -> None:
    """Raise KeyboardInterrupt on SIGINT and SIGTERM from now on.

    SIGINT too, explicitly: a process started in the background by a non-interactive shell
    (``nohup make ... &``, some CI runners) inherits SIGINT ignored, and Python then installs no
    KeyboardInterrupt for it, so an interrupt would leave the run and all it built in place."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, interrupt)
