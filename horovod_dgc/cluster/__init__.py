"""Launch Horovod on a cluster of hosts without SSH or ``horovodrun``: one or more workers per
host.

Every host runs the same entrypoint, configured by environment variables only, so the same
command serves a Docker Compose service, a network-namespace test cluster
(``benchmarks/cluster/netns.py``) or hosts started by hand::

    # once, on a host every worker can reach
    python -m horovod_dgc.cluster rendezvous
    # on every host, with its own HOROVOD_DGC_RANK
    python -m horovod_dgc.cluster worker -- python benchmarks/cluster/step.py

``rendezvous`` serves Horovod's Gloo rendezvous (the HTTP key-value store ``horovodrun``
runs inside its driver) on a fixed port until it is stopped. ``worker`` waits until that
server answers, sets the ``HOROVOD_*`` variables ``horovodrun --gloo`` would set for this
worker's slot, and replaces itself with the command (same process id).

The worker first checks that the host name resolves to an address of the interface, and
stops with an error naming both otherwise: Horovod 0.28.1 binds the Gloo connections of its
process sets to the host name's address whatever ``HOROVOD_GLOO_IFACE`` says, so a name
resolving to 127.0.0.1 would leave the other hosts unable to connect. (Docker gives each
container an ``/etc/hosts`` line for its name; ``benchmarks/cluster/netns.py`` writes one per
namespace.)

Environment variables (one source of truth: :mod:`horovod_dgc.cluster.settings`):

==============================  =========  ==============================================
variable                        used by    meaning
==============================  =========  ==============================================
``HOROVOD_DGC_SIZE``            both       number of workers, required
``HOROVOD_DGC_RANK``            worker     this worker's rank, 0 .. size-1, required
``HOROVOD_DGC_LOCAL_SIZE``      both       workers per host (default 1): ranks
                                           ``h * LOCAL_SIZE`` onwards run on host ``h``
``HOROVOD_DGC_RENDEZVOUS_ADDR`` both       worker: address of the rendezvous server,
                                           required; rendezvous: address to listen on
                                           (default ``0.0.0.0``, every interface)
``HOROVOD_DGC_RENDEZVOUS_PORT`` both       TCP port of the rendezvous server (default
                                           29600)
``HOROVOD_DGC_IFACE``           worker     network interface Gloo uses (default ``eth0``);
                                           also given to PyTorch's Gloo as
                                           ``GLOO_SOCKET_IFNAME``
``HOROVOD_DGC_TIMEOUT_S``       worker     seconds to wait for the rendezvous server
                                           before giving up with an error (default 60)
==============================  =========  ==============================================

The worker sets ``HOROVOD_RANK``/``SIZE`` from these, ``HOROVOD_LOCAL_RANK``/``SIZE`` (its
place on its host), ``HOROVOD_CROSS_RANK``/``SIZE`` (its host's, and the number of hosts),
``HOROVOD_HOSTNAME=host<host>``, ``HOROVOD_CONTROLLER=gloo``, ``HOROVOD_CPU_OPERATIONS=gloo``,
``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``PORT`` and ``HOROVOD_GLOO_IFACE``.
"""
from .settings import RendezvousSettings, WorkerSettings, host_label

__all__ = ["RendezvousSettings", "WorkerSettings", "host_label"]
