"""Data-parallel training of a 1.03M-parameter CNN on Fashion-MNIST with Horovod and a
horovod_dgc compressor: the one-argument change ``compression=`` on the stock
``hvd.DistributedOptimizer`` (``--path stock``), horovod_dgc's fused optimizer
(``--path fused``), or a ``DistributedDataParallel`` model with horovod_dgc's communication
hook (``--path ddp``); float32, bfloat16 autocast, or float16 autocast with a GradScaler
(stock and fused paths).

    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python examples/pytorch_fashion_mnist.py \\
        --compression dgc --epochs 3

``--path ddp`` runs under either launcher: under ``horovodrun`` Horovod only launches the
processes and averages the reported loss; under ``torchrun`` Horovod is not imported at all
(it need not be installed)::

    torchrun --standalone --nproc-per-node 2 examples/pytorch_fashion_mnist.py --path ddp

99.9% of the parameters are in the tensors that are compressed (the second convolution's
kernel and the two weight matrices); the rest (biases, the first 288-weight kernel) travel
dense. Rank 0 prints one line per epoch and a summary; ``--json`` writes the metrics.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _fashion_mnist as data  # noqa: E402
from _flags import (BASELINES, METHODS, MOMENTUM_IN_COMPRESSOR, add_adaptive_flag,  # noqa: E402
                    add_aggregation_flag, add_beta_flag, add_small_density_flag, compression_options, given)
from horovod_dgc.core.wire import VALUE_FORMATS  # noqa: E402
import horovod_dgc.torch as hdgc  # noqa: E402
from horovod_dgc.torch import ddp  # noqa: E402
from horovod_dgc.core import CompressionConfig  # noqa: E402


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--compression", choices=METHODS, default="dgc")
    p.add_argument("--path", choices=("stock", "fused", "ddp"), default="stock",
                   help="stock: hvd.DistributedOptimizer(compression=...); fused: "
                   "horovod_dgc.torch.DistributedOptimizer; ddp: DistributedDataParallel with "
                   "horovod_dgc.torch.ddp's hook (fused and ddp: compressing methods only)")
    p.add_argument("--ddp-port", type=int, default=29531,
                   help="--path ddp: TCP port of torch.distributed's rendezvous on localhost")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="bf16 and fp16: torch.amp autocast; fp16 with a GradScaler in "
                   "Horovod's recipe")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--density", type=float, default=0.001,
                   help="final fraction of each compressed tensor sent per step")
    p.add_argument("--warmup-epochs", type=int, default=1,
                   help="epochs of warm-up sparsity (densities rho^(e+1)/(W+1), e < W)")
    p.add_argument("--steps-per-epoch", type=int,
                   help="the warm-up schedule's epoch in the compressor's own steps (e.g. 58 with "
                   "--warmup-epochs 4: the paper's four densities within the first real epoch); "
                   "default: the real epoch, advanced by set_epoch")
    p.add_argument("--value-dtype", choices=VALUE_FORMATS,
                   help="how values travel (default: the method's)")
    add_aggregation_flag(p)
    p.add_argument("--min-numel", type=int, help="tensors with fewer elements are small: "
                   "sent at --small-density (default: the method's)")
    add_small_density_flag(p)
    add_beta_flag(p)
    add_adaptive_flag(p)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64, help="images per step, per rank")
    p.add_argument("--lr", type=float, help="peak learning rate (SGD 0.05 x workers/4, "
                   "Adam 0.001), annealed to 0 by a cosine")
    p.add_argument("--momentum", type=float, default=0.9,
                   help="SGD momentum (inside the compressor for dgc and blocksign)")
    p.add_argument("--train-images", type=int, default=60000,
                   help="train on the first N training images (a quick run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the metrics here (rank 0)")
    args = p.parse_args(argv)
    if args.path != "stock" and args.compression in BASELINES:
        p.error(f"--path {args.path} needs a compressing method")
    if args.adaptive == "on" and args.compression in BASELINES:
        p.error("--adaptive on: a compressing method")
    if args.path == "ddp" and args.precision == "fp16":
        p.error("--path ddp: this example has no GradScaler recipe for a DDP hook")
    if under_torchrun() and args.path != "ddp":
        p.error(f"--path {args.path} runs through Horovod: launch it with horovodrun "
                f"(torchrun runs --path ddp)")
    return args


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


@dataclass(frozen=True)
class Workers:
    """This process among the workers: its rank, their number, and Horovod where it launched
    them (None under torchrun)."""

    rank: int
    size: int
    horovod: Any

    def mean(self, value: float, name: str) -> float:
        """``value`` averaged over the workers."""
        if self.horovod is not None:
            return self.horovod.allreduce(torch.tensor(value), name=name).item()
        total = torch.tensor(value)
        dist.all_reduce(total)
        return total.item() / self.size


def join_workers(args: argparse.Namespace) -> Workers:
    """Horovod's workers (under horovodrun; ``--path ddp`` also sets up torch.distributed
    among them), or torch.distributed's alone (under torchrun)."""
    if under_torchrun():
        dist.init_process_group("gloo")
        return Workers(dist.get_rank(), dist.get_world_size(), None)
    import horovod.torch as hvd
    hvd.init()
    if args.path == "ddp":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.ddp_port}",
                                rank=hvd.rank(), world_size=hvd.size())
    return Workers(hvd.rank(), hvd.size(), hvd)


