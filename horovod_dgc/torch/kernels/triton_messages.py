"""Whole sparse messages in one kernel each on a GPU (Triton): a message's encode, and the
check and decode of every message an allgather delivered.

The core's compositions (``wire.MessageLayout.encode``; ``wire.decode_senders`` with the
codings' ``decode_rows``) take about 25 framework kernels to encode a message and 60 to
check and decode a bucket's messages on a GPU, most of them on a few words or a view of
each part. Here:

* :func:`encode_message` writes the header, the index coding (raw, Elias-Fano or bitmap)
  and the values (float32, float16 clamped to its range, bfloat16) into a zeroed message in
  one launch, each program taking one job (the header, a block of packed fields or raw
  positions, a block of bitvector marks, a block of values);
* :func:`decode_messages` takes one program per message: it checks the header against
  ``wire.header_table``'s bounds and the step, decodes the positions (checking them against
  the count and the tensor's size as the codings' ``decode_rows`` do) and the values, 0
  past the count (and everywhere in a message that fails a check, its flags word
  included), scaled for the sum;
* :func:`check_headers` checks every header of a set of messages of one layout (blocksign's
  packed signs and scales, whose parts the caller reads itself) and hands out each
  message's flags and count words, one program per message.

What the kernels refuse is left to the caller's composition; what fails a check is
explained by running the composition on the host copy of the data (:func:`explain`), which
names the sending rank, the tensor and the field. These are the GPU's twins of bits.c's
``encode_message`` and ``decode_messages`` (which take the CPU's tensors).
``tests/test_triton_messages.py`` checks both against messages built by hand in the test.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from ...core import codecs, wire
from . import INDEX_KINDS, VALUE_KINDS, plan_row
from .triton_memory import launchable, triton

if triton is not None:
    import triton.language as tl

# Slots, bytes or bits a program (or one step of a message's loop) covers.
ENTRIES_PER_PROGRAM = 1024
BITS_PER_STEP = 4096
# The value formats the encode writes (int8's scale is a reduction over the message: the
# composition's).
ENCODED_VALUES = ("float32", "float16", "bfloat16", None)  # None: a message of positions only
HEADER_LANES = 16  # header words the kernels take (a power of two at least the header's)


if triton is not None:
    @triton.jit(do_not_specialize=["w0", "w1", "w2", "w3", "w4", "w5", "w6", "w7", "w8", "w9", "w10",
                                   "w11", "w12", "w13", "w14", "w15", "count", "message_at", "run",
                                   "base"])
    def _encode(positions, values, message, decoded, run_time_word, runs, sources,
                w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15, n_words,
                count, capacity, low_bits, index_at, n_index_bytes, n_index_programs, upper_at, n_upper_bits,
                n_mark_programs, value_at, message_at, run, base,
                INDEX: tl.constexpr, VALUE: tl.constexpr, TENSOR_WORD: tl.constexpr, RUN: tl.constexpr,
                COUNT_AT: tl.constexpr, FLOAT16_MAX: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        lane = tl.arange(0, BLOCK).to(tl.int64)
        message += message_at
        if RUN:  # run ``run`` of the sorted positions: its length is the count, known only here
            start = tl.load(runs + run).to(tl.int64)
            length = tl.load(runs + run + 1).to(tl.int64) - start
            # No store past the capacity: a longer run's count word makes receivers refuse it.
            count = tl.where(length < capacity, length, capacity)
            positions += start
            sources += start
            decoded += start
        if pid == 0:  # the header
            w = tl.arange(0, 16)
            words = (tl.where(w == 0, w0, 0) + tl.where(w == 1, w1, 0) + tl.where(w == 2, w2, 0)
                     + tl.where(w == 3, w3, 0) + tl.where(w == 4, w4, 0) + tl.where(w == 5, w5, 0)
                     + tl.where(w == 6, w6, 0) + tl.where(w == 7, w7, 0) + tl.where(w == 8, w8, 0)
                     + tl.where(w == 9, w9, 0) + tl.where(w == 10, w10, 0) + tl.where(w == 11, w11, 0)
                     + tl.where(w == 12, w12, 0) + tl.where(w == 13, w13, 0) + tl.where(w == 14, w14, 0)
                     + tl.where(w == 15, w15, 0))
            if TENSOR_WORD >= 0:
                words = tl.where(w == TENSOR_WORD, tl.load(run_time_word).to(tl.int32), words)
            if RUN:
                words = tl.where(w == COUNT_AT, length.to(tl.int32), words)
            tl.store(message.to(tl.pointer_type(tl.int32)) + w, words.to(tl.int32), mask=w < n_words)
        elif pid <= n_index_programs:  # raw positions, or Elias-Fano's packed low fields
            block = (pid - 1).to(tl.int64) * BLOCK
            if INDEX == 2:
                byte = block + lane
                packed = tl.zeros([BLOCK], dtype=tl.int64)
                for j in tl.static_range(8):
                    bit = byte * 8 + j
                    field = bit // low_bits
                    value = tl.load(positions + field, mask=(field < count) & (byte < n_index_bytes),
                                    other=base).to(tl.int64) - base
                    packed |= ((value >> (bit % low_bits)) & 1) << j
                tl.store(message + index_at + byte, packed.to(tl.uint8), mask=byte < n_index_bytes)
            else:
                i = block + lane
                position = tl.load(positions + i, mask=i < count, other=base).to(tl.int64) - base
                if INDEX == 0:
                    tl.store((message + index_at).to(tl.pointer_type(tl.int32)) + i, position.to(tl.int32),
                             mask=i < count)
                else:
                    tl.store((message + index_at).to(tl.pointer_type(tl.int64)) + i, position, mask=i < count)
        elif pid <= n_index_programs + n_mark_programs:  # the bitvector's marks
            i = (pid - 1 - n_index_programs).to(tl.int64) * BLOCK + lane
            position = tl.load(positions + i, mask=i < count, other=base).to(tl.int64) - base
            mark = (position >> low_bits) + i if INDEX == 2 else position
            inside = (i < count) & (mark >= 0) & (mark < n_upper_bits)
            bit = tl.full([BLOCK], 1, tl.int32) << (mark & 31).to(tl.int32)
            tl.atomic_or((message + upper_at).to(tl.pointer_type(tl.int32)) + (mark >> 5), bit, mask=inside)
        elif VALUE != 4:  # the values, and what receivers will decode of them
            i = (pid - 1 - n_index_programs - n_mark_programs).to(tl.int64) * BLOCK + lane
            if RUN:  # the values are gathered from the source, and decoded only where sent
                value = tl.load(values + tl.load(sources + i, mask=i < count, other=0), mask=i < count,
                                other=0).to(tl.float32)
                kept = i < count
            else:
                value = tl.load(values + i, mask=i < count, other=0).to(tl.float32)
                kept = i < capacity
            inside = i < capacity
            if VALUE == 0:
                tl.store((message + value_at).to(tl.pointer_type(tl.float32)) + i, value, mask=inside)
                tl.store(decoded + i, value, mask=kept)
            elif VALUE == 1:
                # Comparisons, not minimum/maximum: a NaN stays NaN, as the composition's clamp keeps it.
                value = tl.where(value > FLOAT16_MAX, FLOAT16_MAX, tl.where(value < -FLOAT16_MAX, -FLOAT16_MAX, value))
                coded = value.to(tl.float16)
                tl.store((message + value_at).to(tl.pointer_type(tl.float16)) + i, coded, mask=inside)
                tl.store(decoded + i, coded.to(tl.float32), mask=kept)
            else:
                # Rounded to nearest even by hand: Triton's interpreter truncates where a GPU rounds.
                bits = value.to(tl.uint32, bitcast=True)
                top = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                top = tl.where(value != value, 0x7FC0, top)
                tl.store((message + value_at).to(tl.pointer_type(tl.uint16)) + i, top.to(tl.uint16), mask=inside)
                tl.store(decoded + i, (top << 16).to(tl.float32, bitcast=True), mask=kept)

    @triton.jit
    def _header(header, bounds, m, step_word, bounds_at_high, WORDS: tl.constexpr, STEP_AT: tl.constexpr,
                COUNT_AT: tl.constexpr, FLAGS_AT: tl.constexpr, LANES: tl.constexpr):
        """Message m's header at byte pointer ``header``, checked: (its words outside their
        bounds, the step word counted wrong unless it is the decoding step's; its flags
        word; its count word, 0 for a header that fails)."""
        w = tl.arange(0, LANES)
        word_inside = w < WORDS
        words = tl.load(header.to(tl.pointer_type(tl.int32)) + w, mask=word_inside, other=0)
        low = tl.load(bounds + m * WORDS + w, mask=word_inside, other=0)
        high = tl.load(bounds + bounds_at_high + m * WORDS + w, mask=word_inside, other=0)
        fits = tl.where(w == STEP_AT, words == step_word, (words >= low) & (words <= high))
        wrong = tl.sum((word_inside & ~fits).to(tl.int32), 0)
        flag = tl.sum(tl.where(w == FLAGS_AT, words, 0), 0)
        return wrong, flag, tl.where(wrong == 0, tl.sum(tl.where(w == COUNT_AT, words, 0), 0), 0)

    @triton.jit(do_not_specialize=["step_word", "bounds_at_high"])
    def _decode(data, plan, bounds, positions, values, flags, counts, bad, step_word, bounds_at_high, scale,
                COLUMNS: tl.constexpr, WORDS: tl.constexpr, STEP_AT: tl.constexpr, COUNT_AT: tl.constexpr,
                FLAGS_AT: tl.constexpr, LANES: tl.constexpr, STEP: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        row = plan + m * COLUMNS
        offset = tl.load(row)
        kind = tl.load(row + 1)
        numel = tl.load(row + 2)
        capacity = tl.load(row + 3)
        low_bits = tl.load(row + 4)
        upper_bits = tl.load(row + 5)
        index_at = offset + tl.load(row + 6)
        upper_at = offset + tl.load(row + 7)
        value_kind = tl.load(row + 8)
        value_at = offset + tl.load(row + 9)
        scale_at = offset + tl.load(row + 10)
        out = positions + tl.load(row + 12)
        out_values = values + tl.load(row + 12)
        wrong, flag, count = _header(data + offset, bounds, m, step_word, bounds_at_high, WORDS, STEP_AT,
                                     COUNT_AT, FLAGS_AT, LANES)
        tl.store(counts + m, count)
        count = count.to(tl.int64)
        # The positions: each coding's slots, 0 past the count.
        if kind >= 2:  # Elias-Fano's upper bits or the bitmap: the i-th set bit into slot i
            bits_at = tl.where(kind == 2, upper_at, index_at)
            n_bits = tl.where(kind == 2, upper_bits, numel)
            seen = tl.zeros([], dtype=tl.int64)
            start = tl.zeros([], dtype=tl.int64)
            while start < n_bits:
                bit = start + tl.arange(0, STEP).to(tl.int64)
                byte = tl.load(data + bits_at + (bit >> 3), mask=bit < n_bits, other=0).to(tl.int64)
                is_set = (((byte >> (bit & 7)) & 1) == 1) & (bit < n_bits)
                rank = seen + tl.cumsum(is_set.to(tl.int64), 0) - 1
                tl.store(out + rank, bit, mask=is_set & (rank < capacity))
                seen += tl.sum(is_set.to(tl.int64), 0)
                start += STEP
            tl.debug_barrier()  # the marks written above, by other threads, are read below
            wrong += tl.where(seen == count, 0, 1).to(tl.int32)
            start = tl.zeros([], dtype=tl.int64)
            while start < capacity:
                slot = start + tl.arange(0, STEP).to(tl.int64)
                sent = slot < count
                mark = tl.load(out + slot, mask=sent & (slot < seen), other=0)
                position = mark
                if kind == 2:
                    field = tl.zeros([STEP], dtype=tl.int64)
                    j = tl.zeros([], dtype=tl.int64)
                    while j < low_bits:
                        bit = slot * low_bits + j
                        byte = tl.load(data + index_at + (bit >> 3), mask=sent, other=0).to(tl.int64)
                        field |= ((byte >> (bit & 7)) & 1) << j
                        j += 1
                    position = ((mark - slot) << low_bits) + field
                position = tl.where(sent, position, 0)
                wrong += tl.sum((position >= numel).to(tl.int32), 0)
                tl.store(out + slot, position, mask=slot < capacity)
                start += STEP
        else:  # raw: every slot must lie in the tensor, past the count too
            start = tl.zeros([], dtype=tl.int64)
            while start < capacity:
                slot = start + tl.arange(0, STEP).to(tl.int64)
                inside = slot < capacity
                if kind == 0:
                    raw = tl.load((data + index_at).to(tl.pointer_type(tl.int32)) + slot, mask=inside,
                                  other=0).to(tl.int64)
                else:
                    raw = tl.load((data + index_at).to(tl.pointer_type(tl.int64)) + slot, mask=inside, other=0)
                wrong += tl.sum((inside & ((raw < 0) | (raw >= numel))).to(tl.int32), 0)
                tl.store(out + slot, tl.where(slot < count, raw, 0), mask=inside)
                start += STEP
        # The values, times the sum's scale, 0 past the count.
        start = tl.zeros([], dtype=tl.int64)
        while (start < capacity) & (value_kind != 4):
            slot = start + tl.arange(0, STEP).to(tl.int64)
            sent = slot < count
            if value_kind == 0:
                value = tl.load((data + value_at).to(tl.pointer_type(tl.float32)) + slot, mask=sent, other=0.0)
            elif value_kind == 1:
                value = tl.load((data + value_at).to(tl.pointer_type(tl.float16)) + slot, mask=sent,
                                other=0.0).to(tl.float32)
            elif value_kind == 2:
                value = tl.load((data + value_at).to(tl.pointer_type(tl.bfloat16)) + slot, mask=sent,
                                other=0.0).to(tl.float32)
            else:
                level = tl.load((data + value_at).to(tl.pointer_type(tl.int8)) + slot, mask=sent, other=0)
                value = level.to(tl.float32) * tl.load((data + scale_at).to(tl.pointer_type(tl.float32)))
            tl.store(out_values + slot, tl.where(sent, value, 0.0) * scale, mask=slot < capacity)
            start += STEP
        if wrong != 0:  # nothing of a message that fails a check reaches the sum
            start = tl.zeros([], dtype=tl.int64)
            while start < capacity:
                slot = start + tl.arange(0, STEP).to(tl.int64)
                tl.store(out + slot, tl.zeros([STEP], dtype=tl.int64), mask=slot < capacity)
                tl.store(out_values + slot, tl.zeros([STEP], dtype=tl.float32), mask=slot < capacity)
                start += STEP
        tl.store(flags + m, tl.where(wrong == 0, flag, 0))
        tl.store(bad + m, wrong)


if triton is not None:
    @triton.jit(do_not_specialize=["step_word", "bounds_at_high", "message_bytes"])
    def _check_headers(data, bounds, flags, counts, failures, step_word, bounds_at_high, message_bytes,
                       WORDS: tl.constexpr, STEP_AT: tl.constexpr, COUNT_AT: tl.constexpr,
                       FLAGS_AT: tl.constexpr, LANES: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        wrong, flag, count = _header(data + m * message_bytes, bounds, m, step_word, bounds_at_high, WORDS,
                                     STEP_AT, COUNT_AT, FLAGS_AT, LANES)
        tl.store(flags + m, tl.where(wrong == 0, flag, 0))
        tl.store(counts + m, count)
        tl.atomic_add(failures, wrong)


def _header_words(headers: wire.HeaderTable) -> dict:
    """The header kernel's constants for ``headers``."""
    return dict(WORDS=headers.words, STEP_AT=headers.step_at, COUNT_AT=headers.count_at,
                FLAGS_AT=headers.flags_at, LANES=HEADER_LANES)


