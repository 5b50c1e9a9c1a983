"""PyTorch implementation of the core's :class:`~horovod_dgc.core.ops.TensorOps`.

Updates happen in place (``out`` arguments are overwritten), and data-dependent control flow
reads the condition on the host: one synchronisation per loop test, none per element.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..core.ops import BlockBounds, Bound, Candidates, Pieces, Scalar, TensorOps, buffer_of
from . import kernels
from .kernels import triton_bits, triton_memory, triton_messages, triton_selection, triton_signs

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
          "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_HALF = (torch.float16, torch.bfloat16)
_INTEGERS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_GATHER_BITS = 0x0102040810204080
# Row b: the eight signs (+1 for a set bit, -1 otherwise) that byte b packs, bit i first.
_HOST = torch.device("cpu")
_BIT_TABLE = ((torch.arange(256, device=_HOST).unsqueeze(1) >> torch.arange(8, device=_HOST)) & 1).bool()
_SIGN_TABLE = _BIT_TABLE.float() * 2 - 1
_tables: Dict[Tuple[str, torch.device, torch.dtype], torch.Tensor] = {}


def _table(name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The bit or sign table on ``device``, copied there once: a copy from the host at every
    call waits for the GPU each time."""
    key = (name, device, dtype)
    if key not in _tables:
        _tables[key] = {"bits": _BIT_TABLE, "signs": _SIGN_TABLE}[name].to(device=device, dtype=dtype)
    return _tables[key]


def _kernel_bound(bound: Bound) -> Any:
    """A bound as the kernels take it: a number, or a 1-D float32 tensor of one per block."""
    return bound.values if isinstance(bound, BlockBounds) else bound


def _one_dim(grad: Any) -> Any:
    """A gradient as the accumulate kernels take it: 1-D, or :class:`Pieces` (1-D parts)."""
    return grad if isinstance(grad, Pieces) else grad.reshape(-1)


def _usable(out: Optional[torch.Tensor], like: torch.Tensor) -> Optional[torch.Tensor]:
    """``out`` where it can hold a result shaped and typed like ``like``, else None."""
    if out is None or out.shape != like.shape or out.dtype != like.dtype:
        return None
    return out


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (a header, a few bounds) on ``device``. The copy does not wait
    for the GPU: from pageable memory the driver stages the bytes before it returns, so
    ``host`` may be freed at once; a plain copy would wait for the GPU to finish its queue."""
    return host.to(device, non_blocking=True)


# Fixed integer tables a process keeps on their devices: a few per bucket and tensor, for
# large models.
TABLES_KEPT = 4096


@functools.lru_cache(maxsize=TABLES_KEPT)
def _fixed(values: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` on ``device``, made once: a bucket's searchsorted bounds and the places of
    its headers' device words are the same at every step (each copy would cost a host-to-
    device transfer and an operation)."""
    return _to_device(torch.tensor(values, dtype=dtype, device=_HOST), device)


def _explain(inputs: Sequence[Any], explain: Callable[..., None]) -> None:
    """Raise a failed check's error, from the values of its inputs."""
    explain(*[x.tolist() if isinstance(x, torch.Tensor) else x for x in inputs])
    raise AssertionError("a check failed and its explanation raised nothing")


def dtype_name(dtype: torch.dtype) -> str:
    """The core's name of a torch dtype (``"other"`` for dtypes the core does not know)."""
    return DTYPE_NAMES.get(dtype, "other")


