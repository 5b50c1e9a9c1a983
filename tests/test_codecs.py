"""The coded message formats against a naive coder written here (Python ints and bytes, the
format's definition), and fuzz tests of the decoders (one message; gathers of 2 ranks' messages
in every value format; ScaleCom's leader positions; the C kernels and the core's composition):
random and mutated messages end in a clean MessageError or decode to exactly what the naive
reader (``naive_read_message``) reads from them."""
import math
import random
import struct
import zlib
from typing import Sequence, Tuple

import pytest
import torch

from horovod_dgc.core import MessageError, TopK, TopKConfig
from horovod_dgc.core.blocksign import BlockSign, BlockSignConfig
from horovod_dgc.core.scalecom import ScaleCom, ScaleComConfig, leader_positions
from horovod_dgc.core.codecs import Bitmap, EliasFano, RawIndices, index_coding, value_coding
from horovod_dgc.core.method import CompressCall
from horovod_dgc.core.ops import TensorOps
from horovod_dgc.core.selection import top_count
from horovod_dgc.core.wire import (COUNT_WORD, HEADER_BYTES, HEADER_FIELDS, HEADER_WORDS, MessageLayout,
                                   PartsLayout, encode_parts, encode_set, part_at, receive, set_table)
from horovod_dgc.torch.ops import TorchOps

from conftest import randn

ops = TorchOps()


def naive_elias_fano(positions, n, capacity):
    """The two parts as bytes, from the definition: l low bits each (LSB first), then a
    bitvector where the i-th position sets bit (position >> l) + i."""
    l = max(0, int(math.floor(math.log2(n / capacity)))) if capacity < n else 0
    low_bits = []
    for p in list(positions) + [0] * (capacity - len(positions)):
        low_bits += [(p >> b) & 1 for b in range(l)]
    upper = [0] * (capacity + (n >> l) + 1)
    for i, p in enumerate(positions):
        upper[(p >> l) + i] = 1
    return bits_to_bytes(low_bits), bits_to_bytes(upper)


def bits_to_bytes(bits):
    bits = bits + [0] * (-len(bits) % 8)
    return bytes(sum(bits[i + j] << j for j in range(8)) for i in range(0, len(bits), 8))


def bytes_to_bits(data):
    return [(byte >> j) & 1 for byte in data for j in range(8)]


def naive_decode_elias_fano(lower, upper, n, capacity, count):
    l = max(0, int(math.floor(math.log2(n / capacity)))) if capacity < n else 0
    ones = [i for i, bit in enumerate(bytes_to_bits(upper)[:capacity + (n >> l) + 1]) if bit]
    if len(ones) != count:
        return None
    low_bits = bytes_to_bits(lower)
    lows = [sum(low_bits[i * l + b] << b for b in range(l)) for i in range(count)]
    positions = [((one - i) << l) | low for i, (one, low) in enumerate(zip(ones, lows))]
    return positions if all(0 <= p < n for p in positions) else None


@pytest.mark.parametrize("n,capacity,count", [(1_000_000, 1000, 1000), (4096, 41, 30), (100, 100, 60),
                                               (5000, 1, 1), (1 << 20, 1 << 18, 1 << 18)])
def test_elias_fano_matches_the_definition_both_ways(n, capacity, count, device, choices):
    positions = sorted(random.Random(n).sample(range(n), count))
    coding = EliasFano(n, capacity)
    lower, upper = coding.encode(ops, torch.tensor(positions, device=device), count)
    expected_lower, expected_upper = naive_elias_fano(positions, n, capacity)
    assert bytes(lower.tolist()) == expected_lower and bytes(upper.tolist()) == expected_upper
    decoded, consistent = coding.decode(ops, [lower, upper], torch.tensor(count, device=device))
    assert bool(consistent)
    assert decoded.tolist() == positions + [0] * (capacity - count)


def test_bitmap_and_raw_round_trip_and_refuse_an_inconsistent_count(device, choices):
    n, positions = 1000, sorted(random.Random(1).sample(range(1000), 300))
    for coding in (Bitmap(n, 400), RawIndices(n, 400)):
        parts = coding.encode(ops, torch.tensor(positions, device=device), len(positions))
        decoded, consistent = coding.decode(ops, parts, torch.tensor(len(positions), device=device))
        assert bool(consistent) and decoded.tolist()[:300] == positions, coding.name
    parts = Bitmap(n, 400).encode(ops, torch.tensor(positions, device=device), len(positions))
    assert bytes(parts[0].tolist()) == bits_to_bytes([int(i in set(positions)) for i in range(n)])
    assert not bool(Bitmap(n, 400).decode(ops, parts, torch.tensor(299, device=device))[1])


