"""How well does ScaleCom's leader choose for everyone? Its premise is that the workers'
error-compensated gradients ``p_i = m_i + g_i`` are alike, so that one worker's top-k (the
leader's, a different worker each step) stands for the top-k of their average.

Trains the Fashion-MNIST CNN with N workers simulated in one process (``simulated.py``,
the core's ScaleCom with its defaults) at each batch size, and every ``--every`` steps after
the warm-up measures, on the largest compressed tensor (``fc1.weight``, 1,003,520 entries):

* **overlap of p**: the mean over pairs of workers of the share of their top-k sets of
  ``|p_i|`` that they have in common; **overlap of g**: the same for the gradients alone;
* **leader's share of the top-k**: the share of the average ``mean_i p_i``'s own top-k set
  that the leader's indices hold;
* **leader's share of the energy**: the sum of squares of the average at the leader's indices
  over its sum at the average's own top-k (1 when the leader's choice is the best possible).

    .venv/bin/python -m benchmarks.scalecom_leader [--batch-sizes 64 256] [--steps 360] [--beta B]
"""
from __future__ import annotations

import argparse
import statistics
from itertools import combinations
from typing import Dict, List, Sequence, Tuple

import torch

from horovod_dgc.core.methods import BY_NAME
from horovod_dgc.core.scalecom import ScaleCom

from .simulated import WARMUP_STEPS, Gradients, train

TENSOR = "fc1.weight"


def top_set(x: torch.Tensor, k: int) -> set:
    return set(x.abs().topk(k).indices.tolist())


def mean_pair_overlap(xs: Sequence[torch.Tensor], k: int) -> float:
    """Mean over pairs of the share of their top-k sets in common."""
    tops = [top_set(x, k) for x in xs]
    return statistics.fmean(len(a & b) / k for a, b in combinations(tops, 2))


class Observer:
    """Keeps, per measured step, the workers' p (from stage 2) and gradients, and the
    leader's indices, and turns them into the four measures."""

    def __init__(self, method: ScaleCom, every: int):
        self.every = every
        self.p: Dict[int, List[torch.Tensor]] = {}
        self.g: Dict[int, List[torch.Tensor]] = {}
        self.chosen: Dict[int, torch.Tensor] = {}
        second = method.second

        def recorded_second(ops, state, received, handover):
            call = handover.call
            kept = call.name == TENSOR and self.measured(call.step)
            if kept:  # before stage 2, whose memory update may reuse p's storage
                self.p.setdefault(call.step, []).append(handover.data["p"].clone())
            out = second(ops, state, received, handover)
            if kept:
                self.chosen[call.step] = handover.data["indices"].clone()
            return out

        method.second = recorded_second

    def measured(self, step: int) -> bool:
        return step >= WARMUP_STEPS and (step - WARMUP_STEPS) % self.every == self.every - 1

    def gradients(self, step: int, grads: Gradients) -> None:
        if self.measured(step):
            self.g[step] = [g[TENSOR].flatten() for g in grads]

    def rows(self) -> List[Tuple[int, float, float, float, float]]:
        """(step, overlap of p, overlap of g, leader's share of the top-k, of the energy)."""
        out = []
        for step in sorted(self.p):
            ps, chosen = self.p[step], self.chosen[step]
            k = chosen.numel()
            average = sum(ps) / len(ps)
            best = average.abs().topk(k).indices
            share = len(set(chosen.tolist()) & set(best.tolist())) / k
            energy = float(average[chosen].square().sum() / average[best].square().sum())
            out.append((step + 1, mean_pair_overlap(ps, k), mean_pair_overlap(self.g[step], k),
                        share, energy))
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256],
                   help="images per worker per step")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=360, help=f"steps in all ({WARMUP_STEPS} of warm-up)")
    p.add_argument("--every", type=int, default=30, help="steps between measurements")
    p.add_argument("--density", type=float, default=0.001)
    p.add_argument("--beta", type=float, help="the memory's low-pass filter (default: ScaleCom's)")
    args = p.parse_args()
    options = {} if args.beta is None else {"beta": args.beta}
    torch.set_num_threads(1)
    print("| batch per worker | step | overlap of p | overlap of g | leader's share of the top-k "
          "| leader's share of the energy |\n|---:|---:|---:|---:|---:|---:|")
    for batch in args.batch_sizes:
        method = BY_NAME["scalecom"].build(**options)
        observer = Observer(method, args.every)
        train(method, args.workers, args.steps, args.density, batch=batch, observe=observer.gradients)
        rows = observer.rows()
        for step, p_overlap, g_overlap, share, energy in rows:
            print(f"| {batch} | {step} | {p_overlap:.3f} | {g_overlap:.3f} | {share:.3f} | {energy:.3f} |",
                  flush=True)
        means = [statistics.fmean(column) for column in list(zip(*rows))[1:]]
        print(f"| {batch} | mean | " + " | ".join(f"**{m:.3f}**" for m in means) + " |", flush=True)


if __name__ == "__main__":
    main()
