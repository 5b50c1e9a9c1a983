"""How a sparse message codes its positions and its values; ``wire.py`` frames them.

Positions travel sorted ascending, the values in the same order. Every coding has a size
fixed by the tensor's number of elements ``n`` and the message's capacity, so messages keep
one size per tensor and density (Horovod's response cache keeps its fast path).

Index codings (the smallest for ``n`` and the capacity is used):

* ``raw``: one int32 per position (int64 from 2**31 elements on);
* ``elias-fano``: with ``l = floor(log2(n / capacity))``, the ``l`` low bits of every position,
  packed, then a bitvector of ``capacity + (n >> l) + 1`` bits in which the i-th position
  sets bit ``(position >> l) + i``: at most ``l + 2`` bits and a fraction per position (11.9
  at density 0.001);
* ``bitmap``: one bit per element of the tensor (the smallest at warm-up densities of 25%).

Value codings: ``float32``, ``float16`` and ``bfloat16`` (a value beyond float16's range is
clamped to it), and ``int8``: one byte per value and one float32 scale per message,
``value = q * max|v| / 127``. Whatever a coding rounds away stays in the sender's memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict, List, Optional, Sequence, Tuple

from .ops import Scalar, Tensor, TensorOps

Parts = Tuple[Tuple[str, int], ...]
# The largest finite value of each 16-bit float format: larger values are clamped to it.
FORMAT_MAX = {"float16": 65504.0}
INT8_LEVELS = 127
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8, "uint8": 1,
               "int8": 1}


def _bytes_for_bits(bits: int) -> int:
    return -(-bits // 8)


ALIGN_BYTES = 8  # every part of a message starts on a multiple of this


def part_bytes(parts: Parts) -> int:
    """Bytes the parts take in a message, each padded to ALIGN_BYTES."""
    return sum(-(-count * DTYPE_BYTES[dtype] // ALIGN_BYTES) * ALIGN_BYTES for dtype, count in parts)


def past_count(ops: TensorOps, capacity: int, count: Scalar, like: Tensor) -> Tensor:
    """Which of a message's ``capacity`` slots lie past its ``count``: its padding."""
    return ops.greater_equal(ops.arange(capacity, like=like), count)


@dataclass(frozen=True)
class IndexCoding:
    """One way to code the sorted positions of a message of ``capacity`` slots for a tensor
    of ``numel`` elements."""

    numel: int
    capacity: int
    name: ClassVar[str]
    code: ClassVar[int]

    @property
    def parts(self) -> Parts:
        raise NotImplementedError

    def encode(self, ops: TensorOps, positions: Tensor, count: Scalar) -> List[Tensor]:
        """The parts for the ``count`` ascending int64 ``positions``."""
        raise NotImplementedError

    def decode(self, ops: TensorOps, parts: Sequence[Tensor], count: Scalar) -> Tuple[Tensor, Scalar]:
        """(``capacity`` int64 positions, 0 past ``count``; whether the parts are consistent
        with ``count`` and the tensor's size)."""
        raise NotImplementedError

    def decode_rows(self, ops: TensorOps, parts: Sequence[Tensor], counts: Tensor, padding: Tensor
                    ) -> Tuple[Tensor, Scalar, Optional[Tensor]]:
        """:meth:`decode` of ``len(counts)`` messages at once, each part holding every
        message's entries one message after another: (their ``capacity`` positions each,
        laid end to end; whether every message's parts agree with its count and the tensor's
        size; for a coding whose set bits must match the count, each message's number of
        them, else None). ``padding``: ``TensorOps.past_counts`` of ``counts``."""
        raise NotImplementedError

    def checked_slots(self, ops: TensorOps, parts: Sequence[Tensor], positions: Tensor) -> Tensor:
        """The slots whose range :meth:`decode_rows` checks, given what it decoded of
        ``parts``: its ``positions`` (0 past each count), for a receiver's explanation of a
        failed check."""
        return positions

    def _in_range(self, ops: TensorOps, positions: Tensor) -> Scalar:
        return ops.all_within(positions, 0, self.numel - 1)

    def _counted(self, ops: TensorOps, found: Tensor, counts: Tensor) -> Scalar:
        return ops.all_within(ops.add(found, ops.cast(counts, "int64"), 1, -1), 0, 0)


