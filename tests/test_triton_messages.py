"""The GPU's whole-message kernels (``kernels/triton_messages.py``) against messages built
here byte by byte from the wire format's definition (``struct`` for the header and raw
positions, bit loops for Elias-Fano and the bitmap, torch's CPU casts for the 16-bit values),
and their checks against messages spoiled one field at a time.

As ``test_triton_bits.py``: on a CUDA device the kernels run on CUDA tensors, and on every
machine with Triton the same tests run again in a child process under Triton's interpreter
on CPU tensors; there TorchOps is made to choose as on a GPU, so the decode's checks and
their explanation run as an engine runs them.
"""
import random
import struct

import pytest
import torch
from conftest import TRITON_DEVICE, check_under_the_triton_interpreter, runs_on_the_triton_device

pytest.importorskip("triton")

from horovod_dgc.core import wire  # noqa: E402
from horovod_dgc.core.wire import MessageError, MessageLayout  # noqa: E402
from horovod_dgc.torch.kernels import triton_memory, triton_messages  # noqa: E402
from horovod_dgc.torch.ops import TorchOps  # noqa: E402

DEVICE, runs_here = TRITON_DEVICE, runs_on_the_triton_device
STEP = 7


def bits_to_bytes(bits, n_bytes):
    out = [0] * n_bytes
    for i, bit in enumerate(bits):
        out[i // 8] |= bit << (i % 8)
    return bytes(out)


def padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % 8)


def coded_values(values, value_format):
    """(bytes on the wire, what a receiver decodes as float32) of float32 ``values``."""
    v = torch.tensor(values, dtype=torch.float32)
    if value_format == "float32":
        coded = v
    elif value_format == "float16":
        coded = v.clamp(-65504.0, 65504.0).to(torch.float16)
    else:
        coded = v.to(torch.bfloat16)
    return coded.view(torch.uint8).numpy().tobytes(), coded.to(torch.float32).tolist()


