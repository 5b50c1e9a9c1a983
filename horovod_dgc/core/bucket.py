"""A bucket: many tensors' gradients as one flat buffer and a table of segments, so that a
step's work is a fixed number of operations per bucket instead of per tensor.

Each member tensor is a :class:`Segment` of the flat buffer, starting at a multiple of
:data:`ALIGN` elements; the gap after a segment is padding, zero in every buffer (gradients,
memories, averages), never selected and never sent. Per-tensor semantics are properties of
the segment table, not of a loop: each segment's k (``ceil(density * numel)`` at its own
density), its memory's masking, its weight decay.

Selection (:func:`select_segments`) takes the exact top-k of every segment at once, in
steps whose number does not depend on the number of segments:

1. the maximum ``|x|`` of every block of ``B`` elements (blocks never straddle segments,
   since ``B`` divides :data:`ALIGN`);
2. one sort of the block maxima keyed by (segment, magnitude): the ``p_s = min(k_s,
   blocks_s)`` largest blocks of each segment hold its top-k (an entry above the k-th
   largest lies in a block whose maximum is above it, and fewer than k blocks have one);
3. their entries, and one sort of those keyed by (segment, magnitude): the first ``k_s`` of
   each segment. Where sizes read back cost no wait (the CPU), the entries below each
   segment's ``p_s``-th largest block maximum are dropped before that sort (at least ``k_s``
   entries of each segment reach it).

Magnitudes are compared as the bits of their float32 values (non-negative floats order as
their bit patterns), so the keys are exact integers: ``(segment + 1) * 2**32 - (bits + 1)``,
and ``(segment + 1) * 2**32`` for padding, which every real entry outranks.

A bucket travels as one sparse message (``wire.MessageLayout``): one header for the
bucket, and the selected positions of every segment in the bucket's flat numbering, which
ascend across segments, in one index coding, then their values.
"""
from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from .ops import BlockBounds, Candidates, Tensor, TensorOps
from .selection import (CANDIDATE_CAPACITY, GAUSSIAN_ADJUSTMENTS, GAUSSIAN_HIGH, GAUSSIAN_LOW,
                        EXACT_BELOW_NUMEL, GAUSSIAN_LOWER_BY, GAUSSIAN_RAISE_BY, MAX_CANDIDATE_SHARE, TARGET_CANDIDATES, block_size,
                        gaussian_capacity, gaussian_z, magnitude_bits, predict_bound, top_count)

# Every segment starts at a multiple of ALIGN elements, and selection blocks divide it.
ALIGN = 64
# candidate_target: a segment of k entries aims at 1 + SMALL_K_SPREAD / sqrt(k) times k
# candidates where that is more than TARGET_CANDIDATES times (k below 256).
SMALL_K_SPREAD = 16.0
_SEGMENT_SHIFT = 2 ** 32