@dataclass(frozen=True)
class RawIndices(IndexCoding):
    name: ClassVar[str] = "raw"
    code: ClassVar[int] = 1

    @property
    def dtype(self) -> str:
        return "int32" if self.numel < 2 ** 31 else "int64"

    @property
    def parts(self) -> Parts:
        return ((self.dtype, self.capacity),)

    def encode(self, ops: TensorOps, positions: Tensor, count: Scalar) -> List[Tensor]:
        return [ops.pad(ops.cast(positions, self.dtype), self.capacity)]

    def decode(self, ops: TensorOps, parts: Sequence[Tensor], count: Scalar) -> Tuple[Tensor, Scalar]:
        # Every slot must lie in the tensor (the coding writes 0 past the count), but what a
        # slot past the count holds is padding: 0, whatever its bytes say.
        positions = ops.cast(parts[0], "int64")
        return ops.where(past_count(ops, self.capacity, count, positions), 0, positions), \
            self._in_range(ops, positions)

    def decode_rows(self, ops: TensorOps, parts: Sequence[Tensor], counts: Tensor, padding: Tensor
                    ) -> Tuple[Tensor, Scalar, Optional[Tensor]]:
        positions = ops.cast(parts[0], "int64")
        return ops.where(padding, 0, positions), self._in_range(ops, positions), None

    def checked_slots(self, ops: TensorOps, parts: Sequence[Tensor], positions: Tensor) -> Tensor:
        return ops.cast(parts[0], "int64")  # every slot, past the count too


