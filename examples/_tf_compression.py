"""The compressor the TensorFlow examples build from ``--compression`` and its options
(flags in ``_flags.py``)."""
from __future__ import annotations

import argparse
from typing import Any, Sequence

from _flags import BASELINES, MOMENTUM_IN_COMPRESSOR, compression_options, given
from horovod_dgc.tensorflow import Compression


def make(args: argparse.Namespace, variables: Sequence[Any]):
    """Horovod's compressor for ``args.compression``, keyed by ``variables``."""
    if args.compression in BASELINES:
        return getattr(Compression, BASELINES[args.compression])
    options: dict = given(args, "min_numel")
    options.update(compression_options(args, args.sparsity_warmup_epochs))
    if args.compression in MOMENTUM_IN_COMPRESSOR:
        options["momentum"] = args.momentum
    if args.compression == "dgc" and getattr(args, "wd", 0.0):
        options["weight_decay"] = args.wd  # DGC folds it in before its momentum correction
    if args.compression == "blocksign":
        options["block_size"] = args.block_size
    if getattr(args, "adaptive", "off") == "on":
        options["adaptive"] = True
    return getattr(Compression, args.compression)(variables=variables, **options)


def optimizer_momentum(args: argparse.Namespace) -> float:
    """The optimizer's momentum: none where the compressor applies it."""
    return 0.0 if args.compression in MOMENTUM_IN_COMPRESSOR else args.momentum


def ratio(compression) -> float:
    """Dense bytes over bytes handed to Horovod since the last reset (1 for dense, fp16: 2)."""
    if hasattr(compression, "stats"):
        return compression.stats().ratio
    return 2.0 if compression is Compression.fp16 else 1.0
