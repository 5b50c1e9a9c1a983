"""The wire format: a checked header, then the method's parts, as bytes.

Layout of a sparse message for one tensor (native byte order, every part 8-byte aligned)::

    header   HEADER_WORDS int32 words (HEADER_FIELDS)
    indices  the positions, sorted, in the smallest index coding (``codecs.py``: raw,
             Elias-Fano or bitmap)
    values   the values in the same order: float32 | float16 | bfloat16 | int8 and a scale
    padding  zeros up to a multiple of 8 bytes, after each part

``capacity`` is fixed per tensor and density, so every rank sends the same number of bytes
for a tensor: Horovod's response cache keeps its fast path, and the receiver finds rank r's
message at ``r * nbytes``. Unused slots (``count < capacity``) decode as position 0, value 0.

:func:`receive` is the one way in for every family: it checks the size of what a collective
delivered and every header in it against what this rank expects, in one vectorised
comparison, and raises :class:`MessageError` naming the sending rank and the tensor on any
difference (adapters never read or write header words). An adapter's kernels
(``TensorOps.check_headers``, ``decode_received``) check the same bounds, from
:func:`header_table`, and leave a message they refuse to :func:`receive`'s explanation,
which names the difference. :func:`encode_set` frames several messages of one layout in
one gather, from a table (:func:`set_table`) made once per bucket.
"""
from __future__ import annotations

import functools
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, TypeVar

from . import codecs
from .ops import Scalar, Tensor, TensorOps

MAGIC = 0x44474332  # "DGC" and format version 2 (coded indices and values)
HEADER_FIELDS = ("magic", "method", "tensor id", "numel (low)", "numel (high)", "capacity",
                 "count", "value format", "index format", "sender rank", "step", "flags")
HEADER_WORDS = len(HEADER_FIELDS)
HEADER_BYTES = HEADER_WORDS * 4
FLAGS_WORD = HEADER_FIELDS.index("flags")
COUNT_WORD = HEADER_FIELDS.index("count")
STEP_WORD = HEADER_FIELDS.index("step")
ALIGN_BYTES = codecs.ALIGN_BYTES
# Each method id's name, for errors: the method table (methods.py) registers them.
METHOD_NAMES: Dict[int, str] = {}
# Each tensor id's name, for errors about a message whose tensor is known only at run time
# (one trace serving several tensors): the adapters that trace so register them.
TENSOR_NAMES: Dict[int, str] = {}

DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3, "int32": 4, "int64": 5, "uint8": 6,
               "int8": 7}
DTYPE_BYTES = codecs.DTYPE_BYTES
FLAG_NONFINITE = 1  # the sender's gradient was not finite: it sent nothing, kept its memory
VALUE_FORMATS = ("float32", "float16", "int8")

_INT31 = 2 ** 31


class MessageError(RuntimeError):
    """A received message does not match what this rank expects."""


def tensor_id(name: str) -> int:
    """A stable 32-bit identity of a tensor name, as a signed int32."""
    value = zlib.crc32(name.encode("utf-8"))
    return value - 2 ** 32 if value >= _INT31 else value


def register_names(names: Iterable[str]) -> None:
    """Make each of ``names`` known by its tensor id (:data:`TENSOR_NAMES`)."""
    TENSOR_NAMES.update((tensor_id(name), name) for name in names)


def name_of(word: int) -> str:
    """The registered name of the tensor whose id is ``word`` (a header's tensor id word)."""
    return TENSOR_NAMES.get(int(word), f"<id {int(word)}>")


def step_word(step: Any) -> Any:
    """The header's step word of a message sent at ``step`` (a Python int or a 0-d integer
    tensor): the step modulo 2**31, so a long run never overflows the int32 word."""
    return step % _INT31


