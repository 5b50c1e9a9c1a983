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
import zlib
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from .ops import Tensor, TensorOps
from .selection import block_size, magnitude_bits, top_count

# Every segment starts at a multiple of ALIGN elements, and selection blocks divide it.
ALIGN = 64
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
    the dtype of their gradients (a bucket holds one dtype).

    Raises ValueError on construction for an empty bucket, repeated names, or segments that
    are not laid out one after another at multiples of ALIGN.
    """

    label: str
    segments: Tuple[Segment, ...]
    dtype: str

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
    def of(cls, label: str, members: Sequence[Tuple[str, int, bool]], dtype: str) -> "Bucket":
        """The bucket of ``members``, (name, numel, small) each, laid out in that order."""
        segments, offset = [], 0
        for name, numel, small in members:
            segments.append(Segment(name, numel, offset, small))
            offset += aligned(numel)
        return cls(label, tuple(segments), dtype)

    @property
    def numel(self) -> int:
        """Elements of the flat buffer, padding included."""
        last = self.segments[-1]
        return last.offset + last.span

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(s.name for s in self.segments)

    @functools.cached_property
    def key(self) -> str:
        """The name its message and memories go by: the label and a checksum of the member
        names, so that ranks whose buckets hold other tensors are told apart by the header."""
        return f"{self.label}#{zlib.crc32(chr(0).join(self.names).encode()):08x}"


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
        return _interned(cls(bucket, ks, min(ALIGN, block_size(min(densities)))))

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
        made = _TABLES.get(self)
        if made is None:
            made = _TABLES[self] = Tables.build(ops, self, like)
        return made


_TABLES: Dict[Plan, "Tables"] = {}


@functools.lru_cache(maxsize=4096)
def _interned(plan: Plan) -> Plan:
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
        slot_counts: per segment, its candidate slots (``p_s * block``).
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
    """

    block_base: Tensor
    real_block: Tensor
    block_picks: Tensor
    last_pick: Tensor
    whole_segment: Tensor
    slot_counts: Tensor
    slot_base: Tensor
    slot_last: Tensor
    slot_offset: Tensor
    ks: Tensor
    within: Tensor
    segment_bounds: Tuple[int, ...]
    first_start: Tensor
    entry_picks: Tensor
    large_picks: Tensor

    @classmethod
    def build(cls, ops: TensorOps, plan: Plan, like: Tensor) -> "Tables":
        bucket, block = plan.bucket, plan.block
        block_base, real_block, block_picks, last_pick = [], [], [], []
        slot_base, slot_last, slot_offset, entry_picks, large = [], [], [], [], []
        slot = 0
        for s, (segment, k, picks) in enumerate(zip(bucket.segments, plan.ks, plan.block_picks)):
            base = (s + 1) * _SEGMENT_SHIFT
            blocks = segment.span // block
            first = segment.offset // block
            block_base += [base] * blocks
            real_block += [1 if j * block < segment.numel else 0 for j in range(blocks)]
            block_picks += range(first, first + picks)
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
                   slot_counts=ints([p * block for p in plan.block_picks]),
                   slot_base=ints(slot_base), slot_last=ints(slot_last),
                   slot_offset=ints(slot_offset), ks=ints(plan.ks),
                   within=ints([j for k in plan.ks for j in range(k)]),
                   segment_bounds=tuple(s * _SEGMENT_SHIFT + 1 for s in range(1, len(plan.ks))),
                   first_start=ints([0]),
                   entry_picks=ints(entry_picks), large_picks=ints(large))


def _keys(ops: TensorOps, bits: Tensor, base: Tensor, real: Tensor) -> Tensor:
    """Sort keys: a segment's entries together, its largest first, padding last."""
    return ops.add(base, ops.where(real, ops.add(bits, 1), 0), 1, -1)


def select_segments(ops: TensorOps, x: Tensor, plan: Plan) -> Tensor:
    """Positions (int64, in the bucket's flat numbering, ascending) of the ``k_s`` entries of
    largest magnitude of every segment of ``x``, the bucket's flat buffer: ``plan.total`` of
    them, segment s's at ``plan.pick_starts[s]`` onward. Ties at a segment's k-th largest
    magnitude are broken either way."""
    tables = plan.tables(ops, x)
    block = plan.block
    maxima = magnitude_bits(ops, ops.block_abs_max(x, block))
    _, order = ops.sort(_keys(ops, maxima, tables.block_base, tables.real_block))
    # Each segment's chosen blocks in ascending order (they stay grouped by segment): the
    # candidates then follow their positions, and the stable sorts below put the lowest
    # first among equal magnitudes.
    blocks = ops.sort(ops.gather(order, tables.block_picks))[0]
    values = ops.gather_blocks(x, blocks, block)
    positions = ops.add(ops.repeat_blocks(blocks, block, ops.numel(values)), tables.slot_offset, block, 1)
    bits = magnitude_bits(ops, values)
    real = ops.greater_equal(tables.slot_last, positions)
    if ops.sizes_cost_a_wait(x):
        _, ranked = ops.sort(_keys(ops, bits, tables.slot_base, real))
        return ops.sort(ops.gather(positions, ops.gather(ranked, tables.entry_picks)))[0]
    # At least k_s entries of segment s reach its p_s-th largest block maximum: the others
    # cannot be among its top k.
    bound = ops.where(tables.whole_segment, 0, ops.gather(maxima, ops.gather(order, tables.last_pick)))
    reach = ops.greater_equal(bits, ops.repeat_each(bound, tables.slot_counts, ops.numel(bits)))
    kept = ops.nonzero(ops.where(real, reach, False))
    keys, ranked = ops.sort(_keys(ops, ops.gather(bits, kept), ops.gather(tables.slot_base, kept), True))
    picks = tables.within
    if len(plan.ks) > 1:
        starts = ops.concat([tables.first_start, ops.searchsorted(keys, tables.segment_bounds)])
        picks = ops.add(ops.repeat_each(starts, tables.ks, plan.total), picks)
    return ops.sort(ops.gather(ops.gather(positions, kept), ops.gather(ranked, picks)))[0]


def flat_views(ops: TensorOps, flat: Tensor, bucket: Bucket) -> List[Tensor]:
    """Each segment's elements of a bucket's flat buffer (views where the framework has them)."""
    return [ops.slice(flat, s.offset, s.numel) for s in bucket.segments]


