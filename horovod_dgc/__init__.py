"""horovod_dgc: gradient compression for Horovod (DGC, Top-k, Gaussian-k, ...).

``horovod_dgc.core`` is framework-free; ``horovod_dgc.torch`` and ``horovod_dgc.tensorflow``
are the adapters. Import the adapter of your framework::

    from horovod_dgc.torch import Compression
"""
__version__ = "0.1.0"
