"""The launcher's settings, read from environment variables and validated on construction."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Mapping

SIZE = "HOROVOD_DGC_SIZE"
RANK = "HOROVOD_DGC_RANK"
LOCAL_SIZE = "HOROVOD_DGC_LOCAL_SIZE"
RENDEZVOUS_ADDR = "HOROVOD_DGC_RENDEZVOUS_ADDR"
RENDEZVOUS_PORT = "HOROVOD_DGC_RENDEZVOUS_PORT"
IFACE = "HOROVOD_DGC_IFACE"
TIMEOUT_S = "HOROVOD_DGC_TIMEOUT_S"

DEFAULT_RENDEZVOUS_PORT = 29600
DEFAULT_LISTEN_ADDR = "0.0.0.0"
DEFAULT_IFACE = "eth0"
DEFAULT_TIMEOUT_S = 60.0


def host_label(host: int) -> str:
    """The ``HOROVOD_HOSTNAME`` of host ``host`` (0-based); the rendezvous server sizes each
    host's local scope under the same label."""
    return f"host{host}"


def _required(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name, "").strip()
    if not value:
        raise ValueError(f"environment variable {name} is not set")
    return value


def _integer(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None


def _check_port(port: int) -> None:
    if not 1 <= port <= 65535:
        raise ValueError(f"{RENDEZVOUS_PORT} must be in 1..65535, got {port}")


def _check_size(size: int, local_size: int) -> None:
    if size < 1:
        raise ValueError(f"{SIZE} must be >= 1, got {size}")
    if local_size < 1 or size % local_size:
        raise ValueError(f"{LOCAL_SIZE} must be >= 1 and divide {SIZE}={size}, got {local_size}")


def _local_size(environ: Mapping[str, str]) -> int:
    return _integer(LOCAL_SIZE, environ.get(LOCAL_SIZE) or "1")


@dataclass(frozen=True)
class RendezvousSettings:
    """Where the rendezvous server listens, and for how many workers.

    Attributes:
        size: number of workers.
        listen_addr: IPv4 address to bind (``0.0.0.0``: every interface).
        port: TCP port.
        local_size: workers per host (ranks ``h * local_size`` onwards run on host ``h``).
    """

    size: int
    listen_addr: str = DEFAULT_LISTEN_ADDR
    port: int = DEFAULT_RENDEZVOUS_PORT
    local_size: int = 1

    def __post_init__(self) -> None:
        _check_size(self.size, self.local_size)
        _check_port(self.port)
        ipaddress.IPv4Address(self.listen_addr)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "RendezvousSettings":
        return cls(size=_integer(SIZE, _required(environ, SIZE)),
                   listen_addr=environ.get(RENDEZVOUS_ADDR) or DEFAULT_LISTEN_ADDR,
                   port=_integer(RENDEZVOUS_PORT,
                                 environ.get(RENDEZVOUS_PORT) or str(DEFAULT_RENDEZVOUS_PORT)),
                   local_size=_local_size(environ))


@dataclass(frozen=True)
class WorkerSettings:
    """One worker: its rank, the job's size, where the rendezvous server is, which interface.

    Attributes:
        rank: this worker's rank, ``0 <= rank < size``.
        size: number of workers.
        rendezvous_addr: host name or address of the rendezvous server.
        port: the rendezvous server's TCP port.
        iface: the network interface Gloo binds to.
        timeout_s: how long to wait for the rendezvous server.
        local_size: workers per host (ranks ``h * local_size`` onwards run on host ``h``).
    """

    rank: int
    size: int
    rendezvous_addr: str
    port: int = DEFAULT_RENDEZVOUS_PORT
    iface: str = DEFAULT_IFACE
    timeout_s: float = DEFAULT_TIMEOUT_S
    local_size: int = 1

    def __post_init__(self) -> None:
        _check_size(self.size, self.local_size)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"{RANK} must be in 0..{self.size - 1} ({SIZE}={self.size}), "
                             f"got {self.rank}")
        _check_port(self.port)
        if not self.rendezvous_addr:
            raise ValueError(f"{RENDEZVOUS_ADDR} is empty")
        if not self.iface:
            raise ValueError(f"{IFACE} is empty")
        if not self.timeout_s > 0:
            raise ValueError(f"{TIMEOUT_S} must be > 0, got {self.timeout_s}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "WorkerSettings":
        timeout = environ.get(TIMEOUT_S) or str(DEFAULT_TIMEOUT_S)
        try:
            timeout_s = float(timeout)
        except ValueError:
            raise ValueError(f"{TIMEOUT_S} must be a number, got {timeout!r}") from None
        return cls(rank=_integer(RANK, _required(environ, RANK)),
                   size=_integer(SIZE, _required(environ, SIZE)),
                   rendezvous_addr=_required(environ, RENDEZVOUS_ADDR),
                   port=_integer(RENDEZVOUS_PORT,
                                 environ.get(RENDEZVOUS_PORT) or str(DEFAULT_RENDEZVOUS_PORT)),
                   iface=environ.get(IFACE) or DEFAULT_IFACE,
                   timeout_s=timeout_s, local_size=_local_size(environ))

    def horovod_env(self) -> dict:
        """The variables ``horovodrun --gloo`` sets for this worker's slot."""
        host, local_rank = divmod(self.rank, self.local_size)
        return {
            "HOROVOD_RANK": str(self.rank),
            "HOROVOD_SIZE": str(self.size),
            "HOROVOD_LOCAL_RANK": str(local_rank),
            "HOROVOD_LOCAL_SIZE": str(self.local_size),
            "HOROVOD_CROSS_RANK": str(host),
            "HOROVOD_CROSS_SIZE": str(self.size // self.local_size),
            "HOROVOD_HOSTNAME": host_label(host),
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": self.rendezvous_addr,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(self.port),
            "HOROVOD_GLOO_IFACE": self.iface,
            "GLOO_SOCKET_IFNAME": self.iface,
        }
