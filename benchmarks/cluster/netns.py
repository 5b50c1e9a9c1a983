"""A test cluster of K hosts made of Linux network namespaces, with shaped links.

Layout (every name starts with a prefix unique to the run, so parallel runs never collide)::

    <prefix>-h0  eth0 198.18.0.1/24 ──veth── port0 ┐
    <prefix>-h1  eth0 198.18.0.2/24 ──veth── port1 ┼─ br0 198.18.0.254/24  (<prefix>-br)
    ...                                            ┘

Each host is a namespace with one interface, ``eth0``; the bridge lives in a namespace of its
own and holds the rendezvous address. Inside host k the machine's host name resolves to host
k's address, through ``/etc/netns/<prefix>-hk/hosts`` (which ``ip netns exec`` mounts over
``/etc/hosts``): Horovod 0.28.1 binds its process-set Gloo contexts to the address of the host
name, whatever ``HOROVOD_GLOO_IFACE`` says. Addresses come from the benchmarking range
198.18.0.0/15 and exist only inside these namespaces: no interface, address, route or qdisc
is created or changed outside them (the veth pairs are created directly inside their
namespaces); the one thing outside is each host's ``/etc/netns/<name>/hosts``.

A link shape limits both directions of every host's link: the egress of ``eth0`` (upload)
and of its bridge port (download), so host-to-host traffic crosses two shaped links, as
through a switch. Rates use the ``tbf`` qdisc; a delay needs ``netem`` (one-way delay per
shaped link, so two per host-to-host path), which not every kernel has.

``NetnsCluster`` is a context manager: leaving it, also through an exception, Ctrl-C or
SIGTERM (see ``benchmarks/interrupts.py``), stops every process left in its namespaces and deletes
them, which removes every link, and removes its ``/etc/netns`` entries.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

SUBNET_PREFIX = "198.18.0."
NETMASK_BITS = 24
BRIDGE_HOST = 254
MAX_HOSTS = 200
HOST_IFACE = "eth0"
BRIDGE = "br0"
PREFIX_PATTERN = re.compile(r"^[a-z][a-z0-9]{0,23}$")
ETC_NETNS = Path("/etc/netns")
TBF_BURST_S = 0.004      # token bucket depth: 4 ms at the link rate...
TBF_MIN_BURST_BYTES = 65536  # ...and at least one GSO segment
TBF_QUEUE_S = 0.1        # queue of 100 ms at the link rate before tbf drops


class ClusterError(RuntimeError):
    """The cluster could not be built, shaped, or a job on it failed."""


def require_root_and_tools() -> None:
    """Raise ClusterError (one sentence) unless we are root and ``ip`` and ``tc`` exist."""
    if os.geteuid() != 0:
        raise ClusterError("creating network namespaces needs root: run this command as root "
                           "(for example with sudo).")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"the {' and '.join(missing)} command(s) are missing: install "
                           f"iproute2 (apt-get install iproute2).")


def netns_names() -> List[str]:
    """Every network namespace ``ip netns list`` shows, names only."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


@dataclass(frozen=True)
class LinkShape:
    """The shape of every host's link, in both directions.

    Attributes:
        name: label used in results (``unshaped``, ``100mbit``, ``1gbit``, or from the flags).
        rate_mbit: link rate in Mbit/s; None leaves the rate unlimited.
        delay_ms: one-way delay added per shaped link direction, in milliseconds.
    """

    name: str
    rate_mbit: Optional[float] = None
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a link needs a name")
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise ValueError(f"link {self.name}: rate_mbit must be > 0, got {self.rate_mbit}")
        if not self.delay_ms >= 0:
            raise ValueError(f"link {self.name}: delay_ms must be >= 0, got {self.delay_ms}")

    @property
    def shaped(self) -> bool:
        return self.rate_mbit is not None or self.delay_ms > 0


