"""Blocksign's signs in one kernel each way on a GPU (Triton): the compression of a buffer
into its packed signs and residual, and the decode of packed signs times their blocks'
scales (added to a sum, where one is given).

The core's compositions (``TensorOps.sign_compress`` and ``sign_decode``) take about
fifteen and eight framework kernels on a GPU: the signs packed through a multiply of 0/1
bytes, unpacked again through a bit table, each block's scale expanded to its entries. Each
kernel here reads its inputs once and writes its outputs once. They are the GPU's twins of
the C kernels ``sign_pack`` and ``sign_decode`` (which take the CPU's tensors), for float32
buffers and scales; everything else takes the composition. ``tests/test_triton_signs.py``
checks both against loops written in the test.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .triton_memory import launchable, triton

if triton is not None:
    import triton.language as tl

# Packed bytes (8 entries each), or entries, one program covers.
BYTES_PER_PROGRAM = 512
ENTRIES_PER_PROGRAM = 4096


if triton is not None:
    @triton.jit
    def _sign_compress(x, scales, packed, residual, n, n_bytes, block, BYTES: tl.constexpr):
        byte = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES).to(tl.int64)
        bits = tl.zeros([BYTES], dtype=tl.int32)
        for j in tl.static_range(8):
            i = byte * 8 + j
            inside = i < n
            value = tl.load(x + i, mask=inside, other=0.0)
            positive = value >= 0.0  # padding (past n) is 0: a set bit; NaN is not
            bits |= positive.to(tl.int32) << j
            scale = tl.load(scales + i // block, mask=inside, other=0.0)
            tl.store(residual + i, value - tl.where(positive, scale, -scale), mask=inside)
        tl.store(packed + byte, bits.to(tl.uint8), mask=byte < n_bytes)

    @triton.jit
    def _sign_decode(packed, scales, add_to, out, n, block, ADD: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        inside = i < n
        bit = (tl.load(packed + i // 8, mask=inside, other=0).to(tl.int32) >> (i % 8).to(tl.int32)) & 1
        scale = tl.load(scales + i // block, mask=inside, other=0.0)
        value = tl.where(bit == 1, scale, -scale)
        if ADD:
            value = tl.load(add_to + i, mask=inside, other=0.0) + value
        tl.store(out + i, value, mask=inside)


def compresses(x: torch.Tensor, scales: torch.Tensor, length: int) -> bool:
    """Whether :func:`sign_compress` takes these: float32 ``x`` and ``scales``, ``length`` a
    multiple of 8 that holds ``x``, and tensors Triton may take."""
    return (length % 8 == 0 and length >= x.numel() and x.dtype == scales.dtype == torch.float32
            and launchable(x, scales))


def decodes(packed: torch.Tensor, scales: torch.Tensor, n: int, add_to: Optional[torch.Tensor]) -> bool:
    """Whether :func:`sign_decode` takes these: bytes holding ``n`` signs, float32 ``scales``
    (and ``add_to`` of ``n`` entries, where given), and tensors Triton may take."""
    adds = [] if add_to is None else [add_to]
    return (packed.dtype == torch.uint8 and packed.numel() * 8 >= n
            and all(t.dtype == torch.float32 for t in [scales, *adds]) and all(t.numel() == n for t in adds)
            and launchable(packed, scales, *adds))


def sign_compress(x: torch.Tensor, scales: torch.Tensor, block: int, length: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``TensorOps.sign_compress`` (the residual written over ``x``; what :func:`compresses`
    accepts): one launch."""
    n_bytes = length // 8
    packed = torch.empty(n_bytes, dtype=torch.uint8, device=x.device)
    if n_bytes:
        _sign_compress[(-(-n_bytes // BYTES_PER_PROGRAM),)](x, scales, packed, x, x.numel(), n_bytes, block,
                                                             BYTES=BYTES_PER_PROGRAM)
    return packed, x


def sign_decode(packed: torch.Tensor, scales: torch.Tensor, block: int, n: int,
                add_to: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``TensorOps.sign_decode`` in float32 (written over ``add_to`` where given; what
    :func:`decodes` accepts): one launch."""
    out = add_to if add_to is not None else torch.empty(n, dtype=torch.float32, device=scales.device)
    if n:
        _sign_decode[(-(-n // ENTRIES_PER_PROGRAM),)](packed, scales, out, out, n, block, ADD=add_to is not None,
                                                      BLOCK=ENTRIES_PER_PROGRAM)
    return out