def _programs(n: int) -> int:
    return -(-n // ENTRIES_PER_PROGRAM)


def encodes(layout: wire.MessageLayout, header: Sequence[Any], positions: torch.Tensor, count: Any,
            values: Optional[torch.Tensor]) -> bool:
    """Whether :func:`encode_message` takes these: a value format it writes, at most
    :data:`HEADER_LANES` header words, Python ints but for one that may be a 0-d integer
    tensor on the positions' device (a flag known only there), ``count`` a Python int with
    that many positions and values, and tensors Triton may take."""
    if (layout.value_format not in ENCODED_VALUES or (values is None) != (layout.value_format is None)
            or not isinstance(count, int) or positions.numel() != count
            or positions.dtype not in (torch.int32, torch.int64)
            or (values is not None and (values.numel() != count or not values.is_floating_point()))):
        return False
    tensors = [word for word in header if isinstance(word, torch.Tensor)]
    if (len(header) > HEADER_LANES or len(tensors) > 1
            or not all(isinstance(word, (int, torch.Tensor)) for word in header)
            or any(word.numel() != 1 or word.is_floating_point() or word.device != positions.device
                   for word in tensors)):
        return False
    return launchable(positions) if values is None else launchable(positions, values)


def encode_message(layout: wire.MessageLayout, header: Sequence[Any], positions: torch.Tensor, count: int,
                   values: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(the message, the ``capacity`` values receivers will decode as float32, None for a
    message of positions only) of ``count`` ascending ``positions`` and their ``values``
    (what :func:`encodes` accepts), as ``MessageLayout.encode``'s composition builds them:
    one launch."""
    device = positions.device
    message = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
    decoded = None if values is None else torch.empty(layout.capacity, dtype=torch.float32, device=device)
    # An empty tensor's address may be null, which a launch refuses: any valid one will do
    # where no load reads it.
    _launch(layout, header, message, 0, decoded, positions if count else message,
            values if count and values is not None else message, count)
    return message, decoded


def encodes_runs(layouts: Sequence[wire.MessageLayout], headers: Sequence[Sequence[Any]], positions: torch.Tensor,
                 starts: torch.Tensor, source: torch.Tensor, source_positions: torch.Tensor) -> bool:
    """Whether :func:`encode_runs` takes these: messages with values in a format it writes,
    headers of Python ints, integer ``positions`` and ``source_positions`` of one length,
    ``len(layouts) + 1`` integer ``starts``, a floating-point ``source``, and tensors Triton
    may take."""
    return (len(headers) == len(layouts) and starts.numel() == len(layouts) + 1
            and all(layout.value_format in ENCODED_VALUES and layout.value_format is not None for layout in layouts)
            and all(len(header) <= HEADER_LANES and all(isinstance(word, int) for word in header)
                    for header in headers)
            and all(t.dtype in (torch.int32, torch.int64) for t in (positions, starts, source_positions))
            and source_positions.numel() == positions.numel() and source.is_floating_point()
            and launchable(positions, starts, source, source_positions))


def encode_runs(layouts: Sequence[wire.MessageLayout], headers: Sequence[Sequence[Any]], positions: torch.Tensor,
                starts: torch.Tensor, source: torch.Tensor, source_positions: torch.Tensor, bases: Sequence[int]
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the messages laid end to end, the values receivers will decode as float32 in
    ``positions``' order) where message j, of ``layouts[j]`` and header ``headers[j]`` but
    for its count word, holds run j: ``positions[starts[j]:starts[j + 1]]`` (ascending) less
    ``bases[j]``, and their values ``source[source_positions[starts[j]:starts[j + 1]]]``, as
    ``wire.encode_runs``' composition builds them (what :func:`encodes_runs` accepts). The
    runs' lengths stay on the device: one launch per message, no host wait."""
    device = positions.device
    message = torch.zeros(sum(layout.nbytes for layout in layouts), dtype=torch.uint8, device=device)
    decoded = torch.empty(positions.numel(), dtype=torch.float32, device=device)
    at = 0
    for j, (layout, header) in enumerate(zip(layouts, headers)):
        _launch(layout, header, message, at, decoded, positions if positions.numel() else message,
                source, layout.capacity,
                run=(starts, j, source_positions if positions.numel() else message, bases[j]))
        at += layout.nbytes
    return message, decoded


def _launch(layout: wire.MessageLayout, header: Sequence[Any], message: torch.Tensor, message_at: int,
            decoded: Optional[torch.Tensor], positions: torch.Tensor, values: torch.Tensor, count: int,
            run: Optional[Tuple[torch.Tensor, int, torch.Tensor, int]] = None) -> None:
    """One :func:`_encode` of ``layout``'s message at byte ``message_at`` of ``message``;
    ``run``: (starts, j, source positions, base) where the message holds run j less base
    (then ``count`` is the most it holds, ``values`` the source)."""
    row = plan_row(layout, 0, 0, 0)
    index_kind, low_bits, upper_bits, index_at, upper_at, value_at = (row[1], row[4], row[5], row[6], row[7],
                                                                      row[9])
    index_bytes = layout.part_spans[0][1]
    if index_kind == INDEX_KINDS["elias-fano"]:
        n_index = _programs(index_bytes) if low_bits else 0
    elif index_kind == INDEX_KINDS["bitmap"]:
        n_index, upper_at, upper_bits = 0, index_at, layout.numel
    else:
        n_index = _programs(count)
    n_marks = _programs(count) if index_kind >= INDEX_KINDS["elias-fano"] else 0
    tensor_word = next((i for i, word in enumerate(header) if isinstance(word, torch.Tensor)), -1)
    words = [0 if isinstance(word, torch.Tensor) else word for word in header]
    words += [0] * (HEADER_LANES - len(words))
    starts, j, sources, base = run if run is not None else (message, 0, message, 0)
    n_values = 0 if decoded is None else _programs(layout.capacity)
    _encode[(1 + n_index + n_marks + n_values,)](
        positions, values, message, message if decoded is None else decoded,
        header[tensor_word] if tensor_word >= 0 else message, starts, sources, *words, len(header),
        count, layout.capacity, low_bits, index_at, index_bytes, n_index, upper_at, upper_bits, n_marks, value_at,
        message_at, j, base,
        INDEX=index_kind, VALUE=VALUE_KINDS[layout.value_format], TENSOR_WORD=tensor_word, RUN=run is not None,
        # Only a run's count word is written here (its header table, made once per layout).
        COUNT_AT=wire.header_table((layout,), (0,)).count_at if run is not None else -1,
        FLOAT16_MAX=codecs.FORMAT_MAX["float16"],
        BLOCK=ENTRIES_PER_PROGRAM)


@dataclass(frozen=True)
class HeaderPlan:
    """What the kernels accept in each header of some messages, on one device."""

    bounds: torch.Tensor  # int32: every message's lowest header words, then its highest
    headers: wire.HeaderTable  # where each header lies, where its step, count and flags words are


def _header_plan(headers: wire.HeaderTable, device: torch.device) -> HeaderPlan:
    return HeaderPlan(bounds=torch.tensor(headers.low + headers.high, dtype=torch.int32, device=device),
                      headers=headers)


@functools.lru_cache(maxsize=wire.HEADER_TABLES_KEPT)
def header_plan(layout: wire.Layout, senders: Tuple[int, ...], device: torch.device) -> HeaderPlan:
    """The :class:`HeaderPlan` of one message of ``layout`` from each of ``senders``."""
    return _header_plan(wire.header_table((layout,), senders), device)


@dataclass(frozen=True)
class Plan:
    """Where :func:`decode_messages` finds each message of some senders for some layouts,
    and what it accepts in each header, on one device."""

    rows: torch.Tensor  # int64, plan_row per message in the order received
    header: HeaderPlan
    starts: Tuple[int, ...]  # where each layout's slots start among the decoded ones
    slots: int  # decoded slots of all messages


@functools.lru_cache(maxsize=wire.HEADER_TABLES_KEPT)
def plan(layouts: Tuple[wire.MessageLayout, ...], senders: Tuple[int, ...], device: torch.device) -> Plan:
    """The plan of the messages for ``layouts`` from each of ``senders``, sender after sender.
    The decoded slots go layout after layout, each sender's ``capacity`` in that order, so a
    layout's messages are one run of slots (what the sum scatters)."""
    headers = wire.header_table(layouts, senders)
    starts, at = [], 0
    for layout in layouts:
        starts.append(at)
        at += len(senders) * layout.capacity
    rows = []
    for m, offset in enumerate(headers.offsets):
        i, t = divmod(m, len(layouts))
        rows.append(plan_row(layouts[t], offset, m, starts[t] + i * layouts[t].capacity))
    return Plan(rows=torch.tensor(rows, dtype=torch.int64, device=device), header=_header_plan(headers, device),
                starts=tuple(starts), slots=at)


def decodes(data: torch.Tensor, layouts: Sequence[wire.MessageLayout], senders: int, step: Any,
            outs: Sequence[torch.Tensor] = ()) -> bool:
    """Whether :func:`decode_messages` takes these: ``senders`` messages for each of
    ``layouts`` of the size they expect, a step known on the host, float32 sums ``outs`` (if
    any: then messages with values) of the layouts' sizes, and tensors Triton may take."""
    return (data.dtype == torch.uint8 and isinstance(step, int)
            and all(isinstance(layout, wire.MessageLayout) for layout in layouts)
            and data.numel() == sum(layout.nbytes for layout in layouts) * senders
            and all(layout.value_format is not None for layout in layouts if outs)
            and all(out.dtype == torch.float32 and out.dim() == 1 and out.numel() == layout.numel
                    for out, layout in zip(outs, layouts))
            and launchable(data, *outs))


@dataclass(frozen=True)
class Decoded:
    """What :func:`decode_messages` made of the messages."""

    positions: List[torch.Tensor]  # per layout: every sender's capacity slots, sender after sender
    values: List[torch.Tensor]  # the same slots' values times the scale, float32 (0 for positions only)
    flags: torch.Tensor  # int32 flags word of each message, in the order received (0 for one that fails a check)
    counts: torch.Tensor  # int32 count word of each message (0 for a header that fails its check)
    fine: torch.Tensor  # 0-d bool: whether every message passed every check


def decode_messages(data: torch.Tensor, layouts: Sequence[wire.MessageLayout], senders: Tuple[int, ...],
                    step: int, scale: float = 1.0) -> Decoded:
    """Every header of ``data`` (the messages for ``layouts`` from each of ``senders``,
    sender after sender) checked, every message's positions and values decoded and checked,
    in one launch (what :func:`decodes` accepts). A message that fails a check decodes as
    zeros; ``fine`` says whether any did (:func:`explain` names it)."""
    table = plan(tuple(layouts), tuple(senders), data.device)
    n_messages = len(layouts) * len(senders)
    positions = torch.empty(table.slots, dtype=torch.int64, device=data.device)
    values = torch.empty(table.slots, dtype=torch.float32, device=data.device)
    flags, counts, failures = torch.empty(3, n_messages, dtype=torch.int32, device=data.device)
    header = table.header
    _decode[(n_messages,)](data, table.rows, header.bounds, positions, values, flags, counts, failures,
                           wire.step_word(step), len(header.bounds) // 2, scale,
                           COLUMNS=table.rows.shape[1], **_header_words(header.headers), STEP=BITS_PER_STEP)
    if len(layouts) == 1:
        per_layout = [(positions, values)]
    else:
        ends = table.starts[1:] + (table.slots,)
        per_layout = [(positions[a:b], values[a:b]) for a, b in zip(table.starts, ends)]
    return Decoded(positions=[p for p, _ in per_layout], values=[v for _, v in per_layout],
                   flags=flags, counts=counts, fine=(failures == 0).all())


def explain(host_ops: Callable[[], Any], layouts: Sequence[wire.MessageLayout], senders: Tuple[int, ...],
            data: List[int], step: int) -> None:
    """Raise the error the composition raises for these messages (``data``: their bytes, read
    back), on the ops ``host_ops()`` makes (the host's, whose checks raise at once): it names
    the sending rank, the tensor and what is wrong."""
    expected = [(layout, sender) for sender in senders for layout in layouts]
    wire.decode_composed(host_ops(), torch.tensor(data, dtype=torch.uint8), expected, step,
                         ["float32"] * len(expected))


def checks_headers(data: torch.Tensor, expected: Sequence[Tuple[Any, Any]], step: Any) -> bool:
    """Whether :func:`check_headers` takes these: messages of one layout, from senders and
    at a step known on the host, of the size they expect, and tensors Triton may take."""
    if not expected or not isinstance(step, int) or data.dtype != torch.uint8:
        return False
    layout = expected[0][0]
    return (all(other == layout and isinstance(sender, int) for other, sender in expected)
            and data.numel() == layout.nbytes * len(expected) and launchable(data))


def check_headers(data: torch.Tensor, layout: wire.Layout, senders: Tuple[int, ...],
                  step: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each message's flags word, each one's count word, whether every header passed) of
    ``data``, one message of ``layout`` from each of ``senders`` laid end to end, every header
    checked against ``wire.header_table``'s bounds and the step (what :func:`checks_headers`
    accepts): one launch. A message whose header fails a check has flags and count 0."""
    table = header_plan(layout, senders, data.device)
    flags = torch.empty(len(senders), dtype=torch.int32, device=data.device)
    counts = torch.empty(len(senders), dtype=torch.int32, device=data.device)
    failures = torch.zeros((), dtype=torch.int32, device=data.device)
    _check_headers[(len(senders),)](data, table.bounds, flags, counts, failures, wire.step_word(step),
                                    len(table.bounds) // 2, layout.nbytes, **_header_words(table.headers))
    return flags, counts, failures == 0
