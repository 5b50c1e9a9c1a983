"""Selection against naive references: exact top-k, DGC's sampled selection, Gaussian-k."""
import math
from fractions import Fraction

import pytest
import torch

import horovod_dgc.core.selection as selection
from horovod_dgc.core.ops import Candidates
from horovod_dgc.core.selection import (CANDIDATE_CAPACITY, FIRST_MARGIN, GAUSSIAN_HIGH, GAUSSIAN_LOW,
                                        EXACT_BELOW_NUMEL, MIN_MARGIN, TARGET_CANDIDATES, block_size,
                                        candidate_capacity, gaussian_capacity,
                                        predict_bound, select_exact, select_gaussian, select_sampled,
                                        top_count)
from horovod_dgc.torch.ops import TorchOps

from conftest import WaitingOps

ops = TorchOps()


def naive_topk_set(x: torch.Tensor, k: int) -> set:
    """The k positions of largest magnitude by a plain sort (ties: lower position first)."""
    values = x.tolist()  # one copy to the host, not one per entry
    return set(sorted(range(x.numel()), key=lambda i: (-abs(values[i]), i))[:k])


def samples(n: int, seed: int, device: torch.device):
    """Drawn on the CPU (the same values on every device), then moved to ``device``."""
    gen = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, generator=gen, device="cpu")
    heavy = torch.distributions.StudentT(torch.tensor(1.5, device="cpu")).sample((n,))
    sparse = normal * (torch.rand(n, generator=gen, device="cpu") < 0.05)
    shifted = normal + 3.0
    return {"normal": normal.to(device), "heavy-tailed": heavy.to(device), "mostly zero": sparse.to(device),
            "shifted": shifted.to(device)}


@pytest.mark.parametrize("n,density", [(5000, 0.01), (20_011, 0.001), (3, 0.5), (777, 1.0)])
def test_exact_topk_matches_naive_sort(n, density, device):
    for name, x in samples(n, 1, device).items():
        k = top_count(density, n)
        got = select_exact(ops, x, k)
        assert got.numel() == k
        assert set(got.tolist()) == naive_topk_set(x, k) or name == "mostly zero"


@pytest.mark.parametrize("n,density", [(100_003, 0.001), (50_000, 0.01), (4099, 0.1), (4096, 0.25)])
def test_dgc_sampled_selection_sends_exactly_k_true_topk(n, density, device):
    k = top_count(density, n)
    for name, x in samples(n, 2, device).items():
        for step in range(5):
            got = select_sampled(ops, x, k, sample_ratio=0.01, offset=step * 7919,
                                 max_retries=4, retry_factor=0.8)
            assert got.numel() == k, (name, step)
            assert len(set(got.tolist())) == k, (name, step)
            kth = torch.topk(x.abs(), k).values[-1]
            assert x[got].abs().min() >= kth, (name, step)
            if name != "mostly zero":  # zeros tie: any of them is a correct k-th entry
                assert set(got.tolist()) == set(torch.topk(x.abs(), k).indices.tolist())


def test_dgc_selection_without_retries_falls_back_to_an_exact_bound(device):
    x = torch.randn(10_000, device="cpu").to(device)
    k = 100
    # A retry factor that barely lowers the threshold cannot reach k: the block bound must.
    got = select_sampled(ops, x, k, sample_ratio=0.001, offset=0, max_retries=1, retry_factor=0.999)
    assert set(got.tolist()) == set(torch.topk(x.abs(), k).indices.tolist())


@pytest.mark.parametrize("n,density", [(64, 0.05), (2048, 0.05), (EXACT_BELOW_NUMEL - 1, 0.001)])
def test_small_tensors_take_a_plain_exact_topk(n, density, monkeypatch, device):
    """Below EXACT_BELOW_NUMEL entries (norms and biases) the selection is the naive top-k in
    ascending order, and neither the sample nor the block selection runs; from it on, the
    sample does (a cut-off on the wrong side would send 25M-entry tensors to a full top-k)."""
    ran = []
    for name in ("sampled_threshold", "select_by_blocks"):
        real = getattr(selection, name)
        monkeypatch.setattr(selection, name, lambda *a, _real=real, _name=name, **kw:
                            ran.append(_name) or _real(*a, **kw))
    k = top_count(density, n)
    for name, x in samples(n, 7, device).items():
        got = select_sampled(ops, x, k, 0.01, 3, 4, 0.8)
        assert got.tolist() == sorted(got.tolist()) and got.numel() == k, name
        if name != "mostly zero":
            assert set(got.tolist()) == naive_topk_set(x, k), name
    assert ran == []
    x = samples(EXACT_BELOW_NUMEL, 7, torch.device("cpu"))["normal"]
    select_sampled(ops, x, top_count(0.001, x.numel()), 0.01, 3, 4, 0.8)
    assert ran == ["sampled_threshold"]


