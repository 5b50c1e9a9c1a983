"""The selection's kernels (``kernels/triton_selection.py``): Gaussian-k's thresholds against
a loop written here from the method's rule (count, compare with ``[2k/3, 4k/3]``, raise by
1.5 or lower by 0.5, keep the lowest tried), then a bucket's whole Gaussian-k selection with
the kernel against the core's composition, as a GPU's engine would run it without the
kernel; the sort keys (and the chosen blocks' positions) against the float32 bits ``struct``
gives, and a bucket's top-k with them against a sort of each segment alone.

As ``test_triton_bits.py``: on a CUDA device the kernel runs on CUDA tensors, and on every
machine with Triton the same tests run again in a child process under Triton's interpreter.
"""
import random
import struct

import numpy as np
import pytest
import torch
from conftest import TRITON_DEVICE, check_under_the_triton_interpreter, runs_on_the_triton_device

pytest.importorskip("triton")

from horovod_dgc.core import bucket as buckets  # noqa: E402
from horovod_dgc.core.ops import TensorOps  # noqa: E402
from horovod_dgc.torch.kernels import triton_memory, triton_selection  # noqa: E402
from horovod_dgc.torch.ops import TorchOps  # noqa: E402

DEVICE, runs_here = TRITON_DEVICE, runs_on_the_triton_device


def by_the_rule(magnitudes, counts, thresholds, ks, whole, adjustments):
    out, start = [], 0
    for count, t, k, w in zip(counts, thresholds, ks, whole):
        mine = magnitudes[start:start + count]
        start += count
        low, high = np.float32(2.0 / 3.0 * k), np.float32(4.0 / 3.0 * k)
        t, lowest = np.float32(t), np.float32(t)
        reached = sum(m >= t for m in mine)
        for _ in range(adjustments):
            if low <= reached <= high:
                break
            t = np.float32(t * np.float32(1.5 if reached > high else 0.5))
            reached = sum(m >= t for m in mine)
            lowest = min(lowest, t)
        out.append(0.0 if w else float(t if reached >= np.float32(np.ceil(2.0 / 3.0 * k)) else lowest))
    return out


def segments(rng, n_segments):
    """Per segment: its magnitudes, k, a starting threshold far off or near, whether whole."""
    counts, ks, thresholds, whole, magnitudes = [], [], [], [], []
    for s in range(n_segments):
        k = rng.choice([1, 3, 40, 700])
        count = min(rng.choice([k + 1, 2 * k, 4 * k]), 5000)
        values = np.abs(np.random.RandomState(s).standard_normal(count)).astype(np.float32)
        magnitudes += values.tolist()
        counts.append(count)
        ks.append(k)
        thresholds.append(float(np.float32(rng.choice([0.01, 0.5, 1.0, 2.0, 8.0]))))
        whole.append(s % 7 == 6)
    return magnitudes, counts, ks, thresholds, whole


def tensors(device, magnitudes, counts, ks, thresholds, whole):
    f32 = dict(dtype=torch.float32, device=device)
    return (torch.tensor(magnitudes, **f32), torch.tensor(buckets._starts(counts), device=device),
            torch.tensor(counts, device=device), torch.tensor(thresholds, **f32),
            torch.tensor([2.0 / 3.0 * k for k in ks], **f32), torch.tensor([4.0 / 3.0 * k for k in ks], **f32),
            torch.tensor([float(np.ceil(2.0 / 3.0 * k)) for k in ks], **f32),
            torch.tensor(whole, dtype=torch.bool, device=device))


@pytest.mark.parametrize("n_segments", [1, 5, 40])
@runs_here
def test_every_segments_threshold_follows_the_rule(n_segments):
    magnitudes, counts, ks, thresholds, whole = segments(random.Random(n_segments), n_segments)
    got = triton_selection.gaussian_thresholds(*tensors(DEVICE, magnitudes, counts, ks, thresholds, whole), 3)
    assert got.cpu().tolist() == by_the_rule(magnitudes, counts, thresholds, ks, whole, 3)