def aligned(numel: int) -> int:
    """``numel`` rounded up to a multiple of :data:`ALIGN` (at least ALIGN)."""
    return max(ALIGN, -(-numel // ALIGN) * ALIGN)


@dataclass(frozen=True)
class Segment:
    """One member tensor of a bucket.

    Attributes:
        name: the tensor's name, identical on every rank.
        numel: its elements.
        offset: where it starts in the bucket's flat buffer (elements, a multiple of ALIGN).
        small: whether it is small (``CompressionConfig.is_small``): compressed at the small
            density, and with an unmasked memory for DGC.
    """

    name: str
    numel: int
    offset: int
    small: bool = False

    @property
    def end(self) -> int:
        """One past its last element in the flat buffer."""
        return self.offset + self.numel

    @property
    def span(self) -> int:
        """Its elements and the padding after it."""
        return aligned(self.numel)


@dataclass(frozen=True)
class Bucket:
    """Tensors exchanged as one: a label identical on every rank, the segments in order and
    the dtype of their gradients (a bucket holds one dtype), and whether they are compressed
    (else sent dense: their memories are a tensor's that is not compressed).

    Raises ValueError on construction for an empty bucket, repeated names, or segments that
    are not laid out one after another at multiples of ALIGN.
    """

    label: str
    segments: Tuple[Segment, ...]
    dtype: str
    compressed: bool = True

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError(f"bucket {self.label!r} has no tensors")
        names = [s.name for s in self.segments]
        if len(set(names)) != len(names):
            raise ValueError(f"bucket {self.label!r} holds a tensor twice: {names}")
        offset = 0
        for s in self.segments:
            if s.numel < 1 or s.offset != offset:
                raise ValueError(f"bucket {self.label!r}: segment {s.name!r} at {s.offset} with "
                                 f"{s.numel} elements, expected a non-empty one at {offset}")
            offset += s.span

    @classmethod
    def of(cls, label: str, members: Sequence[Tuple[str, int, bool]], dtype: str,
           compressed: bool = True) -> "Bucket":
        """The bucket of ``members``, (name, numel, small) each, laid out in that order."""
        segments, offset = [], 0
        for name, numel, small in members:
            segments.append(Segment(name, numel, offset, small))
            offset += aligned(numel)
        return cls(label, tuple(segments), dtype, compressed)

    @property
    def numel(self) -> int:
        """Elements of the flat buffer, padding included."""
        last = self.segments[-1]
        return last.offset + last.span

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(s.name for s in self.segments)

    @functools.cached_property
    def padding(self) -> Tuple[int, ...]:
        """The positions of the flat buffer that are padding, ascending."""
        return tuple(i for s in self.segments for i in range(s.end, s.offset + s.span))

    @functools.cached_property
    def key(self) -> str:
        """The name its message and memories go by: the label and a checksum of the member
        names, so that ranks whose buckets hold other tensors are told apart by the header."""
        return f"{self.label}#{zlib.crc32(chr(0).join(self.names).encode()):08x}"


@functools.lru_cache(maxsize=1024)
def shards_of(bucket: Bucket, lengths: Tuple[int, ...]) -> Bucket:
    """The layout of one rank's shards of ``bucket``'s tensors kept as one flat buffer: segment
    s holds ``lengths[s]`` entries (a sharded memory's ``shard_length`` for that tensor), laid
    out as any bucket is, under the same label and names."""
    return Bucket.of(bucket.label, [(s.name, n, s.small) for s, n in zip(bucket.segments, lengths)],
                     bucket.dtype)


@dataclass(frozen=True)
class Plan:
    """How many entries each segment of a bucket sends at given densities, and the block
    length of its selection (what a step's selection and message need besides the data).

    Attributes:
        bucket: the bucket.
        ks: entries each segment selects (``top_count`` at its density).
        block: the selection's block length (a power of two dividing ALIGN).
    """

    bucket: Bucket
    ks: Tuple[int, ...]
    block: int

    @classmethod
    def at(cls, bucket: Bucket, densities: Sequence[float]) -> "Plan":
        """The plan for each segment's density; the block suits the lowest density."""
        ks = tuple(top_count(d, s.numel) for d, s in zip(densities, bucket.segments))
        return interned(cls(bucket, ks, min(ALIGN, block_size(min(densities)))))

    @property
    def total(self) -> int:
        """Entries the bucket sends."""
        return sum(self.ks)

    @functools.cached_property
    def block_picks(self) -> Tuple[int, ...]:
        """Per segment, how many of its largest blocks hold its top-k: ``min(k, blocks)``."""
        return tuple(min(k, -(-s.numel // self.block)) for k, s in zip(self.ks, self.bucket.segments))

    @functools.cached_property
    def pick_starts(self) -> Tuple[int, ...]:
        """Where each segment's selections start among the bucket's (ascending positions)."""
        return tuple(_starts(self.ks))

    def tables(self, ops: TensorOps, like: Tensor) -> "Tables":
        """The plan's index tables on the device of ``like``, made once per plan (a bucket
        stays on one device)."""
        return constant_tables(self, Tables.build, ops, like)


_TABLES: Dict[Tuple[Any, Any], Any] = {}


def constant_tables(plan: Any, build: Callable[[TensorOps, Any, Tensor], Any], ops: TensorOps, like: Tensor) -> Any:
    """``build(ops, plan, like)``, made once per plan and what its constants can be shared by
    (``TensorOps.constants_key``)."""
    key = (plan, ops.constants_key(like))
    made = _TABLES.get(key)
    if made is None:
        made = _TABLES[key] = build(ops, plan, like)
    return made


@functools.lru_cache(maxsize=4096)
def interned(plan: Plan) -> Plan:
    """One object per distinct plan (its tables are cached by it)."""
    return plan


def _starts(counts: Sequence[int]) -> List[int]:
    starts, at = [], 0
    for count in counts:
        starts.append(at)
        at += count
    return starts


@dataclass(frozen=True)
class Tables:
    """The constant tensors a plan's selection indexes with (see :func:`select_segments`).

    Attributes:
        block_base: per block, ``(segment + 1) * 2**32``.
        real_block: per block, whether it holds an entry of its segment (not only padding).
        block_picks: positions in the sorted blocks of each segment's ``p_s`` largest.
        last_pick: per segment, the position in the sorted blocks of its ``p_s``-th largest.
        whole_segment: per segment, whether all its blocks are picked (then every entry is a
            candidate and no block maximum bounds them).
        pick_segment: per picked block, its segment.
        slot_base, slot_last, slot_offset: per candidate slot, its segment's key base, its
            segment's last position, and its place in its block.
        ks: per segment, k (int64).
        within: for each selection, its place among its segment's (``0 .. k_s - 1``).
        segment_bounds: ``s * 2**32 + 1`` for s = 1 .. S - 1: the keys of segment s lie in
            ``(s * 2**32, (s + 1) * 2**32]``, so the count of keys below bound s is where
            segment s starts among sorted keys.
        first_start: a one-element zero, where segment 0 starts.
        entry_picks: where sizes cost a wait, the positions in the sorted candidates of each
            segment's first k.
        large_picks: the selections' places in the large segments (whose memory DGC masks).
        segment_edges: where each segment starts in the flat buffer, then its end (for
            counting positions per segment).
        segment_base: per segment, ``(segment + 1) * 2**32``.
        first_picks: per segment, where its selections start among the bucket's
            (``plan.pick_starts``).
        pick_base: per selection (``plan.total``, segment after segment), its segment's
            ``segment_base``.
        block_segment: per block, its segment (for a bound per segment expanded per block).
        first_blocks: per segment, its first block.
        targets: per segment, the candidates its bound aims at, in multiples of its k
            (:func:`candidate_target`).
        collects_all: per segment, whether its candidates are all its entries (bound 0).
    """

    block_base: Tensor
    real_block: Tensor
    block_picks: Tensor
    last_pick: Tensor
    whole_segment: Tensor
    pick_segment: Tensor
    slot_base: Tensor
    slot_last: Tensor
    slot_offset: Tensor
    ks: Tensor
    within: Tensor
    segment_bounds: Tuple[int, ...]
    first_start: Tensor
    entry_picks: Tensor
    large_picks: Tensor
    segment_edges: Tuple[int, ...]
    segment_base: Tensor
    first_picks: Tensor
    pick_base: Tensor
    block_segment: Tensor
    first_blocks: Tensor
    targets: Tensor
    collects_all: Tensor

    @classmethod
    def build(cls, ops: TensorOps, plan: Plan, like: Tensor) -> "Tables":
        bucket, block = plan.bucket, plan.block
        block_base, real_block, block_picks, last_pick, pick_segment = [], [], [], [], []
        slot_base, slot_last, slot_offset, entry_picks, large = [], [], [], [], []
        slot = 0
        for s, (segment, k, picks) in enumerate(zip(bucket.segments, plan.ks, plan.block_picks)):
            base = (s + 1) * _SEGMENT_SHIFT
            blocks = segment.span // block
            first = segment.offset // block
            block_base += [base] * blocks
            real_block += [1 if j * block < segment.numel else 0 for j in range(blocks)]
            block_picks += range(first, first + picks)
            pick_segment += [s] * picks
            last_pick.append(first + picks - 1)
            slot_base += [base] * (picks * block)
            slot_last += [segment.end - 1] * (picks * block)
            slot_offset += list(range(block)) * picks
            entry_picks += range(slot, slot + k)
            slot += picks * block
        for start, k, segment in zip(plan.pick_starts, plan.ks, bucket.segments):
            if not segment.small:
                large += range(start, start + k)
        whole = [1 if picks * block >= segment.numel or picks < k else 0
                 for segment, k, picks in zip(bucket.segments, plan.ks, plan.block_picks)]

        def ints(values: Sequence[int]) -> Tensor:
            return ops.constant(list(values), "int64", like=like)

        return cls(block_base=ints(block_base),
                   real_block=ops.greater_equal(ints(real_block), 1),
                   block_picks=ints(block_picks), last_pick=ints(last_pick),
                   whole_segment=ops.greater_equal(ints(whole), 1),
                   pick_segment=ints(pick_segment),
                   slot_base=ints(slot_base), slot_last=ints(slot_last),
                   slot_offset=ints(slot_offset), ks=ints(plan.ks),
                   within=ints([j for k in plan.ks for j in range(k)]),
                   segment_bounds=tuple(s * _SEGMENT_SHIFT + 1 for s in range(1, len(plan.ks))),
                   first_start=ints([0]),
                   entry_picks=ints(entry_picks), large_picks=ints(large),
                   segment_edges=tuple(s.offset for s in bucket.segments) + (bucket.numel,),
                   segment_base=ints([(s + 1) * _SEGMENT_SHIFT for s in range(len(plan.ks))]),
                   first_picks=ints(plan.pick_starts),
                   pick_base=ints([(s + 1) * _SEGMENT_SHIFT for s, k in enumerate(plan.ks) for _ in range(k)]),
                   block_segment=ints([s for s, segment in enumerate(bucket.segments)
                                       for _ in range(segment.span // block)]),
                   first_blocks=ints([segment.offset // block for segment in bucket.segments]),
                   targets=ops.constant([candidate_target(k) for k in plan.ks], "float32", like=like),
                   collects_all=ops.greater_equal(ints([int(_collects_all(s)) for s in bucket.segments]), 1))


def _keys(ops: TensorOps, x: Tensor, base: Tensor, real: Any) -> Tensor:
    """Sort keys of ``x``'s magnitudes: a segment's entries together (``base``: its base,
    per entry), its largest first, padding (where ``real`` is False) last."""
    keys = ops.magnitude_keys(x, base, real)
    if keys is not None:
        return keys
    return ops.add(base, ops.where(real, ops.add(magnitude_bits(ops, x), 1), 0), 1, -1)


def select_segments(ops: TensorOps, x: Tensor, plan: Plan, maxima: Optional[Tensor] = None) -> Tensor:
    """Positions (int64, in the bucket's flat numbering, ascending) of the ``k_s`` entries of
    largest magnitude of every segment of ``x``, the bucket's flat buffer: ``plan.total`` of
    them, segment s's at ``plan.pick_starts[s]`` onward. Ties at a segment's k-th largest
    magnitude are broken either way. ``maxima``: ``ops.block_abs_max(x, plan.block)``, where
    the memory's pass took it."""
    tables = plan.tables(ops, x)
    block = plan.block
    maxima = ops.block_abs_max(x, block) if maxima is None else maxima
    _, order = ops.sort(_keys(ops, maxima, tables.block_base, tables.real_block))
    # Each segment's chosen blocks in ascending order (they stay grouped by segment): the
    # candidates then follow their positions, and the stable sorts below put the lowest
    # first among equal magnitudes.
    blocks = ops.sort(ops.gather(order, tables.block_picks))[0]
    if ops.sizes_cost_a_wait(x):
        positions, keys = block_keys(ops, x, blocks, block, tables)
        _, ranked = ops.sort(keys)
        return ops.sort(ops.gather(positions, ops.gather(ranked, tables.entry_picks)))[0]
    values, positions, real = _block_entries(ops, x, blocks, block, tables)
    # At least k_s entries of segment s reach its p_s-th largest block maximum: the others
    # cannot be among its top k.
    bits = magnitude_bits(ops, values)
    bound = ops.where(tables.whole_segment, 0,
                      magnitude_bits(ops, ops.gather(maxima, ops.gather(order, tables.last_pick))))
    reach = ops.greater_equal(bits, ops.repeat_blocks(ops.gather(bound, tables.pick_segment), block, ops.numel(bits)))
    kept = ops.nonzero(ops.where(real, reach, False))
    keys, ranked = ops.sort(_keys(ops, ops.gather(values, kept), ops.gather(tables.slot_base, kept), True))
    picks = tables.within
    if len(plan.ks) > 1:
        starts = ops.concat([tables.first_start, ops.searchsorted(keys, tables.segment_bounds)])
        picks = ops.add(ops.repeat_each(starts, tables.ks, plan.total), picks)
    return ops.sort(ops.gather(ops.gather(positions, kept), ops.gather(ranked, picks)))[0]


def _block_entries(ops: TensorOps, x: Tensor, blocks: Tensor, block: int,
                   tables: Tables) -> Tuple[Tensor, Tensor, Tensor]:
    """(the entries of ``x``'s chosen ``blocks``, their positions, whether each lies in its
    segment)."""
    values = ops.gather_blocks(x, blocks, block)
    # ``blocks`` is not read again: scaled in place to its first entries.
    positions = ops.add(ops.repeat_blocks(ops.scale(blocks, block), block, ops.numel(values)), tables.slot_offset)
    return values, positions, ops.greater_equal(tables.slot_last, positions)


def block_keys(ops: TensorOps, x: Tensor, blocks: Tensor, block: int, tables: Tables) -> Tuple[Tensor, Tensor]:
    """(the positions of ``x``'s chosen ``blocks``' entries, their sort keys: a segment's
    together, its largest first, entries past its end last)."""
    found = ops.block_keys(x, blocks, block, tables.slot_offset, tables.slot_last, tables.slot_base)
    if found is not None:
        return found
    values, positions, real = _block_entries(ops, x, blocks, block, tables)
    return positions, _keys(ops, values, tables.slot_base, real)


def candidate_target(k: int) -> float:
    """Candidates a segment's bound aims at, in multiples of its k: ``TARGET_CANDIDATES``, and
    more for a small k, whose k-th largest moves more from step to step (a bucket whose
    segment falls short of its k selects without its candidates)."""
    return max(TARGET_CANDIDATES, 1.0 + SMALL_K_SPREAD / math.sqrt(k))


def block_bounds(ops: TensorOps, plan: Plan, bounds: Optional[Sequence[float]],
                 like: Tensor) -> Tuple[Optional[BlockBounds], int]:
    """(the bound of every block, its segment's, for the memory's pass to collect candidates
    at; how many candidates it may collect), from each segment's bound predicted at its last
    step (:func:`next_bounds`); (None, 0) where a segment has none, or where the candidates
    would take more than MAX_CANDIDATE_SHARE of the bucket. A segment of fewer than
    EXACT_BELOW_NUMEL entries (whose k-th largest moves too much from step to step to be
    predicted) collects every entry: bound 0, its padding sorting after its entries."""
    if bounds is None or not all(b >= 0.0 and math.isfinite(b) for b in bounds):
        return None, 0
    segments = plan.bucket.segments
    bounds = [0.0 if _collects_all(s) else b for b, s in zip(bounds, segments)]
    capacity = sum(s.span if _collects_all(s) else min(s.span, math.ceil(CANDIDATE_CAPACITY / TARGET_CANDIDATES
                                                                          * candidate_target(k) * k))
                   for k, s in zip(plan.ks, segments))
    if capacity > MAX_CANDIDATE_SHARE * plan.bucket.numel:
        return None, 0
    per_segment = ops.constant(bounds, "float32", like=like)
    return BlockBounds(ops.gather(per_segment, plan.tables(ops, like).block_segment)), capacity


def _collects_all(segment: Segment) -> bool:
    return segment.numel < EXACT_BELOW_NUMEL


class FromCandidates(NamedTuple):
    """What :func:`select_candidates` found: each segment's top-k (positions as
    :func:`select_segments`' ) and its k-th largest magnitude (float32), both None where some
    segment has fewer than its k candidates; and each segment's count of candidates (None
    where none were collected)."""

    positions: Optional[Tensor]
    thresholds: Optional[Tensor]
    counts: Optional[Tensor]


def select_candidates(ops: TensorOps, plan: Plan, candidates: Candidates) -> FromCandidates:
    """:func:`select_segments`' positions from ``candidates`` alone, where every segment holds
    its k among them (see :class:`FromCandidates`). The
    candidates: every entry of the bucket at or above its block's bound (``candidates.bound``),
    collected by the memory's pass (positions ascending; none where more than their capacity
    reached them), and how many of each block's did (``candidates.count``). Reads the counts
    back: only where sizes cost no wait (the CPU)."""
    positions, segments = candidates.positions, len(plan.ks)
    tables = plan.tables(ops, positions)
    counts = ops.scatter_add(ops.zeros(segments, "int64", like=positions), tables.block_segment, candidates.count)
    if not bool(ops.all_within(counts, tables.ks, ops.numel(positions))):
        return FromCandidates(None, None, counts)
    starts = ops.slice(ops.searchsorted(positions, tables.segment_edges), 0, segments)
    found = ops.top_of_segments(positions, candidates.magnitudes, starts, counts, tables.ks)
    if found is not None:
        return FromCandidates(*found, counts)
    base = ops.repeat_each(tables.segment_base, counts, ops.numel(positions))
    _, ranked = ops.sort(_keys(ops, candidates.magnitudes, base, True))
    # Sorting by segment keeps the segments in their order, each at its start among positions,
    # its largest first.
    picks = ops.add(ops.repeat_each(starts, tables.ks, plan.total), tables.within)
    last = ops.gather(ranked, ops.add(ops.add(starts, tables.ks), -1))
    return FromCandidates(ops.sort(ops.gather(positions, ops.gather(ranked, picks)))[0],
                          ops.gather(candidates.magnitudes, last), counts)


def next_bounds(ops: TensorOps, plan: Plan, thresholds: Tensor, bounds: Optional[BlockBounds],
                counts: Optional[Tensor]) -> Tensor:
    """Each segment's candidate bound for its next step (:func:`~.selection.predict_bound`,
    elementwise), from its k-th largest magnitude this step (float32, one per segment), and
    the bound of every block and each segment's count of candidates where this step
    collected them."""
    tables = plan.tables(ops, thresholds)
    held = None
    if bounds is not None and counts is not None:
        held = Candidates(None, None, counts, ops.gather(bounds.values, tables.first_blocks))
    return ops.where(tables.collects_all, 0.0, predict_bound(ops, thresholds, tables.ks, held, tables.targets))


def segment_thresholds(ops: TensorOps, magnitudes: Tensor, plan: Plan) -> Tensor:
    """Each segment's smallest of ``magnitudes``, the float32 ``|x|`` of ``plan``'s
    selection (positions ascending: segment s's ``k_s`` from ``plan.pick_starts[s]`` on): its
    k_s-th largest."""
    tables = plan.tables(ops, magnitudes)
    _, ranked = ops.sort(ops.add(tables.pick_base, magnitude_bits(ops, magnitudes)))
    return ops.gather(magnitudes, ops.gather(ranked, tables.first_picks))


@dataclass(frozen=True)
class GaussianPlan:
    """Gaussian-k on a bucket (:func:`select_gaussian`): each segment's target k and its
    capacity (``gaussian_capacity``: the most it sends), and the selection of every
    segment's ``capacity + 1`` largest entries (all of a segment that fits its capacity), in
    which each threshold's count is taken.

    Attributes:
        plan: the bucket's plan at its densities (each segment's k).
        capacities: per segment, ``gaussian_capacity(k, numel)``.
        reach: the plan of the selection the counts are taken in.
    """

    plan: Plan
    capacities: Tuple[int, ...]
    reach: Plan

    @classmethod
    def of(cls, plan: Plan) -> "GaussianPlan":
        segments = plan.bucket.segments
        capacities = tuple(gaussian_capacity(k, s.numel) for k, s in zip(plan.ks, segments))
        reach = interned(Plan(plan.bucket, tuple(min(c + 1, s.numel) for c, s in zip(capacities, segments)),
                               plan.block))
        return interned(cls(plan, capacities, reach))

    @property
    def total(self) -> int:
        """Most entries the bucket sends."""
        return sum(self.capacities)

    def tables(self, ops: TensorOps, like: Tensor) -> "GaussianTables":
        return constant_tables(self, GaussianTables.build, ops, like)


@dataclass(frozen=True)
class GaussianTables:
    """The constant tensors of a :class:`GaussianPlan` (float32 per segment unless said).

    Attributes:
        block_segment: per block of ALIGN elements, its segment (int64).
        numel: each segment's elements.
        z: ``gaussian_z(k / numel)``.
        low, high, lowest_count: the accepted counts ``2k/3`` and ``4k/3``, and
            ``ceil(2k/3)``, the fewest a final threshold may let through.
        whole: whether the segment is sent whole (its capacity holds it; boolean).
        reach: the selection's entries per segment (int64, for expanding per-segment values).
        reach_start: where each segment's entries start among the selection's (int64).
        slot_segment, slot_base: per selected entry, its segment (int64) and its sort key base.
        kept_slot: per selected entry in a segment's ranking (largest first), whether its
            rank is within the segment's capacity (boolean).
    """

    block_segment: Tensor
    numel: Tensor
    z: Tensor
    low: Tensor
    high: Tensor
    lowest_count: Tensor
    whole: Tensor
    reach: Tensor
    reach_start: Tensor
    slot_segment: Tensor
    slot_base: Tensor
    kept_slot: Tensor

    @classmethod
    def build(cls, ops: TensorOps, plan: GaussianPlan, like: Tensor) -> "GaussianTables":
        segments, ks = plan.plan.bucket.segments, plan.plan.ks
        reach, slots = plan.reach.ks, range(len(segments))

        def ints(values: Sequence[int]) -> Tensor:
            return ops.constant(list(values), "int64", like=like)

        def floats(values: Sequence[float]) -> Tensor:
            return ops.constant(list(values), "float32", like=like)

        return cls(block_segment=ints([s for s, seg in zip(slots, segments) for _ in range(seg.span // ALIGN)]),
                   numel=floats([s.numel for s in segments]),
                   z=floats([gaussian_z(k / s.numel) for k, s in zip(ks, segments)]),
                   low=floats([GAUSSIAN_LOW * k for k in ks]), high=floats([GAUSSIAN_HIGH * k for k in ks]),
                   lowest_count=floats([math.ceil(GAUSSIAN_LOW * k) for k in ks]),
                   whole=ops.greater_equal(ints([int(c >= s.numel) for c, s in zip(plan.capacities, segments)]), 1),
                   reach=ints(reach), reach_start=ints(_starts(reach)),
                   slot_segment=ints([s for s, r in zip(slots, reach) for _ in range(r)]),
                   slot_base=ints([(s + 1) * _SEGMENT_SHIFT for s, r in zip(slots, reach) for _ in range(r)]),
                   kept_slot=ops.greater_equal(ints([int(j < c) for c, r in zip(plan.capacities, reach)
                                                     for j in range(r)]), 1))


def _segment_sums(ops: TensorOps, values: Tensor, segments: Tensor, count: int) -> Tensor:
    """Per segment (``count`` of them), the sum of the float32 ``values`` of its entries."""
    return ops.scatter_add(ops.zeros(count, "float32", like=values), segments, values)


def gaussian_thresholds(ops: TensorOps, x: Tensor, plan: GaussianPlan) -> Tensor:
    """Each segment's ``|mean| + std * z`` (float32): the magnitude a normal distribution of
    the segment's mean and standard deviation exceeds with probability ``k / numel``."""
    tables, count = plan.tables(ops, x), len(plan.capacities)
    x = ops.cast(x, "float32") if ops.dtype(x) != "float32" else x
    totals = [_segment_sums(ops, ops.cast(ops.block_sum(v, ALIGN), "float32"), tables.block_segment, count)
              for v in (x, ops.multiply(x, x))]
    # One value per segment: arithmetic as selection.gaussian_threshold's on its scalars.
    mean = totals[0] / tables.numel
    variance = ops.maximum(totals[1] / tables.numel - mean * mean, 0.0)
    return ops.abs(mean) + ops.sqrt(variance) * tables.z


def select_gaussian(ops: TensorOps, x: Tensor, plan: GaussianPlan, reached: Optional[Tensor] = None) -> Tensor:
    """Gaussian-k of every segment of ``x`` at once: positions (int64, ascending, in the
    bucket's flat numbering) of what :func:`selection.select_gaussian` sends of each segment
    alone, at most ``plan.total`` of them, the count depending on the data.

    A segment's count at a threshold is compared only with ``2k/3``, ``4k/3`` and its
    capacity, and every such comparison comes out the same when the count is taken among the
    segment's ``capacity + 1`` largest entries: so one exact selection of those
    (:func:`select_segments`) replaces every pass over the gradient that counting would
    take, and the adjustments run on tensors of one value per segment. The entries sent are
    the selected ones at or above the final threshold, the ``capacity + 1``-th of a segment
    never (it is reached only when more than the capacity reach the threshold). ``reached``:
    that selection (``select_segments`` at ``plan.reach``), where the caller made it."""
    tables, reach = plan.tables(ops, x), plan.reach
    count = len(plan.capacities)
    positions = select_segments(ops, x, reach) if reached is None else reached
    magnitudes = ops.cast(ops.abs(ops.gather(x, positions)), "float32")

    def counted(threshold: Tensor) -> Tensor:
        return _segment_sums(ops, ops.cast(_reaching(ops, magnitudes, threshold, tables, reach), "float32"),
                             tables.slot_segment, count)

    def adjust(t: Tensor, reached: Tensor, lowest: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        above_low = ops.greater_equal(reached, tables.low)
        within = ops.where(above_low, ops.greater_equal(tables.high, reached), False)
        t = ops.where(within, t, ops.where(above_low, t * GAUSSIAN_RAISE_BY, t * GAUSSIAN_LOWER_BY))
        return t, counted(t), ops.minimum(lowest, t)

    t = gaussian_thresholds(ops, x, plan)
    final = ops.gaussian_thresholds(magnitudes, tables.reach_start, tables.reach, t, tables.low, tables.high,
                                    tables.lowest_count, tables.whole, GAUSSIAN_ADJUSTMENTS)
    if final is not None:
        return _above_thresholds(ops, magnitudes, positions, final, tables, reach)
    state = (t, counted(t), t)
    if ops.sizes_cost_a_wait(x):
        # A segment within its range stays as it is: the adjustments need no test of the
        # counts on the host.
        for _ in range(GAUSSIAN_ADJUSTMENTS):
            state = adjust(*state)
    else:
        state = ops.while_loop(lambda _t, c, _l: ops.equal(ops.all_within(c, tables.low, tables.high), False),
                               adjust, state, GAUSSIAN_ADJUSTMENTS)
    t, reached, lowest = state
    # Fewer than 2k/3 after every adjustment: the lowest threshold tried, as one tensor alone.
    t = ops.where(tables.whole, 0.0, ops.where(ops.greater_equal(reached, tables.lowest_count), t, lowest))
    return _above_thresholds(ops, magnitudes, positions, t, tables, reach)


def _above_thresholds(ops: TensorOps, magnitudes: Tensor, positions: Tensor, t: Tensor,
                      tables: "GaussianTables", reach: Plan) -> Tensor:
    """The ascending ``positions`` whose ``magnitudes`` reach their segment's final
    threshold ``t``, at most each segment's capacity of them (its largest)."""
    _, order = ops.sort(_keys(ops, magnitudes, tables.slot_base, True))
    kept = ops.where(tables.kept_slot, ops.gather(_reaching(ops, magnitudes, t, tables, reach), order), False)
    return ops.sort(ops.gather(ops.gather(positions, order), ops.nonzero(kept)))[0]


def _reaching(ops: TensorOps, magnitudes: Tensor, t: Tensor, tables: "GaussianTables", reach: Plan) -> Tensor:
    """Whether each selected entry's magnitude reaches its segment's threshold ``t``."""
    return ops.greater_equal(magnitudes, ops.repeat_each(t, tables.reach, reach.total))


def flat_views(ops: TensorOps, flat: Tensor, bucket: Bucket) -> List[Tensor]:
    """Each segment's elements of a bucket's flat buffer (views where the framework has them)."""
    return [ops.slice(flat, s.offset, s.numel) for s in bucket.segments]