def test_the_smallest_coding_is_chosen_and_density_0_001_costs_12_bits_a_position():
    assert index_coding(25_000_000, 25_000).name == "elias-fano"
    bits = 8 * sum(count for _, count in EliasFano(25_000_000, 25_000).parts) / 25_000
    assert 11 <= bits <= 13, bits
    assert index_coding(1000, 250).name in ("bitmap", "elias-fano")
    assert index_coding(1000, 600).name == "bitmap"
    assert index_coding(64, 1).name == "raw"


def test_int8_values_are_levels_of_max_over_127_and_16_bit_values_are_clamped(device):
    values = torch.tensor([0.5, -1.27, 0.0031, 1.0, -0.4], device=device)
    (levels, scale), decoded = value_coding("int8", 8).encode(ops, values)
    s = 1.27 / 127
    assert float(scale) == pytest.approx(s)
    expected = [round(v / s) for v in values.tolist()] + [0, 0, 0]
    assert levels.tolist() == expected
    assert decoded.tolist() == pytest.approx([q * s for q in expected], rel=1e-6)
    (_,), decoded = value_coding("float16", 2).encode(ops, torch.tensor([1e6, -7.0], device=device))
    assert decoded.tolist() == [65504.0, -7.0]


VALUE_CODES = {"float32": "f", "float16": "e", "bfloat16": "H", "int8": "b"}  # struct codes


def naive_read_message(message: bytes, reference: bytes, layout: MessageLayout):
    """(positions, float32 values, flagged) of one message from its bytes alone, as the
    format defines them, or None where the definition refuses it: every header word equal to
    the valid ``reference`` message's but the count (0 to capacity) and the flags (0 or 1),
    and positions that agree with the count and lie inside the tensor."""
    words = struct.unpack(f"={HEADER_WORDS}i", message[:HEADER_BYTES])
    fixed = struct.unpack(f"={HEADER_WORDS}i", reference[:HEADER_BYTES])
    count, flags = words[HEADER_FIELDS.index("count")], words[HEADER_FIELDS.index("flags")]
    varying = {HEADER_FIELDS.index("count"), HEADER_FIELDS.index("flags")}
    if (any(w != f for i, (w, f) in enumerate(zip(words, fixed)) if i not in varying)
            or not 0 <= count <= layout.capacity or flags not in (0, 1)):
        return None
    parts, offset = [], HEADER_BYTES
    for dtype, size in layout.parts:
        width = {"uint8": 1, "int8": 1, "int32": 4, "float16": 2, "bfloat16": 2, "float32": 4}[dtype]
        parts.append(message[offset:offset + size * width])
        offset += -(-size * width // 8) * 8
    coding, capacity = layout.indices.name, layout.capacity
    if coding == "elias-fano":
        positions = naive_decode_elias_fano(parts[0], parts[1], layout.numel, capacity, count)
    elif coding == "raw":
        positions = list(struct.unpack(f"={capacity}i", parts[0]))
        positions = positions if all(0 <= p < layout.numel for p in positions) else None
    else:
        ones = [i for i, bit in enumerate(bytes_to_bits(parts[0])[:layout.numel]) if bit]
        positions = ones if len(ones) == count else None
    if positions is None:
        return None
    # The slots past the count are padding: whatever their bytes hold, they add nothing.
    positions = positions[:count]
    if layout.values is None:
        return positions, None, bool(flags)
    fmt = layout.values.name if layout.values.name == "int8" else layout.values.dtype
    code = VALUE_CODES[fmt]
    raw = struct.unpack(f"={capacity}{code}", parts[len(layout.indices.parts)])
    if fmt == "bfloat16":
        values = torch.tensor([struct.unpack("=f", struct.pack("=I", h << 16))[0] for h in raw])
    elif fmt == "int8":
        (scale,) = struct.unpack("=f", parts[-1][:4])
        values = torch.tensor(raw, dtype=torch.float32) * torch.tensor(scale, dtype=torch.float32)
    else:
        values = torch.tensor(raw, dtype=torch.float32)
    return positions, values[:count], bool(flags)


def mutated(rng: random.Random, valid: bytes, trial: int,
            counts: Sequence[Tuple[int, int]] = ()) -> bytearray:
    """``valid`` with 1, 2 or 5 random bytes changed (every tenth trial: all of them random);
    on every seventh a message's count word lowered (``counts``: each message's (offset of its
    count word, capacity)), where only raw positions can still agree with it; every 97th cut
    short."""
    if trial % 10 == 0:
        data = bytearray(rng.randrange(256) for _ in range(len(valid)))
    else:
        data = bytearray(valid)
        for _ in range(rng.choice([1, 1, 2, 5])):
            data[rng.randrange(len(data))] = rng.randrange(256)
    if counts and trial % 7 == 3:
        at, capacity = rng.choice(counts)
        data[at:at + 4] = struct.pack("=i", rng.randrange(capacity + 1))
    if trial % 97 == 0:
        data = data[:rng.randrange(len(data))]
    return data


def valid_message(rng: random.Random, device: torch.device):
    n = rng.choice([2000, 5000, 20_000])
    method = TopK(TopKConfig(density=rng.choice([0.002, 0.01])))
    grad = torch.randn(n, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)),
                       device="cpu").to(device)
    result = method.compress(ops, method.init_state(ops, grad, True, 1), grad,
                             CompressCall("fuzz", 0, 1, 0, method.config.density))
    return method, result


