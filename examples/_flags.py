"""Method names and command-line flags the examples share, PyTorch and TensorFlow alike.

Framework-free, so that the twins of an example (``pytorch_imagenet_resnet50.py`` and
``tensorflow_imagenet_resnet50.py``) take the very same flags from one place.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Optional, Sequence, Union

from horovod_dgc.core.config import AGGREGATIONS, GatheredConfig
from horovod_dgc.core.methods import METHODS as TABLE
from horovod_dgc.core.wire import VALUE_FORMATS

# Horovod's own uncompressed exchanges, by the names the examples and benchmarks give them,
# and the name of each in Horovod's ``Compression`` namespace.
BASELINES = {"dense": "none", "fp16": "fp16"}
METHODS = (*BASELINES, *(spec.name for spec in TABLE))
SPARSE_METHODS = tuple(spec.name for spec in TABLE if spec.takes_density)
# Methods whose messages are aggregated by allgather or sparse all-reduce (--aggregation).
GATHERED_METHODS = tuple(spec.name for spec in TABLE if issubclass(spec.config, GatheredConfig))
# Methods that apply the momentum themselves (the wrapped optimizer then has none).
MOMENTUM_IN_COMPRESSOR = tuple(spec.name for spec in TABLE if spec.momentum_in_compressor)


def add_compression_flags(p: argparse.ArgumentParser) -> None:
    """``--compression`` and the methods' options."""
    comp = p.add_argument_group("gradient compression")
    comp.add_argument("--compression", choices=METHODS, default="dgc",
                      help="dense and fp16: Horovod's own all-reduce (Compression.none and .fp16); "
                      f"{', '.join(spec.name for spec in TABLE)}: horovod_dgc's methods "
                      "(docs/guide/choosing.md)")
    comp.add_argument("--density", type=float, default=0.001,
                      help=f"final fraction of each compressed tensor sent per step "
                      f"({', '.join(SPARSE_METHODS)})")
    comp.add_argument("--sparsity-warmup-epochs", type=int, default=4,
                      help="epochs of DGC's warm-up sparsity (densities 25%%, 6.25%%, ... down "
                      "to --density); sparse methods")
    comp.add_argument("--value-dtype", choices=VALUE_FORMATS,
                      help="how the values sent travel (sparse methods; default: the method's)")
    add_aggregation_flag(comp)
    comp.add_argument("--min-numel", type=int,
                      help="tensors with fewer elements are sent at their own small density "
                      "(default: the method's)")
    add_small_density_flag(comp)
    add_beta_flag(comp)
    comp.add_argument("--block-size", type=int, help="blocksign: elements per scaled sign block "
                      "(default: one block per tensor)")


def add_adaptive_flag(p) -> None:
    """``--adaptive on``: ``adaptive=True`` (each bucket dense where that is predicted faster)."""
    p.add_argument("--adaptive", choices=("off", "on"), default="off",
                   help="on: each bucket goes dense where that is predicted faster on this link "
                   "(adaptive=True)")


# ``--small-density dense``: the small tensors travel dense (``small_density=None``).
DENSE = "dense"


def add_small_density_flag(p) -> None:
    """``--small-density``: a density, or ``dense`` for ``small_density=None``."""
    p.add_argument("--small-density", type=_density_or_dense,
                   help="density of the small tensors (under --min-numel elements, and 1-D "
                   "ones), or 'dense' to all-reduce them uncompressed (sparse methods; default: "
                   "the method's)")


def _density_or_dense(text: str) -> Union[float, str]:
    return DENSE if text == DENSE else float(text)


def add_beta_flag(p) -> None:
    """``--beta``, ScaleCom's low-pass filter of the memory."""
    p.add_argument("--beta", type=float, help="scalecom: low-pass filter of the memory, in "
                   "(0, 1]; 1 is plain error feedback (default: the method's)")


def add_aggregation_flag(p) -> None:
    """``--aggregation``, for the methods of ``GATHERED_METHODS``."""
    p.add_argument("--aggregation", choices=AGGREGATIONS,
                   help=f"how the messages of {', '.join(GATHERED_METHODS)} are combined "
                   "(default: the method's, allgather)")


