"""The training job of ``make cluster-faults`` (``benchmarks/cluster/faults.py``): dgc on
the fused optimizer, a checkpoint every few steps, and a resume from the last complete one.

Run by every worker (``python -m horovod_dgc.cluster worker -- python
benchmarks/cluster/fault_train.py ...``)::

    python benchmarks/cluster/fault_train.py --checkpoint-dir DIR [--steps 12]
        [--checkpoint-every 3] [--model tiny|resnet50] [--batch-size 8]

Every rank prints ``step S done in T s`` after each step (the fault injector watches for it), and
``resumed from step S`` or ``started from scratch`` first, ``parameters sha256 <hex>`` last.
The data of a step depend only on the step and the rank, so a resumed run takes the steps the
interrupted one would have.

**A checkpoint is complete or absent.** After step S (a multiple of ``--checkpoint-every``)
every rank writes its optimizer state (its compressor's residuals included) to a temporary
file and renames it into place (``rank<r>-of-<N>.pt`` under ``step-<S>/``); an all-reduce then
tells rank 0 that every part is written, and rank 0 writes the model the same way. The model
file is the checkpoint's commit: a step directory without it (a fault struck while its parts
were written) is never loaded.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import horovod.torch as hvd
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step import build_model, parameters_digest, sgd  # noqa: E402

import horovod_dgc.torch as hdgc  # noqa: E402

MODEL_FILE = "model.pt"
IMAGE_SIZE = 16


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=12, help="steps of the whole run")
    p.add_argument("--checkpoint-every", type=int, default=3, help="steps between checkpoints")
    p.add_argument("--model", choices=("tiny", "resnet50"), default="tiny")
    p.add_argument("--batch-size", type=int, default=8, help="images per worker per step")
    p.add_argument("--min-step-s", type=float, default=0.0,
                   help="each step takes at least this long (seconds: a fault injected on a "
                        "step's line then lands in the next step, not after the run)")
    args = p.parse_args(argv)
    for name in ("steps", "checkpoint_every", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def step_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step:06d}"


def part_file(folder: Path, step: int, rank: int, size: int) -> Path:
    return step_dir(folder, step) / f"rank{rank}-of-{size}.pt"


def last_complete(folder: Path) -> Optional[int]:
    """The last step whose checkpoint holds its model file (written last), or None."""
    done = [int(d.name.split("-")[1]) for d in folder.glob("step-*") if (d / MODEL_FILE).is_file()]
    return max(done, default=None)


def atomic_save(obj: object, path: Path) -> None:
    """``obj`` at ``path``, or nothing there: written aside, then renamed into place."""
    partial = path.with_name(path.name + ".partial")
    torch.save(obj, partial)
    os.replace(partial, path)


def save(folder: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    step_dir(folder, step).mkdir(parents=True, exist_ok=True)
    atomic_save(optimizer.state_dict(), part_file(folder, step, hvd.rank(), hvd.size()))
    hvd.allreduce(torch.ones(1), name=f"fault_train.saved.{step}")  # every part is in place
    if hvd.rank() == 0:
        atomic_save(model.state_dict(), step_dir(folder, step) / MODEL_FILE)


def batch(step: int, batch_size: int, classes: int) -> tuple:
    generator = torch.Generator().manual_seed(1000 * step + hvd.rank())
    images = torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    return images, torch.randint(0, classes, (batch_size,), generator=generator)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    model, classes = build_model(args.model)
    compression = hdgc.Compression.dgc()
    optimizer = hdgc.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                          compression=compression)
    # Every rank reads the same directory; rank 0's view decides, for all.
    start = hvd.broadcast_object(last_complete(args.checkpoint_dir) if hvd.rank() == 0 else None,
                                 root_rank=0, name="fault_train.start")
    if start is None:
        start = 0
        print("started from scratch", flush=True)
    else:
        model.load_state_dict(torch.load(step_dir(args.checkpoint_dir, start) / MODEL_FILE))
        optimizer.load_state_dict(torch.load(part_file(args.checkpoint_dir, start, hvd.rank(), hvd.size())))
        print(f"resumed from step {start}", flush=True)
    for step in range(start + 1, args.steps + 1):
        started = time.perf_counter()
        images, labels = batch(step, args.batch_size, classes)
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        elapsed = time.perf_counter() - started
        print(f"step {step} done in {elapsed:.3f} s", flush=True)
        time.sleep(max(0.0, args.min_step_s - elapsed))
        if step % args.checkpoint_every == 0:
            save(args.checkpoint_dir, step, model, optimizer)
    print(f"parameters sha256 {parameters_digest(model)}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
