"""What the sparse all-reduce's fixed, equal regions cost on real gradients: would
re-balancing the regions from the selected indices (Ok-Topk's way) send more?

Trains the Fashion-MNIST CNN with N workers simulated in one process (``simulated.py``)
and, at the final density, measures on every step:

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
from collections import defaultdict
from typing import Dict, List

import torch

from horovod_dgc.core.methods import BY_NAME
from horovod_dgc.core.sparse_allreduce import SparseAllreduce

from .simulated import WARMUP_STEPS, train


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


def recorded_training(method_name: str, workers: int, steps: int, density: float) -> Recorder:
    method = BY_NAME[method_name].build(aggregation="sparse_allreduce")
    recorder = Recorder(method)
    train(method, workers, steps, density)
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
        recorder = recorded_training(name, args.workers, args.steps, args.density)
        fixed, ideal = forwarded_energy(recorder)
        print(f"| {name} | {held_back(recorder, args.workers, 'contiguous'):.2%} "
              f"| {held_back(recorder, args.workers, 'strided'):.2%} | {fixed:.2%} | {ideal:.2%} |",
              flush=True)


if __name__ == "__main__":
    main()