@dataclass(frozen=True)
class EliasFano(IndexCoding):
    name: ClassVar[str] = "elias-fano"
    code: ClassVar[int] = 2

    @property
    def low_bits(self) -> int:
        return max(0, (self.numel // max(self.capacity, 1)).bit_length() - 1)

    @property
    def upper_bits(self) -> int:
        return self.capacity + (self.numel >> self.low_bits) + 1

    @property
    def parts(self) -> Parts:
        return (("uint8", _bytes_for_bits(self.capacity * self.low_bits)),
                ("uint8", _bytes_for_bits(self.upper_bits)))

    def encode(self, ops: TensorOps, positions: Tensor, count: Scalar) -> List[Tensor]:
        l, (lower, upper) = self.low_bits, self.parts
        high = ops.floordiv(positions, 2 ** l)
        low = ops.add(positions, high, 1, -(2 ** l))
        marks = ops.add(high, ops.arange(count, like=positions))
        return [ops.pack_fields(low, l, lower[1]), ops.set_bits(marks, upper[1])]

    def decode(self, ops: TensorOps, parts: Sequence[Tensor], count: Scalar) -> Tuple[Tensor, Scalar]:
        return ops.elias_fano_positions(parts[0], self.low_bits, parts[1], self.upper_bits,
                                        self.capacity, count, self.numel)

    def decode_rows(self, ops: TensorOps, parts: Sequence[Tensor], counts: Tensor, padding: Tensor
                    ) -> Tuple[Tensor, Scalar, Optional[Tensor]]:
        high, found = ops.elias_fano_rows(parts[0], self.low_bits, parts[1], self.upper_bits,
                                          self.capacity, ops.numel(counts))
        positions = ops.where(padding, 0, high)
        return positions, ops.where(self._counted(ops, found, counts), self._in_range(ops, positions),
                                    False), found


@dataclass(frozen=True)
class Bitmap(IndexCoding):
    name: ClassVar[str] = "bitmap"
    code: ClassVar[int] = 3

    @property
    def parts(self) -> Parts:
        return (("uint8", _bytes_for_bits(self.numel)),)

    def encode(self, ops: TensorOps, positions: Tensor, count: Scalar) -> List[Tensor]:
        return [ops.set_bits(positions, self.parts[0][1])]

    def decode(self, ops: TensorOps, parts: Sequence[Tensor], count: Scalar) -> Tuple[Tensor, Scalar]:
        positions, n_set = ops.set_bit_positions_fitted(parts[0], self.numel, self.capacity)
        return positions, ops.equal(n_set, count)

    def decode_rows(self, ops: TensorOps, parts: Sequence[Tensor], counts: Tensor, padding: Tensor
                    ) -> Tuple[Tensor, Scalar, Optional[Tensor]]:
        bitmaps = ops.rows(ops.unpack_bits(parts[0]), 0, self.parts[0][1] * 8, self.numel,
                           ops.numel(counts))
        positions, found = ops.row_set_bits(bitmaps, self.numel, self.capacity)
        return positions, self._counted(ops, found, counts), found


INDEX_CODINGS: Dict[int, type] = {c.code: c for c in (RawIndices, EliasFano, Bitmap)}


def index_coding(numel: int, capacity: int) -> IndexCoding:
    """The smallest coding of ``capacity`` positions in a tensor of ``numel`` elements."""
    candidates = [kind(numel, capacity) for kind in INDEX_CODINGS.values()]
    return min(candidates, key=lambda c: (part_bytes(c.parts), c.code))


@dataclass(frozen=True)
class ValueCoding:
    """One way to code ``capacity`` values."""

    capacity: int
    name: ClassVar[str]
    code: ClassVar[int]

    @property
    def parts(self) -> Parts:
        raise NotImplementedError

    def encode(self, ops: TensorOps, values: Tensor) -> Tuple[List[Tensor], Tensor]:
        """(parts, the values receivers will decode, as float32) for up to ``capacity``
        values (padded with zeros)."""
        raise NotImplementedError

    def decode(self, ops: TensorOps, parts: Sequence[Tensor], dtype: str) -> Tensor:
        """The ``capacity`` values in ``dtype``."""
        raise NotImplementedError

    def decode_rows(self, ops: TensorOps, parts: Sequence[Tensor], rows: int, dtype: str) -> Tensor:
        """:meth:`decode` of ``rows`` messages at once (each part: every message's entries,
        one message after another)."""
        return self.decode(ops, parts, dtype)


@dataclass(frozen=True)
class FloatValues(ValueCoding):
    dtype: str = "float32"
    name: ClassVar[str] = "float"
    code: ClassVar[int] = 0  # the dtype's own code (wire.DTYPE_CODES)

    @property
    def parts(self) -> Parts:
        return ((self.dtype, self.capacity),)

    def encode(self, ops: TensorOps, values: Tensor) -> Tuple[List[Tensor], Tensor]:
        if self.dtype in FORMAT_MAX:
            values = ops.clamp(values, FORMAT_MAX[self.dtype])
        coded = ops.pad(ops.cast(values, self.dtype), self.capacity)
        return [coded], ops.cast(coded, "float32")

    def decode(self, ops: TensorOps, parts: Sequence[Tensor], dtype: str) -> Tensor:
        return ops.cast(parts[0], dtype)


@dataclass(frozen=True)
class Int8Values(ValueCoding):
    name: ClassVar[str] = "int8"
    code: ClassVar[int] = 7

    @property
    def parts(self) -> Parts:
        return (("int8", self.capacity), ("float32", 1))

    def encode(self, ops: TensorOps, values: Tensor) -> Tuple[List[Tensor], Tensor]:
        padded = ops.pad(ops.cast(values, "float32"), self.capacity)
        scale = ops.scale(ops.block_abs_max(padded, self.capacity), 1.0 / INT8_LEVELS)
        levels = ops.round(ops.scale(ops.copy(padded), 1.0 / ops.maximum(scale, 1e-30)))
        levels = ops.clamp(levels, INT8_LEVELS)
        return [ops.cast(levels, "int8"), scale], ops.scale(levels, scale)

    def decode(self, ops: TensorOps, parts: Sequence[Tensor], dtype: str) -> Tensor:
        return ops.cast(ops.scale(ops.cast(parts[0], "float32"), parts[1]), dtype)

    def decode_rows(self, ops: TensorOps, parts: Sequence[Tensor], rows: int, dtype: str) -> Tensor:
        scales = ops.repeat_blocks(parts[1], self.capacity, rows * self.capacity)
        return ops.cast(ops.multiply(ops.cast(parts[0], "float32"), scales), dtype)


def value_coding(fmt: str, capacity: int) -> ValueCoding:
    """The coding of value format ``fmt`` (a float dtype name or ``"int8"``)."""
    if fmt == "int8":
        return Int8Values(capacity)
    return FloatValues(capacity, fmt)


def bits_per_entry(index: IndexCoding, values: ValueCoding) -> Tuple[float, float]:
    """(bits per position, bits per value) of a full message."""
    capacity = max(index.capacity, 1)
    return 8 * part_bytes(index.parts) / capacity, 8 * part_bytes(values.parts) / capacity

