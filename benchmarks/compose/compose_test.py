"""``make compose-test``: the Docker Compose cluster, run for real.

    python -m benchmarks.compose.compose_test [--compose auto|v1|v2] [--steps 3]
        [--warmup-steps 1] [--kill-worker RANK [--kill-after-s 5]]

As root, it

1. installs Debian's ``docker.io`` and ``docker-compose`` when missing, and starts ``dockerd``
   when none answers, with no default bridge and no firewall or forwarding changes
   (``--bridge=none --iptables=false --ip-forward=false``); it stops only a daemon it started;
2. refuses, saying why, when the host's iptables FORWARD policy is DROP while bridged traffic
   passes through iptables (the containers could not reach each other);
3. makes the base image when the Dockerfile's default (``ARG BASE_IMAGE=``) is not present: a
   Debian bookworm ``debootstrap --variant=minbase`` from the Debian mirror the machine uses,
   imported with ``docker import`` (no image is ever pulled);
4. builds the image with BuildKit from the wheels this machine has: the CPU torch wheel, the
   Horovod wheel ``make setup`` compiled and cached, and their dependencies at the exact
   versions of ``.venv`` (``docker/wheels/``), so only the project's C kernel is
   compiled;
5. runs the Compose file twice, unshaped and with ``LINK_RATE=100mbit``: a rendezvous and 4
   workers, each training dense then dgc (``benchmarks/compose/train_check.py``);
6. checks every worker's records (every worker finished, the parameters are identical across
   workers, dgc's interface bytes per worker per step at least 100x fewer than dense's), prints
   a table and removes every container, network and volume it created, on success, failure,
   Ctrl-C and SIGTERM, and checks ``docker ps -a``, ``docker network ls``, ``docker volume
   ls`` and ``ip netns list`` are as they were.

A worker container that stops with a non-zero status (killed, say) ends the run at once with a
message naming it. ``--kill-worker RANK`` kills that worker ``--kill-after-s`` seconds after it
started training in the first run, to show it (the test then fails, naming it). Records and logs stay in ``build/compose-test/<project>/``.

Docker client: Debian's ``/usr/bin/docker`` (20.10, the engine's own version), whose ``docker
build`` runs BuildKit inside the daemon; the newer client some machines have in
``/usr/local/bin`` needs the buildx plugin for BuildKit and falls back to the classic builder,
which ignores ``Dockerfile.dockerignore`` and would send the whole checkout, ``.venv``
included.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from ..interrupts import interrupt_on_signals

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "docker"
DOCKERFILE = HERE / "Dockerfile"
COMPOSE_FILE = HERE / "docker-compose.yml"
WHEELS = HERE / "wheels"
WORK = ROOT / "build" / "compose-test"
IMAGE = "horovod_dgc:cpu"
IMAGE_LABEL = "org.horovod_dgc.image=cluster"  # the Dockerfile's LABEL
DOCKER = "/usr/bin/docker"  # Debian's client: see the module's docstring
PACKAGES = ("docker.io", "docker-compose")
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
DAEMON_FLAGS = ("--bridge=none", "--iptables=false", "--ip-forward=false", "--ip-masq=false")
DAEMON_START_S = 60.0
DAEMON_STOP_S = 30.0
BASE_REPOSITORY = "horovod_dgc-base"
BASE_SUITE = "bookworm"
# python3.11-venv's dependencies are spelled out: debootstrap does not resolve the virtual
# python3.11-distutils.
BASE_PACKAGES = ("python3.11", "python3.11-venv", "python3-distutils", "python3-pip-whl",
                 "python3-setuptools-whl", "libopenmpi3", "iproute2", "ca-certificates")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
TORCH_WHEELS = Path("/opt/wheels")
HOROVOD_VERSION = "0.28.1"
HOROVOD_REQUIREMENTS = ("cloudpickle", "psutil", "pyyaml", "packaging")
# torch warns at import without numpy.
TORCH_COMPANIONS = ("numpy",)
BUILD_REQUIREMENTS = ("setuptools", "wheel")
SIZE = 4
METHODS = ("dense", "dgc")
MIN_REDUCTION = 100.0    # dense's interface bytes per worker per step over dgc's
RUN_TIMEOUT_S = 1200.0   # one compose run, start to the last worker's exit
POLL_S = 0.5
STOP_TIMEOUT_S = 3       # docker stop's grace before SIGKILL (python as PID 1 ignores SIGTERM)
LOG_TAIL_LINES = 15


class ComposeTestError(RuntimeError):
    """The test could not run, or a check failed; the message says which in one paragraph.
    ``reported``: already printed (as soon as it was seen, before the clean-up)."""

    reported = False


@dataclass(frozen=True)
class Run:
    """One start of the cluster: a label for its records and its link rate ('' unshaped)."""

    label: str
    link_rate: str


RUNS = (Run("unshaped", ""), Run("100mbit", "100mbit"))


# ---------------------------------------------------------------------------------------------
# Commands


def run(cmd: Sequence[str], *, check: bool = True, env: Optional[Mapping[str, str]] = None,
        timeout_s: Optional[float] = None, log: Optional[Path] = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session (a Ctrl-C reaches only this script, which cleans up);
    its output is returned, or appended to ``log``. ComposeTestError when it fails and
    ``check``."""
    if log is not None:
        with open(log, "a") as out:
            proc = subprocess.run(list(cmd), stdout=out, stderr=subprocess.STDOUT, text=True,
                                  env=env, timeout=timeout_s, start_new_session=True)
    else:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, env=env,
                              timeout=timeout_s, start_new_session=True)
    if check and proc.returncode != 0:
        detail = tail_text(log.read_text(errors="replace")) if log else (proc.stderr or proc.stdout).strip()
        raise ComposeTestError(f"{' '.join(cmd[:4])} ... exited with status {proc.returncode}"
                               + (f" (log: {log})" if log else "") + f":\n{detail}")
    return proc