@pytest.mark.parametrize("density", [0.001, 0.01, 0.05])
def test_gaussiank_count_within_two_thirds_and_four_thirds_of_k_on_bell_data(density, device):
    n = 200_000
    gen = torch.Generator().manual_seed(3)
    for step in range(10):
        x = (torch.randn(n, generator=gen, device="cpu") * (1 + step) + 0.1 * step).to(device)
        k = top_count(density, n)
        got = select_gaussian(ops, x, k)
        assert GAUSSIAN_LOW * k <= got.numel() <= GAUSSIAN_HIGH * k, (step, got.numel(), k)
        threshold = x[got].abs().min()
        assert int((x.abs() >= threshold).sum()) == got.numel(), "not every entry above the threshold"


def test_block_size_is_a_power_of_two_near_twice_the_square_root_of_one_over_density():
    assert block_size(0.001) == 64
    assert block_size(0.25) == 8
    assert block_size(1e-6) == 1024
    assert all(math.log2(block_size(d)).is_integer() for d in (0.3, 0.01, 0.0003))


def test_dgc_selection_fallback_with_fewer_blocks_than_k(device):
    # Density 0.25 gives blocks of 8, so k = n/4 exceeds the n/8 blocks; one huge column at
    # the sampled positions pushes the sampled threshold above every other entry.
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1024, 100, generator=gen, device="cpu") * 1e-3
    x[:, 0] += 1.0
    x = x.reshape(-1).to(device)
    k = top_count(0.25, x.numel())
    got = select_sampled(ops, x, k, sample_ratio=0.01, offset=0, max_retries=4, retry_factor=0.8)
    assert set(got.tolist()) == set(torch.topk(x.abs(), k).indices.tolist())


def _candidates_at(x: torch.Tensor, bound: float, capacity: int):
    """A naive stand-in for what the memory's pass collects: a mask, positions in order."""
    positions = (x.abs() >= bound).nonzero().flatten()
    if positions.numel() > capacity:
        return Candidates(positions[:0], x[:0], positions.numel(), bound)
    return Candidates(positions, x.abs()[positions], positions.numel(), bound)


@pytest.mark.parametrize("bound_factor,capacity_factor", [(0.9, 6), (1.2, 6), (0.3, 6), (0.9, 1)])
def test_dgc_selection_from_collected_candidates_is_the_exact_topk(bound_factor, capacity_factor,
                                                                    monkeypatch, device):
    """Candidates enough (0.9 of the k-th largest), too few (1.2), too many for the capacity
    (0.3, or capacity k): always the naive top-k; the sample runs only when they cannot do.
    Where sizes cost a wait (a GPU) neither runs: the block selection needs no candidates."""
    n, k = 50_000, 50
    sampled = []
    real = selection.sampled_threshold
    monkeypatch.setattr(selection, "sampled_threshold",
                        lambda *a, **kw: sampled.append(1) or real(*a, **kw))
    for name, x in samples(n, 4, device).items():
        if name == "mostly zero":
            continue
        kth = float(torch.topk(x.abs(), k).values[-1])
        candidates = _candidates_at(x, bound_factor * kth, capacity_factor * k)
        sampled.clear()
        got = select_sampled(ops, x, k, 0.01, 3, 4, 0.8, candidates=candidates)
        assert set(got.tolist()) == naive_topk_set(x, k), name
        assert got.tolist() == sorted(got.tolist())
        usable = k <= candidates.count <= capacity_factor * k
        if ops.sizes_cost_a_wait(x):
            assert not sampled, name
        else:
            assert bool(sampled) != usable, (name, candidates.count)


def test_candidate_capacity_and_none_where_candidates_cannot_help():
    assert candidate_capacity(2.0, 10, 100_000) == CANDIDATE_CAPACITY * 10
    # No bound yet, a skipped step's 0, a non-finite one, and a density (warm-up's 25%) whose
    # candidates would be a large share of the tensor: the sampled selection runs.
    for bound, k in [(None, 10), (0.0, 10), (float("nan"), 10), (float("inf"), 10), (2.0, 25_000)]:
        assert candidate_capacity(bound, k, 100_000) == 0