def test_10000_random_and_mutated_messages_end_in_a_clean_error_or_a_correct_decode(device, choices):
    """With the GPU's choices the checks are deferred as the engine defers them: a bad
    message decodes on (zeros in place of what failed) and its error comes at the settling."""
    decoding = TorchOps(defer_checks=True)
    rng = random.Random(2026)
    outcomes = {"error": 0, "decoded": 0}
    for trial in range(10_000):
        if trial % 50 == 0:
            method, result = valid_message(rng, device)
        valid = bytes(result.message.cpu().numpy().tobytes())
        data = mutated(rng, valid, trial)
        message = torch.tensor(list(data), dtype=torch.uint8, device=device)
        try:
            (out,), _ = method.decompress(decoding, message, [result.layout], 1, 0, ["float32"])
            decoding.settle_checks()
        except MessageError:
            outcomes["error"] += 1
            continue
        read = naive_read_message(bytes(data), valid, result.layout)
        assert read is not None, f"trial {trial}: accepted a message the definition refuses"
        positions, values, flagged = read
        # Summed on the CPU, in order, whatever the device (then compared there).
        expected = torch.zeros(result.layout.numel, device="cpu")
        expected.index_add_(0, torch.tensor(positions, dtype=torch.int64), values)
        out = out.cpu()
        if flagged:
            expected.fill_(float("nan"))  # the sender's gradient was not finite
        assert torch.equal(out.isnan(), expected.isnan()), f"trial {trial}"
        assert torch.equal(out.nan_to_num(), expected.nan_to_num()), f"trial {trial}"
        outcomes["decoded"] += 1
    assert outcomes["error"] > 1000 and outcomes["decoded"] > 1000, outcomes


def test_the_header_words_are_in_the_documented_order(device):
    """The 12 header words of a sparse message read back from its bytes: magic, method,
    tensor id (crc32, signed), numel low and high, capacity, count, value format, index
    format, sender rank, step modulo 2**31, flags. Both ends derive the header from the same
    code, so a swap of two fields (rank and step) or a step past int32 would pass every round
    trip; this reads them against docs/algorithms.md#aggregation and wire.HEADER_FIELDS."""
    n, density, rank, world, step = 5000, 0.01, 2, 4, 2 ** 31 + 7
    method = TopK(TopKConfig(density=density, value_dtype="float16"))
    grad = randn(n, generator=torch.Generator().manual_seed(9), device=device)
    result = method.compress(ops, method.init_state(ops, grad, True, world), grad,
                             CompressCall("layer.weight", rank, world, step, density))
    words = struct.unpack(f"={HEADER_WORDS}i", bytes(result.message[:HEADER_BYTES].tolist()))
    crc = zlib.crc32(b"layer.weight")
    k = math.ceil(density * n)
    index_code = {"raw": 1, "elias-fano": 2, "bitmap": 3}[result.layout.indices.name]
    assert words == (0x44474332, 1, crc - 2 ** 32 if crc >= 2 ** 31 else crc, n, 0, k, k,
                     2, index_code, rank, 7, 0)