def tail_text(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def say(message: str) -> None:
    print(f"compose-test: {message}", flush=True)


# ---------------------------------------------------------------------------------------------
# Debian packages and the daemon


def missing_packages(names: Sequence[str]) -> List[str]:
    """The Debian packages among ``names`` that are not installed."""
    missing = []
    for name in names:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Status}", name], capture_output=True,
                             text=True)
        if "ok installed" not in out.stdout:
            missing.append(name)
    return missing


@contextmanager
def services_kept_stopped() -> Iterator[None]:
    """While installing, a policy-rc.d that forbids starting services (Debian's packages of
    the engine start it with its default bridge and firewall rules otherwise); one that
    already exists is left alone."""
    if POLICY_RC_D.exists():
        yield
        return
    POLICY_RC_D.write_text("#!/bin/sh\n# compose-test: no service starts during its install\nexit 101\n")
    POLICY_RC_D.chmod(0o755)
    try:
        yield
    finally:
        POLICY_RC_D.unlink(missing_ok=True)


def ensure_packages(names: Sequence[str], log: Path) -> None:
    """Install the missing ones among ``names`` with apt-get."""
    missing = missing_packages(names)
    if not missing:
        return
    say(f"installing Debian packages {' '.join(missing)} (log: {log})")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    with services_kept_stopped():
        run(["apt-get", "update", "-qq"], env=env, log=log)
        run(["apt-get", "install", "-y", "-qq", *missing], env=env, log=log)


def daemon_answers() -> bool:
    return run([DOCKER, "version", "--format", "{{.Server.Version}}"], check=False,
               timeout_s=20).returncode == 0