def test_predicted_bound_puts_the_target_count_between_it_and_the_threshold(device):
    k, threshold = 100, torch.tensor(10.0, device=device)
    # 901 entries reached 8.0, 100 of them at least the threshold 10: 801 entries per 2.0 of
    # magnitude, so TARGET_CANDIDATES * k entries reach 10 - 2.0 * 100 / 801.
    reached = Candidates(torch.zeros(0, device=device), torch.zeros(0, device=device), 901, 8.0)
    expected = 10.0 - 2.0 * (TARGET_CANDIDATES - 1) * k / 801
    assert float(predict_bound(ops, threshold, k, reached)) == pytest.approx(expected)
    # No count yet, or fewer than k reached the bound (the threshold fell below it).
    assert float(predict_bound(ops, threshold, k, None)) == pytest.approx(10.0 * FIRST_MARGIN)
    few = Candidates(torch.zeros(0, device=device), torch.zeros(0, device=device), 50, 10.5)
    assert float(predict_bound(ops, threshold, k, few)) == pytest.approx(10.0 * FIRST_MARGIN)
    # Entries barely spread below the threshold: never below MIN_MARGIN times it.
    sparse = Candidates(torch.zeros(0, device=device), torch.zeros(0, device=device), 101, 1.0)
    assert float(predict_bound(ops, threshold, k, sparse)) == pytest.approx(10.0 * MIN_MARGIN)


def naive_topk_magnitudes(x: torch.Tensor, k: int) -> list:
    """The k largest magnitudes, largest first, by a plain sort (ties do not matter here)."""
    return sorted((abs(v) for v in x.tolist()), reverse=True)[:k]


