"""The set-up script stops with one clear sentence when root or the registries are missing."""
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "setup_env.sh"


def run_setup(tmp_path: Path, env_extra: dict, user: str = None) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "HOROVOD_DGC_VENV": str(tmp_path / "venv"),
           "HOROVOD_DGC_CACHE": str(tmp_path / "cache"), **env_extra}
    cmd = ["bash", str(SETUP)]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def error_lines(proc: subprocess.CompletedProcess) -> list:
    return [line for line in proc.stderr.splitlines() if "ERROR" in line]


@pytest.fixture
def world_writable_dir():
    """A directory another user can write to (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="horovod_dgc_setup_"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_missing_system_package_without_root_is_one_sentence(world_writable_dir):
    tmp_path = world_writable_dir
    nobody = pwd.getpwnam("nobody").pw_uid
    proc = run_setup(tmp_path, {"HOROVOD_DGC_SYSTEM_PACKAGES": "horovod-dgc-no-such-package"},
                     user=str(nobody))
    assert proc.returncode == 1
    assert error_lines(proc) == ["setup: ERROR: system packages horovod-dgc-no-such-package are "
                                 "missing and installing them needs root: run 'sudo apt-get install "
                                 "horovod-dgc-no-such-package' and then this command again."], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_no_network_to_pypi_is_one_sentence(tmp_path):
    proc = run_setup(tmp_path, {"PIP_CONFIG_FILE": os.devnull,
                                "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
                                "PIP_DEFAULT_TIMEOUT": "2"})
    assert proc.returncode == 1
    lines = error_lines(proc)
    assert len(lines) == 1 and "no network to PyPI?" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
