"""The GPU's bit kernels (``kernels/triton_bits.py``) against loops written here from the
codings' definitions: the packed low-bit fields, the bitvector of positions, and the
Elias-Fano decode of several senders' rows at once (each slot's position, the set bits
counted, those past the capacity dropped, the padding slots). The core's composition of the
row decode is held to the same loop.

As ``test_triton_memory.py``: on a CUDA device the kernels run as TorchOps runs them, and on
every machine with Triton the same tests run again in a child process under Triton's
interpreter on CPU tensors.
"""
import random

import pytest
import torch
from conftest import TRITON_DEVICE, check_under_the_triton_interpreter, runs_on_the_triton_device

pytest.importorskip("triton")

from horovod_dgc.core.ops import TensorOps  # noqa: E402
from horovod_dgc.torch.kernels import triton_bits, triton_memory  # noqa: E402
from horovod_dgc.torch.ops import TorchOps  # noqa: E402

DEVICE, runs_here = TRITON_DEVICE, runs_on_the_triton_device


def packed(bits, n_bytes):
    """Bytes of ``bits`` (0/1, lowest bit of each byte first), zeros after them."""
    out = [0] * n_bytes
    for i, bit in enumerate(bits):
        out[i // 8] |= bit << (i % 8)
    return out


def fields(values, width):
    return [(v >> j) & 1 for v in values for j in range(width)]


@pytest.mark.parametrize("count,width,n_bytes", [(1, 1, 1), (5, 3, 2), (1000, 9, 1125), (1000, 9, 1200),
                                                 (777, 17, 1700), (3, 40, 16), (0, 5, 8)])
@runs_here
def test_fields_are_packed_value_after_value_lowest_bit_first(count, width, n_bytes):
    rng = random.Random(count * width)
    values = [rng.randrange(2 ** width) for _ in range(count)]
    out = triton_bits.pack_fields(torch.tensor(values, dtype=torch.int64, device=DEVICE), width, n_bytes)
    assert out.dtype == torch.uint8 and out.shape == (n_bytes,)
    assert out.cpu().tolist() == packed(fields(values, width), n_bytes)


@pytest.mark.parametrize("count,n_bytes", [(1, 1), (3, 3), (100, 13), (5000, 1001), (70000, 9000), (0, 6)])
@runs_here
def test_the_bit_of_every_position_is_set_and_no_other(count, n_bytes):
    rng = random.Random(count)
    positions = [rng.randrange(n_bytes * 8) for _ in range(count)]  # repeats included
    out = triton_bits.set_bits(torch.tensor(positions, dtype=torch.int64, device=DEVICE), n_bytes)
    assert out.dtype == torch.uint8 and out.shape == (n_bytes,)
    bits = [0] * (n_bytes * 8)
    for p in positions:
        bits[p] = 1
    assert out.cpu().tolist() == packed(bits, n_bytes)


def elias_fano_row(positions, low_bits, capacity, upper_bits, lower_bytes, upper_bytes, rng):
    """One row's bytes by the coding's definition, the low fields' unused bits random (what
    a row's padding holds must not matter to the slots that are counted)."""
    low = [p & (2 ** low_bits - 1) for p in positions]
    lower_bits = fields(low, low_bits) + [rng.randrange(2) for _ in range((capacity - len(positions)) * low_bits)]
    upper = [0] * upper_bits
    for i, p in enumerate(positions):
        upper[(p >> low_bits) + i] = 1
    return packed(lower_bits, lower_bytes), packed(upper, upper_bytes)


def expected_row(lower, upper, low_bits, upper_bits, capacity):
    """Slot i: ((b_i - i) << l) + field_i for the row's i-th set bit b_i (b_i = 0 past its
    last), and the number of set bits."""
    marks = [b for b in range(upper_bits) if (upper[b // 8] >> (b % 8)) & 1]
    out = []
    for i in range(capacity):
        field = sum(((lower[(i * low_bits + j) // 8] >> ((i * low_bits + j) % 8)) & 1) << j
                    for j in range(low_bits))
        out.append((((marks[i] if i < len(marks) else 0) - i) << low_bits) + field)
    return out, len(marks)


@pytest.mark.parametrize("numel,capacity,rows", [(1000, 10, 1), (100000, 100, 3), (5000, 5000, 2),
                                                 (7, 3, 4), (2 ** 20, 1000, 2)])
@pytest.mark.parametrize("run", [pytest.param("kernel", marks=runs_here), "composition"])
def test_every_rows_elias_fano_positions_by_the_definition(numel, capacity, rows, run):
    rng = random.Random(numel + rows)
    low_bits = max(0, (numel // capacity).bit_length() - 1)
    upper_bits = capacity + (numel >> low_bits) + 1
    lower_bytes, upper_bytes = -(-capacity * low_bits // 8), -(-upper_bits // 8)
    lower, upper, want = [], [], []
    for r in range(rows):
        # Full, partly full and empty rows.
        count = [capacity, capacity // 2, 0, 1][r % 4]
        row_lower, row_upper = elias_fano_row(sorted(rng.sample(range(numel), count)), low_bits, capacity,
                                              upper_bits, lower_bytes, upper_bytes, rng)
        lower += row_lower
        upper += row_upper
        want.append(expected_row(row_lower, row_upper, low_bits, upper_bits, capacity))
    if rows > 1:  # one bit more than the capacity, in the last row: dropped, but counted
        last = upper[-upper_bytes:]
        free = next(b for b in range(upper_bits) if not (last[b // 8] >> (b % 8)) & 1)
        upper[len(upper) - upper_bytes + free // 8] |= 1 << (free % 8)
        want[-1] = expected_row(lower[-lower_bytes:] if lower_bytes else [], upper[-upper_bytes:], low_bits,
                                upper_bits, capacity)
    device = DEVICE if run == "kernel" else "cpu"
    args = (torch.tensor(lower, dtype=torch.uint8, device=device), low_bits,
            torch.tensor(upper, dtype=torch.uint8, device=device), upper_bits, capacity, rows)
    decode = triton_bits.elias_fano_rows if run == "kernel" else \
        (lambda *a: TensorOps.elias_fano_rows(TorchOps(), *a))
    positions, found = decode(*args)
    assert positions.dtype == torch.int64 and positions.shape == (rows * capacity,)
    assert positions.cpu().tolist() == [p for row, _ in want for p in row]
    assert found.cpu().tolist() == [n for _, n in want]


@pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available(), reason="no CUDA device")
def test_torch_ops_take_the_kernels_for_cuda_tensors(monkeypatch):
    calls = []
    for name in ("pack_fields", "set_bits", "elias_fano_rows"):
        real = getattr(triton_bits, name)
        monkeypatch.setattr(triton_bits, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    ops, positions = TorchOps(), torch.arange(0, 4000, 7, device="cuda")
    ops.pack_fields(positions, 5, 400)
    ops.set_bits(positions, 500)
    ops.elias_fano_rows(torch.zeros(2, dtype=torch.uint8, device="cuda"), 0,
                        torch.zeros(8, dtype=torch.uint8, device="cuda"), 30, 2, 2)
    assert len(calls) == 3
    ops.set_bits(positions.cpu(), 500)
    assert len(calls) == 3


@pytest.mark.skipif(not triton_memory.INTERPRETED, reason="counts the interpreter's launches")
def test_the_benchmarks_count_a_launch_as_one_operation_and_nothing_inside_it():
    from benchmarks.model_step import OpCounter
    positions = torch.arange(0, 4000, 7)
    with OpCounter() as counted:
        triton_bits.set_bits(positions, 501)
    # zeros, the launch, the bytes' view (view.dtype and detach), their first 501
    assert counted.count == 5
    with OpCounter() as counted:
        torch.zeros(3)
    assert counted.count == 1  # the launcher is itself again after the count


@pytest.mark.skipif(triton_memory.INTERPRETED, reason="this is the interpreted run")
def test_the_kernels_under_the_interpreter_on_cpu_tensors():
    """This file's kernel tests again where Triton interprets kernels on the CPU (a process
    of its own: Triton reads the switch when it is imported)."""
    check_under_the_triton_interpreter(__file__)