def message(layout: MessageLayout, sender: int, positions, values, flags=0, step=STEP, count=None):
    """The bytes of a message by the definition of its header and codings (``count``: the
    header's, if not the number of positions)."""
    count = len(positions) if count is None else count
    words = [wire.MAGIC, layout.method_id, wire.tensor_id(layout.name), layout.numel % 2 ** 31,
             layout.numel // 2 ** 31, layout.capacity, count, wire.DTYPE_CODES.get(layout.value_format, 0),
             layout.indices.code, sender, step, flags]
    out = struct.pack("=12i", *words)
    coding, capacity = layout.indices, layout.capacity
    slots = list(positions) + [0] * (capacity - len(positions))
    if coding.name == "raw":
        out += padded(struct.pack(f"={capacity}{'i' if coding.dtype == 'int32' else 'q'}", *slots))
    elif coding.name == "elias-fano":
        low = coding.low_bits
        fields = [(p >> j) & 1 for p in positions for j in range(low)]
        out += padded(bits_to_bytes(fields, -(-capacity * low // 8)))
        upper = [0] * coding.upper_bits
        for i, p in enumerate(positions):
            upper[(p >> low) + i] = 1
        out += padded(bits_to_bytes(upper, -(-coding.upper_bits // 8)))
    else:
        bitmap = [0] * layout.numel
        for p in positions:
            bitmap[p] = 1
        out += padded(bits_to_bytes(bitmap, -(-layout.numel // 8)))
    decoded = None
    if layout.value_format is not None:
        coded, decoded = coded_values(list(values) + [0.0] * (capacity - len(values)), layout.value_format)
        out += padded(coded)
    assert len(out) == layout.nbytes
    return out, decoded


def layout_of(numel, capacity, value_format="float32", name="w"):
    return MessageLayout(name=name, method_id=2, numel=numel, capacity=capacity, value_format=value_format)


def sample(rng, numel, count):
    positions = sorted(rng.sample(range(numel), count))
    return positions, [rng.gauss(0.0, 1.0) * 10 ** rng.randrange(-3, 6) for _ in positions]


# (numel, capacity, value format): Elias-Fano, the bitmap, raw int32 positions, Elias-Fano
# in a tensor of 2**31 elements and more (a header of two numel words), every value format.
LAYOUTS = [(100_000, 100, "float32"), (100_000, 100, "float16"), (9_000, 3_000, "bfloat16"),
           (5_000, 1_250, "float16"), (70_000, 40_000, "float32"), (64, 1, "float16"),
           (3_000_000_000, 10, "bfloat16")]


@pytest.mark.parametrize("numel,capacity,value_format", LAYOUTS)
@runs_here
def test_a_message_is_encoded_as_the_wire_format_defines_it(numel, capacity, value_format):
    layout = layout_of(numel, capacity, value_format)
    rng = random.Random(numel + capacity)
    for count in (capacity, capacity // 2, 0):
        positions, values = sample(rng, min(numel, 10 ** 6), count)
        values[:1] = [1e6][:count]  # beyond float16's range: clamped there
        header = layout.header(1, STEP, count, 0)
        got, decoded = triton_messages.encode_message(
            layout, header, torch.tensor(positions, dtype=torch.int64, device=DEVICE), count,
            torch.tensor(values, dtype=torch.float32, device=DEVICE))
        want, want_decoded = message(layout, 1, positions, values)
        assert bytes(got.cpu().tolist()) == want, (layout.indices.name, count)
        assert decoded.cpu().tolist() == want_decoded


@runs_here
def test_the_flags_word_may_come_from_the_device():
    layout = layout_of(100_000, 100)
    positions, values = sample(random.Random(1), 100_000, 100)
    header = layout.header(0, STEP, 100, torch.tensor(wire.FLAG_NONFINITE, dtype=torch.int32, device=DEVICE))
    got, _ = triton_messages.encode_message(layout, header, torch.tensor(positions, device=DEVICE), 100,
                                            torch.tensor(values, device=DEVICE))
    assert bytes(got.cpu().tolist()) == message(layout, 0, positions, values, flags=wire.FLAG_NONFINITE)[0]


@runs_here
def test_a_message_of_positions_only_is_encoded_and_one_senders_is_decoded(monkeypatch):
    """ScaleCom's leader's message: its positions, no values, decoded from the leader alone."""
    layout = MessageLayout(name="lead", method_id=4, numel=100_000, capacity=100, value_format=None)
    positions = sorted(random.Random(4).sample(range(100_000), 100))
    sent, decoded = triton_messages.encode_message(layout, layout.header(2, STEP, 100, 0),
                                                   torch.tensor(positions, device=DEVICE), 100, None)
    assert decoded is None and bytes(sent.cpu().tolist()) == message(layout, 2, positions, [])[0]
    monkeypatch.setattr(TorchOps, "sizes_cost_a_wait", lambda self, x: True)
    flags, [(got, values, count)] = wire.decode_received(TorchOps(), sent, [(layout, 2)], STEP, ["float32"])
    assert got.cpu().tolist() == positions and values is None and int(count) == 100
    assert flags.cpu().tolist() == [0]
    with pytest.raises(MessageError, match=r"rank 1 .*'lead'.*sender rank is 2, expected 1"):
        wire.decode_received(TorchOps(), sent, [(layout, 1)], STEP, ["float32"])


@runs_here
def test_each_senders_message_of_one_layout_is_received_with_its_count(monkeypatch):
    """The sparse all-reduce's owners: every rank's message for one region, each message's
    positions, values and count apart (unscaled)."""
    layout = layout_of(*LAYOUTS[0])
    data, want = allgather([layout], 3, random.Random(11))
    monkeypatch.setattr(TorchOps, "sizes_cost_a_wait", lambda self, x: True)
    expected = [(layout, r) for r in range(3)]
    flags, messages = wire.decode_received(TorchOps(), data, expected, STEP, ["float32"] * 3)
    assert flags.cpu().tolist() == [f for _, _, f in want]
    for (positions, values, count), (sent, sent_values, _) in zip(messages, want):
        pad = [0] * (layout.capacity - len(sent))
        assert positions.cpu().tolist() == sent + pad and values.cpu().tolist() == sent_values + pad
        assert int(count) == len(sent)


@pytest.mark.parametrize("value_format", ["float32", "bfloat16"])
@runs_here
def test_runs_of_positions_are_encoded_one_message_each_with_their_lengths_left_on_the_device(value_format):
    """The sparse all-reduce's messages to each owner: run j of the sorted keys goes to
    message j less its base, with its values gathered from the source, and the decoded values
    land in the keys' order; the runs' lengths are known only on the device."""
    rng = random.Random(17)
    # Elias-Fano, raw and the bitmap; full runs, an empty one, a part of one.
    layouts = [layout_of(50_000, 40, value_format), layout_of(50_000, 1, value_format),
               layout_of(50_000, 30, value_format), layout_of(3_000, 900, value_format)]
    runs = [sample(rng, 50_000, 40)[0], [49_999], [], sorted(rng.sample(range(3_000), 500))]
    assert [layout.indices.name for layout in layouts] == ["elias-fano", "raw", "elias-fano", "bitmap"]
    source = [rng.gauss(0.0, 1.0) for _ in range(3_000)]
    source_positions = [rng.randrange(3_000) for run in runs for _ in run]
    lengths = [len(run) for run in runs]
    starts = [sum(lengths[:j]) for j in range(5)]
    headers = [layout.header(1, STEP, 0, 0) for layout in layouts]
    bases = [0, 50_000, 100_000, 150_000]
    got, decoded = triton_messages.encode_runs(
        layouts, headers, torch.tensor([p + base for run, base in zip(runs, bases) for p in run], device=DEVICE),
        torch.tensor(starts, device=DEVICE), torch.tensor(source, dtype=torch.float32, device=DEVICE),
        torch.tensor(source_positions, device=DEVICE), bases)
    want, want_decoded = b"", []
    for j, (layout, run) in enumerate(zip(layouts, runs)):
        values = [source[i] for i in source_positions[starts[j]:starts[j + 1]]]
        data, run_decoded = message(layout, 1, run, values)
        want += data
        want_decoded += run_decoded[:len(run)]
    assert bytes(got.cpu().tolist()) == want
    assert decoded.cpu().tolist() == want_decoded


@pytest.mark.skipif(not triton_memory.INTERPRETED, reason="the engines' tensors are on the CPU")
def test_a_sparse_allreduce_bucket_encoded_by_the_kernel_follows_the_protocol(monkeypatch):
    from test_core_bucket import test_a_sparse_allreduce_bucket_exchanges_each_tensor_as_the_protocol_says as check
    monkeypatch.setattr(TorchOps, "sizes_cost_a_wait", lambda self, x: True)
    calls = []
    encode_runs = triton_messages.encode_runs
    monkeypatch.setattr(triton_messages, "encode_runs", lambda *a: calls.append(1) or encode_runs(*a))
    check(3, "as-on-a-gpu")
    assert calls


@runs_here
def test_a_run_longer_than_its_message_says_so_and_is_refused():
    layout = layout_of(1_000, 10)
    positions = torch.arange(0, 60, 4, device=DEVICE)  # 15 positions for 10 slots
    got, _ = triton_messages.encode_runs([layout], [layout.header(0, STEP, 0, 0)], positions,
                                         torch.tensor([0, 15], device=DEVICE), torch.ones(15, device=DEVICE),
                                         torch.arange(15, device=DEVICE), [0])
    assert got.numel() == layout.nbytes
    with pytest.raises(MessageError, match=r"rank 0 .*'w'.*count is 15, expected 0 to 10"):
        wire.decode_composed(TorchOps(), got.cpu(), [(layout, 0)], STEP, ["float32"])


def test_the_encode_refuses_what_it_does_not_write():
    layout, positions, values = layout_of(1000, 10), torch.arange(10), torch.ones(10)
    header = layout.header(0, STEP, 10, 0)
    assert not triton_messages.encodes(layout_of(1000, 10, "int8"), header, positions, 10, values)
    assert not triton_messages.encodes(layout, header, positions, torch.tensor(10), values)
    assert not triton_messages.encodes(layout, header, positions, 10, None)  # a layout with values
    assert not triton_messages.encodes(layout, header, positions[:9], 10, values)
    two_on_the_device = layout.header(0, torch.tensor(STEP), 10, torch.tensor(0))
    assert not triton_messages.encodes(layout, two_on_the_device, positions, 10, values)


def allgather(layouts, senders, rng, spoil=None):
    """Every sender's messages for ``layouts``, rank after rank, the bytes and what each
    should decode to; ``spoil(sender, t, bytes)`` may change a message."""
    data, want = b"", []
    for sender in range(senders):
        for t, layout in enumerate(layouts):
            count = rng.choice([layout.capacity, layout.capacity // 2, 0])
            positions, values = sample(rng, min(layout.numel, 10 ** 6), count)
            flags = wire.FLAG_NONFINITE if (sender + t) % 3 == 2 else 0
            encoded, decoded = message(layout, sender, positions, values, flags=flags)
            data += spoil(sender, t, encoded) if spoil else encoded
            want.append((positions, decoded[:count], flags))
    return torch.tensor(list(data), dtype=torch.uint8, device=DEVICE), want


@pytest.mark.parametrize("senders", [1, 2, 3])
@runs_here
def test_every_message_of_an_allgather_is_decoded_layout_after_layout(senders):
    layouts = [layout_of(n, c, f, name=f"t{i}") for i, (n, c, f) in enumerate(LAYOUTS)]
    data, want = allgather(layouts, senders, random.Random(senders))
    got = triton_messages.decode_messages(data, layouts, tuple(range(senders)), STEP, 0.25)
    assert bool(got.fine)
    assert got.flags.cpu().tolist() == [flags for _, _, flags in want]
    for t, layout in enumerate(layouts):
        positions, values = got.positions[t].cpu().tolist(), got.values[t].cpu().tolist()
        assert len(positions) == len(values) == senders * layout.capacity
        for sender in range(senders):
            sent, sent_values, _ = want[sender * len(layouts) + t]
            slots = slice(sender * layout.capacity, (sender + 1) * layout.capacity)
            pad = [0] * (layout.capacity - len(sent))
            assert positions[slots] == sent + pad, (layout, sender)
            assert values[slots] == [v * 0.25 for v in sent_values] + pad, (layout, sender)


def header_word(word, value):
    def spoil(sender, t, encoded):
        if (sender, t) != (1, 0):
            return encoded
        return encoded[:4 * word] + struct.pack("=i", value) + encoded[4 * word + 4:]
    return spoil


def extra_set_bit(sender, t, encoded):
    """Rank 1's first message gains a set bit in its bitvector (past its marks)."""
    if (sender, t) != (1, 0):
        return encoded
    layout = layout_of(*LAYOUTS[0])
    at, n_bytes = layout.part_spans[1]
    return encoded[:at + n_bytes - 1] + bytes([encoded[at + n_bytes - 1] | 0x80]) + encoded[at + n_bytes:]


def raw_position_outside(sender, t, encoded):
    """Rank 1's raw message holds a position past the tensor in its last slot (past its count)."""
    if (sender, t) != (1, 0):
        return encoded
    at, n_bytes = layout_of(64, 1, "float16").part_spans[0]
    return encoded[:at] + struct.pack("=i", 64) + encoded[at + 4:]


SPOILED = {
    "magic": (header_word(0, 0x1234), r"rank 1 .*'w'.*magic"),
    "sender rank": (header_word(9, 0), r"rank 1 .*sender rank is 0, expected 1"),
    "step": (header_word(10, STEP + 1), r"rank 1 .*step is 8, expected 7"),
    "count past the capacity": (header_word(6, 101), r"rank 1 .*count is 101, expected 0 to 100"),
    "an extra set bit": (extra_set_bit, r"rank 1 .*'w'.*positions disagree with its count"),
}


@pytest.mark.parametrize("spoiled", list(SPOILED))
@runs_here
def test_a_spoiled_message_decodes_as_zeros_and_the_composition_names_it(spoiled, monkeypatch):
    spoil, error = SPOILED[spoiled]
    layouts = [layout_of(*LAYOUTS[0]), layout_of(64, 1, "float16", name="b")]
    data, _ = allgather(layouts, 2, random.Random(5), spoil)
    got = triton_messages.decode_messages(data, layouts, tuple(range(2)), STEP, 0.5)
    assert not bool(got.fine)
    assert set(got.positions[0].cpu().tolist()[100:]) == {0} and set(got.values[0].cpu().tolist()[100:]) == {0.0}
    clean, _ = allgather(layouts, 2, random.Random(5))
    assert got.positions[0].cpu().tolist()[:100] == \
        triton_messages.decode_messages(clean, layouts, tuple(range(2)), STEP, 0.5).positions[0].cpu().tolist()[:100]
    # Through TorchOps as an engine on a GPU runs it: the check deferred to the step's end.
    monkeypatch.setattr(TorchOps, "sizes_cost_a_wait", lambda self, x: True)
    ops = TorchOps(defer_checks=True)
    outs = [torch.empty(layout.numel, device=DEVICE) for layout in layouts]
    assert ops.decode_sums(data, layouts, 2, STEP, outs, 0.5) is not None
    with pytest.raises(MessageError, match=error):
        ops.settle_checks()


@runs_here
def test_a_spoiled_messages_flags_word_is_not_passed_on():
    """A flags word from a message that fails its checks is no sender's word: it decodes as 0
    (the deferred check then raises, as above), the other messages' words as sent."""
    layouts = [layout_of(*LAYOUTS[0]), layout_of(64, 1, "float16", name="b")]

    def spoil(sender, t, encoded):  # rank 1's second message, flagged not finite, of another step
        return encoded[:40] + struct.pack("=i", STEP + 1) + encoded[44:] if (sender, t) == (1, 1) else encoded

    data, want = allgather(layouts, 2, random.Random(6), spoil)
    got = triton_messages.decode_messages(data, layouts, tuple(range(2)), STEP)
    sent = [flags for _, _, flags in want]
    assert sent[3] == wire.FLAG_NONFINITE and not bool(got.fine)
    assert got.flags.cpu().tolist() == sent[:3] + [0]


@runs_here
def test_a_raw_position_outside_the_tensor_is_refused_past_the_count_too(monkeypatch):
    layouts = [layout_of(64, 1, "float16", name="b")]

    def no_entry(sender, t, encoded):  # count 0, so the spoiled slot lies past it
        return raw_position_outside(sender, t, header_word(6, 0)(sender, t, encoded))

    data, _ = allgather(layouts, 2, random.Random(2), no_entry)
    assert not bool(triton_messages.decode_messages(data, layouts, tuple(range(2)), STEP, 0.5).fine)
    monkeypatch.setattr(TorchOps, "sizes_cost_a_wait", lambda self, x: True)
    ops = TorchOps()
    with pytest.raises(MessageError, match=r"rank 1 .*'b'.*positions disagree"):
        ops.decode_sums(data, layouts, 2, STEP, [torch.empty(64, device=DEVICE)], 0.5)


@runs_here
def test_torch_ops_sum_what_the_kernel_decodes_and_refuse_what_it_does_not_take(monkeypatch):
    monkeypatch.setattr(TorchOps, "sizes_cost_a_wait", lambda self, x: True)
    ops, senders = TorchOps(), 3
    layouts = [layout_of(*LAYOUTS[0]), layout_of(64, 1, "float16", name="b")]
    data, want = allgather(layouts, senders, random.Random(9))
    outs = [torch.full((layout.numel,), 5.0, device=DEVICE) for layout in layouts]
    flags = ops.decode_sums(data, layouts, senders, STEP, outs, 1 / senders)
    assert flags.cpu().tolist() == [f for _, _, f in want]
    for t, (layout, out) in enumerate(zip(layouts, outs)):
        expected = [0.0] * layout.numel
        for sender in range(senders):  # rank order, each value scaled before the sum, in float32
            positions, values, _ = want[sender * len(layouts) + t]
            for p, v in zip(positions, values):
                expected[p] = float(torch.tensor(expected[p]) + torch.tensor(v) * torch.tensor(1 / senders))
        assert out.cpu().tolist() == expected
    # Not what the kernel takes: the wrong size, a float64 sum, a step on the device.
    assert ops.decode_sums(data[:-8], layouts, senders, STEP, outs, 0.5) is None
    assert ops.decode_sums(data, layouts, senders, STEP, [o.double() for o in outs], 0.5) is None
    assert ops.decode_sums(data, layouts, senders, torch.tensor(STEP), outs, 0.5) is None


def parts_message(layout, sender, count, flags, step=STEP):
    """A message of packed signs and a scale (blocksign's parts), header by its definition."""
    words = [wire.MAGIC, layout.method_id, wire.tensor_id(layout.name), layout.numel % 2 ** 31,
             layout.numel // 2 ** 31, layout.capacity, count, wire.DTYPE_CODES["float32"], wire.DTYPE_CODES["uint8"],
             sender, step, flags]
    return struct.pack("=12i", *words) + bytes([sender] * 8) + struct.pack("=f", sender + 0.5) + bytes(4)


HEADER_SPOILED = {  # word, value, what the composition says of rank 1's message
    "magic": (0, 0x1234, r"rank 1 .*'signs'.*magic"),
    "tensor id": (2, 5, r"rank 1 .*'signs'.*tensor id is 5"),
    "count past the capacity": (6, 65, r"rank 1 .*count is 65, expected 0 to 64"),
    "sender rank": (9, 2, r"rank 1 .*sender rank is 2, expected 1"),
    "step": (10, STEP + 1, r"rank 1 .*step is 8, expected 7"),
    "flags": (11, 2, r"rank 1 .*flags is 2, expected 0 to 1"),
}


@pytest.mark.parametrize("spoiled", [None, *HEADER_SPOILED])
@runs_here
def test_every_header_of_a_message_set_is_checked_in_one_launch(spoiled, monkeypatch):
    """The header check against headers written here: each message's flags and count, and a
    header spoiled one word at a time refused (its flags and count 0, the others kept) and
    named by the composition through wire.receive, as an engine runs it. Catches a bound
    read from another message's row, the step compared with its bounds (0) instead of the
    step, the flags or count taken from another word, and a failure not counted."""
    layout = wire.PartsLayout(name="signs", method_id=5, numel=64, capacity=64,
                              part_list=(("uint8", 8), ("float32", 1)))
    sent = [(40, 0), (64, 1), (0, 0)]
    encoded = [parts_message(layout, r, count, flags) for r, (count, flags) in enumerate(sent)]
    if spoiled is not None:
        word, value, error = HEADER_SPOILED[spoiled]
        encoded[1] = encoded[1][:4 * word] + struct.pack("=i", value) + encoded[1][4 * word + 4:]
    data = torch.tensor(list(b"".join(encoded)), dtype=torch.uint8, device=DEVICE)
    flags, counts, fine = triton_messages.check_headers(data, layout, (0, 1, 2), STEP)
    if spoiled is None:
        assert bool(fine) and flags.tolist() == [0, 1, 0] and counts.tolist() == [40, 64, 0]
        return
    assert not bool(fine) and flags.tolist() == [0, 0, 0] and counts.tolist() == [40, 0, 0]
    monkeypatch.setattr(TorchOps, "sizes_cost_a_wait", lambda self, x: True)
    ops = TorchOps()
    assert triton_messages.checks_headers(data, [(layout, r) for r in range(3)], STEP)
    with pytest.raises(MessageError, match=error):
        wire.receive(ops, data, [(layout, r) for r in range(3)], STEP)
        ops.settle_checks()


@runs_here
def test_the_header_check_refuses_what_it_does_not_take():
    layout = wire.PartsLayout(name="signs", method_id=5, numel=64, capacity=64,
                              part_list=(("uint8", 8), ("float32", 1)))
    other = wire.PartsLayout(name="other", method_id=5, numel=64, capacity=64,
                             part_list=(("uint8", 8), ("float32", 1)))
    data = torch.zeros(2 * layout.nbytes, dtype=torch.uint8, device=DEVICE)
    assert triton_messages.checks_headers(data, [(layout, 0), (layout, 1)], STEP) == triton_memory.launchable(data)
    for expected, step, size in [([(layout, 0), (other, 1)], STEP, 2 * layout.nbytes),  # two layouts
                                 ([(layout, 0), (layout, torch.tensor(1))], STEP, 2 * layout.nbytes),  # a traced rank
                                 ([(layout, 0), (layout, 1)], torch.tensor(STEP), 2 * layout.nbytes),  # step on the device
                                 ([(layout, 0), (layout, 1)], STEP, 2 * layout.nbytes - 8)]:  # another size
        assert not triton_messages.checks_headers(data[:size], expected, step)


@pytest.mark.skipif(not triton_memory.INTERPRETED, reason="counts the interpreter's launches")
def test_a_bucket_message_costs_a_few_operations_each_way():
    """What the benchmarks count: the encode is a zeroed message, the decoded values and one
    launch (one per message for runs); the decode of two senders' messages, the check and the sum about ten."""
    from benchmarks.model_step import OpCounter
    layout = layout_of(100_000, 100, "float16")
    positions, values = sample(random.Random(3), 100_000, 100)
    args = (torch.tensor(positions), 100, torch.tensor(values))
    triton_messages.encode_message(layout, layout.header(0, STEP, 100, 0), *args)  # compiled once
    with OpCounter() as counted:
        sent, _ = triton_messages.encode_message(layout, layout.header(1, STEP, 100, 0), *args)
    assert counted.count == 3
    runs = ([layout, layout], [layout.header(1, STEP, 0, 0)] * 2, args[0], torch.tensor([0, 60, 100]),
            args[2], torch.arange(100), [0, 0])
    triton_messages.encode_runs(*runs)
    with OpCounter() as counted:
        triton_messages.encode_runs(*runs)
    assert counted.count == 4  # a zeroed buffer, the decoded values and a launch per message
    first, _ = triton_messages.encode_message(layout, layout.header(0, STEP, 100, 0), *args)
    data, out = torch.cat([first, sent]), torch.empty(100_000)
    ops = TorchOps(defer_checks=True)
    ops.sizes_cost_a_wait = lambda x: True
    ops.decode_sums(data, [layout], 2, STEP, [out], 0.5)
    with OpCounter() as counted:
        ops.decode_sums(data, [layout], 2, STEP, [out], 0.5)
    assert counted.count <= 12
    ops.settle_checks()


@pytest.mark.skipif(triton_memory.INTERPRETED, reason="this is the interpreted run")
def test_the_kernels_under_the_interpreter_on_cpu_tensors():
    """This file's kernel tests again where Triton interprets kernels on the CPU (a process
    of its own: Triton reads the switch when it is imported)."""
    check_under_the_triton_interpreter(__file__)