class Net(nn.Module):
    """conv 3x3 (1->32), pool, conv 3x3 (32->64), pool, fc 3136->320, fc 320->10."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 320)
        self.fc2 = nn.Linear(320, data.NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def make_compression(args: argparse.Namespace, model: nn.Module):
    if args.compression in BASELINES:
        return getattr(hdgc.Compression, BASELINES[args.compression])
    options = given(args, "min_numel", "steps_per_epoch")
    options.update(compression_options(args, args.warmup_epochs))
    if args.compression in MOMENTUM_IN_COMPRESSOR and args.path != "fused" and args.optimizer == "sgd":
        options["momentum"] = args.momentum
    if args.adaptive == "on":
        options["adaptive"] = True
    return getattr(hdgc.Compression, args.compression)(named_parameters=model.named_parameters(),
                                                       **options)


def make_optimizer(args: argparse.Namespace, model: nn.Module, compression, horovod: Any):
    """The optimizer of ``args.path``; ``horovod``: ``horovod.torch`` (the stock path wraps
    with its ``DistributedOptimizer``), or None under torchrun."""
    if args.optimizer == "adam":
        base = torch.optim.Adam(model.parameters(), lr=args.lr)
    else:
        inside = args.compression in MOMENTUM_IN_COMPRESSOR and args.path != "fused"
        base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.0 if inside else args.momentum)
    if args.path == "ddp":
        return base
    wrap = horovod.DistributedOptimizer if args.path == "stock" else hdgc.DistributedOptimizer
    return wrap(base, named_parameters=model.named_parameters(), compression=compression)


def autocast(args: argparse.Namespace):
    if args.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16 if args.precision == "bf16" else torch.float16)


def accuracy(model: nn.Module, test: data.Split, args: argparse.Namespace, workers: Workers,
             name: str) -> float:
    """The test accuracy of the (replicated) model: each worker classifies its shard of
    ``test`` and they add up the right answers (the whole set's figure, in 1/size the time)."""
    mine = test.shard(workers.rank, workers.size)
    model.eval()
    with torch.no_grad(), autocast(args):
        predicted = torch.cat([model(x).argmax(1) for x in mine.images.split(1000)])
    model.train()
    right = (predicted == mine.labels).sum().item()
    return round(workers.mean(right, name=name) * workers.size) / len(test.labels)


def main(args: argparse.Namespace) -> None:
    workers = join_workers(args)
    torch.set_num_threads(1)
    if args.precision == "fp16":
        # On CPUs with AVX512-FP16, oneDNN's float16 convolution backward is a reference loop
        # (3 s a step here, against 0.6 s for ATen's own kernels): same autocast, other kernels.
        torch.backends.mkldnn.enabled = False
    torch.manual_seed(args.seed)
    args.lr = args.lr or (1e-3 if args.optimizer == "adam" else 0.05 * workers.size / 4)
    train, test = data.load()
    shard = train.first(args.train_images).shard(workers.rank, workers.size)
    model = Net()
    if workers.horovod is not None:
        workers.horovod.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = make_compression(args, model)
    optimizer = make_optimizer(args, model, compression, workers.horovod)
    forward = model
    if args.path == "ddp":
        # DDP broadcasts rank 0's parameters here.
        forward = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register(forward, compression, optimizer=optimizer)
    scaler = torch.amp.GradScaler("cpu") if args.precision == "fp16" else None
    if scaler is not None and hasattr(compression, "attach_grad_scaler"):
        compression.attach_grad_scaler(scaler)
    steps = len(shard.labels) // args.batch_size
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * min(step / (args.epochs * steps), 1.0))))
    # Parameters in tensors a compressor with the default min_numel compresses at the full
    # density (not as small tensors), the same figure for every run, dense ones included.
    total = sum(p.numel() for p in model.parameters())
    compressed_share = sum(p.numel() for p in model.parameters()
                           if not CompressionConfig().is_small(tuple(p.shape))) / total
    # What Horovod's all-reduce is handed each step without a compressor (dense, fp16).
    uncompressed_bytes = total * (2 if args.compression == "fp16" else 4)
    if workers.rank == 0:
        print(f"{workers.size} workers, {total:,} parameters ({compressed_share:.2%} in compressed "
              f"tensors), {args.compression} on the {args.path} path, {args.precision}, "
              f"{args.optimizer}, {steps} steps per epoch", flush=True)
    history, started = [], time.perf_counter()
    training_s = 0.0  # wall-clock seconds in the epochs' steps, the test evaluations excluded
    for epoch in range(args.epochs):
        epoch_started = time.perf_counter()
        if hasattr(compression, "set_epoch"):
            compression.set_epoch(epoch)
            compression.reset_stats()
        order = torch.randperm(len(shard.labels), generator=torch.Generator().manual_seed(args.seed + epoch))
        losses = []
        for step in range(steps):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            with autocast(args):
                loss = F.cross_entropy(forward(shard.images[batch]).float(), shard.labels[batch])
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                optimizer.synchronize()
                scaler.unscale_(optimizer)
                with optimizer.skip_synchronize():
                    scaler.step(optimizer)
                scaler.update()
            scheduler.step()
            losses.append(loss.item())
        mean_loss = workers.mean(sum(losses) / len(losses), name=f"loss.{epoch}")
        training_s += time.perf_counter() - epoch_started
        stats = compression.stats() if hasattr(compression, "stats") else None
        acc = accuracy(model, test, args, workers, name=f"accuracy.{epoch}")
        if workers.rank == 0:
            history.append(dict(epoch=epoch + 1, loss=mean_loss, accuracy=acc,
                                density=getattr(compression, "density", 1.0),
                                bytes_per_step=stats.bytes_sent_per_step if stats else None,
                                ratio=stats.ratio if stats else 1.0,
                                handed_ratio=stats.handed_ratio if stats else 1.0,
                                wall_s=time.perf_counter() - started, training_s=training_s))
            carrier = "torch.distributed" if args.path == "ddp" else "Horovod"
            traffic = (f", {stats.bytes_sent_per_step / 1e3:.1f} kB/step to {carrier} "
                       f"({stats.handed_ratio:.0f}x fewer than dense; on the network "
                       f"{stats.ratio:.0f}x)" if stats else
                       f", {uncompressed_bytes / 1e3:.1f} kB/step to Horovod (uncompressed)")
            print(f"epoch {epoch + 1}/{args.epochs}: loss {mean_loss:.4f}, test accuracy {acc:.4f} "
                  f"after {training_s:.1f} s of training, density {history[-1]['density']:.4g}"
                  f"{traffic}", flush=True)
            for line in stats.buckets if stats else ():
                print(f"  {line}", flush=True)
    if workers.rank == 0:
        wall = time.perf_counter() - started
        print(f"final test accuracy: {history[-1]['accuracy']:.4f} after {wall:.0f} s", flush=True)
        if args.json:
            args.json.write_text(json.dumps(dict(vars(args), json=str(args.json), workers=workers.size,
                                                 compressed_share=compressed_share, accuracy=history[-1]["accuracy"], wall_s=wall,
                                                 history=history), indent=2))
    if args.path == "ddp":
        del forward  # the DDP model before its process group (docs/guide/ddp.md)
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