PRESETS: Dict[str, LinkShape] = {
    "unshaped": LinkShape("unshaped"),
    "100mbit": LinkShape("100mbit", rate_mbit=100.0),
    "1gbit": LinkShape("1gbit", rate_mbit=1000.0),
}
LINK_PATTERN = re.compile(r"^(?:(?P<mbit>\d+(?:\.\d+)?)mbit|(?P<gbit>\d+(?:\.\d+)?)gbit|unshaped)"
                          r"(?:\+(?P<delay>\d+(?:\.\d+)?)ms)?$")


def parse_link(text: str) -> LinkShape:
    """A preset name, ``<R>mbit`` or ``<R>gbit``, optionally followed by ``+<D>ms`` of delay
    (``100mbit+2ms``, ``unshaped+1ms``)."""
    if text in PRESETS:
        return PRESETS[text]
    match = LINK_PATTERN.match(text)
    if match is None:
        raise ValueError(f"link {text!r}: expected one of {sorted(PRESETS)} or <R>mbit, "
                         f"<R>gbit, optionally followed by +<D>ms")
    rate = (float(match["mbit"]) if match["mbit"] else
            float(match["gbit"]) * 1000.0 if match["gbit"] else None)
    return LinkShape(text, rate_mbit=rate, delay_ms=float(match["delay"] or 0.0))


def _run(args: Sequence[str]) -> str:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"`{' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc.stdout


def _qdisc_args(shape: LinkShape) -> List[str]:
    """``tc qdisc replace`` arguments after ``root`` for a shaped link."""
    if shape.delay_ms > 0:
        args = ["netem", "delay", f"{shape.delay_ms}ms", "limit", "100000"]
        return args + (["rate", f"{shape.rate_mbit}mbit"] if shape.rate_mbit else [])
    rate_bytes_per_s = shape.rate_mbit * 1e6 / 8
    burst = max(TBF_MIN_BURST_BYTES, int(rate_bytes_per_s * TBF_BURST_S))
    limit = max(2 * burst, int(rate_bytes_per_s * TBF_QUEUE_S))
    return ["tbf", "rate", f"{shape.rate_mbit}mbit", "burst", str(burst), "limit", str(limit)]


