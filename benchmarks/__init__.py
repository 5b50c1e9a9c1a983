"""Measurements of horovod_dgc, each run with ``python -m`` from the repository root:

* ``benchmarks.compress``: the cost of each method's compress and decompress on one large
  gradient, in read passes (``make bench-compress``);
* ``benchmarks.convergence``: dense against every method on 4 workers (``make
  bench-convergence``);
* ``benchmarks.cluster``: training steps on a cluster of network-namespace hosts with shaped
  links (``make cluster-bench``), and ``benchmarks/docker/`` the same on Docker Compose.
"""
