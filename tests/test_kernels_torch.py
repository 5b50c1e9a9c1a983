"""The compiled selection kernels against the torch compositions they replace, and TorchOps'
shorter forms of an operation against torch's own."""
import math

import pytest
import torch

from horovod_dgc.core.ops import BlockBounds, Pieces, TensorOps
from horovod_dgc.torch import kernels
from horovod_dgc.torch.ops import TorchOps


class ComposedMessages(TorchOps):
    """TorchOps without the whole-message kernels: the core's composition encodes and decodes."""

    def encode_message(self, *args):
        return None

    def decode_sums(self, *args):
        return None

    def decode_positions(self, *args):
        return None


def reference(x: torch.Tensor, block: int) -> torch.Tensor:
    rows = x[:x.numel() // block * block].view(-1, block)
    return torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg())


@pytest.mark.parametrize("numel", [0, 7, 64, 1000, 4099])
@pytest.mark.parametrize("block", [1, 8, 17, 64, 1024])
def test_matches_reference(numel, block):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel + block))
    assert torch.equal(kernels.block_abs_max(x, block), reference(x, block))


def test_ranges_split_across_threads_cover_every_block():
    x = torch.randn(kernels.PARALLEL_MIN_NUMEL * 3 + 100, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    try:
        for width in (1, 2, 3):
            torch.set_num_threads(width)
            assert torch.equal(kernels.block_abs_max(x, 64), reference(x, 64))
    finally:
        torch.set_num_threads(threads)


def test_nan_propagates_like_amax():
    x = torch.randn(256)
    x[70] = float("nan")
    maxima = kernels.block_abs_max(x, 64)
    assert torch.isnan(maxima[1]) and not torch.isnan(maxima[[0, 2, 3]]).any()


def test_rejects_other_dtypes_and_layouts():
    with pytest.raises(TypeError, match="float32"):
        kernels.block_abs_max(torch.randn(64, dtype=torch.float64), 8)
    with pytest.raises(TypeError, match="contiguous"):
        kernels.block_abs_max(torch.randn(128)[::2], 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_ops_block_abs_max_includes_the_partial_last_block(dtype):
    x = torch.randn(1000, dtype=dtype)
    expected = torch.cat([reference(x, 64), x[960:].abs().amax().reshape(1)])
    assert torch.equal(TorchOps().block_abs_max(x, 64), expected)


@pytest.mark.parametrize("numel,block", [(1000, 64), (1024, 64), (37, 8), (5000, 1)])
@pytest.mark.parametrize("threshold", [0.0, 1.5, 3.0, 100.0])
def test_collect_matches_the_core_composition(numel, block, threshold):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    x[3] = float("nan")
    n_blocks = -(-numel // block)
    blocks = torch.arange(0, n_blocks, 3, dtype=torch.int64)
    blocks = torch.cat([blocks, torch.tensor([n_blocks - 1])]).unique()
    expected = TensorOps.collect_at_least(TorchOps(), x, blocks, block, torch.tensor(threshold))
    got = kernels.collect_at_least(x, blocks, block, threshold)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("numel,block,threshold", [(1000, 8, 0.5), (100_003, 64, 2.5), (70_001, 32, 0.0)])
def test_count_at_least_is_a_plain_count_of_the_listed_blocks(numel, block, threshold, threads):
    """The count-only read (Gaussian-k's adjustments) against a loop over the listed blocks,
    with a NaN (never counted), a partial last block and thread ranges. Catches a count
    that skips a range's last block or counts a NaN."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    x[3] = float("nan")
    n_blocks = -(-numel // block)
    blocks = torch.cat([torch.arange(0, n_blocks, 2), torch.tensor([n_blocks - 1])]).unique()
    naive = sum(1 for b in blocks.tolist() for v in x[b * block:(b + 1) * block].tolist()
                if abs(v) >= threshold)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert kernels.count_at_least(x, blocks, block, threshold) == naive
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
def test_collect_and_count_take_the_entries_equal_to_the_threshold(threads):
    """Selection's thresholds are magnitudes of entries (a k-th largest), so ties with the
    threshold are the usual case, not a rare one: every entry with |x| equal to it counts,
    against a loop. Catches a ``>`` where ``>=`` belongs in the collection or in the count
    (Gaussian-k's adjustments would then disagree with what is collected)."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    x[400], x[801] = -x[17], x[17]  # ties in other blocks, of both signs
    threshold = float(x[17].abs())
    blocks = torch.arange(-(-x.numel() // 64))
    naive = [p for p, v in enumerate(x.tolist()) if abs(v) >= threshold]
    assert {17, 400, 801} <= set(naive)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        positions, magnitudes = kernels.collect_at_least(x, blocks, 64, threshold)
        count = kernels.count_at_least(x, blocks, 64, threshold)
    finally:
        torch.set_num_threads(previous)
    assert positions.tolist() == naive
    assert torch.equal(magnitudes, x[naive].abs())
    assert count == len(naive)


def test_collect_refuses_a_block_outside_the_tensor():
    with pytest.raises(IndexError, match="block 2 of a tensor of 2 blocks"):
        kernels.collect_at_least(torch.randn(100), torch.tensor([0, 2]), 64, 0.5)


# -- one-pass memory updates and sign coding (streaming.c) against the core's compositions -------
OPS = TorchOps()
GRAD_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _gradient(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 3
    return g.to(dtype)


def _memory(numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed + 100))


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("numel,block", [(1000, 64), (1024, 64), (37, 8), (5, 1024), (4099, 1)])
@pytest.mark.parametrize("stat", [None, "max", "sum"])
def test_error_feedback_equals_the_composition(dtype, numel, block, stat):
    grad, memory = _gradient(numel, dtype, numel), _memory(numel, numel)
    memory[5 % numel] = float("nan")  # a NaN memory makes its block maximum NaN, as amax does
    expected = TensorOps.accumulate(OPS, memory, grad, 0.37, None, block, stat)
    got = kernels.error_feedback(grad, 0.37, memory, None, block, stat)
    assert torch.equal(got[0].nan_to_num(), expected[0].nan_to_num())
    assert got[0].isnan().equal(expected[0].isnan())
    if stat is None:
        assert got[1] is None
    else:
        # Sums run in float64 in another order; rounded to float32 they agree.
        assert got[1].to(torch.float32).nan_to_num().equal(expected[1].nan_to_num())
        assert got[1].isnan().equal(expected[1].isnan())
    assert got[2] is True and bool(expected[2])


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("m", [0.9, 1.0, 0.0])
def test_momentum_correction_equals_the_composition(dtype, nesterov, m):
    numel, block = 3001, 64
    grad = _gradient(numel, dtype, 7)
    momentum, velocity = _memory(numel, 1), _memory(numel, 2)
    expected = TensorOps.momentum_accumulate(OPS, momentum, velocity, grad, m, 0.5, nesterov,
                                             (None, None), block)
    got = kernels.momentum_correction(grad, 0.5, momentum, velocity, m, nesterov, block=block)
    for a, b in zip(got[:3], expected[:3]):
        assert torch.equal(a, b)
    assert got[3] is True


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_gradient_entry_is_reported(dtype, bad):
    grad = _gradient(5000, dtype, 3)
    grad[4321] = bad
    assert kernels.error_feedback(grad, 1.0, _memory(5000, 3))[2] is False
    assert kernels.momentum_correction(grad, 1.0, _memory(5000, 3), _memory(5000, 4), 0.9, False)[3] is False
    assert kernels.error_feedback(grad[:4321], 1.0, _memory(4321, 3))[2] is True


def test_float16_gradients_convert_exactly_for_every_bit_pattern():
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    got = kernels.error_feedback(every, 1.0, torch.zeros(1 << 16))[0]
    expected = every.float() + 0.0
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())
    assert got.isnan().equal(expected.isnan())


@pytest.mark.parametrize("stat,block", [("max", 64), ("sum", 64), ("sum", 3_000_001), (None, 0)])
def test_thread_ranges_cover_every_entry_and_block(stat, block):
    numel = kernels.PARALLEL_MIN_NUMEL * 3 + 100
    grad, memory = _gradient(numel, torch.float32, 5), _memory(numel, 5)
    expected = TensorOps.accumulate(OPS, memory, grad, 1.0, None, block, stat)
    threads = torch.get_num_threads()
    try:
        for width in (1, 2, 3):
            torch.set_num_threads(width)
            got = kernels.error_feedback(grad, 1.0, memory, None, block, stat)
            assert torch.equal(got[0], expected[0]), width
            if stat is not None:
                assert torch.equal(got[1].to(torch.float32), expected[1]), width
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("numel,block,length", [(16, 4, 16), (10, 4, 16), (1001, 1001, 1008),
                                                (5000, 64, 5120), (3 * kernels.PARALLEL_MIN_NUMEL + 3, 1000, 3 * kernels.PARALLEL_MIN_NUMEL + 8)])
def test_sign_pack_equals_the_composition(numel, block, length):
    x = _memory(numel, numel)
    x[::7] = 0.0
    x[3] = float("nan")
    scales = torch.rand(-(-length // block), generator=torch.Generator().manual_seed(1))
    packed, residual = kernels.sign_pack(x.clone(), scales, block, length)
    expected_packed, expected_residual = TensorOps.sign_compress(OPS, x.clone(), scales, block, length)
    assert torch.equal(packed, expected_packed)
    assert torch.equal(residual.nan_to_num(), expected_residual.nan_to_num())


@pytest.mark.parametrize("n,block", [(16, 4), (13, 4), (1001, 1001), (5000, 64),
                                     (3 * kernels.PARALLEL_MIN_NUMEL + 3, 1000)])
@pytest.mark.parametrize("add", [False, True])
def test_sign_decode_equals_the_composition(n, block, add):
    packed = torch.randint(0, 256, (-(-n // 8),), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    scales = torch.rand(-(-n // block), generator=torch.Generator().manual_seed(2))
    base = _memory(n, 9) if add else None
    expected = TensorOps.sign_decode(OPS, packed, scales, block, n, "float32",
                                     None if base is None else base.clone())
    got = kernels.sign_decode(packed, scales, block, n, None if base is None else base.clone())
    assert torch.equal(got, expected)


def test_streaming_kernels_refuse_what_they_cannot_take():
    with pytest.raises(TypeError, match="float32, float16 or bfloat16 gradient"):
        kernels.error_feedback(torch.randn(8, dtype=torch.float64), 1.0, torch.zeros(8))
    with pytest.raises(TypeError, match="one length"):
        kernels.error_feedback(torch.randn(8), 1.0, torch.zeros(9))
    with pytest.raises(TypeError, match="multiple of 8"):
        kernels.sign_pack(torch.randn(10), torch.ones(1), 10, 12)
    with pytest.raises(TypeError, match="at most 16 entries"):
        kernels.sign_decode(torch.zeros(2, dtype=torch.uint8), torch.ones(1), 8, 17)


def test_torch_ops_use_the_composition_for_a_tensor_scale_and_float64():
    grad, memory = torch.randn(100), torch.randn(100)
    scale = torch.tensor(0.5)
    total, _, finite, _ = OPS.accumulate(memory, grad, scale)
    assert torch.equal(total, memory + grad * scale) and bool(finite)
    total, _, _, _ = OPS.accumulate(memory.double(), grad.double(), 0.5)
    assert total.dtype == torch.float64


# -- bit fields of received messages (bits.c) --------------------------------------------------
def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n_bytes,n_bits", [(0, 0), (1, 5), (10, 80), (10, 77), (10000, 79_999)])
def test_set_bit_positions_equal_the_composition(n_bytes, n_bits):
    packed = _bytes(n_bytes, n_bits)
    expected = [i for i in range(n_bits) if (int(packed[i // 8]) >> (i % 8)) & 1]
    assert kernels.set_bit_positions(packed, n_bits).tolist() == expected
    assert torch.equal(OPS.set_bit_positions(packed, n_bits), TensorOps.set_bit_positions(OPS, packed, n_bits))


@pytest.mark.parametrize("width", [1, 7, 9, 12, 17, 33, 63])
def test_unpack_fields_reads_back_what_bits_of_packed(width):
    count = 1001
    values = torch.randint(0, 2 ** min(width, 62), (count,), generator=torch.Generator().manual_seed(width))
    bits = OPS.bits_of(values, width)
    packed = OPS.pack_bits(OPS.pad(bits, -(-bits.numel() // 8) * 8))
    assert torch.equal(TensorOps.unpack_fields(OPS, packed, width, count), values)


def naive_elias_fano_positions(lower, low_bits, upper, n_upper_bits, capacity, count, numel):
    """The definition, one bit at a time: (positions, 0 from count on; consistent)."""
    bit = lambda data, i: (int(data[i // 8]) >> (i % 8)) & 1
    ones = [b for b in range(n_upper_bits) if bit(upper, b)]
    positions = []
    for i in range(min(count, capacity, len(ones))):
        low = sum(bit(lower, i * low_bits + j) << j for j in range(low_bits))
        positions.append(((ones[i] - i) << low_bits) + low)
    consistent = len(ones) == count and all(p < numel for p in positions)
    return positions + [0] * (capacity - len(positions)), consistent


@pytest.mark.parametrize("low_bits,n_upper_bits,capacity,ones,count,numel", [
    (9, 800, 100, 100, 100, 300 << 9),    # consistent, full
    (9, 800, 100, 60, 60, 300 << 9),      # consistent, 60 of 100 slots
    (3, 77, 20, 19, 19, 1 << 20),         # a partial last byte
    (0, 64, 40, 40, 40, 64),              # no low bits
    (9, 800, 100, 61, 60, 300 << 9),      # one set bit more than the count
    (9, 800, 100, 59, 60, 300 << 9),      # one fewer
    (9, 800, 100, 120, 120, 300 << 9),    # more than the capacity
    (12, 800, 100, 100, 100, 5000),       # positions past the tensor
])
def test_elias_fano_positions_equal_the_definition_and_the_composition(
        low_bits, n_upper_bits, capacity, ones, count, numel):
    rng = torch.Generator().manual_seed(n_upper_bits + ones + count)
    marks = torch.randperm(n_upper_bits, generator=rng)[:ones]
    upper = torch.zeros(-(-n_upper_bits // 8), dtype=torch.uint8)
    for b in marks.tolist():
        upper[b // 8] |= 1 << (b % 8)
    lower = _bytes(-(-capacity * low_bits // 8), ones)
    expected, consistent = naive_elias_fano_positions(lower, low_bits, upper, n_upper_bits,
                                                      capacity, count, numel)
    positions, ok = kernels.elias_fano_positions(lower, low_bits, upper, n_upper_bits, capacity,
                                                 count, numel)
    reference, reference_ok = TensorOps.elias_fano_positions(OPS, lower, low_bits, upper, n_upper_bits,
                                                             capacity, torch.tensor(count), numel)
    assert bool(ok) == consistent == bool(reference_ok)
    if consistent:
        assert positions.tolist() == expected == reference.tolist()


def test_bit_kernels_refuse_reading_past_the_bytes():
    with pytest.raises(TypeError, match="at least 17 bits"):
        kernels.set_bit_positions(torch.zeros(2, dtype=torch.uint8), 17)
    with pytest.raises(TypeError, match="at least 30 bits"):
        kernels.elias_fano_positions(torch.zeros(3, dtype=torch.uint8), 10, torch.zeros(2, dtype=torch.uint8),
                                     16, 3, 3, 1000)
    with pytest.raises(TypeError, match="at least 17 bits"):
        kernels.elias_fano_positions(torch.zeros(4, dtype=torch.uint8), 10, torch.zeros(2, dtype=torch.uint8),
                                     17, 3, 3, 1000)


# -- decoding sparse messages into a gradient-sized output (streaming.c) --------------------------
def test_scatter_add_sums_repeated_indices_in_order_like_index_add():
    out = _memory(1000, 1)
    index = torch.randint(0, 1000, (5000,), generator=torch.Generator().manual_seed(2))
    values = _memory(5000, 3)
    expected = out.clone().index_add_(0, index, values)
    assert torch.equal(kernels.scatter_add(out.clone(), index, values), expected)


def test_scatter_add_refuses_an_index_outside_the_output():
    with pytest.raises(IndexError, match="index 10 at 1 is outside a tensor of 10"):
        kernels.scatter_add(torch.zeros(10), torch.tensor([3, 10]), torch.ones(2))


@pytest.mark.parametrize("numel", [0, 13, 3 * kernels.PARALLEL_MIN_NUMEL + 5])
def test_zero_clears_every_entry(numel):
    out = _memory(numel, 4) + 1.0
    assert torch.equal(kernels.zero(out), torch.zeros(numel))


@pytest.mark.parametrize("width,count,n_bytes", [(1, 8, 1), (9, 1001, 1200), (12, 25, 40), (63, 3, 24)])
def test_pack_fields_equals_the_composition(width, count, n_bytes):
    values = torch.randint(0, 2 ** min(width, 62), (count,), generator=torch.Generator().manual_seed(width))
    expected = TensorOps.pack_fields(OPS, values, width, n_bytes)
    assert torch.equal(kernels.pack_fields(values, width, n_bytes), expected)
    assert torch.equal(TensorOps.unpack_fields(OPS, expected, width, count), values)


def test_set_bits_equals_the_composition_and_refuses_a_position_outside():
    positions = torch.tensor([0, 3, 3, 17, 79])
    expected = TensorOps.set_bits(OPS, positions, 10)
    assert torch.equal(kernels.set_bits(positions, 10), expected)
    assert kernels.set_bit_positions(expected, 80).tolist() == [0, 3, 17, 79]
    with pytest.raises(IndexError, match="position 80 is outside 80 bits"):
        kernels.set_bits(torch.tensor([1, 80]), 10)


@pytest.mark.parametrize("threshold", [-1.0, 0.5, 3.0, 100.0])
def test_positions_at_least_equal_the_composition(threshold):
    x = _memory(5001, 8)
    x[[4, 99]] = float("nan")
    expected = TensorOps.positions_at_least(OPS, x, torch.tensor(threshold))
    assert torch.equal(kernels.positions_at_least(x, threshold), expected)


def test_scatter_sub_and_scatter_zero_equal_index_add_and_index_fill():
    out, index, values = _memory(1000, 5), torch.tensor([3, 999, 0, 500]), _memory(4, 6)
    assert torch.equal(OPS.scatter_sub(out.clone(), index, values),
                       out.clone().index_add_(0, index, values, alpha=-1))
    assert torch.equal(OPS.scatter_zero(out.clone(), index), out.clone().index_fill_(0, index, 0))


def test_sign_decode_all_equals_the_concatenation_of_the_composition():
    messages = [(_bytes(16, i), torch.rand(2, generator=torch.Generator().manual_seed(i)), 64, n)
                for i, n in enumerate([128, 128, 77])]
    expected = TensorOps.sign_decode_all(OPS, messages, "float32")
    assert torch.equal(OPS.sign_decode_all(messages, "float32"), expected)
    assert expected.numel() == 128 + 128 + 77


# -- candidates collected during the momentum pass (DGC's selection with a threshold hint) ------
def _naive_candidates(x: torch.Tensor, bound: float):
    """Positions and magnitudes of |x| >= bound by a plain mask, the bound rounded to float32."""
    mask = x.abs() >= torch.tensor(bound, dtype=torch.float32)
    positions = mask.nonzero().flatten()
    return positions, x.abs()[positions]


@pytest.mark.parametrize("numel", [3001, 4097, kernels.PARALLEL_MIN_NUMEL * 2 + 77])
@pytest.mark.parametrize("width", [1, 2, 3])
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("memory", ["momentum", "residual"])
def test_the_memory_pass_collects_every_entry_at_the_bound(numel, width, dtype, memory):
    grad = _gradient(numel, dtype, 11)
    first, second = _memory(numel, 5), _memory(numel, 6)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(width)
        if memory == "momentum":
            _, x, _, _, (positions, magnitudes, count) = kernels.momentum_correction(
                grad, 1.0, first, second, 0.9, False, block=64, bound=5.0, capacity=numel)
        else:
            x, _, _, (positions, magnitudes, count) = kernels.error_feedback(
                grad, 1.0, first * 3, None, 64, "max", bound=5.0, capacity=numel)
    finally:
        torch.set_num_threads(threads)
    expected_positions, expected_magnitudes = _naive_candidates(x, 5.0)
    assert count == expected_positions.numel() > 0
    assert torch.equal(positions, expected_positions)  # ascending across the thread ranges
    assert torch.equal(magnitudes, expected_magnitudes)


@pytest.mark.parametrize("numel", [3001, kernels.PARALLEL_MIN_NUMEL * 2 + 77])
@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("memory", ["momentum", "residual"])
def test_a_bound_per_block_collects_each_blocks_entries_at_its_own(numel, width, memory):
    """A bucket's pass: block b's entries are taken at bounds[b], and each block's count is
    its own (a plain mask per entry with the bound expanded; the composition alike)."""
    block = 64
    grad, first, second = _gradient(numel, torch.float32, 12), _memory(numel, 7), _memory(numel, 8)
    blocks = -(-numel // block)
    bounds = torch.rand(blocks, generator=torch.Generator().manual_seed(3)) * 6.0 + 1.0
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(width)
        if memory == "momentum":
            _, x, _, _, (positions, magnitudes, counts) = kernels.momentum_correction(
                grad, 1.0, first, second, 0.9, False, block=block, bound=bounds, capacity=numel)
        else:
            x, _, _, (positions, magnitudes, counts) = kernels.error_feedback(
                grad, 1.0, first, None, block, "max", bound=bounds, capacity=numel)
    finally:
        torch.set_num_threads(threads)
    per_entry = bounds.repeat_interleave(block)[:numel]
    mask = x.abs() >= per_entry
    assert torch.equal(positions, mask.nonzero().flatten())
    assert torch.equal(magnitudes, x.abs()[mask])
    want = torch.zeros(blocks, dtype=torch.int64).index_add_(0, mask.nonzero().flatten() // block,
                                                            torch.ones(int(mask.sum()), dtype=torch.int64))
    assert torch.equal(counts, want) and int(want.sum()) > 0
    if memory == "residual":
        composed = TensorOps.accumulate(OPS, first, grad, 1.0, None, block, "max", BlockBounds(bounds), numel)[3]
        assert torch.equal(composed.positions, positions) and torch.equal(composed.count, counts)
    overflowed = kernels.error_feedback(grad, 1.0, first, None, block, "max", bound=bounds, capacity=5)[3]
    assert overflowed[0].numel() == 0 and torch.equal(overflowed[2], kernels.error_feedback(
        grad, 1.0, first, None, block, "max", bound=bounds, capacity=numel)[3][2])


def test_candidates_equal_the_composition_and_overflow_to_empty():
    numel = 5000
    grad, momentum, velocity = _gradient(numel, torch.float32, 1), _memory(numel, 1), _memory(numel, 2)
    for capacity in (numel, 10):
        expected = TensorOps.momentum_accumulate(OPS, momentum, velocity, grad, 0.9, 0.5, True,
                                                 (None, None), 64, 3.0, capacity)[4]
        got = kernels.momentum_correction(grad, 0.5, momentum, velocity, 0.9, True, block=64,
                                          bound=3.0, capacity=capacity)[4]
        assert got[2] == expected.count > 10
        assert torch.equal(got[0], expected.positions) and torch.equal(got[1], expected.magnitudes)
    assert got[0].numel() == 0  # capacity 10: more reached the bound, none are kept


def test_the_bound_is_compared_in_float32_rounded_to_nearest():
    # 1 + 2^-25 rounds to 1.0 in float32: an entry of exactly 1.0 reaches it, as in torch.
    velocity = torch.zeros(64)
    velocity[9] = 1.0
    got = kernels.momentum_correction(torch.zeros(64), 1.0, torch.zeros(64), velocity, 0.9, False,
                                      block=64, bound=1.0 + 2.0 ** -25, capacity=64)[4]
    assert got[0].tolist() == [9] and got[2] == 1


def test_without_a_bound_no_candidates_and_a_bound_needs_the_block_maxima():
    grad, memory = _gradient(1000, torch.float32, 2), _memory(1000, 2)
    assert kernels.momentum_correction(grad, 1.0, memory, memory, 0.9, False, block=64)[4] is None
    with pytest.raises(ValueError, match="beside block maxima"):
        kernels.momentum_correction(grad, 1.0, memory, memory, 0.9, False, bound=1.0, capacity=9)
    with pytest.raises(ValueError, match="beside block maxima"):  # the composition, alike
        TensorOps.accumulate(OPS, memory, grad, 1.0, None, 64, "sum", 1.0, 9)
    with pytest.raises(ValueError, match="a bound of at least 0"):
        kernels.momentum_correction(grad, 1.0, memory, memory, 0.9, False, block=64, bound=-1.0, capacity=9)


def test_the_engine_hands_each_steps_candidate_bound_to_the_next(monkeypatch):
    """Over 40 steps of one tensor, the sampled selection runs only in the first steps (while
    the velocity still grows fast), and every step still sends the exact top-k of DGC's
    velocity, computed here with dense tensors and a sort."""
    import horovod_dgc.core.selection as selection
    from horovod_dgc.core import DGC, DGCConfig
    from horovod_dgc.torch.engine import Engine
    sampled_at = []
    sample = selection.sampled_threshold
    monkeypatch.setattr(selection, "sampled_threshold",
                        lambda *a, **kw: sampled_at.append(step) or sample(*a, **kw))
    n, density = 100_000, 0.001
    engine = Engine(DGC(DGCConfig(density=density, momentum=0.9, value_dtype="float32")), 1, 0)
    gen = torch.Generator().manual_seed(3)
    u, v = torch.zeros(n), torch.zeros(n)
    for step in range(40):
        grad = torch.randn(n, generator=gen)
        u = 0.9 * u + grad
        v = v + u
        outgoing = engine.compress("w", grad.reshape(100, -1).clone(), None)  # 1-D would go dense
        (update,) = engine.decompress(outgoing.message, [outgoing])
        mask = update.reshape(-1) != 0
        # The 100 largest |v|, up to exact ties (float32 sums do tie in 100,000 entries).
        assert int(mask.sum()) == 100 and v[mask].abs().min() >= v[~mask].abs().max(), step
        u, v = u.masked_fill(mask, 0.0), v.masked_fill(mask, 0.0)
    assert sampled_at == list(range(len(sampled_at))) and len(sampled_at) <= 20, sampled_at


def test_scalecom_leaders_keep_their_bound_until_they_lead_again(monkeypatch):
    """Two workers over 40 steps, each handing its stage 1's bound to its own next step, as
    the engine does: every step sends the exact top-k of the leader's ``p = m + g`` (dense
    tensors and a sort here), and the sample runs only in the first steps of each leader."""
    import horovod_dgc.core.selection as selection
    from horovod_dgc.core import CompressCall, ScaleCom, ScaleComConfig
    from horovod_dgc.core.collectives import emulate
    sampled_at = []
    sample = selection.sampled_threshold
    monkeypatch.setattr(selection, "sampled_threshold",
                        lambda *a, **kw: sampled_at.append(step) or sample(*a, **kw))
    n, density, world = 100_000, 0.001, 2
    method = ScaleCom(ScaleComConfig(density=density))
    gen = torch.Generator().manual_seed(5)
    states = [method.init_state(OPS, torch.zeros(n), True, world) for _ in range(world)]
    memories, bounds = [torch.zeros(n) for _ in range(world)], [None] * world
    for step in range(40):
        grads = [torch.randn(n, generator=gen) for _ in range(world)]
        calls = [CompressCall("w", rank, world, step, density, candidate_bound=bounds[rank])
                 for rank in range(world)]
        firsts = [method.first(OPS, s, g, c) for s, g, c in zip(states, grads, calls)]
        bounds = [handover.next_bound for _, _, handover in firsts]
        received = emulate(OPS, method.FIRST, [m for m, _, _ in firsts], method.root(calls[0]))
        seconds = [method.second(OPS, s, r, h) for (_, s, h), r in zip(firsts, received)]
        states = [state for _, state in seconds]
        finals = emulate(OPS, method.SECOND, [m for m, _ in seconds], method.root(calls[0]))
        update, _ = method.finish(OPS, finals[0], firsts[0][2])
        p = [m + g for m, g in zip(memories, grads)]
        leader, mask = p[step % world], update != 0
        assert int(mask.sum()) == 100 and leader[mask].abs().min() >= leader[~mask].abs().max(), step
        memories = [q.masked_fill(mask, 0.0) for q in p]
    assert len(sampled_at) <= 10 and max(sampled_at) < 20, sampled_at


def _messages(n: int, counts, capacity: int, seed: int):
    """Ascending positions (0 past each count) and values (0 past it), as decoded messages."""
    gen, messages = torch.Generator().manual_seed(seed), []
    for count in counts:
        positions = torch.zeros(capacity, dtype=torch.int64)
        positions[:count] = torch.randperm(n, generator=gen)[:count].sort().values
        values = torch.zeros(capacity)
        values[:count] = torch.randn(count, generator=gen)
        messages.append((positions, values, count))
    return messages


@pytest.mark.parametrize("n,counts", [(10, [3, 0, 10]), (5000, [40, 40, 17, 0]),
                                      (3 * kernels.PARALLEL_MIN_NUMEL + 5, [900, 1000, 1000])])
def test_sum_sparse_is_the_average_a_loop_over_messages_writes(n, counts):
    messages = _messages(n, counts, max(counts), n)
    expected = [0.0] * n  # the definition: message after message, scale * value added at its position
    for positions, values, count in messages:
        for p, v in zip(positions[:count].tolist(), values[:count].tolist()):
            expected[p] = float(torch.tensor(expected[p], dtype=torch.float32)
                                + torch.tensor(v, dtype=torch.float32) * torch.tensor(1 / 3, dtype=torch.float32))
    threads = torch.get_num_threads()
    try:
        for width in (1, 2, 3):
            torch.set_num_threads(width)
            out = kernels.sum_sparse(torch.full((n,), 7.0), messages, 1 / 3)
            assert out.tolist() == expected
            assert torch.equal(TensorOps.sum_sparse(OPS, torch.full((n,), 7.0), messages, 1 / 3), out)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("offset", [0, 1, 4, 16])  # output 64-byte aligned, or 4, 16, 64 bytes off
def test_sum_sparse_entries_never_leak_into_the_next_chunk(offset):
    # Repeated positions, a NaN and an infinity at the same in-chunk offsets of consecutive
    # chunks: a buffer that is not cleared where they landed would carry them onwards.
    n = 5 * 1024 + 37
    positions = torch.tensor([3, 3, 700, 1024 + 3, 2048 + 700, 4096 + 3, 5 * 1024 + 36])
    values = torch.tensor([1.0, 2.0, float("nan"), 4.0, float("inf"), 5.0, 6.0])
    expected = [0.0] * n
    for p, v in zip(positions.tolist(), values.tolist()):
        expected[p] += v
    out = torch.full((n + offset,), 7.0)[offset:]
    assert kernels.sum_sparse(out, [(positions, values, 7)], 1.0) is out
    got = out.tolist()
    assert math.isnan(got[700]) and got[2048 + 700] == math.inf
    assert [v for i, v in enumerate(got) if i != 700] == [v for i, v in enumerate(expected) if i != 700]


def test_sum_sparse_leaves_unsorted_or_outside_positions_to_the_scatter():
    out = torch.full((10,), 7.0)
    unsorted = [(torch.tensor([4, 2]), torch.ones(2), 2)]
    assert kernels.sum_sparse(out, unsorted, 1.0) is None and bool((out == 7.0).all())
    assert kernels.sum_sparse(out, [(torch.tensor([2, 10]), torch.ones(2), 2)], 1.0) is None
    assert kernels.sum_sparse(out, [(torch.tensor([-1, 2]), torch.ones(2), 2)], 1.0) is None
    # The check reads only the counted positions: a second message out of order past its count.
    assert kernels.sum_sparse(out, [(torch.tensor([1, 3]), torch.ones(2), 2),
                                    (torch.tensor([5, 99, 0]), torch.ones(3), 1)], 1.0) is not None
    assert out.tolist() == [0, 1, 0, 1, 0, 1, 0, 0, 0, 0]
    out.fill_(7.0)
    assert OPS.sum_sparse(out, unsorted, 1.0).tolist() == [0, 0, 1, 0, 1, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="a count of 3 for 2 positions"):
        kernels.sum_sparse(out, [(torch.tensor([2, 4]), torch.ones(2), 3)], 1.0)


# -- the whole decode of an allgather (kernels.decode_sums) -----------------------------------
# (numel, density, value format, gradient dtype): one coding of positions or values each.
DECODE_CASES = {"elias-fano, float16": (100_000, 0.001, "float16", torch.float32),
                "bitmap, float32": (1000, 0.3, "float32", torch.float32),
                "raw, int8": (5000, 0.0002, "int8", torch.float32),
                "elias-fano, bfloat16": (20_000, 0.005, "float16", torch.bfloat16)}


def _allgather(world, flagged_rank=None, seed=0):
    """(layouts, the concatenated messages of ``world`` TopK ranks for every case's tensor,
    each rank's (positions, values as float32) per tensor read from its gradient)."""
    from horovod_dgc.core import TopK, TopKConfig
    from horovod_dgc.core.method import CompressCall
    gen = torch.Generator().manual_seed(seed)
    layouts, messages, sent = [], [], []
    for rank in range(world):
        mine = []
        for t, (numel, density, value_dtype, dtype) in enumerate(DECODE_CASES.values()):
            method = TopK(TopKConfig(density=density, value_dtype=value_dtype))
            grad = torch.randn(numel, generator=gen).to(dtype)
            if dtype == torch.bfloat16:  # bfloat16 rounds many magnitudes alike: no ties at k
                k = round(density * numel)
                planted = torch.randperm(numel, generator=gen)[:k]
                grad.mul_(0.01)[planted] = (2 + torch.arange(k) / 64).to(dtype) * torch.sign(torch.randn(k, generator=gen)).to(dtype)
            if rank == flagged_rank and t == 1:
                grad[7] = float("nan")
            result = method.compress(OPS, method.init_state(OPS, grad, True, world), grad,
                                     CompressCall(f"t{t}", rank, world, 3, density))
            messages.append(result.message)
            if rank == 0:
                layouts.append(result.layout)
            k = result.layout.capacity
            order = sorted(range(numel), key=lambda i: -abs(float(grad[i])))[:k]  # a sort, not the core
            positions = sorted(order)
            values = grad[positions].float()
            if value_dtype == "float16" and dtype == torch.float32:
                values = values.half().float()
            elif value_dtype == "int8":
                scale = values.abs().max() / 127
                values = (values / scale).round() * scale
            mine.append((positions, values))
        sent.append(mine)
    return layouts, torch.cat(messages), sent


def _naive_average(layouts, sent, world):
    """Message after message in rank order, value / N added at its position, in float32."""
    outs = []
    for t, layout in enumerate(layouts):
        out = torch.zeros(layout.numel)
        for rank in range(world):
            positions, values = sent[rank][t]
            for p, v in zip(positions, values):
                out[p] = out[p] + v * torch.tensor(1 / world)
        outs.append(out)
    return outs


@pytest.mark.parametrize("world", [1, 3])
def test_decode_sums_is_the_average_of_every_coding_and_the_composition(world):
    from horovod_dgc.core.sparse import _sum_messages
    layouts, data, sent = _allgather(world)
    assert sorted({layout.indices.name for layout in layouts}) == ["bitmap", "elias-fano", "raw"]
    assert {layout.value_format for layout in layouts} == {"float16", "float32", "int8", "bfloat16"}
    sums = [torch.full((layout.numel,), 7.0) for layout in layouts]
    flags = kernels.decode_sums(data, layouts, world, 3, sums, 1 / world)
    assert flags is not None and flags.tolist() == [0] * world * len(layouts)
    for t, (got, want) in enumerate(zip(sums, _naive_average(layouts, sent, world))):
        # int8's scale is rounded differently by the sort-based reference: one level of it.
        tolerance = dict(rtol=0, atol=2e-2) if layouts[t].value_format == "int8" else dict(rtol=0, atol=0)
        torch.testing.assert_close(got, want, **tolerance)
    composed, composed_flags = _sum_messages(OPS, data, layouts, world, 3,
                                             [torch.zeros(layout.numel) for layout in layouts])
    assert all(torch.equal(a, b) for a, b in zip(sums, composed))
    assert torch.equal(flags, composed_flags)


def test_decode_sums_returns_each_messages_flags_in_the_order_received():
    layouts, data, _ = _allgather(2, flagged_rank=1)
    flags = kernels.decode_sums(data, layouts, 2, 3, [torch.zeros(layout.numel) for layout in layouts], 0.5)
    assert flags.tolist() == [0, 0, 0, 0, 0, 1, 0, 0]


def _corrupt(data, layouts, message, byte, value):
    data = data.clone()
    data[sum(layout.nbytes for layout in layouts[:message]) + byte] = value
    return data


@pytest.mark.parametrize("damage", ["header", "step", "count", "positions", "size", "unsorted"])
def test_decode_sums_leaves_what_it_cannot_take_to_the_composition(damage):
    from horovod_dgc.core import wire
    layouts, data, _ = _allgather(2)
    step = 3
    if damage == "header":
        data = _corrupt(data, layouts, 1, 4 * wire.HEADER_FIELDS.index("tensor id"), 1)
    elif damage == "step":
        step = 4
    elif damage == "count":  # the bitmap's set bits no longer match its count
        data = _corrupt(data, layouts, 1, wire.HEADER_BYTES, 0xFF)
    elif damage == "positions":  # raw position 0 of tensor 2 far outside its 5000 elements
        data = _corrupt(data, layouts, 2, wire.HEADER_BYTES + 3, 0x7F)
    elif damage == "size":
        data = data[:-8]
    else:  # a one-rank message of two raw positions, swapped: summable, but not by sum_sparse
        from horovod_dgc.core import TopK, TopKConfig
        from horovod_dgc.core.method import CompressCall
        method = TopK(TopKConfig(density=0.0004, value_dtype="int8"))
        grad = torch.randn(5000)
        result = method.compress(OPS, method.init_state(OPS, grad, True, 1), grad,
                                 CompressCall("t2", 0, 1, 3, 0.0004))
        assert result.layout.indices.name == "raw" and result.layout.capacity == 2
        layouts, data, at = [result.layout], result.message.clone(), wire.HEADER_BYTES
        data[at:at + 8] = torch.cat([data[at + 4:at + 8], data[at:at + 4]])
    world = 1 if damage == "unsorted" else 2
    sums = [torch.full((layout.numel,), 7.0) for layout in layouts]
    assert kernels.decode_sums(data, layouts, world, step, sums, 1 / world) is None
    assert all(bool((s == 7.0).all()) for s in sums)


def test_sparse_decompress_takes_the_kernel_on_the_cpu(monkeypatch):
    from horovod_dgc.core import TopK, sparse
    layouts, data, sent = _allgather(2)
    monkeypatch.setattr(sparse, "_sum_messages", lambda *args: pytest.fail("composition ran"))
    outs, finite = TopK().decompress(OPS, data, layouts, 2, 3, ["float32"] * len(layouts))
    assert bool(finite)
    assert all(torch.equal(a, b) for a, b in zip(outs[:2], _naive_average(layouts, sent, 2)[:2]))


@pytest.mark.parametrize("case", list(DECODE_CASES))
@pytest.mark.parametrize("count_share", [1.0, 0.5, 0.0])
def test_encode_message_writes_the_compositions_bytes_and_decoded_values(case, count_share):
    from horovod_dgc.core import wire
    numel, density, value_dtype, dtype = DECODE_CASES[case]
    for value_format in ([value_dtype, "int8"] if value_dtype != "int8" else ["int8", "float32"]):
        fmt = wire.value_format(str(dtype).split(".")[-1], value_format)
        layout = wire.MessageLayout(name="w", method_id=1, numel=numel,
                                    capacity=max(1, round(density * numel)), value_format=fmt)
        gen = torch.Generator().manual_seed(numel)
        count = int(layout.capacity * count_share)
        positions = torch.randperm(numel, generator=gen)[:count].sort().values
        # Magnitudes from 1e-9 to 1e6: subnormal and clamped float16 values, ties of rounding.
        values = torch.randn(count, generator=gen) * torch.logspace(-9, 6, count or 1)[:count]
        header = layout.header(2, 7, count, 0)
        got = kernels.encode_message(layout, header, positions, count, values)
        want = layout.encode(ComposedMessages(), header, positions, count, values)
        assert got is not None, (case, fmt)
        assert torch.equal(got[0], want[0]), (case, fmt)
        assert torch.equal(got[1], want[1].float()), (case, fmt)


def test_encode_message_leaves_what_it_cannot_take_to_the_composition():
    from horovod_dgc.core import wire
    layout = wire.MessageLayout(name="w", method_id=1, numel=1000, capacity=10, value_format="float16")
    header = layout.header(0, 0, 3, 0)
    values = torch.ones(3)
    for positions in ([1, 5, 5], [5, 1, 7], [1, 5, 1000], [-1, 5, 7]):
        assert kernels.encode_message(layout, header, torch.tensor(positions), 3, values) is None
    assert kernels.encode_message(layout, header, torch.tensor([1, 5, 7]), 3, values.double()) is None
    tensor_header = list(header[:-1]) + [torch.tensor(0)]
    assert kernels.encode_message(layout, tensor_header, torch.tensor([1, 5, 7]), 3, values) is None


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_positions_reads_a_leaders_message_of_positions_only(case):
    from horovod_dgc.core import wire
    numel, density, _, _ = DECODE_CASES[case]
    layout = wire.MessageLayout(name="w", method_id=4, numel=numel,
                                capacity=max(1, round(density * numel)), value_format=None)
    count = layout.capacity - 1 if layout.capacity > 1 else 1
    positions = torch.randperm(numel, generator=torch.Generator().manual_seed(3))[:count].sort().values
    message, _ = layout.encode(ComposedMessages(), layout.header(1, 5, count, 1), positions, count)
    got, flags = kernels.decode_positions(message, layout, 1, 5)
    assert got.tolist() == positions.tolist() + [0] * (layout.capacity - count)  # a plain list
    assert flags.tolist() == [1]
    # Another sender, another step or a bad count: left to the composition, which names it.
    assert kernels.decode_positions(message, layout, 0, 5) is None
    assert kernels.decode_positions(message, layout, 1, 6) is None
    if layout.indices.name != "raw":  # raw positions carry no count of their own to disagree
        message[:wire.HEADER_BYTES].view(torch.int32)[wire.COUNT_WORD] = count - 1
        assert kernels.decode_positions(message, layout, 1, 5) is None


def _top_by_sort(positions, magnitudes, starts, counts, ks):
    """Each segment's k largest by a Python sort (ties to the lowest position), positions
    ascending, and its k-th largest."""
    picked, kth = [], []
    for start, count, k in zip(starts, counts, ks):
        order = sorted(range(start, start + count), key=lambda j: (-magnitudes[j], positions[j]))[:k]
        picked += sorted(positions[j] for j in order)
        kth.append(magnitudes[order[-1]])
    return picked, kth


@pytest.mark.parametrize("tied", [False, True], ids=["distinct", "tied"])
def test_top_of_segments_takes_each_segments_k_largest_ties_to_the_lowest(tied):
    """Against a sort per segment: k from 1 to every candidate; with ``tied`` the magnitudes
    are a few values (0, a subnormal, infinity among them), so most k-th largest are shared."""
    gen = torch.Generator().manual_seed(3)
    choices = torch.tensor([0.0, 1e-45, 0.5, 1.0, 3.0, math.inf])
    for trial in range(200):
        counts = torch.randint(1, 300, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen).tolist()
        ks = [int(torch.randint(1, c + 1, (1,), generator=gen)) for c in counts]
        ks[0] = counts[0] if trial % 5 == 0 else ks[0]
        n = sum(counts)
        positions = torch.randperm(10 * n, generator=gen)[:n].sort()[0]
        magnitudes = (choices[torch.randint(0, len(choices), (n,), generator=gen)] if tied
                      else torch.rand(n, generator=gen))
        starts = [sum(counts[:s]) for s in range(len(counts))]
        got, kth = kernels.top_of_segments(positions, magnitudes, torch.tensor(starts), torch.tensor(counts),
                                           torch.tensor(ks))
        want, want_kth = _top_by_sort(positions.tolist(), magnitudes.tolist(), starts, counts, ks)
        assert got.tolist() == want
        assert kth.tolist() == want_kth


@pytest.mark.parametrize("k, count, start", [(0, 5, 0), (6, 5, 0), (2, 5, 6)])
def test_top_of_segments_refuses_a_k_or_segment_outside_the_candidates(k, count, start):
    positions, magnitudes = torch.arange(10), torch.rand(10)
    with pytest.raises(ValueError, match="segment 0 takes k="):
        kernels.top_of_segments(positions, magnitudes, torch.tensor([start]), torch.tensor([count]),
                                torch.tensor([k]))


def _pieces(numels, dtype, seed, gaps):
    """A bucket's gradient as parts in their own storage at offsets with ``gaps`` entries of
    padding after each, and the same gradient written out by a plain concatenation."""
    gen = torch.Generator().manual_seed(seed)
    parts = [(torch.randn(n, generator=gen) * 4).to(dtype) for n in numels]
    offsets, at = [], 0
    for n, gap in zip(numels, gaps):
        offsets.append(at)
        at += n + gap
    whole = torch.cat([torch.cat([p, torch.zeros(gap, dtype=dtype)]) for p, gap in zip(parts, gaps)])
    stale = whole.ne(0).to(dtype) * 7  # a buffer that does not hold the gradient (padding zero)
    return Pieces(stale, tuple(parts), tuple(offsets)), whole


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("large", [False, True], ids=["one-range", "thread-ranges"])
def test_the_memory_pass_reads_a_gradient_where_its_pieces_lie(dtype, width, large):
    """Parts of a bucket read where they lie, zeros between them, equal bit for bit to the
    pass over their concatenation: memories, block maxima, per-block candidates and counts
    (pieces longer than a chunk, shorter than a block, and ranges that start inside one)."""
    numels = [3, 1000, 64, 1, 2049] + ([kernels.PARALLEL_MIN_NUMEL + 5, 700_001] if large else [])
    gaps = [61, 24, 0, 63, 63] + ([59, 3] if large else [])
    pieces, whole = _pieces(numels, dtype, 21, gaps)
    n, block = whole.numel(), 64
    bounds = torch.rand(-(-n // block), generator=torch.Generator().manual_seed(4)) * 8.0
    momentum, velocity = _memory(n, 3), _memory(n, 4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(width)
        for grad_scale, nesterov in ((1.0, False), (0.5, True)):
            got = kernels.momentum_correction(pieces, grad_scale, momentum, velocity, 0.9, nesterov, block=block,
                                              bound=bounds, capacity=n)
            want = kernels.momentum_correction(whole, grad_scale, momentum, velocity, 0.9, nesterov, block=block,
                                               bound=bounds, capacity=n)
            for a, b in zip(got[:3] + got[4], want[:3] + want[4]):
                assert torch.equal(a, b)
            assert got[3] is True and got[4][0].numel() > 0
        got = kernels.error_feedback(pieces, 2.0, momentum, None, block, "max", bounds, n)
        want = kernels.error_feedback(whole, 2.0, momentum, None, block, "max", bounds, n)
        for a, b in zip(got[:2] + got[3], want[:2] + want[3]):
            assert torch.equal(a, b)
    finally:
        torch.set_num_threads(threads)
    pieces.parts[-1][-1] = float("nan")
    assert kernels.error_feedback(pieces, 1.0, momentum)[2] is False


def test_pieces_gathered_equal_their_concatenation_on_either_ops():
    """What anything but a memory's pass reads: TorchOps' copy into the flat buffer, and the
    core's composition (a concatenation with zeros), both the plain concatenation."""
    pieces, whole = _pieces([5, 130, 64], torch.float32, 2, [59, 62, 0])
    assert torch.equal(TensorOps.gathered(OPS, pieces), whole)
    assert torch.equal(OPS.gathered(pieces), whole) and OPS.gathered(pieces) is pieces.flat
    assert OPS.takes_pieces(whole) and not OPS.takes_pieces(whole.double())


def test_pieces_read_zeros_past_their_last_and_must_share_one_dtype():
    pieces, whole = _pieces([100, 100], torch.float32, 2, [28, 28])
    short = Pieces(torch.zeros(whole.numel() + 64), pieces.parts, pieces.offsets)
    assert kernels.error_feedback(short, 1.0, torch.zeros(short.flat.numel()))[0][-64:].eq(0).all()
    mixed = Pieces(pieces.flat, (pieces.parts[0], pieces.parts[1].half()), pieces.offsets)
    assert not kernels.supports_accumulate(mixed, torch.zeros(whole.numel()))
    with pytest.raises(TypeError, match="accumulate takes"):
        kernels.error_feedback(mixed, 1.0, torch.zeros(whole.numel()))


@pytest.mark.parametrize("a, b", [
    (0, torch.tensor([5, -3, 7, 2], dtype=torch.int32)),  # a number into an integer tensor
    (float("nan"), torch.tensor([1.5, -2.0, 0.25, 8.0], dtype=torch.float16)),
    (0.5, torch.tensor([5, -3, 7, 2])),  # promotes: no in-place fill of an int64 tensor
    (1, 0), (0, 1), (True, False),  # numbers only
    (torch.tensor([9, 9, 9, 9]), 0),  # a tensor first
    (0, torch.tensor(4)),  # a 0-d tensor the predicate broadcasts over
])
def test_where_equals_torch_where_in_values_and_dtype(a, b):
    pred = torch.tensor([True, False, False, True])
    got, want = TorchOps().where(pred, a, b), torch.where(pred, a, b)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("offset, stride", [(0, 1), (3, 12), (11, 12), (5, 7)])
def test_strided_sample_of_single_entries_is_every_stride_th_from_the_offset(offset, stride):
    x = torch.arange(60, dtype=torch.int32)
    got = TorchOps().strided_sample(x, offset, stride)
    assert got.is_contiguous()
    assert got.tolist() == [v for i, v in enumerate(range(60)) if i >= offset and (i - offset) % stride == 0]
