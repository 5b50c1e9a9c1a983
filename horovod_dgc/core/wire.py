"""The wire format: a checked header, then the method's parts, as bytes.

Layout of a sparse message for one tensor (native byte order, every part 8-byte aligned)::

    header   HEADER_WORDS int32 words (see ``Header``)
    indices  capacity x int32 (int64 when the tensor has 2**31 elements or more)
    values   capacity x float32 | float16 | bfloat16
    padding  zeros up to a multiple of 8 bytes

``capacity`` is fixed per tensor and density, so every rank sends the same number of bytes
for a tensor: Horovod's response cache keeps its fast path, and the receiver finds rank r's
message at ``r * nbytes``. Unused slots (``count < capacity``) hold index 0 and value 0.

The receiver checks every header against what it expects and raises :class:`MessageError`
naming the sending rank and the tensor on any difference.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

from .ops import Tensor, TensorOps

MAGIC = 0x44474331  # "DGC" and format version 1
HEADER_FIELDS = ("magic", "method", "tensor id", "numel (low)", "numel (high)", "capacity",
                 "count", "second part dtype", "first part dtype", "sender rank", "step", "flags")
HEADER_WORDS = len(HEADER_FIELDS)
ALIGN_BYTES = 8

DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3, "int32": 4, "int64": 5, "uint8": 6}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8, "uint8": 1}
FLAG_SKIPPED = 1  # the sender's gradient was not finite and it sent nothing

_INT31 = 2 ** 31


class MessageError(RuntimeError):
    """A received message does not match what this rank expects."""


def tensor_id(name: str) -> int:
    """A stable 32-bit identity of a tensor name, as a signed int32."""
    value = zlib.crc32(name.encode("utf-8"))
    return value - 2 ** 32 if value >= _INT31 else value


def index_dtype(numel: int) -> str:
    return "int32" if numel < _INT31 else "int64"


def wire_value_dtype(grad_dtype: str, value_dtype: str) -> str:
    """bfloat16 and float16 gradients keep their own 16-bit format (no loss); others use
    the configured ``value_dtype``."""
    if grad_dtype in ("bfloat16", "float16"):
        return grad_dtype if value_dtype == "float16" else "float32"
    return value_dtype


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclass(frozen=True)
class Layout:
    """What a message for one tensor looks like; both sides derive it from the config.

    A message is the header followed by its ``parts``: ``(dtype, count)`` pairs, each
    padded to 8 bytes. ``capacity`` and ``count`` are the method's own element counts.
    """

    name: str
    method_id: int
    numel: int
    capacity: int

    @property
    def parts(self) -> Tuple[Tuple[str, int], ...]:
        raise NotImplementedError

    def part_bytes(self, i: int) -> int:
        dtype, count = self.parts[i]
        return _aligned(count * DTYPE_BYTES[dtype])

    @property
    def nbytes(self) -> int:
        """Size of the whole message in bytes."""
        return HEADER_WORDS * 4 + sum(self.part_bytes(i) for i in range(len(self.parts)))

    def header(self, rank: int, step: int, count: Any, flags: Any) -> List[Any]:
        codes = [DTYPE_CODES[dtype] for dtype, _ in self.parts] + [0, 0]
        return [MAGIC, self.method_id, tensor_id(self.name), self.numel % _INT31,
                self.numel // _INT31, self.capacity, count, codes[1], codes[0],
                rank, step % _INT31, flags]

    def check(self, words: Sequence[int], rank: int, step: int) -> None:
        """Raise MessageError unless ``words`` is a valid header from ``rank`` for this
        tensor at ``step``."""
        expected = self.header(rank, step, 0, 0)
        if len(words) != HEADER_WORDS:
            self._fail(rank, f"header has {len(words)} words, expected {HEADER_WORDS}")
        for field, got, want in zip(HEADER_FIELDS, words, expected):
            if field not in ("count", "flags") and got != want:
                self._fail(rank, f"{field} is {got}, expected {want}")
        count = words[HEADER_FIELDS.index("count")]
        if not 0 <= count <= self.capacity:
            self._fail(rank, f"count is {count}, capacity {self.capacity}")

    def _fail(self, rank: int, detail: str) -> None:
        raise MessageError(f"rank {rank} sent a malformed message for tensor "
                           f"{self.name!r}: {detail}")


@dataclass(frozen=True)
class MessageLayout(Layout):
    """A sparse message: ``capacity`` indices, then ``capacity`` values."""

    value_dtype: str = "float32"

    @property
    def index_dtype(self) -> str:
        return index_dtype(self.numel)

    @property
    def parts(self) -> Tuple[Tuple[str, int], ...]:
        return ((self.index_dtype, self.capacity), (self.value_dtype, self.capacity))


@dataclass(frozen=True)
class PartsLayout(Layout):
    """A message of explicitly listed parts (packed signs and scales, index lists)."""

    part_list: Tuple[Tuple[str, int], ...] = ()

    @property
    def parts(self) -> Tuple[Tuple[str, int], ...]:
        return self.part_list


def encode_parts(ops: TensorOps, layout: Layout, header: List[Any], parts: Sequence[Tensor]) -> Tensor:
    """The message bytes; each part already holds its count of entries in its dtype."""
    encoded = [ops.to_bytes(ops.constant(header, "int32", like=parts[0]))]
    encoded += [ops.pad(ops.to_bytes(part), layout.part_bytes(i)) for i, part in enumerate(parts)]
    return ops.concat(encoded)


def split_parts(ops: TensorOps, message: Tensor, layout: Layout) -> Tuple[Tensor, List[Tensor]]:
    """(header words, parts) of one message, without checking them."""
    offset = HEADER_WORDS * 4
    header = ops.from_bytes(ops.slice(message, 0, offset), "int32")
    parts = []
    for i, (dtype, count) in enumerate(layout.parts):
        parts.append(ops.from_bytes(ops.slice(message, offset, count * DTYPE_BYTES[dtype]), dtype))
        offset += layout.part_bytes(i)
    return header, parts


def encode(ops: TensorOps, layout: MessageLayout, header: List[Any], indices: Tensor,
           values: Tensor) -> Tensor:
    """A sparse message; ``indices`` and ``values`` already hold ``capacity`` entries in
    the wire dtypes."""
    return encode_parts(ops, layout, header, [indices, values])


def split(ops: TensorOps, message: Tensor, layout: MessageLayout) -> Tuple[Tensor, Tensor, Tensor]:
    """(header words, indices, values) of one sparse message, without checking them."""
    header, (indices, values) = split_parts(ops, message, layout)
    return header, indices, values
