"""The environment works with real processes: Horovod over Gloo and MPI, both frameworks."""
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import horovodrun, mpirun


@pytest.mark.slow  # ~50 s; the smoke tests below exercise both frameworks and both controllers
def test_check_build_lists_both_frameworks_and_both_controllers():
    out = subprocess.run([str(Path(sys.executable).parent / "horovodrun"), "--check-build"],
                         capture_output=True, text=True, check=True).stdout
    for name in ("TensorFlow", "PyTorch", "MPI", "Gloo"):
        assert f"[X] {name}" in out, out


def test_torch_allreduce_allgather_two_ranks_gloo():
    # The horovodrun executable itself (every other test launches through tests/warm_horovodrun.py).
    out = horovodrun("smoke.py", 2, ["torch"], cli=True)
    assert out.count("ok mpi=False gloo=True") == 2, out


def test_tensorflow_allreduce_allgather_two_ranks_gloo():
    out = horovodrun("smoke.py", 2, ["tensorflow"], cli=True)
    assert out.count("tensorflow rank") == 2 and out.count(" ok") == 2, out


def test_torch_two_ranks_mpirun():
    out = mpirun("smoke.py", 2, ["torch"])
    assert out.count("ok mpi=True") == 2, out


def test_hvd_init_with_mpi4py_communicator():
    out = mpirun("smoke.py", 2, ["torch", "--mpi4py"])
    assert out.count("ok mpi=True") == 2, out
