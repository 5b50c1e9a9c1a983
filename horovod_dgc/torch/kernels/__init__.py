"""Compiled kernels for the PyTorch adapter (built by setup.py; plain C, no torch headers)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Dict

import torch

from . import _block_abs_max

# Below this many elements one call on the calling thread beats handing ranges to the pool.
PARALLEL_MIN_NUMEL = 1 << 20

_pools: Dict[int, ThreadPoolExecutor] = {}


def _pool(width: int) -> ThreadPoolExecutor:
    """A pool of ``width`` threads (torch's intra-op thread count at the call)."""
    if width not in _pools:
        _pools[width] = ThreadPoolExecutor(max_workers=width, thread_name_prefix="horovod_dgc-kernel")
    return _pools[width]


def block_abs_max(x: torch.Tensor, block: int) -> torch.Tensor:
    """``max |x|`` of each whole block of ``block`` elements of a contiguous 1-D float32 CPU
    tensor (a trailing partial block is left to the caller), in one read pass."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() or x.dim() != 1:
        raise TypeError(f"block_abs_max takes a contiguous 1-D float32 CPU tensor, got "
                        f"{x.dtype} {tuple(x.shape)} on {x.device}")
    n_blocks = x.numel() // block
    out = torch.empty(n_blocks, dtype=torch.float32)
    width = torch.get_num_threads()
    if x.numel() < PARALLEL_MIN_NUMEL or width == 1:
        _block_abs_max.block_abs_max(x.data_ptr(), n_blocks, block, out.data_ptr())
        return out
    per_thread = -(-n_blocks // width)
    item_bytes = x.element_size()
    ranges = [(start, min(per_thread, n_blocks - start)) for start in range(0, n_blocks, per_thread)]
    calls = [_pool(width).submit(_block_abs_max.block_abs_max,
                                 x.data_ptr() + start * block * item_bytes, count, block,
                                 out.data_ptr() + start * item_bytes)
             for start, count in ranges]
    for call in calls:
        call.result()
    return out
