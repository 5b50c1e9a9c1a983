"""Start this host's worker: check the network set-up, wait for the rendezvous server, then
become the command."""
from __future__ import annotations

import os
import socket
import time
from typing import List, Mapping, Optional, Sequence

import psutil

from .settings import WorkerSettings

RETRY_INTERVAL_S = 0.5


def interface_addresses(iface: str) -> List[str]:
    """The IP addresses of network interface ``iface``; ValueError if there is none."""
    interfaces = psutil.net_if_addrs()
    if iface not in interfaces:
        raise ValueError(f"no network interface {iface!r} (HOROVOD_DGC_IFACE) on this host; it "
                         f"has {sorted(interfaces)}")
    return [a.address.split("%")[0] for a in interfaces[iface]
            if a.family in (socket.AF_INET, socket.AF_INET6)]


def host_name_address() -> Optional[str]:
    """The address Gloo binds when it is given no interface: the first address the host's
    name resolves to that this host can bind (None if there is none)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except socket.gaierror:
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((sockaddr[0], 0, *sockaddr[2:]))
        except OSError:
            continue
        return sockaddr[0]
    return None


def check_host_name(settings: WorkerSettings) -> None:
    """Raise ValueError unless the host name resolves to an address of the interface.

    Horovod 0.28.1 binds the Gloo contexts of its process sets (the global one included) to
    the address of the host name, whatever ``HOROVOD_GLOO_IFACE`` says; another host could
    not reach a worker whose name resolves to, say, 127.0.0.1.
    """
    addresses = interface_addresses(settings.iface)
    bound = host_name_address()
    if bound not in addresses:
        raise ValueError(
            f"worker rank {settings.rank}: the host name {socket.gethostname()!r} resolves to "
            f"{bound or 'no address this host can bind'}, not to an address of {settings.iface} "
            f"({', '.join(addresses) or 'none'}); Horovod binds its process sets' Gloo "
            f"connections to the host name's address, so the other workers could not reach "
            f"this one: make the name resolve to {settings.iface}'s address (an /etc/hosts line)")


def wait_for_rendezvous(settings: WorkerSettings) -> None:
    """Return once the rendezvous server accepts TCP connections; raise TimeoutError after
    ``settings.timeout_s`` (a Compose service may start before the server listens)."""
    deadline = time.monotonic() + settings.timeout_s
    while True:
        try:
            with socket.create_connection((settings.rendezvous_addr, settings.port),
                                          timeout=RETRY_INTERVAL_S):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"worker rank {settings.rank}: no rendezvous server answered at "
                    f"{settings.rendezvous_addr}:{settings.port} within {settings.timeout_s:g} s "
                    f"({error})") from None
            time.sleep(RETRY_INTERVAL_S)


def exec_worker(settings: WorkerSettings, command: Sequence[str],
                environ: Mapping[str, str]) -> None:
    """Replace this process with ``command`` in Horovod's environment (keeps the pid)."""
    if not command:
        raise ValueError("no command given: python -m horovod_dgc.cluster worker -- COMMAND ...")
    check_host_name(settings)
    wait_for_rendezvous(settings)
    env = {**environ, **settings.horovod_env(), "PYTHONUNBUFFERED": "1"}
    try:
        os.execvpe(command[0], list(command), env)
    except OSError as error:
        raise ValueError(f"worker rank {settings.rank}: cannot run {command[0]!r}: "
                         f"{error.strerror}") from None
