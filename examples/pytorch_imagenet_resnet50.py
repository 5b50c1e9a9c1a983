"""ResNet-50 on ImageNet (or any ImageFolder directory) with Horovod and gradient compression.

    horovodrun -np 4 -H localhost:4 python examples/pytorch_imagenet_resnet50.py \\
        --train-dir /data/imagenet/train --val-dir /data/imagenet/val --compression dgc

The usual Horovod recipe: the learning rate scales with the number of workers and
``--batches-per-allreduce``, warms up linearly over the first epochs (Goyal et al. 2017) and
then decays tenfold at ``--lr-decay-epochs``. DGC's sparsity warm-up follows the epochs.
After every epoch rank 0 saves the model and optimizer, and every rank saves its own part of
the compressor state (its residuals and momentum, which are gradient not yet sent); a new run
with the same ``--checkpoint-dir`` resumes from the latest complete epoch. A resume on another
number of workers redistributes the compressor memories without losing gradient mass (their
average is kept; see horovod_dgc/torch/checkpoint.py).

On a CPU, ``--image-size 32 --batch-size 4 --steps-per-epoch 3`` keeps an epoch to seconds
while the gradient stays ResNet-50's (25.6 M parameters). ``make imagenet-demo`` runs that
on a generated ImageFolder.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, List, Optional

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _flags import (BASELINES, MOMENTUM_IN_COMPRESSOR, compression_options,  # noqa: E402
                    given, imagenet_parser, parse_imagenet_args)
from _imagefolder import ImageFolder, SyntheticImages  # noqa: E402
from _resnet import resnet50  # noqa: E402

import horovod_dgc.torch as hdgc  # noqa: E402
from horovod_dgc.torch.checkpoint import redistribute  # noqa: E402
from horovod_dgc.torch.optimizer import COMPRESSOR_STATE_KEY  # noqa: E402

def build_parser() -> argparse.ArgumentParser:
    """Every flag of the example, documented (shared with the TensorFlow twin)."""
    return imagenet_parser(__doc__.split("\n")[0],
                           loader_workers_help="data-loading processes per rank (0: load in the "
                           "training process)",
                           optimizers=("horovod", "fused"),
                           optimizer_help="horovod: the stock hvd.DistributedOptimizer with "
                           "compression=; fused: horovod_dgc.torch.DistributedOptimizer (sparse "
                           "methods only)")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = parse_imagenet_args(p, argv)
    if args.optimizer == "fused" and args.compression in BASELINES:
        p.error("--optimizer fused needs a compressing method, not --compression "
                f"{args.compression}")
    return args


# -- model, compressor and optimizer ----------------------------------------------------------------
def make_compression(args: argparse.Namespace, model: nn.Module):
    """The compressor for ``--compression`` (sparse ones keyed by parameter name)."""
    if args.compression in BASELINES:
        return getattr(hdgc.Compression, BASELINES[args.compression])
    factory = getattr(hdgc.Compression, args.compression)
    options = given(args, "min_numel")
    options.update(compression_options(args, args.sparsity_warmup_epochs))
    if args.compression == "blocksign":
        options["block_size"] = args.block_size
    if args.compression in MOMENTUM_IN_COMPRESSOR and args.optimizer == "horovod":
        options["momentum"] = args.momentum
    if args.compression == "dgc" and args.optimizer == "horovod":
        options["weight_decay"] = args.wd
    return factory(named_parameters=model.named_parameters(), **options)


def make_optimizer(args: argparse.Namespace, model: nn.Module, compression) -> torch.optim.Optimizer:
    """SGD wrapped for Horovod. On the stock path the momentum (and DGC's weight decay) a
    compressor applies itself is left out of the SGD; the fused optimizer moves it there."""
    inside = args.optimizer == "horovod" and args.compression in MOMENTUM_IN_COMPRESSOR
    sgd = torch.optim.SGD(model.parameters(), lr=args.base_lr,
                          momentum=0.0 if inside else args.momentum,
                          weight_decay=0.0 if inside and args.compression == "dgc" else args.wd)
    wrap = hvd.DistributedOptimizer if args.optimizer == "horovod" else hdgc.DistributedOptimizer
    return wrap(sgd, named_parameters=model.named_parameters(), compression=compression,
                backward_passes_per_step=args.batches_per_allreduce)


def learning_rate(args: argparse.Namespace, epoch: float) -> float:
    """Per-step learning rate at fractional ``epoch``: linear warm-up from ``base_lr`` to
    ``base_lr * workers * batches_per_allreduce``, then tenfold drops."""
    peak = args.base_lr * hvd.size() * args.batches_per_allreduce
    if epoch < args.warmup_epochs:
        return args.base_lr + (peak - args.base_lr) * epoch / args.warmup_epochs
    return peak * 0.1 ** sum(epoch >= e for e in args.lr_decay_epochs)


# -- data ---------------------------------------------------------------------------------------------
def make_loader(args: argparse.Namespace, dataset, batch_size: int, shuffle: bool):
    sampler = torch.utils.data.distributed.DistributedSampler(
        dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=shuffle, seed=args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                                         num_workers=args.loader_workers, drop_last=shuffle)
    return sampler, loader


def make_datasets(args: argparse.Namespace):
    if args.synthetic:
        train = SyntheticImages(args.num_classes, args.image_size, args.synthetic_images, args.seed)
    else:
        train = ImageFolder(args.train_dir, args.image_size, train=True)
    val = ImageFolder(args.val_dir, args.image_size, train=False) if args.val_dir else None
    return train, val


# -- checkpoints ----------------------------------------------------------------------------------------
class Checkpoints:
    """``checkpoint-EEE.pt`` (rank 0: model and optimizer after epoch EEE) and
    ``compressor-EEE-rankR-of-N.pt`` (rank R's compressor part). An epoch counts as saved
    once its ``checkpoint-EEE.pt`` exists: it is written last, after every rank's part."""

    def __init__(self, folder: Path, keep: int):
        self.folder, self.keep = Path(folder), keep

    def model_file(self, epoch: int) -> Path:
        return self.folder / f"checkpoint-{epoch:03d}.pt"

    def part_file(self, epoch: int, rank: int, world_size: int) -> Path:
        return self.folder / f"compressor-{epoch:03d}-rank{rank}-of-{world_size}.pt"

    def latest_epoch(self) -> int:
        """The last saved epoch (0: none), as rank 0 sees it, on every rank."""
        found = 0
        if hvd.rank() == 0 and self.folder.is_dir():
            epochs = [int(m.group(1)) for f in self.folder.iterdir()
                      if (m := re.fullmatch(r"checkpoint-(\d+)\.pt", f.name))]
            found = max(epochs, default=0)
        return hvd.broadcast_object(found, root_rank=0, name="latest_epoch")

    def save(self, epoch: int, model: nn.Module, optimizer, compression, method: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if hasattr(compression, "state_dict"):
            _atomic_save(compression.state_dict(), self.part_file(epoch, hvd.rank(), hvd.size()))
        optimizer_state = optimizer.state_dict()
        optimizer_state.pop(COMPRESSOR_STATE_KEY, None)  # the parts above hold every rank's
        hvd.barrier()
        if hvd.rank() == 0:
            _atomic_save({"epoch": epoch, "compression": method, "model": model.state_dict(),
                          "optimizer": optimizer_state}, self.model_file(epoch))
        self.prune(epoch)

    def prune(self, epoch: int) -> None:
        """Delete this rank's files of epochs older than the ``keep`` latest."""
        if self.keep <= 0 or epoch - self.keep < 1:
            return
        old = epoch - self.keep
        for f in self.folder.glob(f"compressor-{old:03d}-rank{hvd.rank()}-of-*.pt"):
            f.unlink()
        if hvd.rank() == 0:
            self.model_file(old).unlink(missing_ok=True)

    def load(self, epoch: int, model: nn.Module, optimizer, compression, method: str) -> None:
        """Restore epoch ``epoch`` on every rank (the folder is shared): model and optimizer
        from rank 0's file, this rank's compressor part (redistributed if the number of
        workers changed)."""
        saved = torch.load(self.model_file(epoch))
        if saved["compression"] != method:
            raise ValueError(f"{self.model_file(epoch)} was trained with --compression "
                             f"{saved['compression']}, this run asks for {method}")
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        if hasattr(compression, "load_state_dict"):
            compression.load_state_dict(self.compressor_part(epoch))

    def compressor_part(self, epoch: int) -> dict:
        """This rank's compressor state for ``epoch``, from the parts saved then."""
        parts = sorted(self.folder.glob(f"compressor-{epoch:03d}-rank*-of-*.pt"))
        sizes = {int(re.search(r"-of-(\d+)\.pt$", f.name).group(1)) for f in parts}
        if len(sizes) != 1 or len(parts) != next(iter(sizes)):
            raise FileNotFoundError(f"{self.folder} lacks compressor parts of epoch {epoch}: found "
                                    f"{[f.name for f in parts]}, need one per rank of the saving run")
        saved_world = sizes.pop()
        if saved_world == hvd.size():
            return torch.load(self.part_file(epoch, hvd.rank(), saved_world))
        every = [torch.load(self.part_file(epoch, r, saved_world)) for r in range(saved_world)]
        return redistribute(every, hvd.size(), hvd.rank())


def _atomic_save(obj, path: Path) -> None:
    partial = path.with_suffix(".partial")
    torch.save(obj, partial)
    os.replace(partial, path)


# -- training -------------------------------------------------------------------------------------------
@dataclass
class EpochMetrics:
    epoch: int
    loss: float
    accuracy: float
    images_per_s: float
    compression_ratio: float
    density: float
    lr: float
    val_loss: Optional[float] = None
    val_accuracy: Optional[float] = None


def compression_ratio(compression) -> float:
    """Dense bytes over bytes handed to Horovod, this epoch so far."""
    if hasattr(compression, "stats"):
        stats = compression.stats()
        return stats.dense_bytes / stats.bytes_sent if stats.bytes_sent else float("nan")
    return 2.0 if compression is hdgc.Compression.fp16 else 1.0


def train_epoch(args, model, optimizer, compression, loader, epoch: int) -> EpochMetrics:
    """One epoch (at most ``--steps-per-epoch`` exchanges); metrics averaged over ranks."""
    model.train()
    steps = len(loader) if args.steps_per_epoch is None else min(len(loader), args.steps_per_epoch)
    loss_sum, correct, seen = torch.zeros(()), torch.zeros(()), 0
    bar = tqdm(total=steps, desc=f"epoch {epoch + 1}/{args.epochs}", disable=hvd.rank() != 0,
               leave=False)
    started = time.perf_counter()
    for step, (images, labels) in enumerate(loader):
        if step == steps:
            break
        lr = learning_rate(args, epoch + step / steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        chunks = list(zip(images.split(args.batch_size), labels.split(args.batch_size)))
        for chunk_images, chunk_labels in chunks:
            output = model(chunk_images)
            loss = F.cross_entropy(output, chunk_labels)
            (loss / len(chunks)).backward()
            loss_sum += loss.detach() * len(chunk_labels)
            correct += (output.argmax(1) == chunk_labels).sum()
            seen += len(chunk_labels)
        optimizer.step()
        rate = seen * hvd.size() / (time.perf_counter() - started)
        bar.set_postfix(loss=f"{loss_sum.item() / seen:.3f}", acc=f"{correct.item() / seen:.3f}",
                        img_s=f"{rate:.1f}", ratio=f"{compression_ratio(compression):.0f}x",
                        refresh=False)
        bar.update()
    bar.close()
    elapsed = time.perf_counter() - started
    totals = hvd.allreduce(torch.stack([loss_sum, correct.float(), torch.tensor(float(seen))]),
                           op=hvd.Sum, name="train_metrics")
    return EpochMetrics(epoch=epoch + 1, loss=(totals[0] / totals[2]).item(),
                        accuracy=(totals[1] / totals[2]).item(),
                        images_per_s=totals[2].item() / elapsed,
                        compression_ratio=compression_ratio(compression),
                        density=getattr(compression, "density", 1.0), lr=lr)


@torch.no_grad()
def validate(model: nn.Module, loader) -> tuple:
    """(loss, accuracy) on the validation set, averaged over every rank's shard."""
    model.eval()
    totals = torch.zeros(3)
    for images, labels in loader:
        output = model(images)
        totals += torch.stack([F.cross_entropy(output, labels, reduction="sum"),
                               (output.argmax(1) == labels).sum().float(),
                               torch.tensor(float(len(labels)))])
    totals = hvd.allreduce(totals, op=hvd.Sum, name="val_metrics")
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def describe(args: argparse.Namespace) -> str:
    if args.compression in BASELINES:
        return f"{args.compression} (dense)"
    if args.compression == "blocksign":
        return f"blocksign (1 bit per entry, block size {args.block_size or 'one per tensor'})"
    return (f"{args.compression} (density {args.density}, {args.sparsity_warmup_epochs} "
            f"sparsity warm-up epochs)")


def main(args: argparse.Namespace,
         on_resume: Optional[Callable[[int, object], None]] = None) -> List[EpochMetrics]:
    """Train; returns this run's per-epoch metrics. ``on_resume(epoch, compressor)`` is
    called after a checkpoint is restored (the tests check the restored memories there)."""
    hvd.init()
    torch.manual_seed(args.seed)
    train_set, val_set = make_datasets(args)
    model = resnet50(num_classes=len(train_set.classes))
    compression = make_compression(args, model)
    optimizer = make_optimizer(args, model, compression)
    compression = getattr(optimizer, "_compression", compression)
    checkpoints = Checkpoints(args.checkpoint_dir, args.keep_checkpoints)
    start = checkpoints.latest_epoch()
    if start:
        checkpoints.load(start, model, optimizer, compression, args.compression)
        if on_resume is not None:
            on_resume(start, compression)
    else:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    sampler, loader = make_loader(args, train_set, args.batch_size * args.batches_per_allreduce, True)
    val_loader = make_loader(args, val_set, args.val_batch_size, False)[1] if val_set else None
    if hvd.rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        resumed = f", resumed after epoch {start}" if start else ""
        tqdm.write(f"ResNet-50 ({params:,} parameters, {len(train_set.classes)} classes) on "
                   f"{hvd.size()} ranks, {describe(args)}{resumed}")
    history = []
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        train_set.set_epoch(epoch)
        if hasattr(compression, "set_epoch"):
            compression.set_epoch(epoch)
            compression.reset_stats()
        metrics = train_epoch(args, model, optimizer, compression, loader, epoch)
        if val_loader is not None:
            metrics.val_loss, metrics.val_accuracy = validate(model, val_loader)
        checkpoints.save(epoch + 1, model, optimizer, compression, args.compression)
        history.append(metrics)
        if hvd.rank() == 0:
            report(metrics, args)
    if hvd.rank() == 0 and args.json:
        args.json.write_text(json.dumps([asdict(m) for m in history], indent=2))
    return history


def report(m: EpochMetrics, args: argparse.Namespace) -> None:
    val = (f", val loss {m.val_loss:.4f}, val accuracy {m.val_accuracy:.4f}"
           if m.val_loss is not None else "")
    tqdm.write(f"epoch {m.epoch}/{args.epochs}: loss {m.loss:.4f}, accuracy {m.accuracy:.4f}"
               f"{val}, {m.images_per_s:.1f} images/s, lr {m.lr:.4g}, density {m.density:.4%}, "
               f"compression ratio {m.compression_ratio:.1f}x")


if __name__ == "__main__":
    main(parse_args())