@pytest.mark.parametrize("seed", [0, 1, 2])
@runs_here
def test_a_buckets_gaussian_selection_with_the_kernel_is_the_compositions(seed, monkeypatch):
    """Shapes from one element to a segment of 300,000, densities whose capacities hold a
    segment whole or not: the positions sent are the same with and without the kernel."""
    rng = np.random.RandomState(seed)
    members = [("a", 1, True), ("b", 1000, False), ("c", 300_000, False), ("d", 64, True), ("e", 50_000, False)]
    bucket = buckets.Bucket.of("b0", members, "float32")
    plan = buckets.Plan.at(bucket, [0.3, 0.01, 0.001, 0.3, 0.01])
    x = torch.zeros(bucket.numel)
    for s in bucket.segments:
        x[s.offset:s.end] = torch.from_numpy(rng.standard_normal(s.numel).astype(np.float32))
    x = x.to(DEVICE)
    monkeypatch.setattr(TorchOps, "sizes_cost_a_wait", lambda self, x: True)
    gaussian = buckets.GaussianPlan.of(plan)
    with_kernel = buckets.select_gaussian(TorchOps(), x, gaussian)
    monkeypatch.setattr(TorchOps, "gaussian_thresholds", TensorOps.gaussian_thresholds)
    composed = buckets.select_gaussian(TorchOps(), x, gaussian)
    assert with_kernel.cpu().tolist() == composed.cpu().tolist()


def float32_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("masked", [False, True])
@runs_here
def test_sort_keys_are_each_bases_less_one_more_than_the_magnitudes_float32_bits(dtype, masked):
    rng = random.Random(5)
    special = [0.0, -0.0, 1e-40, -1e-40, 3.0, -3.0, 65504.0, float("inf"), -float("inf")]
    x = torch.tensor(special + [rng.gauss(0, 1) * 10 ** rng.randrange(-6, 4) for _ in range(3000)]).to(dtype)
    base = torch.tensor([rng.randrange(1, 40) * 2 ** 33 for _ in range(x.numel())], dtype=torch.int64)
    real = torch.tensor([rng.random() < 0.8 for _ in range(x.numel())]) if masked else True
    got = triton_selection.magnitude_keys(x.to(DEVICE), base.to(DEVICE),
                                          real.to(DEVICE) if masked else True).cpu().tolist()
    magnitudes = x.float().abs().tolist()  # exact: every value of these dtypes is a float32
    want = [b - (float32_bits(m) + 1) if (not masked or r) else b
            for b, m, r in zip(base.tolist(), magnitudes, real.tolist() if masked else [True] * x.numel())]
    assert got == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@runs_here
def test_the_chosen_blocks_entries_get_their_positions_and_keys_by_definition(dtype):
    """Blocks of 8 over three segments whose edges (300, 700) and end (997) cut blocks: an
    entry past its block's segment, or past the bucket, is padding (its segment's base)."""
    rng = random.Random(9)
    block, edges = 8, [0, 300, 700, 997]
    x = torch.tensor([rng.gauss(0, 1) * 10 ** rng.randrange(-3, 3) for _ in range(997)]).to(dtype)
    blocks = sorted(rng.sample(range(1, 124), 30)) + [37, 87, 124]  # 296-303, 696-703, 992-999
    blocks.sort()
    segment_of = [max(i for i, e in enumerate(edges[:-1]) if e <= b * block) for b in blocks]
    slot_offset = [j for _ in blocks for j in range(block)]
    slot_last = [edges[s + 1] - 1 for s in segment_of for _ in range(block)]
    slot_base = [(s + 1) * 2 ** 33 for s in segment_of for _ in range(block)]
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=DEVICE)  # noqa: E731
    positions, keys = triton_selection.block_keys(x.to(DEVICE), as_tensor(blocks), block, as_tensor(slot_offset),
                                                  as_tensor(slot_last), as_tensor(slot_base))
    magnitudes = x.float().abs().tolist()
    want_positions = [b * block + j for b in blocks for j in range(block)]
    want_keys = [base - (float32_bits(magnitudes[p]) + 1) if p <= last else base
                 for p, last, base in zip(want_positions, slot_last, slot_base)]
    assert positions.cpu().tolist() == want_positions
    assert keys.cpu().tolist() == want_keys


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "tied"])
@pytest.mark.skipif(not triton_memory.INTERPRETED, reason="the selection's tensors are on the CPU")
def test_a_buckets_top_k_from_the_kernels_positions_and_keys_is_each_segments_own(ties, monkeypatch):
    from test_core_bucket import test_each_segment_sends_its_own_largest as check
    from conftest import WaitingOps
    calls = []
    block_keys = triton_selection.block_keys
    monkeypatch.setattr(triton_selection, "block_keys", lambda *a: calls.append(1) or block_keys(*a))
    check(WaitingOps(), ties)
    assert calls


@pytest.mark.skipif(triton_memory.INTERPRETED, reason="this is the interpreted run")
def test_the_kernel_under_the_interpreter_on_cpu_tensors():
    """This file's kernel tests again where Triton interprets kernels on the CPU (a process
    of its own: Triton reads the switch when it is imported)."""
    check_under_the_triton_interpreter(__file__)