class NetnsCluster:
    """K hosts as network namespaces joined by a bridge in its own namespace.

    Args:
        hosts: number of hosts, 1..200.
        prefix: start of every namespace name (lowercase letters and digits, at most 24);
            unique per run so parallel runs and tests never collide.
    """

    def __init__(self, hosts: int, prefix: str):
        if not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be an integer in 1..{MAX_HOSTS}, got {hosts!r}")
        if not PREFIX_PATTERN.match(prefix):
            raise ValueError(f"prefix must match {PREFIX_PATTERN.pattern}, got {prefix!r}")
        self.hosts = hosts
        self.prefix = prefix
        self.bridge_ns = f"{prefix}-br"
        self.host_ns = [f"{prefix}-h{rank}" for rank in range(hosts)]
        self.rendezvous_addr = f"{SUBNET_PREFIX}{BRIDGE_HOST}"
        self._created: List[str] = []
        self._etc_dirs: List[Path] = []
        self._made_etc_netns = False

    def address(self, rank: int) -> str:
        """The IPv4 address of host ``rank``'s ``eth0``."""
        return f"{SUBNET_PREFIX}{rank + 1}"

    # -- life cycle --------------------------------------------------------------------------------
    def __enter__(self) -> "NetnsCluster":
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.destroy()

    def _add_namespace(self, name: str) -> None:
        if name in netns_names():
            raise ClusterError(f"network namespace {name} already exists: another run with "
                               f"prefix {self.prefix!r} is active (choose another prefix)")
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _create(self) -> None:
        self._add_namespace(self.bridge_ns)
        _run(["ip", "-n", self.bridge_ns, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", self.bridge_ns, "addr", "add",
              f"{self.rendezvous_addr}/{NETMASK_BITS}", "dev", BRIDGE])
        _run(["ip", "-n", self.bridge_ns, "link", "set", BRIDGE, "up"])
        for rank, ns in enumerate(self.host_ns):
            self._add_namespace(ns)
            port = self.bridge_port(rank)
            _run(["ip", "link", "add", HOST_IFACE, "netns", ns, "type", "veth",
                  "peer", "name", port, "netns", self.bridge_ns])
            _run(["ip", "-n", self.bridge_ns, "link", "set", port, "master", BRIDGE])
            _run(["ip", "-n", self.bridge_ns, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(rank)}/{NETMASK_BITS}",
                  "dev", HOST_IFACE])
            _run(["ip", "-n", ns, "link", "set", HOST_IFACE, "up"])
            self._write_hosts_file(rank)

    def _write_hosts_file(self, rank: int) -> None:
        """Inside host ``rank`` the machine's host name resolves to its own address (for Gloo),
        and every host's address to its namespace's name (for reverse look-ups)."""
        if not ETC_NETNS.exists():
            ETC_NETNS.mkdir()
            self._made_etc_netns = True
        directory = ETC_NETNS / self.host_ns[rank]
        directory.mkdir(exist_ok=True)
        self._etc_dirs.append(directory)
        lines = ["127.0.0.1 localhost"]
        for other, ns in enumerate(self.host_ns):
            names = f"{socket.gethostname()} {ns}" if other == rank else ns
            lines.append(f"{self.address(other)} {names}")
        (directory / "hosts").write_text("\n".join(lines) + "\n")

    def destroy(self) -> None:
        """Stop every process left in our namespaces and delete them (and so their links).
        SIGINT and SIGTERM wait until this is done."""
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            for name in reversed(self._created):
                self._kill_processes_in(name)
                subprocess.run(["ip", "netns", "delete", name], capture_output=True)
            self._created.clear()
            for directory in self._etc_dirs:
                shutil.rmtree(directory, ignore_errors=True)
            self._etc_dirs.clear()
            if self._made_etc_netns and ETC_NETNS.is_dir() and not any(ETC_NETNS.iterdir()):
                ETC_NETNS.rmdir()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    @staticmethod
    def _kill_processes_in(name: str) -> None:
        out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for pid in out.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    # -- links -------------------------------------------------------------------------------------
    @staticmethod
    def bridge_port(rank: int) -> str:
        """The bridge-side end of host ``rank``'s link."""
        return f"port{rank}"

    def shape(self, link: LinkShape, hosts: Optional[Sequence[int]] = None) -> None:
        """Give the links of ``hosts`` (default: every host) this shape, both directions
        (replacing the previous one)."""
        for rank in range(self.hosts) if hosts is None else hosts:
            for where, dev in self._link_ends(rank):
                self._shape_device(where, dev, link)

    def set_link_up(self, rank: int, up: bool) -> None:
        """Bring host ``rank``'s link down (its bridge port: the host is cut off from every
        other, its own interface untouched) or back up."""
        _run(["ip", "-n", self.bridge_ns, "link", "set", self.bridge_port(rank), "up" if up else "down"])

    def _link_ends(self, rank: int) -> List[tuple]:
        """(namespace, device) of both ends of host ``rank``'s link."""
        return [(self.host_ns[rank], HOST_IFACE), (self.bridge_ns, self.bridge_port(rank))]

    @staticmethod
    def _shape_device(ns: str, dev: str, link: LinkShape) -> None:
        if not link.shaped:
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"],
                           capture_output=True)
            return
        args = ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *_qdisc_args(link)]
        proc = subprocess.run(args, capture_output=True, text=True)
        if proc.returncode == 0:
            return
        if link.delay_ms > 0 and "unknown" in proc.stderr.lower():
            raise ClusterError(f"link {link.name}: this kernel has no netem qdisc "
                               f"(CONFIG_NET_SCH_NETEM), so a delay cannot be added; use a link "
                               f"without +<D>ms")
        raise ClusterError(f"`{' '.join(args)}` failed: {proc.stderr.strip()}")

    # -- running commands --------------------------------------------------------------------------
    def exec_args(self, ns: str, command: Sequence[str]) -> List[str]:
        """``command`` run inside namespace ``ns`` (which must be one of ours)."""
        if ns not in self._created:
            raise ValueError(f"{ns} is not a namespace of this cluster")
        return ["ip", "netns", "exec", ns, *command]
