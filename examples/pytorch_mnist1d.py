"""Data-parallel training on MNIST-1D with the stock ``hvd.DistributedOptimizer``.

    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python examples/pytorch_mnist1d.py \\
        --compression dgc --epochs 8

Every rank generates the same data set and trains on its own shard of it. The compressor
is handed to Horovod as ``compression=``; rank 0 prints the loss, the test accuracy and
the traffic per epoch, then a summary whose last two lines are the final test accuracy
and the compression ratio (of the last epoch, after the warm-up).

With the defaults (30 epochs, density 0.1%, 4 warm-up epochs) DGC ends within a point of
dense training (``--compression dense``); tests/test_convergence_torch.py checks that.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import List, Optional, Tuple

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from _data import NUM_CLASSES, Split, load_mnist1d
from _flags import BASELINES, METHODS, MOMENTUM_IN_COMPRESSOR, SPARSE_METHODS
from horovod_dgc.core.stats import CompressionStats
from horovod_dgc.torch import Compression


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compression", choices=METHODS, default="dgc")
    p.add_argument("--density", type=float, default=0.001,
                   help="final fraction of each compressed tensor sent per step")
    p.add_argument("--momentum", type=float, default=0.9,
                   help="SGD momentum (inside the compressor for dgc and blocksign)")
    p.add_argument("--warmup-epochs", type=int, default=4,
                   help="epochs of warm-up sparsity for the sparse methods")
    p.add_argument("--epochs", type=int, default=30,
                   help="30 lets DGC reach the dense accuracy; 8 makes a quick demo")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05,
                   help="initial learning rate, annealed to 0 (cosine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the final metrics here (rank 0)")
    return p.parse_args(argv)


class ConvNet(nn.Module):
    """Three 1-D convolutions, global max pooling over time, a linear classifier.

    The pooling makes the features shift-invariant (the digits sit at random offsets);
    the two 64x64x3 kernels are the tensors large enough to be compressed.
    """

    def __init__(self, channels: int = 64):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv1d(1, channels, 5, padding=2),
                                    nn.Conv1d(channels, channels, 3, padding=1),
                                    nn.Conv1d(channels, channels, 3, padding=1)])
        self.out = nn.Linear(channels, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.unsqueeze(1)
        for conv in self.convs:
            x = F.relu(conv(x))
        return self.out(x.amax(dim=-1))


def make_compression(args: argparse.Namespace, model: nn.Module):
    """Horovod's compressor for ``--compression`` (sparse ones keyed by parameter name)."""
    if args.compression in BASELINES:
        return getattr(Compression, BASELINES[args.compression])
    factory = getattr(Compression, args.compression)
    options = {}
    if args.compression in SPARSE_METHODS:
        options.update(density=args.density, warmup_epochs=args.warmup_epochs)
    if args.compression in MOMENTUM_IN_COMPRESSOR:
        options["momentum"] = args.momentum
    return factory(named_parameters=model.named_parameters(), **options)


def make_optimizer(args: argparse.Namespace, model: nn.Module, compression) -> torch.optim.Optimizer:
    # DGC (momentum correction) and blocksign (worker momentum) apply momentum themselves;
    # the wrapped SGD must not add more.
    momentum = 0.0 if args.compression in MOMENTUM_IN_COMPRESSOR else args.momentum
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=momentum)
    return hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                    compression=compression)


def traffic_line(traffic: CompressionStats) -> str:
    return (f"{traffic.ratio:.1f}x (bytes sent {traffic.bytes_sent_per_step / 1e3:.1f} kB/step "
            f"vs dense {traffic.dense_bytes_per_step / 1e3:.1f} kB/step)")


def epoch_traffic(compression, model: nn.Module, steps: int) -> CompressionStats:
    """This epoch's traffic: the compressor's statistics, or the dense tensors' sizes."""
    if hasattr(compression, "stats"):
        return compression.stats()
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    sent = dense // 2 if compression is Compression.fp16 else dense
    return CompressionStats(steps=steps, bytes_sent=steps * sent, dense_bytes=steps * dense)


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, shard: Split,
                args: argparse.Namespace, epoch: int, generator: torch.Generator) -> float:
    """One pass over this rank's shard; returns the loss averaged over all ranks."""
    model.train()
    x, y = torch.from_numpy(shard.x), torch.from_numpy(shard.y)
    order = torch.randperm(len(y), generator=generator)
    steps = len(y) // args.batch_size
    total = torch.zeros(())
    bar = tqdm(range(steps), desc=f"epoch {epoch + 1}/{args.epochs}", leave=False,
               disable=hvd.rank() != 0)
    for step in bar:
        idx = order[step * args.batch_size:(step + 1) * args.batch_size]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
        scheduler.step()
        total += loss.detach()
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    return hvd.allreduce(total / steps, name="train_loss").item()


