"""Which entries of a tensor to send: exact top-k, DGC's sampled threshold, Gaussian-k.

Each selector returns the int64 positions of the chosen entries of a flat tensor ``x``, in
ascending order (the order messages code them in).

The sampled and Gaussian selectors never build a full-size temporary: one pass computes the
maximum of ``|x|`` per small block, and every later step (counting entries above a threshold,
lowering it, collecting them) looks only inside the blocks whose maximum reaches the
threshold. A threshold retry therefore costs almost nothing, and the final exact top-k runs
over a few more than k candidates instead of the whole tensor.
"""
from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any, Optional, Tuple

from .ops import Candidates, Scalar, Tensor, TensorOps

# Blocks hold about 2 * sqrt(1/density) elements. Candidate blocks then hold about k * block
# elements and there are n / block block maxima: the square root balances the two, and the
# factor 2 favours the block-maximum reductions, which run faster over longer rows.
MIN_BLOCK = 8
MAX_BLOCK = 1024
# The sample's threshold is taken a little below its k-th largest value, so that the first
# try already finds at least k entries in the great majority of steps.
SAMPLE_MARGIN = 1.15
# DGC's defaults for the sampled selection (DGCConfig's, and ScaleCom's leader's).
SAMPLE_RATIO = 0.01
MAX_RETRIES = 4
RETRY_FACTOR = 0.8
# A sample always contains at least this many expected selections, whatever the density.
MIN_SAMPLED_SELECTIONS = 64
# Below this many entries (norms and biases) a full exact top-k costs less than the sample
# and the block filter: 15 against 78 microseconds at 2,048 entries, 21 against 83 at 4,096
# (one CPU thread), and on a GPU it is two kernels and no wait.
EXACT_BELOW_NUMEL = 4096
# A bound known before the memory's pass lets the pass collect the candidates itself: every
# entry reaching it, usable if there are between k and CANDIDATE_CAPACITY * k of them. The
# bound is predicted from the tensor's last step (predict_bound): DGC's velocity piles up just
# below its threshold (at density 0.001, about 25k entries reach 0.9 times the k-th largest),
# so the bound is placed where about TARGET_CANDIDATES * k entries were, from the last step's
# count; a step without a count puts it at FIRST_MARGIN times the k-th largest, and never
# below MIN_MARGIN times it.
TARGET_CANDIDATES = 2
CANDIDATE_CAPACITY = 6
FIRST_MARGIN = 0.99
MIN_MARGIN = 0.5
# Above this share of a tensor (densities of about 2% and more, early in warm-up) candidates
# would take more memory than the sampled selection costs.
MAX_CANDIDATE_SHARE = 0.125


def top_count(density: float, numel: int) -> int:
    """k: how many entries a tensor of ``numel`` elements sends at ``density``."""
    # Rounding first keeps 0.01 * 19200 at 192 instead of a ceil of 192.00000000000003.
    return min(numel, max(1, math.ceil(round(density * numel, 6))))


def block_size(density: float) -> int:
    """Block length (a power of two) used to filter candidates at ``density``."""
    target = 2.0 * (1.0 / density) ** 0.5
    size = 2 ** max(0, round(math.log2(max(target, 1.0))))
    return min(MAX_BLOCK, max(MIN_BLOCK, size))


def filter_block(k: int, numel: int) -> int:
    """Block length of the sampled and Gaussian selections of k entries out of ``numel``:
    the length whose per-block maxima a memory's accumulation may hand them."""
    return block_size(k / numel)


def candidate_capacity(bound: Optional[float], k: int, numel: int) -> int:
    """How many candidates a memory's pass may collect at ``bound`` for a selection of k
    entries out of ``numel``; 0: none (no usable bound, or too large a share of the tensor)."""
    capacity = CANDIDATE_CAPACITY * k
    if (bound is None or not bound > 0.0 or not math.isfinite(bound)
            or capacity > MAX_CANDIDATE_SHARE * numel):
        return 0
    return capacity


def uses_bounds(ops: TensorOps, x: Tensor) -> bool:
    """Whether a selection from ``x`` takes candidates collected at a predicted bound: not
    where sizes read back cost a wait (a GPU), whose :func:`select_by_blocks` needs none."""
    return not ops.sizes_cost_a_wait(x)


