"""What the sparse all-reduce's fixed, equal regions cost on real gradients: would
re-balancing the regions from the selected indices (Ok-Topk's way) send more?

Trains the Fashion-MNIST CNN of ``examples/pytorch_fashion_mnist.py`` with N workers simulated
in one process (the core's ``simulate_step``, one data shard each, SGD with the method's
update; the small tensors averaged densely) and, at the final density, measures on every
step:

* **held back at the alltoall**: the share of a worker's selected entries beyond the fixed
  room per destination (the alltoall message's capacity), which wait in its memory; for the
  regions as built (contiguous slices) and for strided ones (entry i to worker i mod N);
* **forwarded by the owners**: the energy (sum of squares) of what the N owners forward, each
  ``C_out`` entries of its own region, against the same number of entries taken as one top
  over the whole tensor, which ideal regions would allow (both as a share of the energy of the
  owners' sums, earlier residuals included).

    .venv/bin/python -m benchmarks.region_balance [--methods dgc,topk] [--workers 4] [--steps 200]
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn.functional as F

from horovod_dgc.core import CompressCall
from horovod_dgc.core.methods import BY_NAME
from horovod_dgc.core.sparse_allreduce import SparseAllreduce
from horovod_dgc.core.twostage import simulate_step
from horovod_dgc.torch.ops import TorchOps

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import _fashion_mnist as data  # noqa: E402
from pytorch_fashion_mnist import Net  # noqa: E402

OPS = TorchOps()
BATCH = 64
LR = 0.05
# Warm-up: this many steps at WARMUP_DENSITY before the final density; measured after it.
WARMUP_STEPS, WARMUP_DENSITY = 60, 0.032


class Recorder:
    """Wraps a sparse all-reduce's selection and owner stage to keep what they saw."""

    def __init__(self, method: SparseAllreduce):
        self.selections: List[tuple] = []  # (step, positions, region length, room per destination)
        self.owner_sums: Dict[tuple, List[tuple]] = defaultdict(list)  # (name, step) -> (rank, P, C_out)
        select, second = method.inner.select, method.second

        def recorded_select(ops, x, k, call, accumulated):
            positions = select(ops, x, k, call, accumulated)
            to_owner, _ = method.region_layouts(call.name, x.numel(), ops.dtype(x), call.density,
                                                call.world_size)
            self.selections.append((call.step, positions.clone(), to_owner.numel, to_owner.capacity))
            return positions

        def recorded_second(ops, state, received, handover):
            call = handover.call
            _, entries = method._receive(ops, received, handover.data["to_owner"], handover)
            total = state["owner_residual"].clone()
            for where, values in entries:
                total.index_add_(0, where, values / call.world_size)
            self.owner_sums[(call.name, call.step)].append(
                (call.rank, total, handover.data["forward"].capacity))
            return second(ops, state, received, handover)

        method.inner.select = recorded_select
        method.second = recorded_second


def train(method_name: str, workers: int, steps: int, density: float) -> Recorder:
    torch.manual_seed(0)
    method = BY_NAME[method_name].build(aggregation="sparse_allreduce")
    recorder = Recorder(method)
    train_split, _ = data.load()
    shards = [train_split.shard(r, workers) for r in range(workers)]
    model = Net()
    compressed = {n for n, p in model.named_parameters() if not method.config.is_small(tuple(p.shape))}
    states = {n: [method.init_state(OPS, p.detach().flatten(), True, workers) for _ in range(workers)]
              for n, p in model.named_parameters() if n in compressed}
    for step in range(steps):
        at = WARMUP_DENSITY if step < WARMUP_STEPS else density
        grads = []
        for shard in shards:
            i = (step * BATCH) % (len(shard.labels) - BATCH)
            model.zero_grad()
            F.cross_entropy(model(shard.images[i:i + BATCH]), shard.labels[i:i + BATCH]).backward()
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in compressed:
                    calls = [CompressCall(n, r, workers, step, at) for r in range(workers)]
                    results, states[n] = simulate_step(OPS, method, states[n],
                                                       [g[n].flatten().clone() for g in grads], calls)
                    p -= LR * results[0].view_as(p)
                else:
                    p -= LR * sum(g[n] for g in grads) / workers
    return recorder


def held_back(recorder: Recorder, workers: int, regions: str) -> float:
    """Share of the selected entries beyond the room per destination."""
    over = total = 0
    for step, positions, region, room in recorder.selections:
        if step < WARMUP_STEPS:
            continue
        owner = positions // region if regions == "contiguous" else positions % workers
        counts = torch.bincount(owner, minlength=workers)
        over += int((counts - room).clamp(min=0).sum())
        total += positions.numel()
    return over / total


def forwarded_energy(recorder: Recorder) -> tuple:
    """(energy the owners forward, energy one top over the tensor would forward), each as a
    share of the energy of the owners' sums."""
    fixed = ideal = whole = 0.0
    for (_, step), rows in recorder.owner_sums.items():
        if step < WARMUP_STEPS:
            continue
        sums = [total for _, total, _ in sorted(rows, key=lambda row: row[0])]
        forward = rows[0][2]
        fixed += sum(float(s.abs().topk(min(forward, s.numel())).values.square().sum()) for s in sums)
        joined = torch.cat(sums)
        ideal += float(joined.abs().topk(min(forward * len(sums), joined.numel())).values.square().sum())
        whole += float(joined.square().sum())
    return fixed / whole, ideal / whole


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="dgc,topk", help="comma-separated gathered methods")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=200, help=f"steps in all ({WARMUP_STEPS} of warm-up)")
    p.add_argument("--density", type=float, default=0.001)
    args = p.parse_args()
    torch.set_num_threads(1)
    print("| method | held back, contiguous regions | held back, strided | owners forward "
          "(share of energy) | one top over the tensor |\n|---|---:|---:|---:|---:|")
    for name in args.methods.split(","):
        recorder = train(name, args.workers, args.steps, args.density)
        fixed, ideal = forwarded_energy(recorder)
        print(f"| {name} | {held_back(recorder, args.workers, 'contiguous'):.2%} "
              f"| {held_back(recorder, args.workers, 'strided'):.2%} | {fixed:.2%} | {ideal:.2%} |",
              flush=True)


if __name__ == "__main__":
    main()