class TorchOps(TensorOps):
    def __init__(self, defer_checks: bool = False) -> None:
        """``defer_checks``: on a device where reading waits, leave checks and flags to
        :meth:`settle_checks` (see ``TensorOps.defers_checks``); the engine asks for it."""
        self._defer = defer_checks
        self._pending: List[Tuple[torch.Tensor, Sequence[Any], Callable[..., None]]] = []

    def numel(self, x: torch.Tensor) -> int:
        return x.numel()

    def dtype(self, x: torch.Tensor) -> str:
        return dtype_name(x.dtype)

    def cast(self, x: torch.Tensor, dtype: str) -> torch.Tensor:
        return x.to(DTYPES[dtype])

    def zeros(self, n: int, dtype: str, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n, dtype=DTYPES[dtype], device=like.device)

    def zeroed(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernels(x) and x.is_contiguous():
            return kernels.zero(x)
        return x.zero_()

    def scratch(self, n: int, dtype: str, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(n, dtype=DTYPES[dtype], device=like.device)

    def constant(self, values: Sequence[Any], dtype: str, like: torch.Tensor) -> torch.Tensor:
        # Values that are tensors (a count, a flag) are written in where they are: reading them
        # with int() would wait for the GPU once per value.
        # The types once each: index tables of a large bucket hold millions of Python ints.
        if not any(issubclass(kind, torch.Tensor) for kind in set(map(type, values))):
            return _to_device(torch.tensor(values, dtype=DTYPES[dtype], device=_HOST), like.device)
        on_device = [isinstance(v, torch.Tensor) and self.sizes_cost_a_wait(v) for v in values]
        fixed = [0 if held else int(v) for v, held in zip(values, on_device)]
        out = _to_device(torch.tensor(fixed, dtype=DTYPES[dtype], device=_HOST), like.device)
        places: Dict[int, List[int]] = {}  # each tensor's places (a flags word in every header of a set)
        for i in [i for i, held in enumerate(on_device) if held]:
            places.setdefault(id(values[i]), []).append(i)
        for at in places.values():
            value = values[at[0]].reshape(())  # a copy on the device, cast as int() would (toward zero)
            if len(at) == 1:
                out[at[0]] = value
            else:
                out.index_put_((_fixed(tuple(at), torch.int64, like.device),), value.to(out.dtype))
        return out

    def ones(self, n: Any, dtype: str, like: torch.Tensor) -> torch.Tensor:
        return torch.ones(int(n), dtype=DTYPES[dtype], device=like.device)

    def copy(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def concat(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(parts))

    def slice(self, x: torch.Tensor, start: int, length: int) -> torch.Tensor:
        return x[start:start + length]

    def scale_add(self, out: torch.Tensor, alpha: Scalar, x: torch.Tensor,
                  beta: Scalar = 1.0) -> torch.Tensor:
        if not (isinstance(alpha, (int, float)) and alpha == 1.0):
            out.mul_(alpha)
        if isinstance(beta, torch.Tensor):
            return out.add_(x * beta)
        return out.add_(x, alpha=beta)

    def scale(self, out: torch.Tensor, alpha: Scalar) -> torch.Tensor:
        return out.mul_(alpha)

    def add(self, x: torch.Tensor, y: torch.Tensor, alpha: Scalar = 1.0,
            beta: Scalar = 1.0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        numbers = isinstance(alpha, (int, float)) and isinstance(beta, (int, float))
        if numbers and not x.is_floating_point():
            alpha, beta = int(alpha), int(beta)
        if torch.result_type(x, y) != x.dtype:
            out = None
        out = _usable(out, x)
        if numbers and alpha == 1.0:
            return torch.add(x, y, alpha=beta, out=out)
        if numbers:
            return torch.mul(x, alpha, out=out).add_(y, alpha=beta)
        if out is None:
            return x * alpha + y * beta
        return torch.mul(x, alpha, out=out).add_(y * beta)

    def multiply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * y

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dtype=torch.float32) if x.dtype in _HALF else x.sum()

    def dot(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.dtype in _HALF or y.dtype in _HALF:
            return torch.dot(x.float(), y.float())
        return torch.dot(x, y)

    def clamp(self, x: torch.Tensor, bound: float) -> torch.Tensor:
        return x.clamp(-bound, bound)

    def abs(self, x: Any) -> Any:
        return x.abs() if isinstance(x, torch.Tensor) else abs(x)

    def sqrt(self, s: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(torch.as_tensor(s))

    def minimum(self, a: Scalar, b: Scalar) -> torch.Tensor:
        return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))

    def maximum(self, a: Scalar, b: Scalar) -> torch.Tensor:
        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))

    def is_finite(self, s: torch.Tensor) -> torch.Tensor:
        return torch.isfinite(s)

    def where(self, pred: Scalar, a: Scalar, b: Scalar) -> torch.Tensor:
        if not isinstance(pred, torch.Tensor):
            return torch.as_tensor(a if pred else b)
        # One operation each below, where where() first makes a tensor of every number.
        if isinstance(b, torch.Tensor) and not isinstance(a, torch.Tensor) and pred.shape == b.shape \
                and torch.result_type(b, a) == b.dtype:
            return b.masked_fill(pred, a)
        if pred.dtype == torch.bool and type(a) is int and type(b) is int and (a, b) in ((1, 0), (0, 1)):
            return (pred if a else ~pred).to(torch.int64)
        if (type(b) is int and b == 0 and isinstance(a, torch.Tensor) and pred.dtype == torch.bool
                and pred.shape == a.shape and a.dtype in _INTEGERS):
            return a * pred  # integers only: a float's NaN times 0 would stay NaN
        # Python numbers go in as they are: a CPU tensor made of one would be copied to the
        # GPU, and that copy waits for it.
        return torch.where(pred, a, b)

    def topk_abs(self, x: torch.Tensor, k: int) -> torch.Tensor:
        return torch.topk(x.abs(), k, sorted=False).indices

    def min_abs(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs().amin()

    def kth_largest(self, x: torch.Tensor, k: int) -> torch.Tensor:
        return torch.topk(x, k, sorted=False).values.min()

    def rows(self, x: torch.Tensor, start: int, stride: int, length: int, count: int) -> torch.Tensor:
        if count == 1:
            return x[start:start + length]
        x = x.contiguous()
        return torch.as_strided_copy(x, (count, length), (stride, 1), x.storage_offset() + start).view(-1)

    def row_cumsum(self, x: torch.Tensor, row: int) -> torch.Tensor:
        return torch.cumsum(x.view(-1, row), 1, dtype=torch.int64).view(-1)

    def strided_sample(self, x: torch.Tensor, offset: int, stride: int, block: int = 1) -> torch.Tensor:
        if block == 1 and x.dim() == 1:
            return x[offset::stride].contiguous()  # two operations where the blocks' view takes five
        whole = x.numel() // block
        return x[:whole * block].view(-1, block)[offset::stride].reshape(-1)

    def block_abs_max(self, x: torch.Tensor, block: int) -> torch.Tensor:
        whole = x.numel() // block
        if self._kernels(x) and kernels.supports(x):
            maxima = kernels.block_abs_max(x.reshape(-1), block)
        else:
            rows = x[:whole * block].view(-1, block)
            # Two reductions and no full-size |x| temporary. Chunking into cache-sized pieces
            # was a little faster on an idle machine, but each chunk is a parallel section,
            # and with several ranks sharing the cores hundreds of them made selection 100x
            # slower.
            maxima = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_())
        if whole * block == x.numel():
            return maxima
        return torch.cat([maxima, x[whole * block:].abs().amax().reshape(1)])

    def block_abs_sum(self, x: torch.Tensor, block: int) -> torch.Tensor:
        whole = x.numel() // block
        sums = x[:whole * block].view(-1, block).abs().sum(dim=1, dtype=torch.float64)
        if whole * block != x.numel():
            sums = torch.cat([sums, x[whole * block:].abs().sum(dtype=torch.float64).reshape(1)])
        return sums.to(x.dtype)

    def block_sum(self, x: torch.Tensor, block: int) -> torch.Tensor:
        return x.view(-1, block).sum(dim=1, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)

    def repeat_blocks(self, values: torch.Tensor, block: int, n: int) -> torch.Tensor:
        if block >= n:
            return values[:1].expand(n)
        # One copy of a broadcast view: repeat_interleave builds an index and gathers through it.
        return values.reshape(-1, 1).expand(-1, block).reshape(-1)[:n]

    def repeat_each(self, values: torch.Tensor, counts: torch.Tensor, n: int) -> torch.Tensor:
        return values.repeat_interleave(counts, output_size=n)

    def gather_blocks(self, x: torch.Tensor, blocks: torch.Tensor, block: int) -> torch.Tensor:
        whole = x.numel() // block
        if whole * block == x.numel():
            return x.view(-1, block).index_select(0, blocks).reshape(-1)
        # Padding x itself would copy it; only the short last block is padded.
        tail = torch.cat([x[whole * block:], x.new_full((block - x.numel() % block,), float("nan"))])
        if whole == 0:
            return tail.repeat(blocks.numel())
        rows = x[:whole * block].view(-1, block).index_select(0, blocks.clamp(max=whole - 1))
        if blocks.numel() and int(blocks[-1]) == whole:
            rows[-1] = tail
        return rows.reshape(-1)

    def sizes_cost_a_wait(self, x: torch.Tensor) -> bool:
        return x.device.type != "cpu"

    def defers_checks(self, x: torch.Tensor) -> bool:
        return self._defer and self.sizes_cost_a_wait(x)

    def _scatters(self, out: torch.Tensor, values: Optional[torch.Tensor] = None) -> bool:
        """Whether the scatter kernel takes a flat float32 ``out`` and these values, if any
        (torch's index_add_ sets up a parallel loop over all of ``out`` for a few thousand entries)."""
        return (self._kernels(out) and kernels.supports(out) and out.dim() == 1
                and (values is None or (values.dtype == torch.float32 and self._kernels(values))))

    def _kernels(self, x: torch.Tensor) -> bool:
        """Whether the C kernels may take ``x``: on the CPU, unless this TorchOps makes the
        GPU's choices there (``sizes_cost_a_wait``, as tests and benchmarks/host_syncs.py do),
        when the compositions a GPU runs take it instead."""
        return x.device.type == "cpu" and not self.sizes_cost_a_wait(x)

    def _fuses(self, grad_scale: Scalar, bound: Bound, grad: torch.Tensor,
               *memories: Optional[torch.Tensor]) -> bool:
        """Whether a memory's pass runs as one Triton kernel (a GPU's tensors, a grad scale
        known on the host, no candidates to collect) instead of the composition."""
        return (isinstance(grad_scale, (int, float)) and bound is None and not self._kernels(grad)
                and triton_memory.supports(grad, *memories))

    def positions_at_least(self, x: torch.Tensor, threshold: Scalar) -> torch.Tensor:
        if self._kernels(x) and kernels.supports(x) and x.dim() == 1:
            return kernels.positions_at_least(x, float(threshold))
        return super().positions_at_least(x, threshold)

    def collect_at_least(self, x: torch.Tensor, blocks: torch.Tensor, block: int,
                         threshold: Scalar) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._kernels(x) and kernels.supports(x):
            return kernels.collect_at_least(x.reshape(-1), blocks, block, float(threshold))
        return super().collect_at_least(x, blocks, block, threshold)

    def count_at_least(self, x: torch.Tensor, blocks: torch.Tensor, block: int,
                       threshold: Scalar) -> Any:
        if self.counts_without_collecting(x):
            return kernels.count_at_least(x.reshape(-1), blocks, block, float(threshold))
        return super().count_at_least(x, blocks, block, threshold)

    def counts_without_collecting(self, x: torch.Tensor) -> bool:
        return self._kernels(x) and kernels.supports(x)

    def takes_pieces(self, like: torch.Tensor) -> bool:
        return self._kernels(like) and like.dtype in kernels.GRAD_KINDS

    def gathered(self, grad: Any) -> torch.Tensor:
        if not isinstance(grad, Pieces):
            return grad
        torch._foreach_copy_([grad.flat[o:o + p.numel()] for p, o in zip(grad.parts, grad.offsets)],
                             list(grad.parts))
        return grad.flat

    def accumulate(self, memory: torch.Tensor, grad: torch.Tensor, grad_scale: Scalar = 1.0,
                   out: Optional[torch.Tensor] = None, block: int = 0, stat: Optional[str] = None,
                   bound: Bound = None, capacity: int = 0
                   ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Any, Optional[Candidates]]:
        out = _usable(out, memory)
        if (isinstance(grad_scale, (int, float)) and self._kernels(buffer_of(grad))
                and kernels.supports_accumulate(_one_dim(grad), memory, out)):
            total, stats, finite, candidates = kernels.error_feedback(
                _one_dim(grad), float(grad_scale), memory, out, block, stat, _kernel_bound(bound), capacity)
            return (total, None if stats is None else stats.to(memory.dtype), finite,
                    None if candidates is None else Candidates(*candidates, bound))
        grad = self.gathered(grad)
        if self._fuses(grad_scale, bound, grad, memory, out) and stat in (None, "max"):
            _, total, maxima, finite = triton_memory.memory_pass(
                grad, float(grad_scale), memory, out, block if stat else 0)
            return total, maxima, finite, None
        return super().accumulate(memory, grad, grad_scale, out, block, stat, bound, capacity)

    def momentum_accumulate(self, momentum: torch.Tensor, velocity: torch.Tensor,
                            grad: torch.Tensor, m: float, grad_scale: Scalar, nesterov: bool,
                            outs: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]] = (None, None),
                            block: int = 0, bound: Bound = None, capacity: int = 0
                            ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Any,
                                       Optional[Candidates]]:
        outs = (_usable(outs[0], momentum), _usable(outs[1], velocity))
        if isinstance(grad_scale, (int, float)) and self._kernels(buffer_of(grad)) and kernels.supports_accumulate(
                _one_dim(grad), momentum, velocity, *outs):
            *result, candidates = kernels.momentum_correction(
                _one_dim(grad), float(grad_scale), momentum, velocity, m, nesterov, *outs, block,
                _kernel_bound(bound), capacity)
            return (*result, None if candidates is None else Candidates(*candidates, bound))
        grad = self.gathered(grad)
        if self._fuses(grad_scale, bound, grad, momentum, velocity, *outs):
            u, v, maxima, finite = triton_memory.memory_pass(
                grad, float(grad_scale), velocity, outs[1], block, momentum, outs[0], m, nesterov)
            return u, v, maxima, finite, None
        return super().momentum_accumulate(momentum, velocity, grad, m, grad_scale, nesterov, outs,
                                           block, bound, capacity)

    def sign_compress(self, x: torch.Tensor, scales: torch.Tensor, block: int,
                      length: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._kernels(x) and kernels.supports_signs(x, scales):
            return kernels.sign_pack(x, scales, block, length)
        if not self._kernels(x) and triton_signs.compresses(x, scales, length):
            return triton_signs.sign_compress(x, scales, block, length)
        return super().sign_compress(x, scales, block, length)

    def sign_decode(self, packed: torch.Tensor, scales: torch.Tensor, block: int, n: int, dtype: str,
                    add_to: Optional[torch.Tensor] = None) -> torch.Tensor:
        if dtype == "float32" and self._kernels(scales) and kernels.supports_signs(
                scales, *([] if add_to is None else [add_to])):
            return kernels.sign_decode(packed, scales, block, n, add_to)
        if dtype == "float32" and not self._kernels(scales) and triton_signs.decodes(packed, scales, n, add_to):
            return triton_signs.sign_decode(packed, scales, block, n, add_to)
        return super().sign_decode(packed, scales, block, n, dtype, add_to)

    def sign_decode_all(self, messages: Sequence[Tuple[torch.Tensor, torch.Tensor, int, int]],
                        dtype: str) -> torch.Tensor:
        all_scales = [scales for _, scales, _, _ in messages]
        on_kernels = all(map(self._kernels, all_scales)) and kernels.supports_signs(*all_scales)
        if dtype != "float32" or not on_kernels:
            return super().sign_decode_all(messages, dtype)
        out = torch.empty(sum(n for _, _, _, n in messages), dtype=torch.float32, device=_HOST)
        at = 0
        for packed, scales, block, n in messages:
            kernels.sign_decode(packed, scales, block, n, out=out[at:at + n])
            at += n
        return out

    def nonzero(self, mask: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(mask).reshape(-1)

    def searchsorted(self, ascending: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
        return torch.searchsorted(ascending, _fixed(tuple(bounds), ascending.dtype, ascending.device))

    def greater_equal(self, x: torch.Tensor, threshold: Scalar) -> torch.Tensor:
        return x >= threshold

    def size(self, x: torch.Tensor) -> int:
        return x.numel()

    def gather(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        # index_select skips advanced indexing's general set-up: 2x faster for k of 25M.
        if x.dim() == 1 and isinstance(indices, torch.Tensor) and indices.dim() == 1:
            return x.index_select(0, indices)
        return x[indices]

    def scatter_sub(self, out: torch.Tensor, indices: torch.Tensor,
                    values: torch.Tensor) -> torch.Tensor:
        if self._scatters(out, values):
            return kernels.scatter_add(out, indices, values, -1)
        return out.index_add_(0, indices, values, alpha=-1)

    def scatter_zero(self, out: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if self._scatters(out):
            return kernels.scatter_add(out, indices, None)
        return out.index_fill_(0, indices, 0)

    def scatter_add(self, out: torch.Tensor, indices: torch.Tensor,
                    values: torch.Tensor) -> torch.Tensor:
        if self._scatters(out, values):
            return kernels.scatter_add(out, indices, values)
        return out.index_add_(0, indices, values)

    def sum_sparse(self, out: torch.Tensor, messages: Sequence[Tuple[torch.Tensor, torch.Tensor, Scalar]],
                   scale: float) -> torch.Tensor:
        if self._scatters(out) and all(self._scatters(out, values) for _, values, _ in messages):
            summed = kernels.sum_sparse(out, messages, scale)
            if summed is not None:
                return summed
        return super().sum_sparse(out, messages, scale)

    def encode_message(self, layout: Any, header: Sequence[Any], positions: torch.Tensor, count: Any,
                       values: Optional[torch.Tensor]) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        if self._kernels(positions):
            if values is None or not self._kernels(values):
                return None
            return kernels.encode_message(layout, header, positions, count, values)
        if triton_messages.encodes(layout, header, positions, count, values):
            return triton_messages.encode_message(layout, header, positions, count, values)
        return None

    def encode_runs(self, layouts: Sequence[Any], headers: Sequence[Sequence[Any]], positions: torch.Tensor,
                    starts: torch.Tensor, source: torch.Tensor, source_positions: torch.Tensor,
                    bases: Sequence[int]) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        if self._kernels(positions) or not triton_messages.encodes_runs(layouts, headers, positions, starts, source,
                                                                        source_positions):
            return None
        return triton_messages.encode_runs(layouts, headers, positions, starts, source, source_positions, bases)

    def decode_positions(self, data: torch.Tensor, layout: Any, sender: int,
                         step: Any) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        if not self._kernels(data) or not isinstance(sender, int):
            return None
        return kernels.decode_positions(data, layout, sender, step)

    def check_headers(self, data: torch.Tensor, expected: Sequence[Tuple[Any, Any]],
                      step: Any) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if self._kernels(data) or not triton_messages.checks_headers(data, expected, step):
            return None
        return triton_messages.check_headers(data, expected[0][0], tuple(sender for _, sender in expected), step)

    def decode_received(self, data: torch.Tensor, expected: Sequence[Tuple[Any, Any]], step: Any,
                        dtypes: Sequence[str]) -> Optional[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor],
                                                                 torch.Tensor]]:
        if self._kernels(data) or not expected:
            return None
        layout = expected[0][0]
        senders = tuple(sender for _, sender in expected)
        if (any(other != layout for other, _ in expected)
                or not all(isinstance(sender, int) for sender in senders) or any(d != "float32" for d in dtypes)
                or not triton_messages.decodes(data, [layout], len(senders), step)):
            return None
        decoded = triton_messages.decode_messages(data, [layout], senders, step)
        flags = self._checked_flags(decoded, data, [layout], senders, step)
        (positions,), (values,) = decoded.positions, decoded.values
        return flags, positions, None if layout.value_format is None else values, decoded.counts

    def _checked_flags(self, decoded: triton_messages.Decoded, data: torch.Tensor, layouts: Sequence[Any],
                       senders: Tuple[int, ...], step: int) -> torch.Tensor:
        """The flags of ``decoded`` once its checks pass (deferred where checks are: the kernel
        leaves nothing of a failed message, its flags word included): a failed one raises the
        composition's error, naming the rank, the tensor and the field."""
        self._deferred(decoded.fine, [data, step],
                       functools.partial(triton_messages.explain, type(self), tuple(layouts), senders))
        return decoded.flags

    def decode_sums(self, data: torch.Tensor, layouts: Sequence[Any], world_size: int, step: Any,
                    outs: Sequence[torch.Tensor], scale: float) -> Optional[torch.Tensor]:
        if self._kernels(data):
            if not all(self._scatters(out) for out in outs):
                return None
            return kernels.decode_sums(data, layouts, world_size, step, outs, scale)
        if not triton_messages.decodes(data, layouts, world_size, step, outs):
            return None
        senders = tuple(range(world_size))
        decoded = triton_messages.decode_messages(data, layouts, senders, step, scale)
        flags = self._checked_flags(decoded, data, layouts, senders, step)
        for out, positions, values in zip(outs, decoded.positions, decoded.values):
            self.scatter_add(self.zeroed(out), positions, values)
        return flags

    def magnitude_keys(self, x: torch.Tensor, base: torch.Tensor, real: Any) -> Optional[torch.Tensor]:
        masks = [real] if isinstance(real, torch.Tensor) else []
        if (self._kernels(x) or (not masks and real is not True) or not x.is_floating_point()
                or x.dtype == torch.float64 or base.dtype != torch.int64
                or any(t.numel() != x.numel() for t in [base, *masks])
                or not triton_memory.launchable(x, base, *masks)):
            return None
        return triton_selection.magnitude_keys(x, base, real)

    def block_keys(self, x: torch.Tensor, blocks: torch.Tensor, block: int, slot_offset: torch.Tensor,
                   slot_last: torch.Tensor, slot_base: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        tables = (slot_offset, slot_last, slot_base)
        if (self._kernels(x) or not x.is_floating_point() or x.dtype == torch.float64
                or any(t.dtype != torch.int64 for t in (blocks, *tables))
                or slot_offset.numel() != blocks.numel() * block
                or not triton_memory.launchable(x, blocks, *tables)):
            return None
        return triton_selection.block_keys(x, blocks, block, *tables)

    def gaussian_thresholds(self, magnitudes: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                            thresholds: torch.Tensor, low: torch.Tensor, high: torch.Tensor, fewest: torch.Tensor,
                            whole: torch.Tensor, adjustments: int) -> Optional[torch.Tensor]:
        if self._kernels(magnitudes) or not triton_memory.launchable(magnitudes, starts, counts, thresholds, low,
                                                                     high, fewest, whole):
            return None
        return triton_selection.gaussian_thresholds(magnitudes, starts, counts, thresholds, low, high, fewest,
                                                    whole, adjustments)

    def top_of_segments(self, positions: torch.Tensor, magnitudes: torch.Tensor, starts: torch.Tensor,
                        counts: torch.Tensor, ks: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        if not (self._kernels(positions) and kernels.supports(magnitudes)):
            return None
        return kernels.top_of_segments(positions, magnitudes, starts, counts, ks)

    def pad(self, x: torch.Tensor, length: int) -> torch.Tensor:
        if x.numel() == length:
            return x
        if x.numel() > length:
            raise ValueError(f"{x.numel()} entries do not fit in {length}")
        return torch.nn.functional.pad(x, (0, length - x.numel()))  # one kernel, where zeros and cat are two

    def to_bytes(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        return x if x.dtype == torch.uint8 else x.view(torch.uint8)

    def from_bytes(self, data: torch.Tensor, dtype: str) -> torch.Tensor:
        target = DTYPES[dtype]
        if data.dtype == target:
            return data
        if data.storage_offset() % target.itemsize:
            data = data.clone()
        return data.view(target)

    def bitcast(self, x: torch.Tensor, dtype: str) -> torch.Tensor:
        return x.contiguous().view(DTYPES[dtype])  # one view, where the bytes' are two

    def pack_signs(self, x: torch.Tensor) -> torch.Tensor:
        # Eight 0/1 bytes read as one little-endian int64; the multiply gathers byte i's bit
        # into bit 56 + i, so the top byte is the packed value (no carries reach it).
        bits = (x >= 0).view(torch.uint8).view(torch.int64)
        return ((bits * _GATHER_BITS) >> 56).to(torch.uint8)

    def unpack_signs(self, packed: torch.Tensor, dtype: str) -> torch.Tensor:
        # A gather of 32-byte rows from the sign table is the CPU's fastest way; on a GPU it
        # took 2.0 ms for 3.2 M bytes, ten times the gather of 8-byte rows of bits and a where.
        if packed.device.type != "cpu":
            signs = torch.where(self.unpack_bits(packed), 1.0, -1.0)
            return signs if dtype == "float32" else signs.to(DTYPES[dtype])
        table = _table("signs", packed.device, DTYPES[dtype])
        return table.index_select(0, packed.to(torch.int64)).reshape(-1)

    def pack_bits(self, bits: torch.Tensor) -> torch.Tensor:
        words = bits.to(torch.uint8).contiguous().view(torch.int64)
        return ((words * _GATHER_BITS) >> 56).to(torch.uint8)

    def unpack_bits(self, packed: torch.Tensor) -> torch.Tensor:
        table = _table("bits", packed.device, torch.bool)
        return table.index_select(0, packed.to(torch.int64)).reshape(-1)

    def pack_fields(self, values: torch.Tensor, width: int, n_bytes: int) -> torch.Tensor:
        if self._kernels(values) and 0 < width < 64:
            return kernels.pack_fields(values, width, n_bytes)
        if 0 < width < 64 and triton_memory.launchable(values):
            return triton_bits.pack_fields(values, width, n_bytes)
        return super().pack_fields(values, width, n_bytes)

    def set_bits(self, positions: torch.Tensor, n_bytes: int) -> torch.Tensor:
        if self._kernels(positions):
            return kernels.set_bits(positions, n_bytes)
        if triton_memory.launchable(positions):
            return triton_bits.set_bits(positions, n_bytes)
        return super().set_bits(positions, n_bytes)

    def set_bit_positions(self, packed: torch.Tensor, n_bits: int) -> torch.Tensor:
        if self._kernels(packed):
            return kernels.set_bit_positions(packed, n_bits)
        return super().set_bit_positions(packed, n_bits)

    def set_bit_positions_fitted(self, packed: torch.Tensor, n_bits: int,
                                 capacity: int) -> Tuple[torch.Tensor, Any]:
        if not self.sizes_cost_a_wait(packed):
            return super().set_bit_positions_fitted(packed, n_bits, capacity)
        bits = self.unpack_bits(packed)[:n_bits]
        positions = torch.nonzero_static(bits, size=capacity, fill_value=0).reshape(-1)
        return positions, bits.sum()

    def elias_fano_positions(self, lower: torch.Tensor, low_bits: int, upper: torch.Tensor,
                             n_upper_bits: int, capacity: int, count: Scalar,
                             numel: int) -> Tuple[torch.Tensor, Any]:
        if self._kernels(lower) and self._kernels(upper) and low_bits <= 56:
            return kernels.elias_fano_positions(lower, low_bits, upper, n_upper_bits, capacity,
                                                int(count), numel)
        return super().elias_fano_positions(lower, low_bits, upper, n_upper_bits, capacity, count, numel)

    def elias_fano_rows(self, lower: torch.Tensor, low_bits: int, upper: torch.Tensor, n_upper_bits: int,
                        capacity: int, rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if not self._kernels(upper) and capacity and low_bits < 63 and triton_memory.launchable(lower, upper):
            return triton_bits.elias_fano_rows(lower, low_bits, upper, n_upper_bits, capacity, rows)
        return super().elias_fano_rows(lower, low_bits, upper, n_upper_bits, capacity, rows)

    def past_counts(self, capacity: int, counts: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        # Every slot against its message's count, broadcast: no table of each slot's count.
        slots = torch.arange(capacity, device=like.device)
        return (slots >= counts.reshape(-1, 1)).reshape(-1)

    def bits_of(self, values: torch.Tensor, width: int) -> torch.Tensor:
        shifts = torch.arange(width, device=values.device)
        return ((values.unsqueeze(1) >> shifts) & 1).bool().reshape(-1)

    def from_bits(self, bits: torch.Tensor, width: int) -> torch.Tensor:
        if width == 0:
            return bits.new_zeros(0, dtype=torch.int64)
        shifts = torch.arange(width, device=bits.device)
        return (bits.reshape(-1, width).to(torch.int64) << shifts).sum(1)

    def sort(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        values, order = torch.sort(x, stable=True)
        return values, order

    def arange(self, n: Scalar, like: torch.Tensor) -> torch.Tensor:
        return torch.arange(int(n), device=like.device)

    def floordiv(self, x: torch.Tensor, divisor: int) -> torch.Tensor:
        return torch.div(x, divisor, rounding_mode="floor")

    def round(self, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    def fit(self, data: torch.Tensor, length: int) -> torch.Tensor:
        if data.numel() == length:
            return data
        if data.numel() > length:
            return data[:length]
        return torch.cat([data, data.new_zeros(length - data.numel())])

    def equal(self, a: Scalar, b: Scalar) -> Any:
        return a == b

    def differences(self, x: torch.Tensor) -> torch.Tensor:
        return torch.diff(x)

    def all_within(self, x: torch.Tensor, low: Any, high: Any) -> torch.Tensor:
        if isinstance(low, (int, float)) and isinstance(high, (int, float)) and low == high:
            return (x == low).all()
        return ((x >= low) & (x <= high)).all()

    def check(self, pred: Scalar, error: Exception) -> None:
        if not bool(pred):
            raise error

    def verify(self, pred: Scalar, inputs: Sequence[Any], explain: Callable[..., None],
               result: torch.Tensor) -> torch.Tensor:
        if self._deferred(pred, inputs, explain):
            # Until then the work goes on with zeros in place of a result that failed (no
            # index from a bad message reaches a scatter).
            return torch.where(pred, result, torch.zeros_like(result))
        return result

    def _deferred(self, pred: Scalar, inputs: Sequence[Any], explain: Callable[..., None]) -> bool:
        """Whether the check ``pred`` waits for settle_checks(), to be read with the step's
        other checks at once; if not, it is made now (and raises if it failed)."""
        if isinstance(pred, torch.Tensor) and self.defers_checks(pred):
            self._pending.append((pred, inputs, explain))
            return True
        if not bool(pred):
            _explain(inputs, explain)
        return False

    def settle_checks(self, *flags: Any) -> List[bool]:
        """Every check :meth:`verify` deferred (:meth:`defers_checks`), and ``flags``
        (booleans, or 0-d tensors there), read together: raises the first failed check's
        error, else returns the flags as Python booleans. One wait for a whole step."""
        pending, self._pending = self._pending, []
        on_device = [f for f in flags if isinstance(f, torch.Tensor)]
        if not pending and not on_device:
            return [bool(f) for f in flags]
        tensors = [p for p, _, _ in pending] + on_device
        # One device for the single read: a check made on the host joins the GPU's by a copy
        # that does not wait (a GPU value read on its own would).
        target = next((t.device for t in tensors if t.device.type != "cpu"), _HOST)
        read = torch.stack([_to_device(t.reshape(()).to(torch.bool), target) for t in tensors])
        values = iter(read.tolist())
        for (_, inputs, explain), ok in zip(pending, values):
            if not ok:
                _explain(inputs, explain)
        return [next(values) if isinstance(f, torch.Tensor) else bool(f) for f in flags]

    def discard_checks(self) -> None:
        """Forget the deferred checks of a step that will not finish."""
        self._pending = []

    def while_loop(self, cond: Callable[..., Scalar], body: Callable[..., Tuple],
                   loop_vars: Tuple, max_iterations: int) -> Tuple:
        for _ in range(max_iterations):
            if not bool(cond(*loop_vars)):
                break
            loop_vars = body(*loop_vars)
        return loop_vars

    def cond(self, pred: Scalar, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
        return true_fn() if bool(pred) else false_fn()