class Daemon:
    """The Docker daemon for the test: the running one, else ``dockerd`` started here with
    :data:`DAEMON_FLAGS` and stopped on exit (a context manager)."""

    def __init__(self, log: Path):
        self.log = log
        self.process: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Daemon":
        if daemon_answers():
            say("using the Docker daemon that is already running")
            return self
        say(f"starting dockerd {' '.join(DAEMON_FLAGS)} (log: {self.log})")
        with open(self.log, "a") as out:
            self.process = subprocess.Popen(["dockerd", *DAEMON_FLAGS], stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + DAEMON_START_S
        while not daemon_answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ComposeTestError(f"dockerd did not start; the end of {self.log}:\n"
                                       f"{tail_text(self.log.read_text(errors='replace'))}")
            time.sleep(POLL_S)
        return self

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        say("stopping the dockerd it started")
        self.process.terminate()
        try:
            self.process.wait(timeout=DAEMON_STOP_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __exit__(self, *exc) -> None:
        with uninterrupted():
            self.stop()


def forward_policy() -> Optional[str]:
    """The iptables FORWARD chain's policy (``ACCEPT``, ``DROP``), None without iptables."""
    if shutil.which("iptables") is None:
        return None
    out = run(["iptables", "-S", "FORWARD"], check=False)
    match = re.search(r"^-P FORWARD (\w+)", out.stdout, re.MULTILINE)
    return match.group(1) if match else None


def bridge_calls_iptables() -> bool:
    """Whether bridged frames pass through iptables (br_netfilter loaded and enabled)."""
    path = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
    return path.exists() and path.read_text().strip() == "1"


def forward_blocks_bridges(policy: Optional[str], bridged_through_iptables: bool) -> bool:
    """True when traffic between containers on one bridge would be dropped: FORWARD's policy
    is DROP (a daemon that once managed the firewall leaves it so) and bridged frames go
    through iptables; this daemon adds no rule that would accept them."""
    return policy == "DROP" and bridged_through_iptables


def check_forward_policy() -> None:
    policy, bridged = forward_policy(), bridge_calls_iptables()
    if forward_blocks_bridges(policy, bridged):
        raise ComposeTestError(
            "the host's iptables FORWARD policy is DROP (a Docker daemon that managed the "
            "firewall leaves it so) and bridged traffic passes through iptables "
            "(net.bridge.bridge-nf-call-iptables=1), so the containers could not reach each "
            "other; this test changes no firewall rule: run 'iptables -P FORWARD ACCEPT' (or "
            "'sysctl net.bridge.bridge-nf-call-iptables=0') and then this command again.")
    if policy == "DROP":
        say("note: the iptables FORWARD policy is DROP, but bridged traffic bypasses iptables")


# ---------------------------------------------------------------------------------------------
# What the test must leave as it found


def snapshot() -> Dict[str, List[str]]:
    """The daemon's containers, networks and volumes and the host's named network
    namespaces, as ids or names."""
    def lines(cmd: Sequence[str]) -> List[str]:
        return sorted(line.split()[0] for line in run(cmd).stdout.splitlines() if line.strip())

    return {"docker ps -a": lines([DOCKER, "ps", "-a", "-q", "--no-trunc"]),
            "docker network ls": lines([DOCKER, "network", "ls", "-q", "--no-trunc"]),
            "docker volume ls": lines([DOCKER, "volume", "ls", "-q"]),
            "ip netns list": lines(["ip", "netns", "list"])}


def snapshot_changes(before: Mapping[str, List[str]], after: Mapping[str, List[str]]) -> List[str]:
    """One line per listing that differs: what appeared and what disappeared."""
    changes = []
    for listing, old in before.items():
        new = after.get(listing, [])
        added, removed = sorted(set(new) - set(old)), sorted(set(old) - set(new))
        if added or removed:
            changes.append(f"{listing}: added {added or 'nothing'}, removed {removed or 'nothing'}")
    return changes


# ---------------------------------------------------------------------------------------------
# Images


def dockerfile_base_default(dockerfile: Path = DOCKERFILE) -> str:
    """The default of the Dockerfile's ``ARG BASE_IMAGE=``."""
    match = re.search(r"^ARG BASE_IMAGE=(\S+)", dockerfile.read_text(), re.MULTILINE)
    if not match:
        raise ComposeTestError(f"{dockerfile} has no 'ARG BASE_IMAGE=<image>' line")
    return match.group(1)


def image_present(ref: str) -> bool:
    return run([DOCKER, "image", "inspect", ref], check=False).returncode == 0


def debian_mirror(sources: Sequence[Path] = (Path("/etc/apt/sources.list"),
                                             *sorted(Path("/etc/apt/sources.list.d").glob("*")))
                  ) -> str:
    """The first Debian archive (not its security archive) the machine's apt uses for
    bookworm, from one-line or deb822 sources; :data:`DEFAULT_MIRROR` when none is found."""
    for path in sources:
        if not path.is_file() or not path.name.endswith((".list", ".sources")):
            continue
        text = path.read_text(errors="replace")
        if path.name.endswith(".list"):
            candidates = [(m.group(1), m.group(2)) for m in
                          re.finditer(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)", text, re.MULTILINE)]
        else:
            candidates = []
            for stanza in re.split(r"\n\s*\n", text):
                uris = re.search(r"^URIs:\s*(\S+)", stanza, re.MULTILINE)
                suites = re.search(r"^Suites:\s*(.+)$", stanza, re.MULTILINE)
                enabled = re.search(r"^Enabled:\s*no", stanza, re.MULTILINE | re.IGNORECASE)
                if uris and suites and not enabled:
                    candidates += [(uris.group(1), suite) for suite in suites.group(1).split()]
        for uri, suite in candidates:
            if suite == BASE_SUITE and "security" not in uri:
                return uri.rstrip("/")
    return DEFAULT_MIRROR


def base_tag() -> str:
    """The local base image's name; its tag changes with the packages it holds."""
    digest = hashlib.sha256(" ".join(BASE_PACKAGES).encode()).hexdigest()[:8]
    return f"{BASE_REPOSITORY}:{BASE_SUITE}-{digest}"


def build_base_image(tag: str, log: Path) -> None:
    """A minimal Debian root file system with :data:`BASE_PACKAGES`, imported as ``tag``."""
    ensure_packages(["debootstrap"], log)
    mirror = debian_mirror()
    root = Path(tempfile.mkdtemp(prefix="hdgc-rootfs-", dir="/var/tmp"))
    started = time.monotonic()
    say(f"making base image {tag}: debootstrap {BASE_SUITE} minbase from {mirror} (log: {log})")
    try:
        run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
             BASE_SUITE, str(root), mirror], log=log)
        run(["chroot", str(root), "apt-get", "clean"], log=log)
        shutil.rmtree(root / "var" / "lib" / "apt" / "lists", ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(root), "--numeric-owner", "-c", "."],
                               stdout=subprocess.PIPE, start_new_session=True)
        with open(log, "a") as out:
            imported = subprocess.run(
                [DOCKER, "import", "--change",
                 "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                 "--change", 'CMD ["bash"]', "-", tag],
                stdin=tar.stdout, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        tar.stdout.close()
        if tar.wait() != 0 or imported.returncode != 0:
            raise ComposeTestError(f"importing {root} as {tag} failed; see {log}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    say(f"base image {tag} made in {time.monotonic() - started:.0f} s")


def choose_base(log: Path) -> str:
    """The Dockerfile's default base when present, else the local debootstrap one (made when
    missing). Never pulls."""
    default = dockerfile_base_default()
    if image_present(default):
        return default
    tag = base_tag()
    if not image_present(tag):
        build_base_image(tag, log)
    return tag


def horovod_wheel(torch_version: str) -> Path:
    """The Horovod wheel ``make setup`` cached for this torch version."""
    cache = Path(os.environ.get("HOROVOD_DGC_CACHE", Path.home() / ".cache" / "horovod_dgc"))
    base_version = torch_version.split("+")[0]
    found = sorted(cache.glob(f"wheels/horovod-{HOROVOD_VERSION}-py3.11-torch{base_version}-*/"
                              f"horovod-{HOROVOD_VERSION}-*.whl"))
    if not found:
        raise ComposeTestError(f"no cached Horovod {HOROVOD_VERSION} wheel for torch "
                               f"{base_version} under {cache}/wheels: run 'make setup' first.")
    return found[-1]


def frozen_versions(python: str) -> List[str]:
    """``name==version`` of every package in the project's environment (pip freeze), the
    ones installed from files or in editable mode left out."""
    out = run([python, "-m", "pip", "freeze", "--exclude-editable"]).stdout
    return [line for line in out.splitlines() if "==" in line and " @ " not in line]


def stage_wheels(python: str, log: Path) -> None:
    """Fill :data:`WHEELS`: constraints.txt (the environment's exact versions), torch and the
    Horovod wheel with their run-time dependencies, and what builds the project's wheel."""
    WHEELS.mkdir(exist_ok=True)
    versions = frozen_versions(python)
    (WHEELS / "constraints.txt").write_text("\n".join(versions) + "\n")
    torch = next((line.split("==")[1] for line in versions if line.lower().startswith("torch==")), None)
    if torch is None:
        raise ComposeTestError(f"torch is not installed in {python}'s environment: run 'make setup'.")
    wheel = horovod_wheel(torch)
    for old in WHEELS.glob("horovod-*.whl"):
        if old.name != wheel.name or old.stat().st_size != wheel.stat().st_size:
            old.unlink()
    if not (WHEELS / wheel.name).exists():
        shutil.copy2(wheel, WHEELS / wheel.name)
    links = ["--find-links", str(TORCH_WHEELS)] if TORCH_WHEELS.is_dir() else []
    out = run([python, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary=:all:",
               "-d", str(WHEELS), "-c", str(WHEELS / "constraints.txt"), *links,
               f"torch=={torch}", *TORCH_COMPANIONS, *HOROVOD_REQUIREMENTS, *BUILD_REQUIREMENTS])
    with open(log, "a") as out_log:
        out_log.write(out.stdout)
    wanted = {wheel.name} | {Path(m.group(1)).name for m in
                             re.finditer(r"(?:Saved|File was already downloaded) (\S+\.whl)", out.stdout)}
    for stale in WHEELS.glob("*.whl"):
        if stale.name not in wanted:
            stale.unlink()


def build_image(base: str, log: Path) -> None:
    """The project's image, tagged :data:`IMAGE`, with BuildKit; RUN steps on the host's
    network (for Debian packages the base lacks; no address is created)."""
    started = time.monotonic()
    say(f"building {IMAGE} on {base} (log: {log})")
    run([DOCKER, "build", "--network=host", "--progress=plain", "-f", str(DOCKERFILE),
         "--build-arg", f"BASE_IMAGE={base}", "--build-arg", "WHEELS_ONLY=1", "-t", IMAGE, str(ROOT)],
        env=dict(os.environ, DOCKER_BUILDKIT="1"), log=log)
    # The image this build replaced, now untagged (the build cache keeps its layers).
    run([DOCKER, "image", "prune", "-f", "--filter", f"label={IMAGE_LABEL}"], log=log)
    say(f"image built in {time.monotonic() - started:.0f} s")


# ---------------------------------------------------------------------------------------------
# Compose


def compose_command(kind: str) -> List[str]:
    """``docker compose`` (v2) or ``docker-compose`` (v1): ``kind`` v2, v1, or auto (v2 when
    its plugin answers)."""
    v2_works = run([DOCKER, "compose", "version"], check=False).returncode == 0
    if kind == "v2" or (kind == "auto" and v2_works):
        if not v2_works:
            raise ComposeTestError("'docker compose' (v2) is not installed: install the compose "
                                   "plugin, or use --compose v1.")
        return [DOCKER, "compose"]
    if shutil.which("docker-compose") is None:
        raise ComposeTestError("docker-compose (v1) is not installed (apt-get install docker-compose).")
    return ["docker-compose"]


def worker_command(run_spec: Run, args: argparse.Namespace) -> List[str]:
    return ["python", "-m", "horovod_dgc.cluster", "worker", "--",
            "python", "-m", "benchmarks.compose.train_check", "--methods", ",".join(METHODS),
            "--link", run_spec.label, "--out", f"/results/{run_spec.label}",
            "--warmup-steps", str(args.warmup_steps), "--steps", str(args.steps)]


def write_override(path: Path, command: List[str]) -> None:
    """A second Compose file that gives every worker ``command`` (JSON is YAML)."""
    services = {f"worker{rank}": {"command": command} for rank in range(SIZE)}
    path.write_text(json.dumps({"services": services}, indent=2) + "\n")


@dataclass(frozen=True)
class ContainerState:
    """What ``docker inspect`` says of one container of the project."""

    name: str
    service: str
    status: str          # created, running, exited, dead, ...
    exit_code: int
    oom_killed: bool
    finished_s: float    # seconds since the epoch when it ended; 0.0 while it runs

    @classmethod
    def from_inspect(cls, item: Mapping) -> "ContainerState":
        state, labels = item["State"], item["Config"].get("Labels") or {}
        return cls(name=item["Name"].lstrip("/"),
                   service=labels.get("com.docker.compose.service", "?"),
                   status=state["Status"], exit_code=int(state.get("ExitCode", 0)),
                   oom_killed=bool(state.get("OOMKilled")),
                   finished_s=epoch_seconds(state.get("FinishedAt", "")))

    @property
    def ended(self) -> bool:
        return self.status in ("exited", "dead")


def epoch_seconds(timestamp: str) -> float:
    """Seconds since the epoch of Docker's RFC 3339 UTC time with up to nanoseconds
    (``2026-11-25T05:25:16.412555563Z``); 0.0 for its zero time or anything else."""
    match = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?Z", timestamp)
    if not match or timestamp.startswith("0001-"):
        return 0.0
    whole = datetime.datetime.strptime(match.group(1), "%Y-%m-%dT%H:%M:%S")
    fraction = float("0." + match.group(2)) if match.group(2) else 0.0
    return whole.replace(tzinfo=datetime.timezone.utc).timestamp() + fraction


def describe_exit(state: ContainerState) -> str:
    if state.oom_killed:
        return f"was killed for lack of memory (exit {state.exit_code})"
    if state.exit_code > 128:
        try:
            name = signal.Signals(state.exit_code - 128).name
        except ValueError:
            name = f"signal {state.exit_code - 128}"
        return f"was killed ({name}, exit {state.exit_code})"
    return f"exited with status {state.exit_code}"


def judge(states: Sequence[ContainerState], workers: int) -> Optional[str]:
    """None while the run goes on; ``"finished"`` when all ``workers`` worker containers
    exited 0; raises ComposeTestError naming the first worker that ended otherwise (the
    others may crash when it goes), or the rendezvous server when it ended before the
    workers did."""
    worker_states = [s for s in states if s.service.startswith("worker")]
    failed = sorted((s for s in worker_states if s.ended and s.exit_code != 0),
                    key=lambda s: (s.finished_s, s.service))
    if failed:
        first = failed[0]
        others = ", ".join(f"{s.name} ({describe_exit(s)})" for s in failed[1:])
        raise ComposeTestError(f"worker container {first.name} (service {first.service}) "
                               f"{describe_exit(first)}" + (f"; also {others}" if others else ""))
    if len(worker_states) == workers and all(s.ended for s in worker_states):
        return "finished"
    for s in states:
        if s.service == "rendezvous" and s.ended:
            raise ComposeTestError(f"the rendezvous container {s.name} {describe_exit(s)} "
                                   f"before the workers finished")
    return None


def project_containers(project: str) -> List[str]:
    out = run([DOCKER, "ps", "-a", "-q", "--no-trunc", "--filter",
               f"label=com.docker.compose.project={project}"])
    return out.stdout.split()


def inspect(ids: Sequence[str]) -> List[ContainerState]:
    if not ids:
        return []
    out = run([DOCKER, "inspect", *ids], check=False)
    if out.returncode != 0:  # a container went away between the two calls: ask again later
        return []
    return sorted((ContainerState.from_inspect(item) for item in json.loads(out.stdout)),
                  key=lambda s: s.service)


class ComposeRun:
    """One ``up`` of the cluster, supervised until every worker exits; :meth:`down` removes
    its containers, network and volumes."""

    def __init__(self, compose: List[str], project: str, run_spec: Run, work: Path,
                 args: argparse.Namespace):
        self.project, self.run_spec, self.args = project, run_spec, args
        self.results = work / "results"
        self.logs = work / "logs" / run_spec.label
        self.logs.mkdir(parents=True, exist_ok=True)
        override = work / f"override-{run_spec.label}.yml"
        write_override(override, worker_command(run_spec, args))
        self.cmd = [*compose, "-p", project, "-f", str(COMPOSE_FILE), "-f", str(override)]
        self.env = dict(os.environ, LINK_RATE=run_spec.link_rate, RESULTS_DIR=str(self.results))
        self.env.pop("LINK_DELAY", None)

    def up(self, kill_rank: Optional[int], kill_after_s: float) -> float:
        """Start the cluster and wait for the workers; their wall time in seconds."""
        log = self.logs / "compose.log"
        say(f"{self.run_spec.label}: starting rendezvous + {SIZE} workers"
            + (f" (LINK_RATE={self.run_spec.link_rate})" if self.run_spec.link_rate else ""))
        started = time.monotonic()
        run([*self.cmd, "up", "-d", "--no-build"], env=self.env, log=log)
        killed_at: Optional[float] = None
        training_since: Optional[float] = None
        try:
            while True:
                elapsed = time.monotonic() - started
                ids = project_containers(self.project)
                if kill_rank is not None and killed_at is None:
                    if training_since is None and self.worker_training(kill_rank, ids):
                        training_since = time.monotonic()
                    if training_since is not None and time.monotonic() - training_since >= kill_after_s:
                        killed_at = self.kill_worker(kill_rank, ids)
                if judge(inspect(ids), SIZE) == "finished":
                    self.save_logs()
                    if kill_rank is not None and killed_at is None:
                        raise ComposeTestError(f"the workers finished before worker{kill_rank} "
                                               f"could be killed (try a smaller --kill-after-s)")
                    return time.monotonic() - started
                if elapsed > RUN_TIMEOUT_S:
                    raise ComposeTestError(f"the workers ran past {RUN_TIMEOUT_S:g} s")
                time.sleep(POLL_S)
        except ComposeTestError as error:
            self.save_logs()
            since = (f" ({time.monotonic() - killed_at:.1f} s after it was killed)"
                     if killed_at is not None else "")
            failure = ComposeTestError(f"{self.run_spec.label}: {error}{since}; "
                                       f"{self.failure_context(str(error))}")
            print(f"compose-test: FAILED: {failure}\ncompose-test: removing the containers and "
                  f"the network", file=sys.stderr, flush=True)
            failure.reported = True
            raise failure from None

    def check_shaped(self) -> None:
        """With a link rate, every worker's entrypoint must have said it shaped its link."""
        if not self.run_spec.link_rate:
            return
        logs = sorted(self.logs.glob("*worker*.log"))
        unshaped = [p.name for p in logs if "shape_link: eth0 shaped" not in p.read_text(errors="replace")]
        if len(logs) != SIZE or unshaped:
            raise ComposeTestError(f"{self.run_spec.label}: no 'shape_link: eth0 shaped' line in "
                                   f"{unshaped or 'the missing worker logs'} ({self.logs})")

    def worker_training(self, rank: int, ids: Sequence[str]) -> bool:
        """Whether worker ``rank`` has said it started training (train_check.py's first line)."""
        target = next((s for s in inspect(ids) if s.service == f"worker{rank}"), None)
        if target is None:
            return False
        out = run([DOCKER, "logs", target.name], check=False)
        return f"train_check rank {rank} " in out.stdout + out.stderr

    def kill_worker(self, rank: int, ids: Sequence[str]) -> float:
        target = next((s for s in inspect(ids) if s.service == f"worker{rank}"), None)
        if target is None:
            raise ComposeTestError(f"no container for worker{rank} to kill")
        say(f"killing worker container {target.name} (--kill-worker {rank})")
        run([DOCKER, "kill", target.name])
        return time.monotonic()

    def failure_context(self, message: str) -> str:
        """The end of the failed container's log, for the error message."""
        match = re.search(r"container (\S+)", message)
        if not match:
            return f"logs in {self.logs}"
        path = self.logs / f"{match.group(1)}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return f"the end of its log ({path}):\n{tail_text(text) or '(empty)'}"

    def save_logs(self) -> None:
        for state in inspect(project_containers(self.project)):
            out = run([DOCKER, "logs", state.name], check=False)
            (self.logs / f"{state.name}.log").write_text(out.stdout + out.stderr)

    def down(self) -> None:
        run([*self.cmd, "down", "-v", "--remove-orphans", "-t", str(STOP_TIMEOUT_S)],
            env=self.env, check=False, log=self.logs / "compose.log")
        for leftover in project_containers(self.project):  # should none remain
            run([DOCKER, "rm", "-f", "-v", leftover], check=False)


# ---------------------------------------------------------------------------------------------
# Records, checks, table


def load_records(results: Path) -> Dict[Tuple[str, str], List[dict]]:
    """(run label, method) -> the workers' records, by rank."""
    records: Dict[Tuple[str, str], List[dict]] = {}
    for path in sorted(results.glob("*/rank*.json")):
        record = json.loads(path.read_text())
        records.setdefault((record["link"], record["method"]), []).append(record)
    for group in records.values():
        group.sort(key=lambda r: r["rank"])
    return records


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


def check_records(records: Mapping[Tuple[str, str], List[dict]], runs: Sequence[Run] = RUNS,
                  methods: Sequence[str] = METHODS, size: int = SIZE,
                  min_reduction: float = MIN_REDUCTION) -> List[Check]:
    """Every worker finished each method of each run, the parameters are identical across
    workers, dgc sent ``min_reduction``x fewer interface bytes per step than dense on every
    worker of each run."""
    checks = []
    for run_spec in runs:
        for method in methods:
            group = records.get((run_spec.label, method), [])
            ranks = [r["rank"] for r in group]
            checks.append(Check(f"{run_spec.label} {method}: every worker finished",
                                ranks == list(range(size)), f"records from ranks {ranks}"))
            digests = {r["params_sha256"] for r in group}
            checks.append(Check(f"{run_spec.label} {method}: parameters identical across workers",
                                bool(group) and len(digests) == 1,
                                f"{len(digests)} distinct digest(s) over {len(group)} workers"))
        dense = {r["rank"]: r for r in records.get((run_spec.label, "dense"), [])}
        dgc = {r["rank"]: r for r in records.get((run_spec.label, "dgc"), [])}
        ratios = [dense[k]["tx_bytes_per_step"] / max(dgc[k]["tx_bytes_per_step"], 1.0)
                  for k in sorted(set(dense) & set(dgc))]
        checks.append(Check(
            f"{run_spec.label}: dgc sends >= {min_reduction:g}x fewer bytes per worker per step than dense",
            len(ratios) == size and min(ratios) >= min_reduction,
            "dense/dgc per worker: " + (", ".join(f"{r:.0f}x" for r in ratios) or "no records")))
    return checks


def table(records: Mapping[Tuple[str, str], List[dict]], runs: Sequence[Run] = RUNS) -> str:
    """Markdown: one row per run and method, in the order of ``runs``."""
    lines = ["| run | method | workers done | median step, slowest worker (s) "
             "| MB sent per worker per step (mean, min-max) | dense / this (min over workers) "
             "| parameters identical |",
             "|---|---|---:|---:|---:|---:|---|"]
    order = {run_spec.label: index for index, run_spec in enumerate(runs)}
    for (label, method), group in sorted(records.items(),
                                         key=lambda item: (order.get(item[0][0], len(order)),
                                                           item[0][1] != "dense", item[0][1])):
        slowest = [max(r["step_s"][i] for r in group) for i in range(len(group[0]["step_s"]))]
        sent = [r["tx_bytes_per_step"] for r in group]
        dense = {r["rank"]: r["tx_bytes_per_step"] for r in records.get((label, "dense"), [])}
        ratio = min((dense[r["rank"]] / max(r["tx_bytes_per_step"], 1.0) for r in group
                     if r["rank"] in dense), default=None)
        same = len({r["params_sha256"] for r in group}) == 1
        lines.append(f"| {label} | {method} | {len(group)} | {statistics.median(slowest):.2f} "
                     f"| {statistics.mean(sent) / 1e6:.3f} ({min(sent) / 1e6:.3f}-{max(sent) / 1e6:.3f}) "
                     f"| {'' if ratio is None else f'{ratio:.0f}x'} | {'yes' if same else 'NO'} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Main


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0].strip("`: "))
    p.add_argument("--compose", choices=("auto", "v1", "v2"), default="auto",
                   help="docker compose (v2) or docker-compose (v1); auto: v2 when installed")
    p.add_argument("--steps", type=int, default=3, help="timed steps per method")
    p.add_argument("--warmup-steps", type=int, default=1, help="untimed steps per method")
    p.add_argument("--kill-worker", type=int, choices=range(SIZE), metavar="RANK",
                   help="kill this worker's container during the first run (the test then fails)")
    p.add_argument("--kill-after-s", type=float, default=5.0,
                   help="seconds after that worker started training to kill it")
    p.add_argument("--python", default=sys.executable,
                   help="the project's environment, whose versions the image gets")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup_steps < 0:
        p.error("--steps must be >= 1 and --warmup-steps >= 0")
    return args


@contextmanager
def uninterrupted() -> Iterator[None]:
    """Clean-up that a second Ctrl-C or SIGTERM cannot cut short."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_cluster(args: argparse.Namespace, work: Path, project: str, log: Path) -> None:
    """Build, run both :data:`RUNS`, check and print; ComposeTestError on any failure."""
    compose = compose_command(args.compose)
    base = choose_base(log)
    stage_wheels(args.python, log)
    build_image(base, work / "build.log")
    check_forward_policy()
    for index, run_spec in enumerate(RUNS):
        cluster = ComposeRun(compose, project, run_spec, work, args)
        try:
            wall = cluster.up(args.kill_worker if index == 0 else None, args.kill_after_s)
            cluster.check_shaped()
            say(f"{run_spec.label}: every worker finished in {wall:.0f} s")
        finally:
            with uninterrupted():
                cluster.down()
    records = load_records(work / "results")
    print("\n" + table(records) + "\n", flush=True)
    checks = check_records(records)
    for check in checks:
        print(f"- {'PASS' if check.passed else 'FAIL'}: {check.name} ({check.detail})", flush=True)
    failed = [c.name for c in checks if not c.passed]
    if failed:
        raise ComposeTestError(f"{len(failed)} check(s) failed: {'; '.join(failed)}")


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("compose-test: ERROR: installing and running the Docker engine needs root: run "
              "it as root (sudo make compose-test).", file=sys.stderr)
        return 1
    interrupt_on_signals()
    started = time.monotonic()
    project = f"hdgc{os.getpid()}"
    work = WORK / project
    work.mkdir(parents=True, exist_ok=True)
    log = work / "setup.log"
    status = 1
    try:
        ensure_packages(PACKAGES, log)
        with Daemon(work / "dockerd.log"):
            before = snapshot()
            try:
                run_cluster(args, work, project, log)
                status = 0
            finally:
                with uninterrupted():
                    changes = snapshot_changes(before, snapshot())
                    for change in changes:
                        print(f"compose-test: ERROR: left behind: {change}", file=sys.stderr)
                    if changes:
                        status = 1
    except ComposeTestError as error:
        print(f"compose-test: FAILED after {time.monotonic() - started:.0f} s"
              + (" (see above); everything it created was removed" if error.reported else f": {error}"),
              file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("compose-test: interrupted; its containers and networks were removed",
              file=sys.stderr)
        return 130
    say(("passed" if status == 0 else "failed") + f" in {time.monotonic() - started:.0f} s "
        f"(records and logs: {work})")
    return status


if __name__ == "__main__":
    sys.exit(main())