def value_format(grad_dtype: str, configured: str) -> str:
    """The format values travel in: the configured one (``VALUE_FORMATS``), except that a
    16-bit setting keeps a bfloat16 gradient's own 16-bit format (no loss)."""
    if configured == "float16" and grad_dtype == "bfloat16":
        return "bfloat16"
    return configured


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

    # The two below are cached: a decode reads them for every message of every tensor.
    @functools.cached_property
    def part_spans(self) -> Tuple[Tuple[int, int], ...]:
        """(byte offset in the message, bytes of entries) of each part."""
        spans, offset = [], HEADER_BYTES
        for i, (dtype, count) in enumerate(self.parts):
            spans.append((offset, count * DTYPE_BYTES[dtype]))
            offset += self.part_bytes(i)
        return tuple(spans)

    @functools.cached_property
    def nbytes(self) -> int:
        """Size of the whole message in bytes."""
        return HEADER_BYTES + sum(self.part_bytes(i) for i in range(len(self.parts)))

    @property
    def format_codes(self) -> Tuple[int, int]:
        """(value format, index format) codes of the header: the first two parts' dtypes."""
        codes = [DTYPE_CODES[dtype] for dtype, _ in self.parts] + [0, 0]
        return codes[1], codes[0]

    @functools.cached_property
    def _fixed_words(self) -> Tuple[Tuple[int, int], int, Tuple[int, ...], Tuple[int, int]]:
        """The header words that only depend on the layout: (magic, method), the tensor id
        of its name, (numel, capacity), the formats."""
        return ((MAGIC, self.method_id), tensor_id(self.name),
                (self.numel % _INT31, self.numel // _INT31, self.capacity), self.format_codes)

    def header(self, rank: Any, step: Any, count: Any, flags: Any, traced_id: Any = None) -> List[Any]:
        """The header words of a message from ``rank`` at ``step`` (Python ints or 0-d
        integer tensors, so a graph can write run-time values). ``traced_id``: the tensor id
        word, where one trace serves several tensors of this layout's size (a run-time
        value); None: the id of the layout's name."""
        kind, identity, size, formats = self._fixed_words
        return [*kind, identity if traced_id is None else traced_id, *size, count, *formats, rank,
                step_word(step), flags]

    def bounds(self, rank: Any, step: Any, traced_id: Any = None) -> Tuple[List[Any], List[Any]]:
        """(lowest, highest) accepted value of each header word of a message from ``rank``
        at ``step``: every word is fixed but the count (0 to capacity) and the flags."""
        low = self.header(rank, step, 0, 0, traced_id)
        high = self.header(rank, step, self.capacity, FLAG_NONFINITE, traced_id)
        return low, high

    def diagnose(self, words: Sequence[int], rank: int, step: int, traced_id: Optional[int] = None) -> None:
        """Raise MessageError, naming the field, unless ``words`` is a valid header from
        ``rank`` for this tensor (``traced_id``: its id, given at run time) at ``step``."""
        if len(words) != HEADER_WORDS:
            self._fail(rank, f"header has {len(words)} words, expected {HEADER_WORDS}", traced_id)
        low, high = self.bounds(rank, step, traced_id)
        for field, got, least, most in zip(HEADER_FIELDS, words, low, high):
            if not least <= got <= most:
                wanted = least if least == most else f"{least} to {most}"
                if field == "method":  # another method on that rank: say which
                    got, wanted = (f"{i} ({METHOD_NAMES.get(i, 'none')})" for i in (got, wanted))
                elif field == "tensor id" and got in TENSOR_NAMES:  # another tensor's message
                    got = f"{got} ({TENSOR_NAMES[got]!r})"
                self._fail(rank, f"{field} is {got}, expected {wanted}", traced_id)

    def named(self, traced_id: Optional[int] = None) -> str:
        """The name of this layout's tensor, or of the tensor whose id is ``traced_id``."""
        return self.name if traced_id is None else name_of(traced_id)

    def _fail(self, rank: int, detail: str, traced_id: Optional[int] = None) -> None:
        raise MessageError(f"rank {rank} sent a malformed message for tensor "
                           f"{self.named(traced_id)!r}: {detail}")


@dataclass(frozen=True)
class MessageLayout(Layout):
    """A sparse message: ``capacity`` positions in the smallest index coding, then (unless
    ``value_format`` is None: a message of positions only) ``capacity`` values."""

    value_format: Optional[str] = "float32"

    @functools.cached_property
    def indices(self) -> codecs.IndexCoding:
        return codecs.index_coding(self.numel, self.capacity)

    @functools.cached_property
    def values(self) -> Optional[codecs.ValueCoding]:
        return None if self.value_format is None else codecs.value_coding(self.value_format,
                                                                           self.capacity)

    @functools.cached_property
    def parts(self) -> Tuple[Tuple[str, int], ...]:
        return self.indices.parts + (self.values.parts if self.values else ())

    @property
    def format_codes(self) -> Tuple[int, int]:
        value_code = 0 if self.value_format is None else DTYPE_CODES[self.value_format]
        return value_code, self.indices.code

    def encode(self, ops: TensorOps, header: List[Any], positions: Tensor, count: Any,
               values: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """(the message, the values receivers will decode as float32) for ``count`` sorted
        ``positions`` and their ``values``."""
        coded = ops.encode_message(self, header, positions, count, values)
        if coded is not None:
            return coded
        parts = self.indices.encode(ops, positions, count)
        decoded = None
        if self.values is not None:
            value_parts, decoded = self.values.encode(ops, values)
            parts += value_parts
        return encode_parts(ops, self, header, parts), decoded

    def empty(self, ops: TensorOps, header: List[Any], like: Tensor) -> Tensor:
        """A message with no entries (a flagged sender's)."""
        parts = [ops.zeros(count, dtype, like=like) for dtype, count in self.parts]
        return encode_parts(ops, self, header, parts)

    def decode(self, ops: TensorOps, parts: Sequence[Tensor], count: Any,
               dtype: str) -> Tuple[Tensor, Optional[Tensor], Any]:
        """(``capacity`` positions, their values in ``dtype`` or None, whether the positions
        agree with ``count`` and the tensor's size). The slots past ``count`` are padding,
        position 0 (every index coding's decode) and value 0, whatever their bytes hold, so
        that they add nothing."""
        n = len(self.indices.parts)
        positions, consistent = self.indices.decode(ops, parts[:n], count)
        if self.values is None:
            return positions, None, consistent
        values = self.values.decode(ops, parts[n:], dtype)
        padding = codecs.past_count(ops, self.capacity, count, positions)
        return positions, ops.where(padding, 0.0, values), consistent

    def decode_rows(self, ops: TensorOps, parts: Sequence[Tensor], counts: Tensor, dtype: str
                    ) -> Tuple[Tensor, Tensor, Scalar, Optional[Tensor]]:
        """:meth:`decode` of ``len(counts)`` messages at once (each part: every message's
        entries, one message after another): (positions and values, ``capacity`` of each
        message laid end to end; whether all agree with their counts and the tensor's size;
        each message's set bits where the coding counts them, else None)."""
        n = len(self.indices.parts)
        padding = ops.past_counts(self.capacity, counts, parts[0])
        positions, consistent, found = self.indices.decode_rows(ops, parts[:n], counts, padding)
        values = self.values.decode_rows(ops, parts[n:], ops.numel(counts), dtype)
        return positions, ops.where(padding, 0.0, values), consistent, found


@dataclass(frozen=True)
class PartsLayout(Layout):
    """A message of explicitly listed parts (packed signs and scales, index lists)."""

    part_list: Tuple[Tuple[str, int], ...] = ()

    @property
    def parts(self) -> Tuple[Tuple[str, int], ...]:
        return self.part_list


def encode_parts(ops: TensorOps, layout: Layout, header: List[Any], parts: Sequence[Tensor]) -> Tensor:
    """The message bytes; each part already holds its count of entries in its dtype."""
    for (dtype, _), part in zip(layout.parts, parts):
        if ops.dtype(part) != dtype:  # its bytes would be cut or padded into another dtype's
            raise TypeError(f"{layout.name!r}: a {ops.dtype(part)} part where the layout "
                            f"holds {dtype}")
    encoded = [ops.to_bytes(ops.constant(header, "int32", like=parts[0]))]
    encoded += [ops.pad(ops.to_bytes(part), layout.part_bytes(i)) for i, part in enumerate(parts)]
    return ops.concat(encoded)


# Zero words after a message set's headers: the bytes a set's table reads for padding.
ZERO_WORDS = 2


def encode_set(ops: TensorOps, layout: Layout, headers: Sequence[Sequence[Any]], sources: Sequence[Tensor],
               table: Tensor) -> Tensor:
    """``len(headers)`` messages of ``layout`` laid end to end, in one gather: message m's
    header is ``headers[m]``, its parts the entries of ``sources`` (one per part, in the
    part's dtype) that :func:`set_table` picked for it."""
    for (dtype, _), source in zip(layout.parts, sources):
        if ops.dtype(source) != dtype:  # its bytes would be read as another dtype's
            raise TypeError(f"{layout.name!r}: a {ops.dtype(source)} part where the layout holds {dtype}")
    words = ops.constant([word for header in headers for word in header] + [0] * ZERO_WORDS, "int32",
                         like=sources[0])
    return ops.gather(ops.concat([ops.to_bytes(words)] + [ops.to_bytes(source) for source in sources]), table)


def set_table(layout: Layout, picks: Sequence[Sequence[Sequence[int]]], source_sizes: Sequence[int]) -> List[int]:
    """The byte table of :func:`encode_set` for ``len(picks)`` messages: message m's part i
    holds the entries ``picks[m][i]`` of source i (``source_sizes[i]`` entries in the part's
    dtype), then zeros up to the part's room."""
    zero = len(picks) * HEADER_BYTES  # the first byte of the zero words
    bases, at = [], zero + ZERO_WORDS * 4
    for (dtype, _), size in zip(layout.parts, source_sizes):
        bases.append(at)
        at += size * DTYPE_BYTES[dtype]
    table: List[int] = []
    for m, per_part in enumerate(picks):
        table += range(m * HEADER_BYTES, (m + 1) * HEADER_BYTES)
        for i, ((dtype, _), entries, base) in enumerate(zip(layout.parts, per_part, bases)):
            width = DTYPE_BYTES[dtype]
            if width == 1:
                table += [base + e for e in entries]
            else:
                table += [base + e * width + b for e in entries for b in range(width)]
            table += [zero] * (layout.part_bytes(i) - len(entries) * width)
    return table


def part_at(layout: Layout, message: int, part: int) -> int:
    """Where part ``part`` of message ``message`` begins among messages of ``layout`` laid
    end to end, in bytes."""
    return message * layout.nbytes + layout.part_spans[part][0]


def encode_runs(ops: TensorOps, layouts: Sequence[MessageLayout], headers: Sequence[Sequence[Any]],
                positions: Tensor, starts: Tensor, source: Tensor, source_positions: Tensor,
                bases: Sequence[int]) -> Tuple[Tensor, Tensor]:
    """(the messages laid end to end, the values receivers will decode as float32 in
    ``positions``' order) where message j, of ``layouts[j]`` with ``headers[j]`` but for its
    count word (the run's length), holds run j: ``positions[starts[j]:starts[j + 1]]``
    (ascending) less ``bases[j]``, and their values
    ``source[source_positions[starts[j]:starts[j + 1]]]``."""
    coded = ops.encode_runs(layouts, headers, positions, starts, source, source_positions, bases)
    if coded is not None:
        return coded
    messages, decoded = [], []
    for j, (layout, header) in enumerate(zip(layouts, headers)):
        start = ops.gather(starts, j)
        length = ops.gather(starts, j + 1) - start
        header = [length if w == COUNT_WORD else word for w, word in enumerate(header)]
        run = ops.slice(positions, start, length)
        message, values = layout.encode(ops, header, ops.add(run, -bases[j]) if bases[j] else run, length,
                                        ops.gather(source, ops.slice(source_positions, start, length)))
        messages.append(message)
        decoded.append(ops.slice(values, 0, length))
    return ops.concat(messages), ops.concat(decoded)


def parts_of(ops: TensorOps, message: Tensor, layout: Layout) -> List[Tensor]:
    """The parts of one message (its header is not read)."""
    return [ops.from_bytes(ops.slice(message, offset, nbytes), dtype)
            for (dtype, _), (offset, nbytes) in zip(layout.parts, layout.part_spans)]


Expected = Tuple[Layout, Any]  # a message's layout and its sender's rank (int or 0-d tensor)

# Layouts a process keeps at once: every tensor's at the current density (and a few warm-up
# densities' worth), with room for large models.
INTERNED_LAYOUTS = 65536
L = TypeVar("L", bound=Layout)


@functools.lru_cache(maxsize=INTERNED_LAYOUTS)
def interned(layout: L) -> L:
    """The one instance equal to ``layout``, so that its cached sizes, part offsets and
    header words are worked out once per tensor and density, not once per message (a method
    builds its layouts afresh at every compress and decode)."""
    return layout


@dataclass(frozen=True)
class Received:
    """What :func:`receive` found: the messages' bytes once checked (zeros in place of bytes
    that failed a check whose error waits, as ``TensorOps.verify`` hands them on), what each
    was expected to be, and each message's flags word (nonzero: the sender's gradient was
    not finite) and count word."""

    data: Tensor
    expected: Sequence[Expected]
    flags: Tensor
    counts: Tensor

    def parts(self, ops: TensorOps) -> List[List[Tensor]]:
        """Each message's parts, as views where the bytes allow."""
        return [parts_of(ops, ops.slice(self.data, offset, layout.nbytes), layout)
                for offset, (layout, _) in zip(_offsets(self.expected), self.expected)]


def receive(ops: TensorOps, data: Tensor, expected: Sequence[Expected], step: Any,
            receiver: Any = None, traced_id: Any = None) -> Received:
    """The checked bytes, flags and counts of the messages in ``data``, the concatenation of
    one message per entry of ``expected``, after checking the total size and every header at
    once (one comparison; ``step`` may be a run-time tensor). On any difference
    :class:`MessageError` names the first sending rank and tensor that differ, or the
    receiving rank ``receiver`` when only the size differs. ``traced_id``: the tensor id word
    every message carries, where one trace serves several tensors (``Layout.header``); None:
    each layout's own."""
    total = sum(layout.nbytes for layout, _ in expected)
    size_ok = ops.size(data) == total
    fitted = ops.fit(data, total)
    checked = None if traced_id is not None else ops.check_headers(fitted, expected, step)
    if checked is None:
        headers = _headers(ops, fitted, expected)
        low, high = _bounds(expected, step, traced_id)
        valid = ops.all_within(headers, ops.constant(low, "int32", like=headers),
                               ops.constant(high, "int32", like=headers))
        flags = ops.strided_sample(headers, FLAGS_WORD, HEADER_WORDS)
        counts = ops.strided_sample(headers, COUNT_WORD, HEADER_WORDS)
    else:
        flags, counts, valid = checked
    senders = [sender for _, sender in expected]
    # Senders known only at run time (a traced rank) are read with the data if a check fails.
    traced = [] if all(isinstance(sender, int) for sender in senders) else [
        ops.constant(senders, "int64", like=flags)]

    def explain(values: Sequence[int], *rest: Any) -> None:
        ranks, (at, *word) = (rest[0], rest[1:]) if traced else (senders, rest)
        _diagnose(values, ranks, at, expected, total, receiver, *word)

    fitted = ops.verify(ops.where(size_ok, valid, False), [data, *traced, step, *id_inputs(traced_id)], explain,
                        fitted)
    return Received(fitted, expected, flags, counts)


def _headers(ops: TensorOps, data: Tensor, expected: Sequence[Expected]) -> Tensor:
    """Every header's words, message after message."""
    layouts = {layout for layout, _ in expected}
    if len(layouts) == 1:  # messages of one size: the headers are rows of the data
        return ops.from_bytes(ops.rows(data, 0, layouts.pop().nbytes, HEADER_BYTES, len(expected)), "int32")
    return ops.from_bytes(ops.concat([ops.slice(data, offset, HEADER_BYTES) for offset in _offsets(expected)]),
                          "int32")


@dataclass(frozen=True)
class HeaderTable:
    """Every header of some senders' messages for some layouts (each sender's messages in
    layout order, sender after sender: an allgather's, or one broadcast message), for a
    kernel that checks them all in one loop: message m's header starts at ``offsets[m]``,
    and its word w must lie in ``[low[m * words + w], high[m * words + w]]``, except the step
    word, which must equal :func:`step_word` of the decoding step (``low`` and ``high`` hold 0
    there)."""

    low: Tuple[int, ...]
    high: Tuple[int, ...]
    offsets: Tuple[int, ...]
    total_bytes: int
    words: int = HEADER_WORDS  # per header
    step_at: int = STEP_WORD  # which word of a header is the step, the count, the flags
    count_at: int = COUNT_WORD
    flags_at: int = FLAGS_WORD


# Header tables a process keeps at once: one per tensor on the stock path, one per bucket on the
# fused one, for every tensor of large models and a few warm-up densities.
HEADER_TABLES_KEPT = 8192


@functools.lru_cache(maxsize=HEADER_TABLES_KEPT)
def header_table(layouts: Tuple[Layout, ...], senders: Tuple[int, ...]) -> HeaderTable:
    """The :class:`HeaderTable` of messages for ``layouts`` from each of ``senders``."""
    expected = [(layout, sender) for sender in senders for layout in layouts]
    low, high = _bounds(expected, 0)
    return HeaderTable(low=tuple(low), high=tuple(high), offsets=tuple(_offsets(expected)),
                       total_bytes=sum(layout.nbytes for layout, _ in expected))


def id_inputs(traced_id: Any) -> List[Any]:
    """The run-time inputs an explanation takes for a tensor id word given at run time."""
    return [] if traced_id is None else [traced_id]


def _bounds(expected: Sequence[Expected], step: Any, traced_id: Any = None) -> Tuple[List[Any], List[Any]]:
    """Every expected message's lowest accepted header words, one after another; then its
    highest (``Layout.bounds``)."""
    low: List[Any] = []
    high: List[Any] = []
    for layout, sender in expected:
        least, most = layout.bounds(sender, step, traced_id)
        low += least
        high += most
    return low, high


def _offsets(expected: Sequence[Expected]) -> List[int]:
    offsets, offset = [], 0
    for layout, _ in expected:
        offsets.append(offset)
        offset += layout.nbytes
    return offsets


def _diagnose(data: Sequence[int], senders: Sequence[int], step: int,
              expected: Sequence[Expected], total: int, receiver: Any,
              traced_id: Optional[int] = None) -> None:
    """Raise MessageError for the first message whose header is wrong, read where it should
    be (with the size difference, if any, as context)."""
    names = ", ".join(repr(name) for name in sorted({layout.named(traced_id) for layout, _ in expected}))
    where = "" if receiver is None else f" on rank {receiver}"
    size_note = "" if len(data) == total else (
        f"; received {len(data)} bytes for tensor(s) {names}{where}, expected {total} (a "
        f"different density or tensor set on some rank?)")
    raw = bytes(int(b) & 0xFF for b in data)
    for offset, (layout, _), sender in zip(_offsets(expected), expected, senders):
        if offset + HEADER_BYTES > len(raw):
            break
        words = list(struct.unpack(f"={HEADER_WORDS}i", raw[offset:offset + HEADER_BYTES]))
        try:
            layout.diagnose(words, int(sender), int(step), traced_id)
        except MessageError as error:
            raise MessageError(f"{error}{size_note}") from None
    raise MessageError(f"the messages are malformed{size_note or f' for tensor(s) {names}{where}'}")


# What a receiver says of a message whose positions its header or its tensor contradicts.
BAD_POSITIONS = "its positions disagree with its count or lie outside the tensor (a corrupted message?)"


def checked_positions(ops: TensorOps, decoded: Sequence[Tuple[Tensor, Any]],
                      expected: Sequence[Expected], step: Any, traced_id: Any = None) -> List[Tensor]:
    """The positions of every message, once every message's positions are known to agree
    with its count and to lie inside its tensor (``decoded``: (positions, whether they do)
    per message of ``expected``); else MessageError names the first sender that differs.
    ``traced_id``: as :func:`receive`'s."""
    all_positions = ops.concat([positions for positions, _ in decoded])
    verdicts = ops.constant([ops.where(ok, 1, 0) for _, ok in decoded], "int32", like=all_positions)
    senders = ops.constant([sender for _, sender in expected], "int64", like=all_positions)

    def explain(values: List[int], ranks: List[int], at: int, *word: int) -> None:
        for ok, (layout, _), rank in zip(values, expected, ranks):
            if not ok:
                layout._fail(rank, BAD_POSITIONS, *word)

    all_positions = ops.verify(ops.all_within(verdicts, 1, 1), [verdicts, senders, step, *id_inputs(traced_id)],
                               explain, all_positions)
    out, offset = [], 0
    for positions, _ in decoded:
        out.append(ops.slice(all_positions, offset, ops.numel(positions)))
        offset += ops.numel(positions)
    return out


def decode_senders(ops: TensorOps, data: Tensor, layouts: Sequence[MessageLayout], senders: int,
                   step: Any, dtypes: Sequence[str], receiver: Any = None, traced_id: Any = None
                   ) -> Tuple[Tensor, List[Tuple[Tensor, Tensor]]]:
    """:func:`decode_received` of ``data``, the messages of ``senders`` ranks for ``layouts``
    (each rank's in layout order, rank after rank), decoded a layout at a time for all ranks
    at once, so that the operations do not grow with the number of ranks: (each message's
    flags word, rank after rank as :func:`receive` gives them; per layout, the positions and
    values in ``dtypes[t]`` of every rank's message, ``capacity`` of each laid end to end,
    padding 0). Checks and errors as :func:`receive` and :func:`checked_positions` raise them."""
    expected = [(layout, sender) for sender in range(senders) for layout in layouts]
    per_sender = sum(layout.nbytes for layout in layouts)
    total = per_sender * senders
    offsets = _offsets([(layout, 0) for layout in layouts])
    fitted = ops.fit(data, total)
    headers = [ops.from_bytes(ops.rows(fitted, offset, per_sender, HEADER_BYTES, senders), "int32")
               for offset in offsets]
    by_layout = [(layout, sender) for layout in layouts for sender in range(senders)]
    low, high = _bounds(by_layout, step, traced_id)
    every = ops.concat(headers)
    valid = ops.all_within(every, ops.constant(low, "int32", like=every), ops.constant(high, "int32", like=every))
    ranks = ops.constant([sender for _, sender in expected], "int64", like=every)
    fitted = ops.verify(ops.where(ops.size(data) == total, valid, False),
                        [data, ranks, step, *id_inputs(traced_id)],
                        lambda values, at_ranks, at, *word: _diagnose(values, at_ranks, at, expected, total,
                                                                      receiver, *word),
                        fitted)
    flags = ops.strided_sample(every, FLAGS_WORD, HEADER_WORDS)
    if len(layouts) > 1:  # layout after layout here; rank after rank, as receive's
        flags = ops.gather(flags, ops.constant([t * senders + r for r in range(senders)
                                                for t in range(len(layouts))], "int64", like=every))
    decoded, evidence = [], []
    for layout, offset, words, dtype in zip(layouts, offsets, headers, dtypes):
        counts = ops.strided_sample(words, COUNT_WORD, HEADER_WORDS)
        parts = [ops.from_bytes(ops.rows(fitted, offset + start, per_sender, nbytes, senders), part_dtype)
                 for (part_dtype, _), (start, nbytes) in zip(layout.parts, layout.part_spans)]
        positions, values, consistent, found = layout.decode_rows(ops, parts, counts, dtype)
        decoded.append((positions, values))
        checked = layout.indices.checked_slots(ops, parts[:len(layout.indices.parts)], positions)
        evidence.append((consistent, [checked, counts] + ([] if found is None else [found])))
    verdicts = ops.constant([ops.where(ok, 1, 0) for ok, _ in evidence], "int32", like=every)

    def explain(step_at: int, *values: Any) -> None:
        word, values = values[:len(id_inputs(traced_id))], values[len(id_inputs(traced_id)):]
        for layout, (_, shown) in zip(layouts, evidence):
            found_words, values = values[:len(shown)], values[len(shown):]
            positions, counts, found = (list(found_words) + [None])[:3]
            for sender in range(senders):
                slots = positions[sender * layout.capacity:(sender + 1) * layout.capacity]
                if (found is not None and found[sender] != counts[sender]) or \
                        not all(0 <= p < layout.numel for p in slots):
                    layout._fail(sender, BAD_POSITIONS, *word)

    shown = [x for _, inputs in evidence for x in inputs]
    checked = ops.verify(ops.all_within(verdicts, 1, 1), [step, *id_inputs(traced_id), *shown], explain,
                         ops.concat([positions for positions, _ in decoded]))
    out, start = [], 0
    for (positions, values) in decoded:
        out.append((ops.slice(checked, start, ops.numel(positions)), values))
        start += ops.numel(positions)
    return flags, out


def decode_received(ops: TensorOps, data: Tensor, expected: Sequence[Expected], step: Any,
                    dtypes: Sequence[str], receiver: Any = None, traced_id: Any = None
                    ) -> Tuple[Tensor, List[Tuple[Tensor, Optional[Tensor], Any]]]:
    """(each message's flags word, each message's (positions, values as ``dtypes[m]``,
    count)) of ``data``, the concatenation of one message per entry of ``expected``: every
    header checked (:func:`receive`), every message decoded, its positions checked
    (:func:`checked_positions`): by the adapter's kernel (``TensorOps.decode_received``)
    where it takes them, else :func:`decode_composed`. ``traced_id``: as :func:`receive`'s."""
    decoded = _by_kernel(ops, data, expected, step, dtypes, traced_id)
    if decoded is None:
        return decode_composed(ops, data, expected, step, dtypes, receiver, traced_id)
    flags, positions, values, counts = decoded
    if len(expected) == 1:
        return flags, [(positions, values, ops.gather(counts, 0))]
    out, start = [], 0
    for m, (layout, _) in enumerate(expected):
        out.append((ops.slice(positions, start, layout.capacity),
                    None if values is None else ops.slice(values, start, layout.capacity), ops.gather(counts, m)))
        start += layout.capacity
    return flags, out


def decode_end_to_end(ops: TensorOps, data: Tensor, expected: Sequence[Expected], step: Any, dtype: str,
                      receiver: Any = None, traced_id: Any = None) -> Tuple[Tensor, Tensor, Tensor]:
    """(each message's flags word; every message's ``capacity`` positions and values as
    ``dtype``, 0 past its count, message after message) of ``data``: :func:`decode_received`
    of messages with values, for a caller that sums them all at once."""
    decoded = _by_kernel(ops, data, expected, step, [dtype] * len(expected), traced_id)
    if decoded is not None:
        return decoded[:3]
    flags, messages = decode_composed(ops, data, expected, step, [dtype] * len(expected), receiver, traced_id)
    return flags, ops.concat([positions for positions, _, _ in messages]), ops.concat([v for _, v, _ in messages])


def _by_kernel(ops: TensorOps, data: Tensor, expected: Sequence[Expected], step: Any, dtypes: Sequence[str],
               traced_id: Any) -> Optional[Tuple[Tensor, Tensor, Optional[Tensor], Tensor]]:
    """``TensorOps.decode_received`` of these messages, unless their tensor id word is given
    at run time (the kernel checks each layout's own)."""
    return None if traced_id is not None else ops.decode_received(data, expected, step, dtypes)


def decode_composed(ops: TensorOps, data: Tensor, expected: Sequence[Expected], step: Any,
                    dtypes: Sequence[str], receiver: Any = None, traced_id: Any = None
                    ) -> Tuple[Tensor, List[Tuple[Tensor, Optional[Tensor], Any]]]:
    """:func:`decode_received` composed: what a kernel's decode (``TensorOps.decode_sums``,
    ``decode_positions``, ``decode_received``) does in one call, and what names the problem
    when a kernel's check fails."""
    received = receive(ops, data, expected, step, receiver, traced_id)
    counts = [ops.gather(received.counts, m) for m in range(len(expected))]
    decoded = [layout.decode(ops, parts, count, dtype) for (layout, _), parts, count, dtype
               in zip(expected, received.parts(ops), counts, dtypes)]
    positions = checked_positions(ops, [(where, ok) for where, _, ok in decoded], expected, step, traced_id)
    return received.flags, [(where, values, count) for where, (_, values, _), count
                            in zip(positions, decoded, counts)]
