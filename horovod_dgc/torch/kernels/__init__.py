"""Compiled kernels for the PyTorch adapter (built by setup.py; plain C, no torch headers).

They take contiguous float32 CPU tensors; :class:`~horovod_dgc.torch.ops.TorchOps` uses the
torch composition for every other dtype and device.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Tuple

import torch

from . import _selection

# Below this many elements one call on the calling thread beats handing ranges to the pool.
PARALLEL_MIN_NUMEL = 1 << 20

_pools: Dict[int, ThreadPoolExecutor] = {}


def _pool(width: int) -> ThreadPoolExecutor:
    """A pool of ``width`` threads (torch's intra-op thread count at the call)."""
    if width not in _pools:
        _pools[width] = ThreadPoolExecutor(max_workers=width, thread_name_prefix="horovod_dgc-kernel")
    return _pools[width]


def supports(x: torch.Tensor) -> bool:
    """Whether the kernels take ``x``: contiguous, float32, on the CPU."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()


def _check(x: torch.Tensor, kernel: str) -> None:
    if not supports(x) or x.dim() != 1:
        raise TypeError(f"{kernel} takes a contiguous 1-D float32 CPU tensor, got "
                        f"{x.dtype} {tuple(x.shape)} on {x.device}")


def block_abs_max(x: torch.Tensor, block: int) -> torch.Tensor:
    """``max |x|`` of each whole block of ``block`` elements of ``x`` (a trailing partial
    block is left to the caller), in one read pass."""
    _check(x, "block_abs_max")
    n_blocks = x.numel() // block
    out = torch.empty(n_blocks, dtype=torch.float32)
    width = torch.get_num_threads()
    if x.numel() < PARALLEL_MIN_NUMEL or width == 1:
        _selection.block_abs_max(x.data_ptr(), n_blocks, block, out.data_ptr())
        return out
    per_thread = -(-n_blocks // width)
    item_bytes = x.element_size()
    ranges = [(start, min(per_thread, n_blocks - start)) for start in range(0, n_blocks, per_thread)]
    calls = [_pool(width).submit(_selection.block_abs_max,
                                 x.data_ptr() + start * block * item_bytes, count, block,
                                 out.data_ptr() + start * item_bytes)
             for start, count in ranges]
    for call in calls:
        call.result()
    return out


def collect_at_least(x: torch.Tensor, blocks: torch.Tensor, block: int,
                     threshold: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(positions, magnitudes) of the entries with ``|x| >= threshold`` in the listed blocks
    (int64 block numbers; the last block may be partial), ascending, in one pass."""
    _check(x, "collect_at_least")
    blocks = blocks.to(torch.int64).contiguous()
    capacity = blocks.numel() * block
    positions = torch.empty(capacity, dtype=torch.int64)
    magnitudes = torch.empty(capacity, dtype=torch.float32)
    count = _selection.collect_at_least(x.data_ptr(), x.numel(), blocks.data_ptr(), blocks.numel(),
                                        block, float(threshold), positions.data_ptr(),
                                        magnitudes.data_ptr())
    return positions[:count].clone(), magnitudes[:count].clone()
