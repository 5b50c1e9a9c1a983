"""The Docker Compose cluster for users: it parses, refers to files that exist, and starts
the same entrypoint with the same variables as the network-namespace cluster."""
from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import uuid

import pytest
import yaml

from horovod_dgc.cluster import settings

from conftest import ROOT

DOCKER = ROOT / "benchmarks" / "docker"
LAUNCHER = ["python", "-m", "horovod_dgc.cluster"]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "docker-compose.yml").read_text())


def workers(compose: dict) -> dict:
    return {name: s for name, s in compose["services"].items() if name != "rendezvous"}


def address(service: dict) -> str:
    return service["networks"]["cluster"]["ipv4_address"]


def test_build_points_at_the_dockerfile_and_its_copied_paths_exist(compose):
    for name, service in compose["services"].items():
        context = (DOCKER / service["build"]["context"]).resolve()
        assert context == ROOT, name
        dockerfile = context / service["build"]["dockerfile"]
        assert dockerfile.is_file(), name
    for line in (DOCKER / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"


def test_services_run_the_netns_clusters_entrypoint(compose):
    assert compose["services"]["rendezvous"]["command"] == [*LAUNCHER, "rendezvous"]
    for name, service in workers(compose).items():
        command = service["command"]
        assert command[:5] == [*LAUNCHER, "worker", "--"], name
        assert (ROOT / command[6]).is_file(), f"{name} runs a missing {command[6]}"
    # The netns harness starts its workers through the very same module.
    harness = (ROOT / "benchmarks" / "cluster" / "job.py").read_text()
    assert '"-m", "horovod_dgc.cluster"' in harness


def test_workers_use_the_launchers_variables_with_distinct_ranks(compose):
    services = workers(compose)
    ranks = sorted(int(s["environment"][settings.RANK]) for s in services.values())
    assert ranks == list(range(len(services)))
    rendezvous = compose["services"]["rendezvous"]
    assert int(rendezvous["environment"][settings.SIZE]) == len(services)
    subnet = ipaddress.ip_network(compose["networks"]["cluster"]["ipam"]["config"][0]["subnet"])
    assert subnet.subnet_of(ipaddress.ip_network("198.18.0.0/15"))
    for name, service in services.items():
        env = service["environment"]
        for variable in (settings.SIZE, settings.RENDEZVOUS_ADDR, settings.RENDEZVOUS_PORT, settings.IFACE):
            assert variable in env, f"{name} lacks {variable}"
        assert int(env[settings.SIZE]) == len(services)
        assert env[settings.RENDEZVOUS_ADDR] == address(rendezvous)
        assert env[settings.RENDEZVOUS_PORT] == rendezvous["environment"][settings.RENDEZVOUS_PORT]
        assert ipaddress.ip_address(address(service)) in subnet
        assert "NET_ADMIN" in service["cap_add"]
        settings.WorkerSettings.from_env({k: str(v) for k, v in env.items()})


def test_entrypoint_script_runs_the_command_unchanged_without_shaping():
    env = {k: v for k, v in os.environ.items() if k != "LINK_RATE"}
    out = subprocess.run([str(DOCKER / "shape_link.sh"), "echo", "a b", "c"], env=env,
                         capture_output=True, text=True, check=True)
    assert out.stdout == "a b c\n"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                    reason="shaping a link needs root, ip and tc")
def test_entrypoint_script_shapes_the_interface_when_asked():
    namespace = f"hdgc-docker-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", namespace], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", namespace, "ip", "link", "add", "eth0", "type", "veth",
                        "peer", "name", "eth0-peer"],
                       check=True)
        env = dict(os.environ, LINK_RATE="100mbit", HOROVOD_DGC_IFACE="eth0")
        env.pop("LINK_DELAY", None)
        out = subprocess.run(["ip", "netns", "exec", namespace, str(DOCKER / "shape_link.sh"),
                              "tc", "qdisc", "show", "dev", "eth0"],
                             env=env, capture_output=True, text=True, check=True)
        assert "tbf" in out.stdout and "rate 100Mbit" in out.stdout, out.stdout
    finally:
        subprocess.run(["ip", "netns", "delete", namespace], check=True)
