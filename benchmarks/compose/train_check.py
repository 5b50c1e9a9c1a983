"""A short training on every worker of the Compose cluster, for ``make compose-test``.

Run on each container through the launcher (``benchmarks/compose/compose_test.py`` does it)::

    python -m horovod_dgc.cluster worker -- python -m benchmarks.compose.train_check \
        --methods dense,dgc --link 100mbit --out /results/100mbit

For each method in turn it trains the model of ``benchmarks/cluster/step.py`` (ResNet-50 by
default, the same initial weights on every rank, synthetic images) with that benchmark's
optimizer for the method, ``--warmup-steps`` untimed steps then ``--steps`` timed ones, and
writes ``<out>/rank<r>.<method>.json`` with what the host checks:

* ``tx_bytes_per_step``: bytes this container's interface (``HOROVOD_GLOO_IFACE``) sent per
  timed step, from the kernel's counter (everything the worker sent: the collectives and
  Horovod's negotiation);
* ``step_s``: this worker's wall-clock seconds of each timed step;
* ``params_sha256``: a digest of this worker's parameters (their float32 bytes) after the last
  step: equal digests on every rank mean bitwise-identical models.

The host compares the ranks' files (``compose_test.py``); no rank checks another here.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import socket
import statistics
import time
from pathlib import Path
from typing import List, Optional

import horovod.torch as hvd
import torch
from torch import nn

from benchmarks.cluster import step as bench

METHODS = bench.METHODS


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="dense,dgc", help=f"comma-separated, from {','.join(METHODS)}")
    p.add_argument("--model", choices=("resnet50", "tiny"), default="resnet50")
    p.add_argument("--batch-size", type=int, default=32, help="images per worker per step")
    p.add_argument("--image-size", type=int, default=32, help="pixels per side")
    p.add_argument("--warmup-steps", type=int, default=1, help="untimed steps per method")
    p.add_argument("--steps", type=int, default=3, help="timed steps per method")
    p.add_argument("--link", default="unknown", help="label of the network, for the records")
    p.add_argument("--out", type=Path, required=True, help="directory for the per-rank records")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown or not args.methods:
        p.error(f"--methods: unknown {unknown}; choose from {','.join(METHODS)}")
    if args.steps < 1 or args.warmup_steps < 0 or args.batch_size < 1 or args.image_size < 1:
        p.error("--steps, --batch-size and --image-size must be >= 1, --warmup-steps >= 0")
    args.iface = os.environ.get("HOROVOD_GLOO_IFACE")
    if not args.iface:
        p.error("HOROVOD_GLOO_IFACE is not set (start this through python -m horovod_dgc.cluster worker)")
    args.powersgd_rank = 4  # step.build_method reads it for PowerSGD
    return args


def params_sha256(model: nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in the model's order (CPU tensors)."""
    digest = hashlib.sha256()
    for param in model.parameters():
        tensor = param.detach().contiguous()
        digest.update(ctypes.string_at(tensor.data_ptr(), tensor.numel() * tensor.element_size()))
    return digest.hexdigest()


def train_method(method: str, args: argparse.Namespace) -> dict:
    """Train ``method`` for the warm-up and timed steps; this worker's record."""
    trained = bench.train_method(method, args)
    model, seconds, sent, warmup = trained.model, trained.seconds, trained.sent_bytes, trained.warmup_steps
    optimizer_label, setting = trained.optimizer_label, trained.setting
    hvd.barrier()
    return {"rank": hvd.rank(), "size": hvd.size(), "host": socket.gethostname(),
            "link": args.link, "method": method, "optimizer": optimizer_label, "setting": setting,
            "model": args.model, "params": sum(p.numel() for p in model.parameters()),
            "warmup_steps": warmup, "steps": args.steps, "step_s": seconds,
            "median_step_s": statistics.median(seconds), "tx_bytes": sent,
            "tx_bytes_per_step": sent / args.steps, "params_sha256": params_sha256(model)}


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    rank = hvd.rank()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    for method in args.methods:
        print(f"train_check rank {rank} {args.link} {method}: {args.warmup_steps}+{args.steps} steps",
              flush=True)
        record = train_method(method, args)
        path = args.out / f"rank{rank}.{method}.json"
        path.write_text(json.dumps(record) + "\n")
        print(f"train_check rank {rank} {args.link} {method}: "
              f"{record['median_step_s']:.3f} s/step, "
              f"{record['tx_bytes_per_step'] / 1e6:.3f} MB sent per step, "
              f"parameters {record['params_sha256'][:12]}", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    hvd.shutdown()
    print(f"train_check rank {rank} done in {time.monotonic() - started:.0f} s",
          flush=True)


if __name__ == "__main__":
    main()
