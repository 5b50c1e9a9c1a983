"""The Docker Compose cluster for users: it parses, refers to files that exist, and starts
the same entrypoint with the same variables as the network-namespace cluster. (``make
compose-test`` runs it for real; ``tests/test_compose_test.py`` tests that script's logic.)"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import uuid

import pytest
import yaml

from benchmarks.compose import compose_test
from horovod_dgc.cluster import settings

from conftest import ROOT

DOCKER = ROOT / "docker"
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
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from=") for w in words):
            for source in words[1:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"


def test_dockerfile_takes_its_base_as_an_argument_with_a_public_default():
    text = (DOCKER / "Dockerfile").read_text()
    default = compose_test.dockerfile_base_default(DOCKER / "Dockerfile")
    assert re.fullmatch(r"python:3\.11-slim-bookworm", default)
    first_from = next(line for line in text.splitlines() if line.startswith("FROM "))
    assert first_from.split()[1] == "${BASE_IMAGE}"
    assert text.index("ARG BASE_IMAGE=") < text.index(first_from)
    # compose_test.py prunes the untagged images of its earlier builds by this label.
    assert f"LABEL {compose_test.IMAGE_LABEL}" in text


def test_the_installer_and_the_entrypoint_are_valid_shell():
    for script in ("install_image.sh", "shape_link.sh"):
        subprocess.run(["bash", "-n", str(DOCKER / script)], check=True)
    out = subprocess.run(["bash", str(DOCKER / "install_image.sh")], capture_output=True, text=True)
    assert out.returncode != 0 and "usage" in out.stderr


def test_the_image_gets_what_the_workers_run(compose):
    """Every file the compose-test's worker command and the default worker command run is
    copied into the image's working directory."""
    copied = []
    for line in (DOCKER / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--") for w in words):
            copied += [w.rstrip("/") for w in words[1:-1]]
    needed = ["benchmarks/cluster/step.py", "benchmarks/compose/train_check.py",
              "docker/shape_link.sh", "examples/_resnet.py"]
    for path in needed:
        assert any(path == c or path.startswith(c + "/") for c in copied), f"{path} not copied"
    spec = compose_test.Run("unshaped", "")
    command = compose_test.worker_command(spec, compose_test.parse_args([]))
    assert command[:5] == [*LAUNCHER, "worker", "--"]
    module = command[command.index("-m", 5) + 1]
    assert (ROOT / (module.replace(".", "/") + ".py")).is_file()


def test_the_override_gives_every_worker_the_command(compose, tmp_path):
    path = tmp_path / "override.yml"
    compose_test.write_override(path, ["python", "-c", "pass"])
    override = yaml.safe_load(path.read_text())
    assert set(override["services"]) == set(workers(compose))
    assert json.loads(path.read_text()) == override


def test_the_network_is_internal_and_results_go_where_asked(compose):
    assert compose["networks"]["cluster"]["internal"] is True
    for name, service in workers(compose).items():
        assert any(v.startswith("${RESULTS_DIR:-") and v.endswith(":/results")
                   for v in service["volumes"]), name


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose (v1) is not installed")
def test_docker_compose_v1_reads_the_file_and_the_override(tmp_path):
    override = tmp_path / "override.yml"
    compose_test.write_override(override, ["python", "-c", "pass"])
    env = dict(os.environ, RESULTS_DIR=str(tmp_path), LINK_RATE="100mbit")
    out = subprocess.run(["docker-compose", "-f", str(DOCKER / "docker-compose.yml"), "-f",
                          str(override), "config"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    assert config["services"]["worker3"]["command"] == ["python", "-c", "pass"]
    assert config["services"]["worker3"]["environment"]["LINK_RATE"] == "100mbit"
    assert config["networks"]["cluster"]["internal"] is True


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
