"""A bucket's selection on a GPU (Triton): Gaussian-k's threshold adjustments for every
segment in one kernel, and the sort keys of magnitudes in one.

The core's composition (``bucket.select_gaussian``) runs its adjustments unrolled where
sizes cost a wait: each is about fourteen framework kernels on a few values per segment
(the counts, the comparisons with the accepted range, the new thresholds). Here one program
per segment counts its magnitudes at or above its threshold, adjusts it and counts again,
as many times as the composition would, and writes the final threshold: one launch for all
of them (``TensorOps.gaussian_thresholds``). The sort keys that order a bucket's entries
(or blocks) segment by segment, largest magnitude first (``bucket._keys``), take seven
elementwise kernels as a composition (the magnitude, its float32 bits widened, the segment's
base, padding) and one here (``TensorOps.magnitude_keys``); where they are those of a
bucket's chosen blocks, the positions of the blocks' entries come with them
(``TensorOps.block_keys``: one kernel where the composition took thirteen). Used for tensors that
``triton_memory.launchable`` accepts; ``tests/test_triton_selection.py`` checks both against
loops written in the test.
"""
from __future__ import annotations

from typing import Tuple

import torch

from ...core.selection import GAUSSIAN_LOWER_BY, GAUSSIAN_RAISE_BY
from .triton_memory import triton

if triton is not None:
    import triton.language as tl

ENTRIES_PER_STEP = 1024
ENTRIES_PER_PROGRAM = 1024


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

    @triton.jit
    def _key_bits(x, i, mask, BFLOAT16: tl.constexpr):
        """One more than the int64 widening of ``|x[i]|``'s float32 bits (0 where not ``mask``)."""
        if BFLOAT16:  # widened by hand: Triton's interpreter rounds bfloat16's subnormals
            bits = tl.load(x.to(tl.pointer_type(tl.uint16)) + i, mask=mask, other=0).to(tl.int32) << 16
        else:
            bits = tl.load(x + i, mask=mask, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
        return tl.where(mask, (bits & 0x7FFFFFFF).to(tl.int64) + 1, 0)  # the sign bit cleared: the magnitude

    @triton.jit
    def _magnitude_keys(x, base, real, keys, n, REAL: tl.constexpr, BFLOAT16: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        inside = i < n
        if REAL:
            inside_and_real = inside & (tl.load(real + i, mask=inside, other=0) != 0)
        else:
            inside_and_real = inside
        bits = _key_bits(x, i, inside_and_real, BFLOAT16)
        tl.store(keys + i, tl.load(base + i, mask=inside, other=0) - bits, mask=inside)

    @triton.jit
    def _block_keys(x, blocks, slot_offset, slot_last, slot_base, positions, keys, n_slots, block,
                    BFLOAT16: tl.constexpr, BLOCK: tl.constexpr):
        s = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        inside = s < n_slots
        position = (tl.load(blocks + s // block, mask=inside, other=0) * block
                    + tl.load(slot_offset + s, mask=inside, other=0))
        real = inside & (tl.load(slot_last + s, mask=inside, other=-1) >= position)
        bits = _key_bits(x, position, real, BFLOAT16)
        tl.store(positions + s, position, mask=inside)
        tl.store(keys + s, tl.load(slot_base + s, mask=inside, other=0) - bits, mask=inside)


def gaussian_thresholds(magnitudes: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                        thresholds: torch.Tensor, low: torch.Tensor, high: torch.Tensor, fewest: torch.Tensor,
                        whole: torch.Tensor, adjustments: int) -> torch.Tensor:
    """``TensorOps.gaussian_thresholds``: one program per segment."""
    out = torch.empty_like(thresholds)
    _gaussian_thresholds[(thresholds.numel(),)](
        magnitudes, starts, counts, thresholds, low, high, fewest, whole, out, adjustments,
        RAISE_BY=GAUSSIAN_RAISE_BY, LOWER_BY=GAUSSIAN_LOWER_BY, STEP=ENTRIES_PER_STEP)
    return out


def magnitude_keys(x: torch.Tensor, base: torch.Tensor, real: "torch.Tensor | bool") -> torch.Tensor:
    """``TensorOps.magnitude_keys``: one launch."""
    keys = torch.empty(x.numel(), dtype=torch.int64, device=x.device)
    n = x.numel()
    if n:
        mask = real if isinstance(real, torch.Tensor) else keys
        _magnitude_keys[(-(-n // ENTRIES_PER_PROGRAM),)](x, base, mask, keys, n,
                                                         REAL=isinstance(real, torch.Tensor),
                                                         BFLOAT16=x.dtype == torch.bfloat16,
                                                         BLOCK=ENTRIES_PER_PROGRAM)
    return keys


def block_keys(x: torch.Tensor, blocks: torch.Tensor, block: int, slot_offset: torch.Tensor,
               slot_last: torch.Tensor, slot_base: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``TensorOps.block_keys``: one launch."""
    n = slot_offset.numel()
    positions = torch.empty(n, dtype=torch.int64, device=x.device)
    keys = torch.empty(n, dtype=torch.int64, device=x.device)
    if n:
        _block_keys[(-(-n // ENTRIES_PER_PROGRAM),)](x, blocks, slot_offset, slot_last, slot_base, positions, keys, n,
                                                     block, BFLOAT16=x.dtype == torch.bfloat16,
                                                     BLOCK=ENTRIES_PER_PROGRAM)
    return positions, keys
