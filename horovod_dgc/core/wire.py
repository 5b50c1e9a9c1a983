"""The wire format of one sparse message: a checked header, indices, values, as bytes.

Layout of a message for one tensor (native byte order, every part 8-byte aligned)::

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
from typing import List, Sequence, Tuple

from .ops import Tensor, TensorOps

MAGIC = 0x44474331  # "DGC" and format version 1
HEADER_FIELDS = ("magic", "method", "tensor id", "numel (low)", "numel (high)", "capacity",
                 "count", "value dtype", "index dtype", "sender rank", "step", "flags")
HEADER_WORDS = len(HEADER_FIELDS)
ALIGN_BYTES = 8

DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3, "int32": 4, "int64": 5}
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
class MessageLayout:
    """What a message for one tensor looks like; both sides derive it from the config."""

    name: str
    method_id: int
    numel: int
    capacity: int
    value_dtype: str

    @property
    def index_dtype(self) -> str:
        return index_dtype(self.numel)

    @property
    def index_bytes(self) -> int:
        return _aligned(self.capacity * DTYPE_BYTES[self.index_dtype])

    @property
    def value_bytes(self) -> int:
        return _aligned(self.capacity * DTYPE_BYTES[self.value_dtype])

    @property
    def nbytes(self) -> int:
        """Size of the whole message in bytes."""
        return HEADER_WORDS * 4 + self.index_bytes + self.value_bytes

    def header(self, rank: int, step: int, count: int, flags: int) -> List[int]:
        return [MAGIC, self.method_id, tensor_id(self.name), self.numel % _INT31,
                self.numel // _INT31, self.capacity, count, DTYPE_CODES[self.value_dtype],
                DTYPE_CODES[self.index_dtype], rank, step % _INT31, flags]

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



def encode(ops: TensorOps, layout: MessageLayout, header: List[int], indices: Tensor,
           values: Tensor) -> Tensor:
    """The message bytes; ``indices`` and ``values`` already hold ``capacity`` entries in
    the wire dtypes."""
    parts = [ops.to_bytes(ops.constant(header, "int32", like=values)),
             ops.pad(ops.to_bytes(indices), layout.index_bytes),
             ops.pad(ops.to_bytes(values), layout.value_bytes)]
    return ops.concat(parts)


def split(ops: TensorOps, message: Tensor, layout: MessageLayout) -> Tuple[Tensor, Tensor, Tensor]:
    """(header words, indices, values) of one message, without checking them."""
    header_bytes = HEADER_WORDS * 4
    header = ops.from_bytes(ops.slice(message, 0, header_bytes), "int32")
    index_part = ops.slice(message, header_bytes, layout.capacity * DTYPE_BYTES[layout.index_dtype])
    value_start = header_bytes + layout.index_bytes
    value_part = ops.slice(message, value_start, layout.capacity * DTYPE_BYTES[layout.value_dtype])
    return (header, ops.from_bytes(index_part, layout.index_dtype),
            ops.from_bytes(value_part, layout.value_dtype))