def test_a_blocksign_header_names_its_scales_as_values_and_its_signs_as_indices(device):
    """Blocksign's message: packed signs (uint8, code 6) as the index part and float32 scales
    (code 1) as the values; the header says so in the value-format and index-format words.
    Catches the two codes swapped (self-consistent, so no round trip notices)."""
    method = BlockSign(BlockSignConfig())
    grad = randn(4096, device=device)
    state = method.init_state(ops, grad, True, 2)
    message, _, handover = method.first(ops, state, grad, CompressCall("w", 0, 2, 3, 1.0))
    words = struct.unpack(f"={HEADER_WORDS}i", bytes(message[:HEADER_BYTES].tolist()))
    assert words[HEADER_FIELDS.index("value format")] == 1
    assert words[HEADER_FIELDS.index("index format")] == 6
    assert words[HEADER_FIELDS.index("sender rank")] == 0 and words[HEADER_FIELDS.index("step")] == 3


def gathered_messages(rng: random.Random, fmt: str):
    """A valid allgather of 2 ranks' messages for 3 tensors whose sizes and densities pick
    Elias-Fano, bitmap and raw index codings, values in ``fmt`` (a bfloat16 gradient for
    bfloat16), at a random step: (method, the bytes, each message's layout in order, step)."""
    method = TopK(TopKConfig(value_dtype="float16" if fmt == "bfloat16" else fmt))
    dtype = torch.bfloat16 if fmt == "bfloat16" else torch.float32
    tensors = [(rng.choice([5000, 20_000]), rng.choice([0.002, 0.01])),
               (rng.choice([1000, 3000]), rng.choice([0.3, 0.5])),
               (rng.choice([64, 200]), 0.01)]
    step, world, messages, layouts = rng.randrange(1 << 20), 2, [], []
    for rank in range(world):
        for t, (n, density) in enumerate(tensors):
            grad = torch.randn(n, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
            result = method.compress(ops, method.init_state(ops, grad.to(dtype), True, world),
                                     grad.to(dtype), CompressCall(f"t{t}", rank, world, step, density))
            messages.append(result.message)
            layouts.append(result.layout)
    return method, bytes(torch.cat(messages).numpy().tobytes()), layouts, step


class CountingOps(TorchOps):
    """TorchOps that counts the decodes its C kernels took, or (``kernel=False``) makes a
    GPU's choices on the CPU: every decode is then the core's composition of torch
    operations, as on a GPU."""

    def __init__(self, kernel: bool) -> None:
        super().__init__()
        self.kernel, self.kernel_decodes = kernel, 0

    def sizes_cost_a_wait(self, x: torch.Tensor) -> bool:
        return not self.kernel or super().sizes_cost_a_wait(x)

    def decode_sums(self, *args, **kwargs):
        flags = super().decode_sums(*args, **kwargs)
        self.kernel_decodes += flags is not None
        return flags


@pytest.mark.parametrize("decoder", ["kernel", "composition"])
@pytest.mark.parametrize("fmt", ["float32", "float16", "bfloat16", "int8"])
def test_2500_mutated_gathers_of_each_value_format_decode_as_the_definition_or_raise(fmt, decoder):
    """The C decoder (``decode_messages`` and ``sum_sparse``) and the core's composition on
    hostile input, 10,000 trials each over the four value formats: 2 ranks' messages for 3
    tensors coded as Elias-Fano, bitmap and raw, random bytes changed, a count lowered (or
    all bytes random, or cut short). Every trial ends in a MessageError or in each tensor
    being exactly the average the definition reads from the bytes (NaN where a rank flagged
    it). Catches a decoder that accepts a header word it should not (a sender's rank, the
    step), adds the padding past a count, reads a bitmap's padding bits, takes an int8 scale
    from the wrong place, decodes bfloat16 as float16, adds rank 1's values to the wrong
    tensor, or reads past a message (a crash)."""
    rng, decoding = random.Random(f"gathers-{fmt}"), CountingOps(kernel=decoder == "kernel")
    outcomes, codings = {"error": 0, "decoded": 0}, set()
    for trial in range(2500):
        if trial % 50 == 0:
            method, valid, layouts, step = gathered_messages(rng, fmt)
            counts = [(sum(other.nbytes for other in layouts[:m]) + 4 * COUNT_WORD, layout.capacity)
                      for m, layout in enumerate(layouts)]
            codings |= {layout.indices.name for layout in layouts}
        data = mutated(rng, valid, trial, counts)
        out_dtype = "bfloat16" if fmt == "bfloat16" else "float32"
        try:
            received = torch.frombuffer(data, dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
            outs, _ = method.decompress(decoding, received, layouts[:3], 2, step, [out_dtype] * 3)
        except MessageError:
            outcomes["error"] += 1
            continue
        offsets = [sum(layout.nbytes for layout in layouts[:m]) for m in range(len(layouts))]
        read = [naive_read_message(bytes(data[o:o + layout.nbytes]), valid[o:o + layout.nbytes], layout)
                for o, layout in zip(offsets, layouts)]
        assert all(r is not None for r in read), f"trial {trial}: accepted a gather the definition refuses"
        for t, out in enumerate(outs):
            expected = torch.zeros(layouts[t].numel)
            for positions, values, _ in read[t::3]:  # rank 0's message, then rank 1's
                expected.index_add_(0, torch.tensor(positions, dtype=torch.int64), values * 0.5)
            if any(flagged for _, _, flagged in read[t::3]):
                expected.fill_(float("nan"))
            expected = expected.to(out.dtype)
            assert torch.equal(out.isnan(), expected.isnan()), f"trial {trial}, tensor {t}"
            assert torch.equal(out.nan_to_num(), expected.nan_to_num()), f"trial {trial}, tensor {t}"
        outcomes["decoded"] += 1
    assert codings == {"elias-fano", "bitmap", "raw"}, codings
    assert outcomes["error"] > 250 and outcomes["decoded"] > 250, outcomes
    if decoder == "kernel":
        # It leaves raw positions out of order (a changed raw index) to the composition.
        assert decoding.kernel_decodes > 0.9 * outcomes["decoded"], (decoding.kernel_decodes, outcomes)
    else:
        assert decoding.kernel_decodes == 0


@pytest.mark.parametrize("decoder", ["kernel", "composition"])
def test_10000_mutated_leader_messages_decode_as_the_definition_or_raise(decoder):
    """ScaleCom's broadcast of the leader's positions (no values) through
    ``scalecom.leader_positions``, the C kernel's ``decode_positions`` or the composition, on
    hostile input: each trial a valid message (Elias-Fano, bitmap or raw) with random bytes
    changed, a count lowered, all bytes random, or cut short, decoded as from leader 1 at its
    step. Every trial ends in a MessageError or in the positions the definition reads from
    the bytes, 0 past the count. Catches a decoder that accepts another leader's or step's
    message, keeps a raw message's positions past a lowered count, or reads past the message."""
    decoding, rng = CountingOps(kernel=decoder == "kernel"), random.Random(f"leader-{decoder}")
    method, outcomes, codings = ScaleCom(ScaleComConfig()), {"error": 0, "decoded": 0}, set()
    for trial in range(10_000):
        if trial % 50 == 0:
            n, density = rng.choice([(20_000, 0.002), (3000, 0.3), (200, 0.01)])
            layout = method.index_layout("w", n, density)
            codings.add(layout.indices.name)
            step, count = rng.randrange(1 << 20), layout.capacity
            positions = sorted(rng.sample(range(n), count))
            message, _ = layout.encode(ops, layout.header(1, step, count, 0),
                                       torch.tensor(positions, dtype=torch.int64), count)
            valid = bytes(message.numpy().tobytes())
        data = mutated(rng, valid, trial, [(4 * COUNT_WORD, layout.capacity)])
        received = torch.frombuffer(data, dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
        try:
            got = leader_positions(decoding, received, layout, 1, step, 0)
        except MessageError:
            outcomes["error"] += 1
            continue
        read = naive_read_message(bytes(data), valid, layout)
        assert read is not None, f"trial {trial}: accepted a message the definition refuses"
        expected, _, _ = read
        assert got.tolist() == expected + [0] * (layout.capacity - len(expected)), f"trial {trial}"
        outcomes["decoded"] += 1
    assert codings == {"elias-fano", "bitmap", "raw"}, codings
    assert outcomes["error"] > 500 and outcomes["decoded"] > 500, outcomes


def test_a_part_of_another_dtype_than_its_layout_is_refused_naming_the_tensor():
    """A part's bytes are padded or cut to its slot: a float64 part in a float32 slot would
    travel as garbage (blocksign's float64 scales did)."""
    layout = PartsLayout(name="fc.weight", method_id=5, numel=64, capacity=64,
                         part_list=(("uint8", 8), ("float32", 1)))
    header = layout.header(0, 0, 64, 0)
    signs = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(TypeError, match=r"'fc.weight': a float64 part where the layout holds float32"):
        encode_parts(ops, layout, header, [signs, torch.ones(1, dtype=torch.float64)])
    message = encode_parts(ops, layout, header, [signs, torch.ones(1)])
    assert message.numel() == layout.nbytes


@pytest.mark.parametrize("sizes", [(3, 1), (16, 5), (9, 0)])
def test_a_message_set_is_each_message_built_byte_by_byte(sizes):
    """encode_set's one gather against messages written here with struct: each header, then
    each part's picked entries and zeros up to its 8-byte room. The flags word is a tensor, as
    a sender's non-finite flag is. Catches a part read from the wrong source or at a wrong
    offset (a source's size, the zero words after the headers), a float's bytes taken one
    entry apart, padding read from a source instead of the zero words, and a message's part
    found at the wrong place by part_at."""
    n_signs, n_scales = sizes
    layout = PartsLayout(name="layer.weight", method_id=5, numel=8 * n_signs, capacity=8 * n_signs,
                         part_list=(("uint8", n_signs), ("float32", n_scales)))
    rng = random.Random(f"set-{sizes}")
    signs = torch.tensor([rng.randrange(256) for _ in range(2 * n_signs + 3)], dtype=torch.uint8)
    scales = torch.tensor([rng.uniform(-2, 2) for _ in range(n_scales + 2)])
    picks = [[rng.sample(range(signs.numel()), n_signs), rng.sample(range(scales.numel()), n)]
             for n in (n_scales, max(0, n_scales - 1), 0)]
    flags = torch.tensor(1)
    headers = [layout.header(3, 7, m + 1, flags) for m in range(len(picks))]
    table = torch.tensor(set_table(layout, picks, [signs.numel(), scales.numel()]))
    got = bytes(encode_set(ops, layout, headers, [signs, scales], table).tolist())
    expected = b""
    for m, (sign_picks, scale_picks) in enumerate(picks):
        words = [int(w) for w in headers[m]]
        part_signs = bytes(int(signs[i]) for i in sign_picks)
        part_scales = b"".join(struct.pack("=f", float(scales[i])) for i in scale_picks)
        message = struct.pack(f"={HEADER_WORDS}i", *words)
        for part, room in ((part_signs, -(-n_signs // 8) * 8), (part_scales, -(-4 * n_scales // 8) * 8)):
            message += part + bytes(room - len(part))
        assert len(message) == layout.nbytes
        assert got[part_at(layout, m, 0):part_at(layout, m, 0) + n_signs] == part_signs
        assert got[part_at(layout, m, 1):part_at(layout, m, 1) + len(part_scales)] == part_scales
        expected += message
    assert got == expected
    with pytest.raises(TypeError, match=r"'layer.weight': a float64 part where the layout holds float32"):
        encode_set(ops, layout, headers, [signs, scales.double()], table)


def test_a_received_set_hands_on_its_checked_bytes_flags_and_counts():
    """receive of messages of one layout (the headers read as rows of the data) against the
    words written: flags and counts message after message, the parts of each, and a wrong
    step named with its sender. Catches headers read at another message's offset and the
    flags or count word taken from another field."""
    layout = PartsLayout(name="w", method_id=5, numel=64, capacity=64, part_list=(("uint8", 8), ("float32", 1)))
    messages = [encode_parts(ops, layout, layout.header(r, 4, 10 * r, r % 2), [torch.full((8,), r, dtype=torch.uint8),
                                                                              torch.tensor([r + 0.5])])
                for r in range(3)]
    data = torch.cat(messages)
    received = receive(ops, data, [(layout, r) for r in range(3)], 4)
    assert received.flags.tolist() == [0, 1, 0] and received.counts.tolist() == [0, 10, 20]
    assert torch.equal(received.data, data)
    assert [(p.tolist(), s.tolist()) for p, s in received.parts(ops)] == [([r] * 8, [r + 0.5]) for r in range(3)]
    with pytest.raises(MessageError, match=r"rank 0 sent a malformed message for tensor 'w': step is 4, expected 5"):
        receive(ops, data, [(layout, r) for r in range(3)], 5)


@pytest.mark.parametrize("rows, row_bits, capacity", [(1, 40, 8), (3, 17, 5), (4, 64, 64), (2, 9, 1)])
def test_row_set_bits_against_a_loop_over_each_row(rows, row_bits, capacity):
    """Catches a rank counted across rows (a row's start not subtracted), a row boundary off
    by one, and set bits past the capacity written over the next row's slots."""
    rng = random.Random(f"rows-{rows}-{row_bits}")
    bits = [rng.random() < rng.choice([0.1, 0.5, 0.9]) for _ in range(rows * row_bits)]
    found, counted = TorchOps().row_set_bits(torch.tensor(bits), row_bits, capacity)
    expected, expected_counts = [], []
    for r in range(rows):
        ones = [i for i, bit in enumerate(bits[r * row_bits:(r + 1) * row_bits]) if bit]
        expected += (ones + [0] * capacity)[:capacity]
        expected_counts.append(len(ones))
    assert found.tolist() == expected and counted.tolist() == expected_counts


@pytest.mark.parametrize("counts, capacity", [([3], 5), ([0, 4, 1], 4), ([1, 0, 1, 1], 1), ([7, 2], 7)])
@pytest.mark.parametrize("run", ["torch", "composition"])
def test_the_padding_of_each_message_is_its_slots_from_its_count_on(counts, capacity, run):
    """TorchOps' broadcast comparison and the core's composition against a loop. Catches a
    row's count compared with the next row's slots, a slot at the count taken as sent, and
    the slot numbered across rows."""
    ops = TorchOps()
    past = ops.past_counts if run == "torch" else (lambda *a: TensorOps.past_counts(ops, *a))
    padding = past(capacity, torch.tensor(counts, dtype=torch.int32), torch.zeros(1))
    assert padding.tolist() == [slot >= count for count in counts for slot in range(capacity)]


def test_where_with_zero_keeps_integers_where_true_and_floats_as_where_does():
    """The shortcut for integers (a product with the predicate) against a loop, and a float's
    NaN still 0 where false (a product would keep it)."""
    ops, pred = TorchOps(), torch.tensor([True, False, True, False])
    ints = torch.tensor([5, -7, 2 ** 40, 9])
    assert ops.where(pred, ints, 0).tolist() == [v if p else 0 for v, p in zip(ints.tolist(), pred.tolist())]
    assert ops.where(pred, ints, 0).dtype == torch.int64
    floats = torch.tensor([1.5, float("nan"), float("inf"), float("nan")])
    assert ops.where(pred, floats, 0).tolist() == [1.5, 0.0, float("inf"), 0.0]


def test_a_constant_writes_each_device_word_in_every_place_it_is_given(monkeypatch):
    """Words left on the device (as on a GPU) are written in place: one tensor given at
    several places (a flags word in every header of a message set) and another once, against
    the list read on the host. Catches a tensor written at its first place only."""
    monkeypatch.setattr(TorchOps, "sizes_cost_a_wait", lambda self, x: True)
    flag, other = torch.tensor(1), torch.tensor(-7)
    got = TorchOps().constant([3, flag, 5, flag, other, flag], "int32", like=torch.zeros(1))
    assert got.dtype == torch.int32 and got.tolist() == [3, 1, 5, 1, -7, 1]


def test_bitcast_reads_a_float32_as_its_ieee_bits():
    values = [0.0, -0.0, 1.0, -2.5, float("inf"), 3.4e38, 1e-45]
    bits = TorchOps().bitcast(torch.tensor(values), "int32")
    assert bits.dtype == torch.int32
    assert bits.tolist() == [struct.unpack("<i", struct.pack("<f", v))[0] for v in values]


@pytest.mark.parametrize("start, stride, length, count", [(0, 10, 10, 3), (3, 10, 4, 3), (5, 7, 2, 1),
                                                          (8, 16, 8, 4)])
def test_rows_are_the_slices_of_each_message_laid_end_to_end(start, stride, length, count):
    """Both adapters' strided copy against Python slicing, the last row ending the tensor.
    Catches a stride taken as the row length and a start applied once per row."""
    data = list(range(start + (count - 1) * stride + length))
    expected = [v for r in range(count) for v in data[start + r * stride:start + r * stride + length]]
    assert TorchOps().rows(torch.tensor(data), start, stride, length, count).tolist() == expected
    tf = pytest.importorskip("tensorflow")
    from horovod_dgc.tensorflow.ops import TFOps
    assert TFOps().rows(tf.constant(data), start, stride, length, count).numpy().tolist() == expected


@pytest.mark.parametrize("corrupt", ["upper", "lower-count"])
def test_a_composed_decode_of_every_rank_at_once_names_the_rank_whose_positions_are_wrong(corrupt):
    """The decode of all ranks' messages of a tensor at once still names the sender: rank 2
    of 3 sends an Elias-Fano bitvector with a bit cleared (its count then disagrees), or a
    count lowered under a full bitvector."""
    method = TopK(TopKConfig(density=0.01))
    messages, layout = [], None
    for rank in range(3):
        grad = torch.randn(5000, generator=torch.Generator().manual_seed(rank))
        result = method.compress(ops, method.init_state(ops, grad, True, 3), grad,
                                 CompressCall("layer3.conv", rank, 3, 4, 0.01))
        messages.append(result.message.clone())
        layout = result.layout
    assert layout.indices.name == "elias-fano"
    bad = messages[2]
    if corrupt == "upper":
        start, nbytes = layout.part_spans[1]
        bits = bad[start:start + nbytes]
        first = int(torch.nonzero(bits)[0])
        bits[first] = bits[first] & (bits[first] - 1)  # its lowest set bit cleared
    else:
        bad[4 * COUNT_WORD:4 * COUNT_WORD + 4] = torch.tensor([layout.capacity - 1], dtype=torch.int32).view(torch.uint8)
    with pytest.raises(MessageError, match=r"rank 2 .*'layer3.conv'.*positions disagree with its count"):
        method.decompress(CountingOps(kernel=False), torch.cat(messages), [layout], 3, 4, ["float32"])


def test_a_composed_decode_of_every_rank_at_once_poisons_only_the_tensor_a_rank_flagged():
    """Rank 1 of 2 flags its first of two tensors (a NaN gradient): that tensor's average is
    NaN, the other's is the plain average. Catches the flags read layout after layout, which
    poisons the other tensor."""
    method, world = TopK(TopKConfig(density=0.01)), 2
    messages, layouts, grads = [], [], {}
    for rank in range(world):
        for t in range(2):
            grad = torch.randn(3000, generator=torch.Generator().manual_seed(10 * rank + t))
            if rank == 1 and t == 0:
                grad[5] = float("nan")
            grads[rank, t] = grad
            result = method.compress(ops, method.init_state(ops, grad, True, world), grad,
                                     CompressCall(f"t{t}", rank, world, 2, 0.01))
            messages.append(result.message)
            layouts.append(result.layout)
    outs, _ = method.decompress(CountingOps(kernel=False), torch.cat(messages), layouts[:2], world, 2,
                                ["float32"] * 2)
    assert outs[0].isnan().all()
    k = top_count(0.01, 3000)
    expected = torch.zeros(3000)
    for rank in range(world):
        chosen = torch.argsort(-grads[rank, 1].abs(), stable=True)[:k]
        expected[chosen] += grads[rank, 1][chosen].to(torch.float16).float() / world
    assert torch.equal(outs[1], expected)


@pytest.mark.parametrize("decoder", ["kernel", "composition"])
def test_a_raw_slot_past_the_count_outside_the_tensor_is_named(decoder):
    """Every raw slot must lie in the tensor, the padding past the count too (the coding
    writes 0 there): a message whose count is 0 and whose slot holds the tensor's size is
    refused, naming its sender, by the kernel and by the composition alike (whose
    explanation must look at the slots its check looked at, not at the padded positions)."""
    method, world, messages = TopK(TopKConfig()), 2, []
    grad = torch.randn(200, generator=torch.Generator().manual_seed(3))
    for rank in range(world):
        result = method.compress(ops, method.init_state(ops, grad, True, world), grad,
                                 CompressCall("bias", rank, world, 5, 0.01))
        messages.append(bytearray(result.message.numpy().tobytes()))
    layout = result.layout
    assert layout.indices.name == "raw"
    at = layout.part_spans[0][0]
    messages[1][4 * COUNT_WORD:4 * COUNT_WORD + 4] = struct.pack("=i", 0)
    messages[1][at:at + 4] = struct.pack("=i", 200)
    data = torch.frombuffer(bytearray(b"".join(messages)), dtype=torch.uint8)
    with pytest.raises(MessageError, match=r"rank 1 .*'bias'.*positions disagree"):
        method.decompress(CountingOps(kernel=decoder == "kernel"), data, [layout], world, 5, ["float32"])
