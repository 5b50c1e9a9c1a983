"""``--compression`` and the method's options for the TensorFlow examples."""
from __future__ import annotations

import argparse
from typing import Any, Sequence

from horovod_dgc.tensorflow import Compression

METHODS = ("none", "fp16", "dgc", "topk", "gaussiank", "scalecom", "blocksign")
DENSE_METHODS = ("none", "fp16")
SPARSE_METHODS = ("dgc", "topk", "gaussiank", "scalecom")
# Methods that apply the momentum themselves (the optimizer then has none).
MOMENTUM_IN_COMPRESSOR = ("dgc", "blocksign")


def add_flags(p: argparse.ArgumentParser) -> None:
    """The compression flags (those of examples/pytorch_imagenet_resnet50.py)."""
    comp = p.add_argument_group("gradient compression")
    comp.add_argument("--compression", choices=METHODS, default="dgc",
                      help="none and fp16: Horovod's dense all-reduce; the others: horovod_dgc's")
    comp.add_argument("--density", type=float, default=0.001,
                      help="final fraction of each compressed tensor sent per step (sparse methods)")
    comp.add_argument("--sparsity-warmup-epochs", type=int, default=4,
                      help="epochs of warm-up sparsity (densities 25%%, 6.25%%, ... down to --density)")
    comp.add_argument("--value-dtype", choices=("float32", "float16"), default="float32",
                      help="wire dtype of the values sent (sparse methods)")
    comp.add_argument("--min-numel", type=int, default=1024, help="tensors with fewer elements travel dense")
    comp.add_argument("--beta", type=float, default=1.0, help="scalecom: low-pass filter of the memory")
    comp.add_argument("--block-size", type=int, help="blocksign: elements per scaled sign block "
                      "(default: one block per tensor)")


def make(args: argparse.Namespace, variables: Sequence[Any]):
    """Horovod's compressor for ``args.compression``, keyed by ``variables``."""
    if args.compression in DENSE_METHODS:
        return getattr(Compression, args.compression)
    options: dict = dict(min_numel=args.min_numel)
    if args.compression in SPARSE_METHODS:
        options.update(density=args.density, warmup_epochs=args.sparsity_warmup_epochs,
                       value_dtype=args.value_dtype)
    if args.compression in MOMENTUM_IN_COMPRESSOR:
        options["momentum"] = args.momentum
    if args.compression == "dgc" and getattr(args, "wd", 0.0):
        options["weight_decay"] = args.wd  # DGC folds it in before its momentum correction
    if args.compression == "scalecom":
        options["beta"] = args.beta
    if args.compression == "blocksign":
        options["block_size"] = args.block_size
    return getattr(Compression, args.compression)(variables=variables, **options)


def optimizer_momentum(args: argparse.Namespace) -> float:
    """The optimizer's momentum: none where the compressor applies it."""
    return 0.0 if args.compression in MOMENTUM_IN_COMPRESSOR else args.momentum


def ratio(compression) -> float:
    """Dense bytes over bytes handed to Horovod since the last reset (1 for dense, fp16: 2)."""
    if hasattr(compression, "stats"):
        return compression.stats().ratio
    return 2.0 if compression is Compression.fp16 else 1.0