def crowded(n: int, device: torch.device) -> torch.Tensor:
    """Small noise, with the largest entries crowded into one block, and more in the last
    entries (past the whole blocks when n is not a multiple of the block)."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(5), device="cpu") * 0.01
    x[128:160] = torch.linspace(5.0, 6.0, 32)
    x[-7:] = torch.tensor([-9.0, 8.0, -7.5, 7.0, 6.5, -6.2, 6.1])
    return x.to(device)


@pytest.mark.parametrize("n,density", [(100_003, 0.001), (65_536, 0.001), (50_000, 0.01), (4099, 0.1),
                                       (1000, 0.25), (40, 0.1), (9, 0.5)])
def test_block_selection_is_an_exact_topk_with_fixed_sizes(n, density, device):
    k = top_count(density, n)
    cases = dict(samples(n, 4, device), crowded=crowded(n, device)) if n >= 200 else samples(n, 4, device)
    for name, x in cases.items():
        got = selection.select_by_blocks(ops, x, k)
        positions = got.tolist()
        assert len(positions) == k and positions == sorted(set(positions)), name
        assert all(0 <= p < n for p in positions), name
        # The same magnitudes as a plain sort's top-k: exact, whichever equal entries a tie kept.
        assert sorted((abs(v) for v in x[got].tolist()), reverse=True) == naive_topk_magnitudes(x, k), name
        if name not in ("mostly zero", "crowded"):
            assert set(positions) == naive_topk_set(x, k), name


def test_where_sizes_cost_a_wait_dgc_selects_by_blocks_the_same_top_k(monkeypatch):
    x = samples(100_003, 6, torch.device("cpu"))["normal"]
    k = top_count(0.001, x.numel())
    used = []
    by_blocks = selection.select_by_blocks
    monkeypatch.setattr(selection, "select_by_blocks", lambda *a, **kw: used.append(1) or by_blocks(*a, **kw))
    got = select_sampled(WaitingOps(), x, k, 0.01, 3, 4, 0.8)
    assert used and set(got.tolist()) == naive_topk_set(x, k)


@pytest.mark.parametrize("density,numel", [(0.01, 19200), (0.07, 100), (0.001, 1_000_000), (0.3, 10),
                                           (0.001, 999), (0.0001, 5), (0.29, 100)])
def test_top_count_is_the_exact_ceiling_of_density_times_n(density, numel):
    """k = min(n, max(1, ceil(rho * n))) with rho * n in exact decimal arithmetic (0.01 * 19200
    is 192, not the 193 that a ceiling of the float product 192.00000000000003 gives).
    Catches a ceiling of the unrounded float product."""
    exact = Fraction(str(density)) * numel
    assert top_count(density, numel) == min(numel, max(1, math.ceil(exact)))


@pytest.mark.parametrize("n,density", [(100_003, 0.001), (50_000, 0.01)])
def test_gaussiank_sends_the_largest_entries_when_its_adjustments_end_too_low(n, density,
                                                                             monkeypatch, device):
    """A normal threshold far too low (a memory whose tail was cut by earlier steps) stays too
    low after the three adjustments: far more than ceil(4k/3) entries reach it, and the message
    must hold exactly the ceil(4k/3) largest (a sort here). Catches a final pick that collects
    from a bound with fewer than capacity entries above it (the k-th largest block maximum
    instead of the capacity-th) or that keeps the wrong ones."""
    monkeypatch.setattr(selection, "gaussian_threshold", lambda ops_, x_, d: 1e-3)
    k = top_count(density, n)
    capacity = gaussian_capacity(k, n)
    for name, x in samples(n, 9, device).items():
        if name == "mostly zero":
            continue
        got = select_gaussian(ops, x, k)
        assert got.tolist() == sorted(naive_topk_set(x, capacity)), name


def test_gaussiank_capacity_is_the_ceiling_of_four_thirds_k():
    """The message holds ceil(4k/3) entries (docs/algorithms.md#gaussiank), never more than n.
    Catches a capacity rounded down (int(4k/3)), one short of the accepted range's top."""
    for k in (1, 2, 10, 11, 100, 1000):
        assert gaussian_capacity(k, 10 ** 6) == -(-4 * k // 3), k
    assert gaussian_capacity(10, 12) == 12


def test_dgc_selection_fallback_bound_lets_k_entries_through_on_one_spike_per_block(monkeypatch, device):
    """When the sampled threshold and its retries find fewer than k entries, the bound is the
    k-th largest block maximum: k distinct entries reach it. With one non-zero entry per
    block the (k-1)-th largest maximum would let only k - 1 through. The sample is made to
    overshoot every entry, so the fallback always runs; the result must be the naive top-k."""
    n, k = 8192, 50
    block = selection.filter_block(k, n)
    values = torch.zeros(n)
    magnitudes = torch.randperm(n // block, generator=torch.Generator().manual_seed(5)).float() + 1.0
    values[::block] = magnitudes * torch.where(torch.arange(n // block) % 2 == 0, 1.0, -1.0)
    x = values.to(device)
    monkeypatch.setattr(selection, "sampled_threshold", lambda *a, **kw: float(x.abs().max()) * 2.0)
    got = select_sampled(ops, x, k, 0.01, 0, max_retries=1, retry_factor=0.999)
    assert got.tolist() == sorted(naive_topk_set(x, k))


@pytest.mark.parametrize("selection_ops", [TorchOps(), WaitingOps()], ids=["own-choice", "as-on-a-gpu"])
@pytest.mark.parametrize("n,density", [(777, 0.05), (5000, 0.01), (20_011, 0.001), (50_000, 0.003)])
def test_ties_at_the_kth_largest_go_to_the_lowest_positions(selection_ops, n, density):
    """Small integers: most magnitudes tie, and the k-th largest is shared by many entries.
    Every path (the full top-k, the sampled selection with or without candidates, the
    blocks a GPU selects by) takes the lowest tied positions, as the naive sort does, so
    that a tensor's top-k is one set on the stock path, in a bucket and on every device."""
    gen = torch.Generator().manual_seed(n)
    x = torch.round(torch.randn(n, generator=gen) * 2)
    k = top_count(density, n)
    want = sorted(naive_topk_set(x, k))
    got = select_sampled(selection_ops, x, k, 0.01, 3, 4, 0.8)
    assert got.tolist() == want
    assert select_exact(selection_ops, x, k).tolist() == want
    bound = float(x.abs().max()) * 0.99 if n > 1000 else None
    if bound is not None:
        positions = torch.nonzero(x.abs() >= bound).reshape(-1)
        candidates = Candidates(positions, x.abs()[positions], positions.numel(), bound)
        if positions.numel() >= k:
            assert select_sampled(selection_ops, x, k, 0.01, 3, 4, 0.8, candidates=candidates).tolist() == want