def predict_bound(ops: TensorOps, threshold: Scalar, k: Any,
                  candidates: Optional[Candidates], target: Any = TARGET_CANDIDATES) -> Scalar:
    """The candidate bound for a tensor's next step, from this step's k-th largest magnitude
    ``threshold`` and the candidates collected at this step's bound (None: none were): where
    ``target * k`` entries would have reached it if entries were spread evenly between the
    bound and the threshold, and within [MIN_MARGIN, 1] times the threshold. Elementwise
    where the arguments are tensors of one value per tensor (a bucket's segments)."""
    if candidates is None:
        return threshold * FIRST_MARGIN
    excess = ops.maximum(candidates.count - k, 1)
    gap = ops.maximum(threshold - candidates.bound, 0.0)
    bound = threshold - gap * ((target - 1) * k / excess)
    return ops.where(candidates.count > k, ops.maximum(bound, threshold * MIN_MARGIN),
                     threshold * FIRST_MARGIN)


def magnitude_bits(ops: TensorOps, x: Tensor) -> Tensor:
    """``|x|`` as the int64 bit patterns of its float32 values: non-negative floats order as
    their bits, so these compare exactly as the float32 magnitudes do."""
    magnitudes = ops.cast(ops.abs(x), "float32")
    return ops.cast(ops.bitcast(magnitudes, "int32"), "int64")


_POSITION_SPAN = 2 ** 32


def ranked_keys(ops: TensorOps, x: Tensor, positions: Tensor) -> Tensor:
    """Non-negative int64 keys that order entries by magnitude and, among equal magnitudes,
    put the lower position first: ``bits(|x|) * 2**32 + (2**32 - 1 - position)``."""
    return ops.add(ops.add(magnitude_bits(ops, x), positions, _POSITION_SPAN, -1), _POSITION_SPAN - 1)


def top_lowest_first(ops: TensorOps, x: Tensor, positions: Tensor, k: int) -> Tensor:
    """Positions (ascending) of the k entries of largest magnitude among ``x`` at
    ``positions``, ties at the k-th largest magnitude going to the lowest positions: the one
    top-k every path of every method agrees on."""
    return ops.sort(ops.gather(positions, ops.topk_abs(ranked_keys(ops, x, positions), k)))[0]


def largest_of(ops: TensorOps, positions: Tensor, magnitudes: Tensor, k: int) -> Tensor:
    """Positions (ascending) of the k largest ``magnitudes`` among candidates listed in
    ascending ``positions`` (at least k of them), ties going to the lowest positions."""
    # The candidates reaching the k-th largest magnitude keep their ascending order; only a tie
    # at that magnitude (more than k reach it) needs a top-k and a sort.
    chosen = ops.nonzero(ops.greater_equal(magnitudes, ops.kth_largest(magnitudes, k)))
    return ops.cond(ops.equal(ops.size(chosen), k), lambda: ops.gather(positions, chosen),
                    lambda: top_lowest_first(ops, magnitudes, positions, k))


# Knuth's multiplicative hash spreads successive steps over the sampling offsets.
_OFFSET_MULTIPLIER = 2654435761


def sampling_offset(step: Any, tensor: int) -> Any:
    """The sampling offset of a tensor's step (``tensor``: its wire id)."""
    return (step * _OFFSET_MULTIPLIER + tensor) % 2 ** 31


def select_exact(ops: TensorOps, x: Tensor, k: int) -> Tensor:
    """The k entries of largest magnitude (ties to the lowest positions), by a full top-k."""
    return top_lowest_first(ops, x, ops.arange(ops.numel(x), like=x), k)


class _BlockFilter:
    """Entries of ``x`` with ``|x| >= threshold``, found through per-block maxima (computed
    here unless given: ``ops.block_abs_max(x, block)``). ``count_only``: :meth:`count` reads
    without collecting (for a search whose thresholds may let most of ``x`` through, as
    Gaussian-k's adjustments do); else it collects, for a :meth:`largest` at the same
    threshold to reuse."""

    def __init__(self, ops: TensorOps, x: Tensor, block: int, block_max: Optional[Tensor] = None,
                 count_only: bool = False):
        self.ops, self.x, self.block = ops, x, block
        self.count_only = count_only and ops.counts_without_collecting(x)
        self.block_max = ops.block_abs_max(x, block) if block_max is None else block_max
        self._last: Tuple[Any, Tuple[Tensor, Tensor]] = (None, (None, None))
        self._counted: Tuple[Any, Scalar] = (None, None)

    def at(self, threshold: Scalar) -> Tuple[Tensor, Tensor]:
        """(positions, magnitudes) of every entry with ``|x| >= threshold``."""
        if self._last[0] is threshold:
            return self._last[1]
        blocks = self.ops.positions_at_least(self.block_max, threshold)
        self._last = (threshold, self.ops.collect_at_least(self.x, blocks, self.block, threshold))
        return self._last[1]

    def count(self, threshold: Scalar) -> Scalar:
        if self.count_only and self._last[0] is not threshold:
            if self._counted[0] is not threshold:
                blocks = self.ops.positions_at_least(self.block_max, threshold)
                self._counted = (threshold, self.ops.count_at_least(self.x, blocks, self.block, threshold))
            return self._counted[1]
        return self.ops.size(self.at(threshold)[0])

    def lower_bound(self, k: int) -> Scalar:
        """A threshold at most the k-th largest ``|x|``: the k-th largest block maximum
        (k distinct entries reach it), or 0 when there are fewer than k blocks."""
        if self.ops.numel(self.block_max) < k:
            return 0.0
        return self.ops.kth_largest(self.block_max, k)

    def largest(self, threshold: Scalar, k: int) -> Tensor:
        """Positions (ascending) of the k largest entries among those at or above
        ``threshold`` (there must be at least k of them)."""
        return largest_of(self.ops, *self.at(threshold), k)