@torch.no_grad()
def accuracy(model: nn.Module, split: Split) -> float:
    model.eval()
    predicted = model(torch.from_numpy(split.x)).argmax(dim=1)
    return (predicted == torch.from_numpy(split.y)).float().mean().item()


def describe(args: argparse.Namespace) -> str:
    if args.compression in BASELINES:
        return f"{args.compression} (dense, SGD momentum {args.momentum})"
    if args.compression not in SPARSE_METHODS:
        return f"{args.compression} (1 bit per entry, momentum {args.momentum})"
    return (f"{args.compression} (density {args.density}, momentum {args.momentum}, "
            f"{args.warmup_epochs} warm-up epochs)")


def main(args: argparse.Namespace) -> None:
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    train, test = load_mnist1d()
    model = ConvNet()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = make_compression(args, model)
    optimizer = make_optimizer(args, model, compression)
    started = time.perf_counter()
    history, total, last = fit(args, model, compression, optimizer,
                               train.shard(hvd.rank(), hvd.size()), test)
    if hvd.rank() == 0:
        report(args, model, compression, history, total, last, time.perf_counter() - started)


def fit(args: argparse.Namespace, model: nn.Module, compression, optimizer: torch.optim.Optimizer,
        shard: Split, test: Split) -> Tuple[List[dict], CompressionStats, CompressionStats]:
    """Train for ``args.epochs``; rank 0 evaluates after every epoch. Returns the per-epoch
    metrics (rank 0), the whole run's traffic and the last epoch's."""
    generator = torch.Generator().manual_seed(args.seed * 1009 + hvd.rank())
    steps_per_epoch = len(shard.y) // args.batch_size
    # Annealing to zero makes the final accuracy a property of the run, not of its last step.
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs * steps_per_epoch)
    history: List[dict] = []
    total = last = CompressionStats()
    for epoch in range(args.epochs):
        if hasattr(compression, "set_epoch"):
            compression.set_epoch(epoch)
            compression.reset_stats()
        density = getattr(compression, "density", 1.0)
        loss = train_epoch(model, optimizer, scheduler, shard, args, epoch, generator)
        last = epoch_traffic(compression, model, steps_per_epoch)
        total += last
        if hvd.rank() == 0:
            acc = accuracy(model, test)
            history.append(dict(epoch=epoch + 1, loss=loss, accuracy=acc, density=density,
                                ratio=last.ratio))
            tqdm.write(f"epoch {epoch + 1}/{args.epochs}: train loss {loss:.4f}, "
                       f"test accuracy {acc:.4f}, density {density:.4%}, ratio {last.ratio:.1f}x")
    return history, total, last


def report(args: argparse.Namespace, model: nn.Module, compression, history: List[dict],
           total: CompressionStats, last: CompressionStats, wall_s: float) -> None:
    """Rank 0's summary (last two lines: accuracy and ratio) and the optional JSON file."""
    acc = history[-1]["accuracy"]
    params = sum(p.numel() for p in model.parameters())
    print(f"\n=== {hvd.size()} ranks, {args.epochs} epochs, {params} parameters, "
          f"{wall_s:.1f} s ===")
    print(f"compression: {describe(args)}")
    if hasattr(compression, "stats"):
        print(f"last epoch: {compression.stats().summary()}")
        print(f"whole run (warm-up included): {traffic_line(total)}")
    print(f"final test accuracy: {acc:.4f}")
    print(f"compression ratio: {traffic_line(last)}", flush=True)
    if args.json:
        metrics = dict(compression=args.compression, accuracy=acc, ratio=last.ratio,
                       ratio_whole_run=total.ratio, epochs=args.epochs, density=args.density,
                       seed=args.seed, wall_time_s=wall_s, history=history)
        with open(args.json, "w") as f:
            json.dump(metrics, f, indent=2)


if __name__ == "__main__":
    main(parse_args())
