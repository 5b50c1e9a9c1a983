"""Measurements of horovod_dgc, each run with ``python -m`` from the repository root:

* ``benchmarks.compress``: the cost of each method's compress and decompress on one large
  gradient, in read passes (``make bench-compress``);
* ``benchmarks.convergence``: dense against every method on 4 workers (``make
  bench-convergence``);
* ``benchmarks.cluster``: training steps on a cluster of network-namespace hosts with shaped
  links (``make cluster-bench``), and ``docker/`` the same on Docker Compose (``benchmarks/compose/`` runs it: ``make compose-test``).
"""

import os
from pathlib import Path
from typing import Dict

ROOT = Path(__file__).resolve().parents[1]


def worker_env(**extra: str) -> Dict[str, str]:
    """The environment of a worker launched from this repository (horovodrun, mpirun, a
    cluster host): this one's, with the repository first on ``PYTHONPATH``, unbuffered output,
    one OpenMP thread per worker (the workers share the machine's cores), TensorFlow's C++
    log quiet, and what OpenMPI needs to run as root in a container; then ``extra``."""
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            "TF_CPP_MIN_LOG_LEVEL": "3", "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            # OpenMPI refuses shared-memory single copy in containers without this.
            "OMPI_MCA_btl_vader_single_copy_mechanism": "none", **extra}
