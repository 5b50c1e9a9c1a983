"""Compiled kernels for the PyTorch adapter (built by setup.py; plain C, no torch headers).

They take contiguous CPU tensors: float32 memories, and float32, float16 or bfloat16
gradients; :class:`~horovod_dgc.torch.ops.TorchOps` uses the core's composition of torch
operations for every other dtype and device, and that composition is what the kernels are
tested against.
"""
from __future__ import annotations

import functools
import math
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ...core import wire
from ...core.ops import Pieces, buffer_of
from . import _bits, _selection, _streaming

# The kernels read and write host memory: their outputs are CPU tensors whatever
# torch.set_default_device says.
CPU = torch.device("cpu")

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


def _ranges(n: int, unit: int, width: int) -> List[Tuple[int, int]]:
    """(start, count) ranges covering ``n`` entries, one per thread of ``width``, each start a
    multiple of ``unit``; a single range below PARALLEL_MIN_NUMEL entries."""
    if n < PARALLEL_MIN_NUMEL or width == 1:
        return [(0, n)]
    per_thread = -(-n // width // unit) * unit
    return [(start, min(per_thread, n - start)) for start in range(0, n, per_thread)]


def _run(kernel: Callable, calls: Sequence[tuple]) -> list:
    """``kernel(*args)`` for each argument tuple, on the pool when there are several."""
    if len(calls) == 1:
        return [kernel(*calls[0])]
    pool = _pool(torch.get_num_threads())
    return [call.result() for call in [pool.submit(kernel, *args) for args in calls]]


def block_abs_max(x: torch.Tensor, block: int) -> torch.Tensor:
    """``max |x|`` of each whole block of ``block`` elements of ``x`` (a trailing partial
    block is left to the caller), in one read pass."""
    _check(x, "block_abs_max")
    n_blocks = x.numel() // block
    out = torch.empty(n_blocks, dtype=torch.float32, device=CPU)
    item_bytes = x.element_size()
    _run(_selection.block_abs_max,
         [(x.data_ptr() + start * item_bytes, count // block, block,
           out.data_ptr() + start // block * item_bytes)
          for start, count in _ranges(n_blocks * block, block, torch.get_num_threads())])
    return out


def positions_at_least(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Positions (int64, ascending) of the entries of ``x`` that are ``>= threshold``, in one
    pass (torch: a mask, then nonzero)."""
    _check(x, "positions_at_least")
    out = torch.empty(x.numel(), dtype=torch.int64, device=CPU)
    count = _selection.positions_at_least(x.data_ptr(), x.numel(), float(threshold), out.data_ptr())
    return out[:count].clone()


def collect_at_least(x: torch.Tensor, blocks: torch.Tensor, block: int,
                     threshold: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(positions, magnitudes) of the entries with ``|x| >= threshold`` in the listed blocks
    (int64 block numbers; the last block may be partial), ascending, in one pass."""
    _check(x, "collect_at_least")
    blocks = blocks.to(torch.int64).contiguous()
    capacity = blocks.numel() * block
    positions = torch.empty(capacity, dtype=torch.int64, device=CPU)
    magnitudes = torch.empty(capacity, dtype=torch.float32, device=CPU)
    # Each range of the listed blocks writes from its first block's slot on.
    ranges = _listed_ranges(blocks, block)
    counts = _run(_selection.collect_at_least,
                  [(x.data_ptr(), x.numel(), blocks.data_ptr() + first * 8, n_listed, block,
                    float(threshold), positions.data_ptr() + first * block * 8,
                    magnitudes.data_ptr() + first * block * 4) for first, n_listed in ranges])
    parts = [(first * block, count) for (first, _), count in zip(ranges, counts)]
    return (torch.cat([positions[at:at + count] for at, count in parts]),
            torch.cat([magnitudes[at:at + count] for at, count in parts]))


def count_at_least(x: torch.Tensor, blocks: torch.Tensor, block: int, threshold: float) -> int:
    """How many entries of the listed blocks have ``|x| >= threshold``: the count of
    :func:`collect_at_least`, without writing the entries (a read of the listed blocks)."""
    _check(x, "count_at_least")
    blocks = blocks.to(torch.int64).contiguous()
    return sum(_run(_selection.collect_at_least,
                    [(x.data_ptr(), x.numel(), blocks.data_ptr() + first * 8, n_listed, block,
                      float(threshold), 0, 0) for first, n_listed in _listed_ranges(blocks, block)]))


def top_of_segments(positions: torch.Tensor, magnitudes: torch.Tensor, starts: torch.Tensor,
                    counts: torch.Tensor, ks: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(positions, thresholds) of each segment's ``ks[s]`` largest ``magnitudes`` among the
    candidates ``starts[s] .. starts[s] + counts[s] - 1`` (int64 positions ascending, float32
    magnitudes, int64 tables): their positions in order, ties at the ``ks[s]``-th largest going
    to the first, and that ``ks[s]``-th largest (float32, one per segment)."""
    if positions.dtype != torch.int64 or not positions.is_contiguous() or magnitudes.numel() != positions.numel():
        raise TypeError("top_of_segments takes contiguous int64 positions and float32 magnitudes of one length")
    _check(magnitudes, "top_of_segments")
    starts, counts, ks = (t.to(device=CPU, dtype=torch.int64).contiguous() for t in (starts, counts, ks))
    out = torch.empty(int(ks.sum()), dtype=torch.int64, device=CPU)
    thresholds = torch.empty(ks.numel(), dtype=torch.float32, device=CPU)
    _selection.top_of_segments(positions.data_ptr(), magnitudes.data_ptr(), positions.numel(), ks.numel(),
                               starts.data_ptr(), counts.data_ptr(), ks.data_ptr(), out.data_ptr(),
                               thresholds.data_ptr())
    return out, thresholds


def _listed_ranges(blocks: torch.Tensor, block: int) -> List[Tuple[int, int]]:
    """(first listed block, how many) per thread."""
    return [(start // block, count // block)
            for start, count in _ranges(blocks.numel() * block, block, torch.get_num_threads())]


GRAD_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_RESIDUAL, _MOMENTUM, _NESTEROV = 0, 1, 2
_STATS = {None: 0, "max": 1, "sum": 2}
# From this many entries on, new memories are written with non-temporal stores: they do not fit
# in the cache, and the next pass over them is the next step's.
STREAM_MIN_NUMEL = 1 << 20
# Sum ranges start on a multiple of this many entries when blocks are longer than a range.
_SUM_UNIT = 64


def supports_accumulate(grad: Union[torch.Tensor, Pieces], *memories: Optional[torch.Tensor]) -> bool:
    """Whether :func:`error_feedback` and :func:`momentum_correction` take these tensors:
    contiguous CPU tensors of one length, a float32/float16/bfloat16 gradient (or
    :class:`~horovod_dgc.core.ops.Pieces` of contiguous CPU parts of one such dtype), float32
    memories (a None memory is an output to allocate)."""
    if isinstance(grad, Pieces):
        parts = grad.parts
        if not all(p.dtype == grad.flat.dtype and p.device.type == "cpu" and p.is_contiguous() for p in parts):
            return False
        grad = grad.flat
    tensors = [grad, *(m for m in memories if m is not None)]
    return (grad.dtype in GRAD_KINDS and all(m.dtype == torch.float32 for m in tensors[1:])
            and all(t.device.type == "cpu" and t.is_contiguous() and t.numel() == grad.numel()
                    for t in tensors))


def _piece_table(pieces: Pieces) -> Tuple[torch.Tensor, torch.Tensor]:
    """(ends, addresses) of the pieces the accumulate kernel reads a gradient from: each part,
    and a piece of zeros (address 0) for every gap between parts and after the last."""
    ends, addresses, end = [], [], 0
    for part, offset in zip(pieces.parts, pieces.offsets):
        if offset > end:
            ends.append(offset)
            addresses.append(0)
        end = offset + part.numel()
        ends.append(end)
        addresses.append(part.data_ptr())
    if pieces.flat.numel() > end:
        ends.append(pieces.flat.numel())
        addresses.append(0)
    return torch.tensor(ends, dtype=torch.int64), torch.tensor(addresses, dtype=torch.int64)


Candidates = Tuple[torch.Tensor, torch.Tensor, int]
# A candidate bound: a number (or a 0-d tensor), or a 1-D float32 tensor of one per statistic block.
Bound = Union[None, float, torch.Tensor]


_slots = threading.local()


def _candidate_slots(n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """This thread's storage for ``n`` candidates (positions, magnitudes), kept between calls:
    a new allocation of a few MB each step cost the accumulation up to a read pass in page
    faults (and the TLB shootdowns of freeing pages that both kernel threads touched)."""
    held = getattr(_slots, "storage", None)
    if held is None or held[0].numel() < n:
        held = _slots.storage = (torch.empty(n, dtype=torch.int64, device=CPU),
                                 torch.empty(n, dtype=torch.float32, device=CPU))
    return held[0][:n], held[1][:n]


def _accumulate(mode: int, grad: Union[torch.Tensor, Pieces], scale: float, m: float, scale_m: float,
                a: torch.Tensor, a_out: torch.Tensor, b: Optional[torch.Tensor],
                b_out: Optional[torch.Tensor], block: int, stat: Optional[str],
                bound: Bound = None,
                capacity: int = 0) -> Tuple[Optional[torch.Tensor], bool, Optional[Candidates]]:
    """Run the accumulate kernel over thread ranges: (per-block statistic, finite, candidates
    of ``bound``: see :func:`momentum_correction`)."""
    if not supports_accumulate(grad, a, a_out, b, b_out):
        got = buffer_of(grad)
        raise TypeError("accumulate takes contiguous CPU tensors of one length: a float32, float16 "
                        f"or bfloat16 gradient and float32 memories, got {got.dtype} {tuple(got.shape)}")
    # The kernel's (piece_ends, piece_grads, n_pieces); `tables` keeps them alive until it returns.
    tables = _piece_table(grad) if isinstance(grad, Pieces) else None
    piece_args = (tables[0].data_ptr(), tables[1].data_ptr(), tables[0].numel()) if tables else (0, 0, 0)
    grad = buffer_of(grad)
    n = grad.numel()
    if not block:
        stat = None  # block 0: no statistic
    block = block if stat else 1
    n_blocks = -(-n // block)
    width = torch.get_num_threads()
    if stat == "max" or (stat == "sum" and n_blocks >= width):
        ranges = _ranges(n, block, width)
    else:
        ranges = _ranges(n, _SUM_UNIT, width)
    kind, code = GRAD_KINDS[grad.dtype], _STATS[stat]
    g_bytes = grad.element_size()
    stats = None
    if stat is not None:
        # Every block's statistic is written by one range, except where ranges start inside
        # blocks: those blocks are summed from the ranges' partial sums.
        aligned = all(start % block == 0 for start, _ in ranges)
        stats = (torch.empty if aligned else torch.zeros)(
            n_blocks, dtype=torch.float32 if stat == "max" else torch.float64, device=CPU)
    partials = []
    calls = []
    collecting = bound is not None and stat == "max"
    if bound is not None and not collecting:
        raise ValueError("accumulate collects candidates only beside block maxima")
    # Each range writes its candidates from its own first slot on: one range may hold them all.
    slots = [min(capacity, count) if collecting else 0 for _, count in ranges]
    firsts = [sum(slots[:r]) for r in range(len(ranges))]
    positions, magnitudes = _candidate_slots(sum(slots))
    per_block = collecting and isinstance(bound, torch.Tensor) and bound.dim() == 1
    if per_block:
        if bound.numel() != n_blocks or bound.dtype != torch.float32 or not bound.is_contiguous():
            raise ValueError(f"accumulate: a bound per block takes {n_blocks} contiguous float32 values, "
                             f"got {bound.dtype} {tuple(bound.shape)}")
        bound_bits = bound.abs().view(torch.int32)
        block_counts = torch.zeros(n_blocks, dtype=torch.int32, device=CPU)
    for r, (start, count) in enumerate(ranges):
        phase = start % block
        if stats is None:
            target = 0
        elif phase == 0 or stat != "sum":
            target = stats.data_ptr() + start // block * stats.element_size()
        else:
            partial = torch.zeros((phase + count - 1) // block + 1, dtype=torch.float64, device=CPU)
            partials.append((start // block, partial))
            target = partial.data_ptr()
        offset = start * 4
        calls.append((mode, kind, grad.data_ptr() + start * g_bytes, a.data_ptr() + offset,
                      a_out.data_ptr() + offset, b.data_ptr() + offset if b is not None else 0,
                      b_out.data_ptr() + offset if b_out is not None else 0, count, scale, m, scale_m,
                      code, block, phase, target, n >= STREAM_MIN_NUMEL,
                      (0.0 if per_block else float(bound)) if collecting else math.nan, start, slots[r],
                      positions.data_ptr() + firsts[r] * 8 if slots[r] else 0,
                      magnitudes.data_ptr() + firsts[r] * 4 if slots[r] else 0,
                      bound_bits.data_ptr() + start // block * 4 if per_block else 0,
                      block_counts.data_ptr() + start // block * 4 if per_block else 0, *piece_args))
    results = _run(_streaming.accumulate, calls)
    for first, partial in partials:
        # A range that starts inside a block: its partial sums join those of the range before.
        stats[first:first + partial.numel()] += partial
    finite = all(ok for ok, _ in results)
    if not collecting:
        return stats, finite, None
    counts = [count for _, count in results]
    total = sum(counts)
    reached = block_counts.to(torch.int64) if per_block else total
    if total > capacity:
        return stats, finite, (positions[:0], magnitudes[:0], reached)
    # Copied out of the slots, which the thread's next call writes again.
    return stats, finite, (torch.cat([positions[at:at + c] for at, c in zip(firsts, counts)]),
                           torch.cat([magnitudes[at:at + c] for at, c in zip(firsts, counts)]),
                           reached)


def error_feedback(grad: Union[torch.Tensor, Pieces], scale: float, residual: torch.Tensor,
                   out: Optional[torch.Tensor] = None, block: int = 0, stat: Optional[str] = None,
                   bound: Bound = None, capacity: int = 0
                   ) -> Tuple[torch.Tensor, Optional[torch.Tensor], bool, Optional[Candidates]]:
    """``out = residual + scale * grad`` (a new tensor when ``out`` is None) in one pass, with
    its ``"max"`` (float32) or ``"sum"`` (float64) of ``|out|`` per block of ``block`` entries
    (the last one may be partial; None without ``stat`` or for block 0), whether ``grad`` is
    finite, and the candidates of ``out`` at ``bound`` (with ``"max"`` only), as
    :func:`momentum_correction`'s."""
    out = torch.empty_like(residual) if out is None else out
    stats, finite, candidates = _accumulate(_RESIDUAL, grad, scale, 0.0, 0.0, residual, out, None,
                                            None, block, stat, bound, capacity)
    return out, stats, finite, candidates


def momentum_correction(grad: Union[torch.Tensor, Pieces], scale: float, momentum: torch.Tensor,
                        velocity: torch.Tensor, m: float, nesterov: bool,
                        momentum_out: Optional[torch.Tensor] = None,
                        velocity_out: Optional[torch.Tensor] = None, block: int = 0,
                        bound: Bound = None, capacity: int = 0
                        ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], bool,
                                   Optional[Candidates]]:
    """DGC's ``u' = m * u + scale * g; v' = v + u'`` (Nesterov: ``u' = m * u + (scale * m) * g;
    v' = v + u' + scale * g``) in one pass: (u', v', max ``|v'|`` per block of ``block``
    entries or None, whether ``grad`` is finite, candidates). With a ``bound`` (and a block),
    the candidates are (int64 positions ascending, float32 ``|v'|``, count) of every entry with
    ``|v'| >= bound``, or empty tensors beside the count when more than ``capacity`` reached
    it; None without a bound. A bound needs a block (ValueError); it is a number, or a float32
    tensor of one bound per block (a bucket's tensors, each at its own), whose candidates'
    count is then an int64 tensor of each block's. ``grad`` may be
    :class:`~horovod_dgc.core.ops.Pieces`: read where its parts lie, zeros between them."""
    momentum_out = torch.empty_like(momentum) if momentum_out is None else momentum_out
    velocity_out = torch.empty_like(velocity) if velocity_out is None else velocity_out
    mode = _NESTEROV if nesterov else _MOMENTUM
    maxima, finite, candidates = _accumulate(mode, grad, scale, m, scale * m, momentum, momentum_out,
                                             velocity, velocity_out, block, "max", bound, capacity)
    return momentum_out, velocity_out, maxima, finite, candidates


def supports_signs(*tensors: torch.Tensor) -> bool:
    """Whether :func:`sign_pack` and :func:`sign_decode` take these tensors: contiguous
    float32 on the CPU."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
               for t in tensors)


def sign_pack(x: torch.Tensor, scales: torch.Tensor, block: int,
              length: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Blocksign's message and residual in one pass: the signs of ``x`` zero-padded to
    ``length`` entries (a multiple of 8), 8 per byte (bit j of byte i: ``x[8i + j] >= 0``), and
    ``x - scales[i // block] * sign(x)`` written over ``x``."""
    if not supports_signs(x, scales) or length % 8 or length < x.numel():
        raise TypeError(f"sign_pack takes contiguous float32 CPU tensors and a length that is a "
                        f"multiple of 8 and at least {x.numel()}, got {x.dtype}, length {length}")
    packed = torch.empty(length // 8, dtype=torch.uint8, device=CPU)
    _run(_streaming.sign_pack,
         [(x.data_ptr() + start * 4, x.numel(), count, scales.data_ptr(), block, start,
           packed.data_ptr() + start // 8, x.data_ptr() + start * 4)
          for start, count in _ranges(length, 8, torch.get_num_threads())])
    return packed, x


def sign_decode(packed: torch.Tensor, scales: torch.Tensor, block: int, n: int,
                add_to: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``scales[i // block] * (+1 where bit i of packed is set, else -1)`` for ``i < n``, as a
    new float32 tensor, written over ``out``, or added to ``add_to`` (overwritten)."""
    target = add_to if add_to is not None else out
    if not supports_signs(scales) or n > packed.numel() * 8 or (
            target is not None and (not supports_signs(target) or target.numel() != n)):
        raise TypeError(f"sign_decode takes float32 CPU scales and at most {packed.numel() * 8} "
                        f"entries, got {scales.dtype}, n={n}")
    packed = packed.contiguous()
    out = torch.empty(n, dtype=torch.float32, device=CPU) if target is None else target
    _run(_streaming.sign_decode,
         [(packed.data_ptr() + start // 8, count, scales.data_ptr(), block, start,
           out.data_ptr() + start * 4, add_to is not None)
          for start, count in _ranges(n, 8, torch.get_num_threads())])
    return out


def _check_packed(packed: torch.Tensor, n_bits: int, kernel: str) -> torch.Tensor:
    if packed.dtype != torch.uint8 or packed.device.type != "cpu" or n_bits > packed.numel() * 8:
        raise TypeError(f"{kernel} takes a uint8 CPU tensor of at least {n_bits} bits, got "
                        f"{packed.dtype} of {packed.numel() * 8} bits on {packed.device}")
    return packed.contiguous()


def set_bit_positions(packed: torch.Tensor, n_bits: int) -> torch.Tensor:
    """Positions (int64, ascending) of the set bits among the first ``n_bits`` of ``packed``
    (bit j of byte i is bit 8i + j)."""
    packed = _check_packed(packed, n_bits, "set_bit_positions")
    out = torch.empty(_bits.count_set_bits(packed.data_ptr(), n_bits), dtype=torch.int64, device=CPU)
    _bits.set_bit_positions(packed.data_ptr(), n_bits, out.data_ptr())
    return out


def elias_fano_positions(lower: torch.Tensor, low_bits: int, upper: torch.Tensor,
                         n_upper_bits: int, capacity: int, count: int,
                         numel: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(``capacity`` int64 positions, 0 from ``count`` on; whether they agree with ``count``
    and lie below ``numel``, a 0-d bool tensor) of an Elias-Fano coding (codecs.EliasFano):
    the i-th set bit b of ``upper`` and the i-th ``low_bits``-bit field of ``lower`` give
    ``((b - i) << low_bits) + field``; ``low_bits`` up to 56. One pass over the bytes."""
    upper = _check_packed(upper, n_upper_bits, "elias_fano_positions")
    lower = _check_packed(lower, low_bits * min(count, capacity), "elias_fano_positions")
    out = torch.empty(capacity, dtype=torch.int64, device=CPU)
    found, in_range = _bits.elias_fano_positions(lower.data_ptr(), low_bits, upper.data_ptr(),
                                                 n_upper_bits, capacity, count, numel, out.data_ptr())
    return out, torch.tensor(found == count and in_range, device=CPU)


def scatter_add(out: torch.Tensor, index: torch.Tensor, values: Optional[torch.Tensor],
                alpha: int = 1) -> torch.Tensor:
    """``out[index] += alpha * values`` (repeated indices summed in order; ``alpha`` 1 or -1)
    for a contiguous float32 CPU ``out``, int64 ``index`` and float32 ``values``; with
    ``values=None``, ``out[index] = 0``. IndexError for an index outside ``out``."""
    _check(out, "scatter_add")
    index = index.to(torch.int64).contiguous()
    if values is None:
        values, alpha = index, 0  # not read
    else:
        values = values.to(torch.float32).contiguous()
    if index.numel() != values.numel():
        raise ValueError(f"scatter_add: {index.numel()} indices for {values.numel()} values")
    _streaming.scatter_add(out.data_ptr(), out.numel(), index.data_ptr(), values.data_ptr(),
                           index.numel(), alpha)
    return out


# sum_sparse's thread ranges start on multiples of its chunk (streaming.c's CHUNK entries).
_SUM_SPARSE_UNIT = 1024


def sum_sparse(out: torch.Tensor, messages: Sequence[Tuple[torch.Tensor, torch.Tensor, int]],
               scale: float) -> Optional[torch.Tensor]:
    """``out`` (flat float32 CPU) overwritten with the sum over ``messages``, in their order,
    of ``scale * values[i]`` at ``positions[i]`` for ``i < count`` (int64 positions, float32
    values; the slots past ``count`` are padding and not read), writing ``out`` once. None,
    and ``out`` untouched, when some message's counted positions are not ascending inside
    ``out`` (the caller then scatters them one message after another)."""
    _check(out, "sum_sparse")
    n, kept, table = out.numel(), [], []
    for positions, values, count in messages:
        positions = positions.to(torch.int64).contiguous()
        values = values.to(torch.float32).contiguous()
        count = int(count)
        if count > min(positions.numel(), values.numel()):
            raise ValueError(f"sum_sparse: a count of {count} for {positions.numel()} positions "
                             f"and {values.numel()} values")
        kept += [positions, values]  # the converted tensors live until the kernel has run
        table += [positions.data_ptr(), values.data_ptr(), count]
    words = torch.tensor(table, dtype=torch.int64, device=CPU)
    if not _streaming.sorted_within(words.data_ptr(), len(messages), n):
        return None
    _run(_streaming.sum_sparse, [(out.data_ptr(), start, count, words.data_ptr(), len(messages), scale)
                                 for start, count in _ranges(n, _SUM_SPARSE_UNIT, torch.get_num_threads())])
    return out


# bits.c's names for the codings (its INDEX_ and VALUE_ enums) and the width of its plan rows.
INDEX_KINDS = {"int32": 0, "int64": 1, "elias-fano": 2, "bitmap": 3}
VALUE_KINDS = {"float32": 0, "float16": 1, "bfloat16": 2, "int8": 3, None: 4}
PLAN_COLUMNS = 13


@dataclass(frozen=True)
class DecodePlan:
    """Where bits.c's ``decode_messages`` finds each message of some senders for some
    layouts, and what it accepts in each header (``wire.header_table``)."""

    rows: torch.Tensor  # int64, one row of PLAN_COLUMNS per message, in the order received
    bounds: torch.Tensor  # int32: every message's lowest header words, then its highest
    headers: wire.HeaderTable
    scratch_entries: int  # slots of all messages together


def plan_row(layout: wire.MessageLayout, offset: int, slot: int, scratch_at: int) -> List[int]:
    """One message's row of a decode plan (bits.c's and ``triton_messages``'): its byte
    offset in the data, index kind, numel, capacity, Elias-Fano's low bits and upper bits,
    where its index part, upper bits, values and int8 scale start (bytes from the message's
    start; 0 where it has none), its value kind, its table slot and where its entries start
    among the decoded slots."""
    indices, spans = layout.indices, [at for at, _ in layout.part_spans]
    index_kind = indices.dtype if indices.name == "raw" else indices.name
    value_at = spans[len(indices.parts)] if layout.value_format else 0
    scale_at = spans[-1] if layout.value_format == "int8" else 0
    low_bits, upper_bits, upper_at = ((indices.low_bits, indices.upper_bits, spans[1])
                                      if indices.name == "elias-fano" else (0, 0, 0))
    row = [offset, INDEX_KINDS[index_kind], layout.numel, layout.capacity, low_bits, upper_bits,
           spans[0], upper_at, VALUE_KINDS[layout.value_format], value_at, scale_at, slot, scratch_at]
    assert len(row) == PLAN_COLUMNS, "bits.c's PLAN_ columns and this row disagree"
    return row


@functools.lru_cache(maxsize=wire.HEADER_TABLES_KEPT)  # a plan per header table
def decode_plan(layouts: Tuple[wire.MessageLayout, ...], senders: Tuple[int, ...]) -> DecodePlan:
    """The plan of the messages for ``layouts`` from each of ``senders``, sender after
    sender; tensor t's message from the i-th sender takes table slot ``t * len(senders) + i``."""
    headers = wire.header_table(layouts, senders)
    rows, scratch_at = [], 0
    for m, offset in enumerate(headers.offsets):
        i, t = divmod(m, len(layouts))
        rows.append(plan_row(layouts[t], offset, t * len(senders) + i, scratch_at))
        scratch_at += layouts[t].capacity
    return DecodePlan(rows=torch.tensor(rows, dtype=torch.int64, device=CPU),
                      bounds=torch.tensor(headers.low + headers.high, dtype=torch.int32, device=CPU),
                      headers=headers, scratch_entries=scratch_at)


@dataclass(frozen=True)
class Decoded:
    """What ``decode_messages`` made of a plan's messages; the table's pointers point into
    ``positions`` and ``values``, which must live while it is read."""

    positions: torch.Tensor  # int64: each message's capacity slots, 0 past its count
    values: torch.Tensor  # float32, the same slots
    table: torch.Tensor  # int64 (positions pointer, values pointer, count) per table slot
    flags: torch.Tensor  # int32 flags word of each message, in the order received


def _decode(data: torch.Tensor, plan: DecodePlan, step: int) -> Optional[Decoded]:
    if data.dtype != torch.uint8 or data.device.type != "cpu" or data.numel() != plan.headers.total_bytes:
        return None
    data = data.contiguous()
    n_messages = len(plan.headers.offsets)
    decoded = Decoded(positions=torch.empty(plan.scratch_entries, dtype=torch.int64, device=CPU),
                      values=torch.empty(plan.scratch_entries, dtype=torch.float32, device=CPU),
                      table=torch.empty(3 * n_messages, dtype=torch.int64, device=CPU),
                      flags=torch.empty(n_messages, dtype=torch.int32, device=CPU))
    headers = plan.headers
    bad = _bits.decode_messages(data.data_ptr(), plan.rows.data_ptr(), n_messages,
                                plan.bounds.data_ptr(), headers.words, headers.step_at,
                                wire.step_word(int(step)), headers.count_at, headers.flags_at,
                                decoded.positions.data_ptr(), decoded.values.data_ptr(),
                                decoded.table.data_ptr(), decoded.flags.data_ptr())
    return None if bad >= 0 else decoded


def decode_positions(data: torch.Tensor, layout: wire.MessageLayout, sender: int,
                     step: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(the ``capacity`` int64 positions, 0 past the count; the flags word, int32 of one
    entry) of one message from ``sender`` for ``layout``, its header checked, in one call;
    None when it is not as expected (the caller's composition then names the problem)."""
    decoded = _decode(data, decode_plan((layout,), (sender,)), step)
    return None if decoded is None else (decoded.positions, decoded.flags)


def decode_sums(data: torch.Tensor, layouts: Sequence[wire.MessageLayout], world_size: int,
                step: int, sums: Sequence[torch.Tensor], scale: float) -> Optional[torch.Tensor]:
    """The whole decode of an allgather of sparse messages in two calls: every header
    checked, every message's positions and values decoded (``decode_messages``), then each
    tensor's flat float32 ``sums[t]`` overwritten with ``scale`` times the sum of its N
    messages, in rank order (``sum_sparse``). Returns each message's flags word (int32, in
    the order received), or None, with ``sums`` untouched, when something is not as expected:
    the size, a header, positions that disagree with their count, raw positions out of
    order, or an input the kernels do not take. The caller's composition then names the
    problem, or scatters what ``sum_sparse`` cannot take."""
    if (any(layout.value_format is None for layout in layouts)
            or any(not supports(s) or s.numel() != layout.numel for s, layout in zip(sums, layouts))):
        return None
    decoded = _decode(data, decode_plan(tuple(layouts), tuple(range(world_size))), step)
    if decoded is None:
        return None
    table, width = decoded.table, torch.get_num_threads()
    row_bytes = 3 * table.element_size()
    for t, out in enumerate(sums):
        _run(_streaming.sum_sparse,
             [(out.data_ptr(), start, count, table.data_ptr() + t * world_size * row_bytes,
               world_size, scale) for start, count in _ranges(out.numel(), _SUM_SPARSE_UNIT, width)])
    return decoded.flags


@functools.lru_cache(maxsize=wire.INTERNED_LAYOUTS)
def _encode_row(layout: wire.MessageLayout) -> Optional[torch.Tensor]:
    """``layout``'s plan row for ``encode_message`` (a message at offset 0), or None for a
    message of positions only, which it does not write."""
    if layout.value_format is None:
        return None
    return torch.tensor(plan_row(layout, 0, 0, 0), dtype=torch.int64, device=CPU)


def encode_message(layout: wire.MessageLayout, header: Sequence[int], positions: torch.Tensor,
                   count: int, values: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(the message, the ``capacity`` values receivers will decode as float32) of ``count``
    ascending int64 ``positions`` and their float32 ``values``, header words ``header``, in
    one call: what ``wire.MessageLayout.encode`` composes. None where the kernel does not take
    them (a header word that is a tensor, positions outside the tensor or out of order, a
    coding it lacks): the composition then encodes them, or names the problem."""
    row = _encode_row(layout)
    if (row is None or not all(isinstance(word, int) for word in header)
            or positions.dtype != torch.int64 or values.dtype != torch.float32
            or positions.device.type != "cpu" or values.device.type != "cpu"
            or positions.numel() != count or values.numel() != count):
        return None
    positions, values = positions.contiguous(), values.contiguous()
    message = torch.empty(layout.nbytes, dtype=torch.uint8, device=CPU)
    decoded = torch.empty(layout.capacity, dtype=torch.float32, device=CPU)
    if not _bits.encode_message(row.data_ptr(), struct.pack(f"={len(header)}i", *header),
                                positions.data_ptr(), values.data_ptr(), count,
                                message.data_ptr(), layout.nbytes, decoded.data_ptr()):
        return None
    return message, decoded


def zero(out: torch.Tensor) -> torch.Tensor:
    """``out`` filled with zeros (contiguous CPU), by memset over thread ranges."""
    if out.device.type != "cpu" or not out.is_contiguous():
        raise TypeError(f"zero takes a contiguous CPU tensor, got one on {out.device}")
    item = out.element_size()
    _run(_streaming.zero, [(out.data_ptr() + start * item, count * item)
                           for start, count in _ranges(out.numel(), 64, torch.get_num_threads())])
    return out


def pack_fields(values: torch.Tensor, width: int, n_bytes: int) -> torch.Tensor:
    """``n_bytes`` bytes holding the lowest ``width`` bits (1 to 63) of each int64 value, one
    field after another, lowest bit first, then zeros."""
    values = values.to(torch.int64).contiguous()
    if values.device.type != "cpu" or values.numel() * width > n_bytes * 8:
        raise TypeError(f"pack_fields: {values.numel()} fields of {width} bits do not fit in "
                        f"{n_bytes} bytes (or are not on the CPU)")
    packed = torch.zeros(n_bytes, dtype=torch.uint8, device=CPU)
    _bits.pack_fields(values.data_ptr(), values.numel(), width, packed.data_ptr())
    return packed


def set_bits(positions: torch.Tensor, n_bytes: int) -> torch.Tensor:
    """``n_bytes`` bytes with bit p set (bit j of byte i is bit 8i + j) for every int64 position
    p; IndexError for one outside them."""
    positions = positions.to(torch.int64).contiguous()
    if positions.device.type != "cpu":
        raise TypeError(f"set_bits takes CPU positions, got them on {positions.device}")
    packed = torch.zeros(n_bytes, dtype=torch.uint8, device=CPU)
    _bits.set_bits(positions.data_ptr(), positions.numel(), n_bytes * 8, packed.data_ptr())
    return packed
