"""Gaussian-k's threshold adjustments for every segment of a bucket in one kernel on a GPU
(Triton).

The core's composition (``bucket.select_gaussian``) runs its adjustments unrolled where
sizes cost a wait: each is about fourteen framework kernels on a few values per segment
(the counts, the comparisons with the accepted range, the new thresholds). Here one program
per segment counts its magnitudes at or above its threshold, adjusts it and counts again,
as many times as the composition would, and writes the final threshold: one launch for all
of them (``TensorOps.gaussian_thresholds``). Used for tensors that
``triton_memory.launchable`` accepts; ``tests/test_triton_selection.py`` checks it against
a loop written in the test.
"""
from __future__ import annotations

import torch

from ...core.selection import GAUSSIAN_LOWER_BY, GAUSSIAN_RAISE_BY
from .triton_memory import triton

if triton is not None:
    import triton.language as tl

ENTRIES_PER_STEP = 1024


if triton is not None:
    @triton.jit
    def _count_at_least(magnitudes, start, count, threshold, STEP: tl.constexpr):
        seen = tl.zeros([], dtype=tl.float32)
        at = tl.zeros([], dtype=tl.int64)
        while at < count:
            slot = at + tl.arange(0, STEP).to(tl.int64)
            value = tl.load(magnitudes + start + slot, mask=slot < count, other=0.0)
            seen += tl.sum(((value >= threshold) & (slot < count)).to(tl.float32), 0)
            at += STEP
        return seen

    @triton.jit
    def _gaussian_thresholds(magnitudes, starts, counts, thresholds, low, high, fewest, whole, out, adjustments,
                             RAISE_BY: tl.constexpr, LOWER_BY: tl.constexpr, STEP: tl.constexpr):
        s = tl.program_id(0)
        start = tl.load(starts + s)
        count = tl.load(counts + s)
        least = tl.load(low + s)
        most = tl.load(high + s)
        t = tl.load(thresholds + s)
        lowest = t
        reached = _count_at_least(magnitudes, start, count, t, STEP)
        step = 0
        while step < adjustments:
            if (reached < least) | (reached > most):
                t = tl.where(reached >= least, t * RAISE_BY, t * LOWER_BY)
                reached = _count_at_least(magnitudes, start, count, t, STEP)
                lowest = tl.minimum(lowest, t)
            step += 1
        final = tl.where(reached >= tl.load(fewest + s), t, lowest)
        tl.store(out + s, tl.where(tl.load(whole + s) != 0, 0.0, final))


def gaussian_thresholds(magnitudes: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                        thresholds: torch.Tensor, low: torch.Tensor, high: torch.Tensor, fewest: torch.Tensor,
                        whole: torch.Tensor, adjustments: int) -> torch.Tensor:
    """``TensorOps.gaussian_thresholds``: one program per segment."""
    out = torch.empty_like(thresholds)
    _gaussian_thresholds[(thresholds.numel(),)](
        magnitudes, starts, counts, thresholds, low, high, fewest, whole, out, adjustments,
        RAISE_BY=GAUSSIAN_RAISE_BY, LOWER_BY=GAUSSIAN_LOWER_BY, STEP=ENTRIES_PER_STEP)
    return out