def compression_options(args: argparse.Namespace, warmup_epochs: int) -> dict:
    """The options of ``args.compression`` that the sparse-method flags set."""
    if args.compression not in SPARSE_METHODS:
        return {}
    options = dict(density=args.density, warmup_epochs=warmup_epochs,
                   **given(args, "value_dtype"))
    if args.compression in GATHERED_METHODS:
        options.update(given(args, "aggregation"))
    if args.compression == "scalecom":
        options.update(given(args, "beta"))
    small = getattr(args, "small_density", None)
    if small is not None:
        options["small_density"] = None if small == DENSE else small
    return options


def given(args: argparse.Namespace, *names: str) -> dict:
    """The options among ``names`` set on the command line (the library keeps its own
    defaults for the others)."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def imagenet_parser(description: str, *, loader_workers_help: str, optimizers: Sequence[str],
                    optimizer_help: str) -> argparse.ArgumentParser:
    """Every flag of the ImageNet examples, documented; the twins differ only in the data
    loader's parallelism and in which distributed optimizers they offer."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    data = p.add_argument_group("data")
    data.add_argument("--train-dir", type=Path, help="ImageFolder directory to train on")
    data.add_argument("--val-dir", type=Path, help="ImageFolder directory to validate on "
                      "after every epoch (optional)")
    data.add_argument("--synthetic", action="store_true",
                      help="random images and labels instead of --train-dir")
    data.add_argument("--synthetic-images", type=int, default=12800,
                      help="images per epoch with --synthetic")
    data.add_argument("--num-classes", type=int, default=1000,
                      help="classes with --synthetic (an ImageFolder has its own)")
    data.add_argument("--image-size", type=int, default=224, help="side of the input images, pixels")
    data.add_argument("--loader-workers", type=int, default=2, help=loader_workers_help)

    train = p.add_argument_group("training")
    train.add_argument("--epochs", type=int, default=90, help="epochs to train in all, "
                       "counting those of the checkpoint resumed from")
    train.add_argument("--batch-size", type=int, default=32, help="images per backward pass, per rank")
    train.add_argument("--val-batch-size", type=int, default=32, help="images per forward pass "
                       "in validation, per rank")
    train.add_argument("--batches-per-allreduce", type=int, default=1,
                       help="backward passes accumulated locally before each exchange")
    train.add_argument("--steps-per-epoch", type=int,
                       help="stop each epoch after this many exchanges (None: the whole shard)")
    train.add_argument("--base-lr", type=float, default=0.0125,
                       help="learning rate per worker and per --batch-size images; scaled by "
                       "the number of workers and --batches-per-allreduce")
    train.add_argument("--warmup-epochs", type=float, default=5,
                       help="epochs of linear learning-rate warm-up from --base-lr")
    train.add_argument("--lr-decay-epochs", type=str, default="30,60,80",
                       help="epochs at which the learning rate drops tenfold (comma separated)")
    train.add_argument("--momentum", type=float, default=0.9,
                       help="SGD momentum (inside the compressor for dgc and blocksign)")
    train.add_argument("--wd", type=float, default=5e-5,
                       help="weight decay (inside the compressor for dgc)")
    train.add_argument("--optimizer", choices=tuple(optimizers), default=optimizers[0],
                       help=optimizer_help)
    train.add_argument("--seed", type=int, default=42,
                       help="seed of the model's initial weights and of the data order")
    add_compression_flags(p)

    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"),
                      help="where checkpoints are written every epoch and resumed from")
    ckpt.add_argument("--keep-checkpoints", type=int, default=2,
                      help="most recent epochs whose checkpoints are kept (0: keep all)")
    p.add_argument("--json", type=Path, help="write this run's per-epoch metrics here (rank 0)")
    return p


def parse_imagenet_args(p: argparse.ArgumentParser,
                        argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse and check what both twins check; ``lr_decay_epochs`` becomes a list of ints."""
    args = p.parse_args(argv)
    if not args.synthetic and args.train_dir is None:
        p.error("give --train-dir DIR (an ImageFolder directory) or --synthetic")
    args.lr_decay_epochs = [int(e) for e in args.lr_decay_epochs.split(",") if e]
    return args
