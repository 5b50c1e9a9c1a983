"""Horovod's own paths never run the compressor with one worker.

With ``hvd.size() == 1`` Horovod's ``DistributedOptimizer`` (PyTorch) registers no gradient
hooks, and its TensorFlow tape and Keras optimizer take the branch of their all-reduce
condition that returns the gradients as they are: the compressor is never called (in
TensorFlow it is traced, into a branch that never runs). So a job started on one worker
(``python train.py``, ``horovodrun -np 1``) trains with the wrapped optimizer alone, unlike
the same script on two workers. Where the compressor applies momentum or weight decay
itself (DGC; blocksign with momentum), that run would silently lose them: refused. Otherwise
the run is the dense baseline: said once.
"""
from __future__ import annotations

import warnings


def refuse_or_warn(config, path: str, instead: str) -> None:
    """Raise ValueError, or warn (UserWarning), that Horovod's ``path`` (e.g.
    ``"DistributedOptimizer"``) skips the compressor of ``config`` on one worker.

    Args:
        config: the compressor's method config (a
            :class:`~horovod_dgc.core.CompressionConfig`).
        path: the Horovod object that skips it, named for the user.
        instead: what the user can do, one sentence without its final full stop.
    """
    skipped = (f"with one worker (hvd.size() == 1) Horovod's {path} never calls the compressor "
               f"(it skips every collective)")
    method = type(config).__name__.replace("Config", "")
    if config.needs_plain_optimizer:
        applied = ", ".join(f"{key}={getattr(config, key)}" for key in ("momentum", "weight_decay")
                            if getattr(config, key, 0.0))
        raise ValueError(f"{skipped}: {method} would not apply its {applied}, so this run would "
                         f"train with the plain optimizer alone; {instead}")
    warnings.warn(f"{skipped}: this run applies uncompressed gradients, unlike the same script "
                  f"on two or more workers, and stats() stays at zero; {instead}", stacklevel=3)
