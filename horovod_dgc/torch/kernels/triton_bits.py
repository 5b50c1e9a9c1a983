"""The index codings' bit work in one kernel each on a GPU (Triton): packing a message's
low-bit fields and setting its bitvector's bits when it is encoded, and decoding every
sender's Elias-Fano positions at once when it is received.

The core's compositions of these (``TensorOps.pack_fields``, ``set_bits`` and
``elias_fano_rows``) take 6 to 14 framework kernels each on a GPU, most of them over one
boolean per bit; each kernel here reads its input once and writes its output once, with no
wait for the host. They are the GPU's twins of the C kernels in ``bits.c`` (which take the
CPU's tensors).

Used for tensors that ``triton_memory.launchable`` accepts (CUDA tensors when Triton imports,
CPU tensors under Triton's interpreter); everything else takes the composition.
``tests/test_triton_bits.py`` checks each against a loop written in the test.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .triton_memory import triton

if triton is not None:
    import triton.language as tl

# Bytes, positions or bits one program (or one step of a row's loop) covers: enough work per
# program to hide its start.
BYTES_PER_PROGRAM = 1024
POSITIONS_PER_PROGRAM = 1024
BITS_PER_STEP = 4096


if triton is not None:
    @triton.jit
    def _pack_fields(values, out, count, n_bytes, WIDTH: tl.constexpr, BYTES: tl.constexpr):
        byte = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
        packed = tl.zeros([BYTES], dtype=tl.int64)
        for j in tl.static_range(8):
            bit = byte * 8 + j
            field = bit // WIDTH
            value = tl.load(values + field, mask=field < count, other=0).to(tl.int64)
            packed |= ((value >> (bit % WIDTH)) & 1) << j
        tl.store(out + byte, packed.to(tl.uint8), mask=byte < n_bytes)

    @triton.jit
    def _set_bits(positions, words, count, n_bits, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        position = tl.load(positions + i, mask=i < count, other=0).to(tl.int64)
        inside = (i < count) & (position >= 0) & (position < n_bits)
        bit = tl.full([BLOCK], 1, tl.int32) << (position & 31).to(tl.int32)
        tl.atomic_or(words + (position >> 5), bit, mask=inside)

    @triton.jit
    def _elias_fano_rows(lower, upper, out, found, lower_bytes, upper_bytes, n_upper_bits, capacity,
                         LOW: tl.constexpr, STEP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        row_out = out + row * capacity
        row_upper = upper + row * upper_bytes
        row_lower = lower + row * lower_bytes
        # First the marks: the i-th set bit's index in slot i (the capacity's first only).
        # While loops, not range(): Triton's interpreter takes no run-time bound in a range.
        seen = tl.zeros([], dtype=tl.int64)
        start = tl.zeros([], dtype=tl.int64)
        while start < n_upper_bits:
            bit = start + tl.arange(0, STEP).to(tl.int64)
            byte = tl.load(row_upper + (bit >> 3), mask=bit < n_upper_bits, other=0).to(tl.int64)
            is_set = (((byte >> (bit & 7)) & 1) == 1) & (bit < n_upper_bits)
            rank = seen + tl.cumsum(is_set.to(tl.int64), 0) - 1
            tl.store(row_out + rank, bit, mask=is_set & (rank < capacity))
            seen += tl.sum(is_set.to(tl.int64), 0)
            start += STEP
        tl.store(found + row, seen)
        tl.debug_barrier()  # the marks written above, by other threads, are read below
        # Then each slot's position: (mark - slot) << LOW, plus its LOW-bit field.
        start = tl.zeros([], dtype=tl.int64)
        while start < capacity:
            slot = start + tl.arange(0, STEP).to(tl.int64)
            inside = slot < capacity
            high = tl.load(row_out + slot, mask=inside, other=0) - slot
            field = tl.zeros([STEP], dtype=tl.int64)
            for j in tl.static_range(LOW):
                bit = slot * LOW + j
                byte = tl.load(row_lower + (bit >> 3), mask=inside, other=0).to(tl.int64)
                field |= ((byte >> (bit & 7)) & 1) << j
            tl.store(row_out + slot, (high << LOW) + field, mask=inside)
            start += STEP


def pack_fields(values: torch.Tensor, width: int, n_bytes: int) -> torch.Tensor:
    """``n_bytes`` uint8 holding the ``width`` lowest bits of every value of the non-negative
    integers ``values``, value after value, lowest bit first (``TensorOps.pack_fields``),
    then zeros."""
    out = torch.empty(n_bytes, dtype=torch.uint8, device=values.device)
    if not n_bytes:
        return out
    # An empty tensor's address may be null, which a launch refuses: any valid one will do
    # where no load reads it.
    _pack_fields[(max(1, -(-n_bytes // BYTES_PER_PROGRAM)),)](
        values if values.numel() else out, out, values.numel(), n_bytes, WIDTH=width, BYTES=BYTES_PER_PROGRAM)
    return out


def set_bits(positions: torch.Tensor, n_bytes: int) -> torch.Tensor:
    """``n_bytes`` uint8 of a bitvector, lowest bit first, with the bit of every position in
    ``positions`` set (``TensorOps.set_bits``); a position outside it sets nothing."""
    words = torch.zeros(-(-n_bytes // 4), dtype=torch.int32, device=positions.device)
    count = positions.numel()
    if count and n_bytes:
        _set_bits[(-(-count // POSITIONS_PER_PROGRAM),)](
            positions, words, count, n_bytes * 8, BLOCK=POSITIONS_PER_PROGRAM)
    # Bit b of int32 word w is bit b % 8 of byte 4w + b // 8 on a little-endian device.
    return words.view(torch.uint8) if n_bytes % 4 == 0 else words.view(torch.uint8)[:n_bytes]


def elias_fano_rows(lower: torch.Tensor, low_bits: int, upper: torch.Tensor, n_upper_bits: int,
                    capacity: int, rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``TensorOps.elias_fano_rows``: one program per row scans its bitvector once."""
    out = torch.zeros(rows * capacity, dtype=torch.int64, device=upper.device)
    found = torch.empty(rows, dtype=torch.int64, device=upper.device)
    _elias_fano_rows[(rows,)](lower if lower.numel() else upper, upper, out, found, lower.numel() // rows,
                              upper.numel() // rows, n_upper_bits, capacity, LOW=low_bits, STEP=BITS_PER_STEP)
    return out, found