def sampled_threshold(ops: TensorOps, x: Tensor, k: int, sample_ratio: float,
                      offset: int, block: int = 1) -> Scalar:
    """Estimate of the k-th largest ``|x|`` from a strided sample of whole blocks of
    ``block`` elements, starting at block ``offset`` (reading whole blocks touches a
    fraction of the cache lines that single strided entries would).

    The sample holds about ``max(sample_ratio * n, MIN_SAMPLED_SELECTIONS * n / k)`` entries.
    """
    n = ops.numel(x)
    if n < 2 * block:
        block = 1
    sample_size = min(n, max(math.ceil(sample_ratio * n), math.ceil(MIN_SAMPLED_SELECTIONS * n / k)))
    blocks = n // block
    stride = max(1, blocks // max(1, sample_size // block))
    sample = ops.abs(ops.strided_sample(x, offset % stride, stride, block))
    m = ops.numel(sample)
    rank = min(m, max(1, math.ceil(k / n * m * SAMPLE_MARGIN)))
    return ops.kth_largest(sample, rank)


def select_by_blocks(ops: TensorOps, x: Tensor, k: int, block_max: Optional[Tensor] = None) -> Tensor:
    """Positions (ascending) of the k entries of largest magnitude, in steps whose sizes do
    not depend on the data (no count is read back: on a GPU each would wait for it).

    The k whole blocks of :func:`filter_block` entries with the largest maxima, and the short
    last block, hold a top-k of ``x``: an entry above the k-th largest ``|x|`` lies in a block
    whose maximum is above it, and fewer than k blocks have one; the blocks at that value
    each hold an entry equal to it, and taking the lowest of those blocks keeps the lowest
    tied entries. An exact top-k over those entries (ties to the lowest positions) is then
    :func:`select_exact`'s. ``block_max``: as for :func:`select_sampled`.
    """
    n = ops.numel(x)
    if k >= n:
        return ops.arange(n, like=x)
    block = filter_block(k, n)
    whole = n // block
    if whole == 0:
        return select_exact(ops, x, k)
    maxima = ops.block_abs_max(x, block) if block_max is None else block_max
    picks = min(k, whole)
    # Among equal maxima the lowest blocks, so that ties go to the lowest positions.
    blocks = top_lowest_first(ops, ops.slice(maxima, 0, whole), ops.arange(whole, like=maxima), picks)
    rows = ops.gather_blocks(ops.slice(x, 0, whole * block), blocks, block)
    tail = n - whole * block
    slots = ops.arange(picks * block, like=blocks)
    within = ops.add(slots, ops.floordiv(slots, block), 1, -block)  # slot % block
    positions = ops.concat([ops.add(ops.repeat_blocks(blocks, block, picks * block), within, block, 1),
                            ops.add(ops.arange(tail, like=blocks), whole * block)])
    return top_lowest_first(ops, ops.concat([rows, ops.slice(x, whole * block, tail)]), positions, k)


def select_sampled(ops: TensorOps, x: Tensor, k: int, sample_ratio: float, offset: int,
                   max_retries: int, retry_factor: float, block_max: Optional[Tensor] = None,
                   candidates: Optional[Candidates] = None) -> Tensor:
    """DGC's selection: sampled threshold, lowered by ``retry_factor`` up to ``max_retries``
    times until at least k entries reach it, then exact top-k among those candidates.
    ``block_max``: max ``|x|`` per block of :func:`filter_block` entries, if already known.
    ``candidates``: every entry of ``x`` reaching some bound, collected while ``x`` was made;
    when they hold at least k entries the top-k is among them, and neither the sample nor the
    block filter runs.

    Exactly k positions come back, and they are the true top-k: if the retries still find
    fewer than k, a guaranteed lower bound of the k-th largest entry becomes the threshold.
    Where sizes read back cost a wait (``ops.sizes_cost_a_wait``: a GPU), the same top-k
    comes from :func:`select_by_blocks` instead, which reads back none; below
    ``EXACT_BELOW_NUMEL`` entries, from :func:`select_exact`.
    """
    n = ops.numel(x)
    if k >= n:
        return ops.arange(n, like=x)
    if n < EXACT_BELOW_NUMEL:
        return select_exact(ops, x, k)
    if ops.sizes_cost_a_wait(x):
        return select_by_blocks(ops, x, k, block_max)
    if candidates is not None:
        return ops.cond(ops.size(candidates.positions) >= k,
                        lambda: largest_of(ops, candidates.positions, candidates.magnitudes, k),
                        lambda: select_sampled(ops, x, k, sample_ratio, offset, max_retries,
                                               retry_factor, block_max))
    block = filter_block(k, n)
    candidates = _BlockFilter(ops, x, block, block_max)
    threshold = sampled_threshold(ops, x, k, sample_ratio, offset, block)

    def lower(t: Scalar, _count: Scalar) -> Tuple[Scalar, Scalar]:
        t = t * retry_factor
        return t, candidates.count(t)

    threshold, count = ops.while_loop(lambda _t, c: c < k, lower,
                                      (threshold, candidates.count(threshold)), max_retries)
    threshold = ops.cond(count < k, lambda: candidates.lower_bound(k), lambda: threshold)
    return candidates.largest(threshold, k)


def gaussian_threshold(ops: TensorOps, x: Tensor, density: float) -> Scalar:
    """``|mean| + std * z`` with ``z = Phi^-1(1 - density / 2)``: the magnitude a normal
    distribution exceeds with probability ``density``."""
    n = ops.numel(x)
    mean = ops.sum(x) / n
    variance = ops.maximum(ops.dot(x, x) / n - mean * mean, 0.0)
    return ops.abs(mean) + ops.sqrt(variance) * gaussian_z(density)


def gaussian_z(density: float) -> float:
    """``Phi^-1(1 - density / 2)``: the multiple of the standard deviation beyond which a
    normal distribution lies with probability ``density``."""
    return NormalDist().inv_cdf(1.0 - density / 2.0)


GAUSSIAN_ADJUSTMENTS = 3
GAUSSIAN_LOW, GAUSSIAN_HIGH = 2.0 / 3.0, 4.0 / 3.0
GAUSSIAN_LOWER_BY, GAUSSIAN_RAISE_BY = 0.5, 1.5


def gaussian_capacity(k: int, numel: int) -> int:
    """Most entries Gaussian-k sends for a target of k: the upper end of its accepted range."""
    return min(numel, math.ceil(GAUSSIAN_HIGH * k))


def select_gaussian(ops: TensorOps, x: Tensor, k: int, block_max: Optional[Tensor] = None) -> Tensor:
    """Gaussian-k: threshold from mean and standard deviation, adjusted at most three times
    (x0.5 below 2k/3 entries, x1.5 above 4k/3); at most ``gaussian_capacity`` positions come
    back (the largest ones if more reach the final threshold).

    Unlike the paper, adjustments that end below 2k/3 entries (they can overshoot: 1, 800,
    60, then 0 entries) fall back to the lowest threshold tried, so that a step never sends
    far fewer entries than an adjustment found. ``block_max``: as for :func:`select_sampled`."""
    n = ops.numel(x)
    capacity = gaussian_capacity(k, n)
    if capacity >= n:
        return ops.arange(n, like=x)
    candidates = _BlockFilter(ops, x, filter_block(k, n), block_max, count_only=True)
    low, high = GAUSSIAN_LOW * k, GAUSSIAN_HIGH * k

    def adjust(t: Scalar, count: Scalar, lowest: Scalar) -> Tuple[Scalar, Scalar, Scalar]:
        t = t * ops.where(count < low, GAUSSIAN_LOWER_BY, GAUSSIAN_RAISE_BY)
        return t, candidates.count(t), ops.minimum(lowest, t)

    threshold = gaussian_threshold(ops, x, k / n)
    threshold, count, lowest = ops.while_loop(lambda _t, c, _l: (c < low) | (c > high), adjust,
                                              (threshold, candidates.count(threshold), threshold),
                                              GAUSSIAN_ADJUSTMENTS)
    # count < 2k/3 for an integer count; an integer bound keeps integer counts comparable.
    threshold = ops.cond(count < math.ceil(low), lambda: lowest, lambda: threshold)

    def largest() -> Tensor:
        # The capacity largest of the entries reaching the threshold are the capacity largest
        # of x, and at least capacity entries reach the capacity-th largest block maximum:
        # collecting from the higher of the two thresholds gives the same set from far fewer
        # entries (the lowest threshold tried can let a quarter of x through).
        return candidates.largest(ops.maximum(threshold, candidates.lower_bound(capacity)), capacity)

    return ops.cond(candidates.count(threshold) > capacity, largest,
                    lambda: candidates.at(threshold)[0])
