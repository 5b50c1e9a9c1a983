"""The sparse all-reduce (aggregation="sparse_allreduce") in the core's N-worker simulation:
against a naive reference of the protocol written here with loops and sorts, the
conservation law over 200 steps, non-finite gradients, mismatched settings, and traffic."""
import dataclasses
import math

import pytest
import torch

from horovod_dgc.core import MessageError, CompressCall
from horovod_dgc.core.methods import BY_NAME, from_saved
from horovod_dgc.core.sparse_allreduce import FORWARD_SLACK, REGION_SLACK, SparseAllreduce
from horovod_dgc.core.twostage import simulate_step
from horovod_dgc.torch import Compression
from horovod_dgc.torch.ops import TorchOps

from conftest import randn

ops = TorchOps()


def calls(workers: int, step: int, density: float, name: str = "w"):
    return [CompressCall(name, r, workers, step, density) for r in range(workers)]


def build(method: str, **options):
    built = BY_NAME[method].build(aggregation="sparse_allreduce", **options)
    assert isinstance(built, SparseAllreduce) and built.family == "two-stage"
    return built


def largest(entries, count):
    """The ``count`` (position, value) pairs of largest |value|, ties to the lower position."""
    return sorted(sorted(entries, key=lambda e: (-abs(e[1]), e[0]))[:count])


def reference_topk_step(residuals, owners, grads, k, workers):
    """One step of the protocol for Top-k, in plain Python lists: returns the update and
    updates the residual lists in place."""
    n = len(grads[0])
    region = math.ceil(n / workers)
    to_owner = min(region, math.ceil(REGION_SLACK * k / workers))
    forward = min(region, math.ceil(FORWARD_SLACK * k / workers))
    received = [[0.0] * region for _ in range(workers)]
    for i in range(workers):
        p = [e + g for e, g in zip(residuals[i], grads[i])]
        chosen = largest(list(enumerate(p)), k)
        for j in range(workers):
            mine = largest([(pos, v) for pos, v in chosen if pos // region == j], to_owner)
            for pos, v in mine:
                p[pos] -= v
                received[j][pos - j * region] += v / workers
        residuals[i] = p
    update = [0.0] * n
    for j in range(workers):
        valid = max(0, min(region, n - j * region))
        total = [owners[j][q] + received[j][q] for q in range(region)]
        for q, v in largest(list(enumerate(total[:valid])), min(forward, valid)):
            update[j * region + q] = v
            total[q] -= v
        owners[j] = total
    return update


@pytest.mark.parametrize("workers,n", [(3, 1000), (4, 1001), (2, 257)])
def test_topk_sparse_allreduce_matches_the_naive_reference(workers, n, device):
    density = 0.02
    method = build("topk", density=density, value_dtype="float32")
    k = math.ceil(density * n)
    gen = torch.Generator().manual_seed(workers)
    states = [method.init_state(ops, torch.zeros(n, device=device), True, workers) for _ in range(workers)]
    residuals = [[0.0] * n for _ in range(workers)]
    owners = [[0.0] * math.ceil(n / workers) for _ in range(workers)]
    for step in range(6):
        # Skewed scales put more of the selection in some regions than their share.
        grads = [(torch.randn(n, generator=gen, device="cpu")
                  * torch.linspace(0.1, 3.0, n, device="cpu")).to(device) for _ in range(workers)]
        results, states = simulate_step(ops, method, states, grads, calls(workers, step, density))
        want = reference_topk_step(residuals, owners, [g.double().tolist() for g in grads], k, workers)
        for r in results:
            torch.testing.assert_close(r.double(), torch.tensor(want, dtype=torch.float64, device=device),
                                       rtol=1e-5, atol=1e-6)
        for i in range(workers):
            torch.testing.assert_close(states[i]["residual"].double(),
                                       torch.tensor(residuals[i], dtype=torch.float64, device=device),
                                       rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(states[i]["owner_residual"].double(),
                                       torch.tensor(owners[i], dtype=torch.float64, device=device),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method,options", [
    ("topk", {}), ("gaussiank", {}), ("dgc", {"momentum": 0.0}), ("topk", {"value_dtype": "int8"})])
def test_sparse_allreduce_conserves_gradient_mass_over_200_steps(method, options, device):
    """(1/N) sum of gradients = updates applied + (1/N) sum of worker residuals + owner
    residuals, with 16-bit (or 8-bit) values rounding on both stages."""
    workers, n, density = 4, 5003, 0.01
    built = build(method, density=density, **options)
    memory = built.inner.memory.state_names[-1]
    gen = torch.Generator().manual_seed(7)
    states = [built.init_state(ops, torch.zeros(n, device=device), True, workers) for _ in range(workers)]
    applied = torch.zeros(n, dtype=torch.float64, device=device)
    mean_grads = torch.zeros(n, dtype=torch.float64, device=device)
    for step in range(200):
        grads = [randn(n, generator=gen, device=device) * (1 + step % 5) for _ in range(workers)]
        results, states = simulate_step(ops, built, states, grads, calls(workers, step, density))
        assert all(torch.equal(results[0], r) for r in results[1:])
        assert torch.count_nonzero(results[0]) <= workers * math.ceil(FORWARD_SLACK * math.ceil(density * n) / workers)
        applied += results[0].double()
        mean_grads += sum(g.double() for g in grads) / workers
    owner = torch.cat([s["owner_residual"] for s in states])
    assert torch.count_nonzero(owner[n:]) == 0
    kept = sum(s[memory].double() for s in states) / workers + owner[:n].double()
    error = (applied + kept - mean_grads).norm() / mean_grads.norm()
    assert error < 1e-5, float(error)


def test_a_non_finite_gradient_on_one_rank_reaches_every_rank(device):
    workers, n = 3, 3000
    method = build("dgc", density=0.01)
    states = [method.init_state(ops, torch.zeros(n, device=device), True, workers) for _ in range(workers)]
    grads = [randn(n, device=device) for _ in range(workers)]
    grads[1][17] = float("inf")
    results, _ = simulate_step(ops, method, states, grads, calls(workers, 0, 0.01))
    assert all(torch.isnan(r).all() for r in results)


def test_raise_policy_names_the_rank_and_tensor(device):
    workers, n = 2, 3000
    method = build("topk", density=0.01, nonfinite="raise")
    states = [method.init_state(ops, torch.zeros(n, device=device), True, workers) for _ in range(workers)]
    grads = [randn(n, device=device), torch.full((n,), float("nan"), device=device)]
    with pytest.raises(Exception, match="tensor 'w' on rank 1"):
        simulate_step(ops, method, states, grads, calls(workers, 0, 0.01))


def test_a_rank_set_up_for_the_allgather_is_named_by_the_header_check(device):
    """Rank 1 runs the same method with allgather messages cut to the alltoall's size: the
    owner names rank 1 and the tensor instead of decoding garbage."""
    workers, n, density = 2, 4000, 0.01
    method = build("topk", density=density)
    plain = BY_NAME["topk"].build(density=density)
    grads = [randn(n, device=device) for _ in range(workers)]
    ctx = calls(workers, 0, density)
    first = [method.first(ops, method.init_state(ops, grads[0], True, workers), grads[0], ctx[0])]
    other = plain.compress(ops, plain.init_state(ops, grads[1], True, workers), grads[1], ctx[1])
    size = ops.numel(first[0][0])
    wrong = ops.fit(other.message, size)
    received = torch.cat([first[0][0][: size // 2], wrong[size // 2:]])
    with pytest.raises(MessageError, match="rank 1 .*tensor 'w'"):
        method.second(ops, first[0][1], received, first[0][2])


def test_options_and_saved_states_keep_the_aggregation():
    with pytest.raises(ValueError, match="aggregation"):
        BY_NAME["dgc"].build(aggregation="ring")
    with pytest.raises(ValueError, match="number of workers"):
        BY_NAME["dgc"].build(aggregation="auto")
    assert BY_NAME["dgc"].build(2, aggregation="auto").family == "sparse"
    assert BY_NAME["dgc"].build(16, aggregation="auto").family == "two-stage"


@pytest.mark.parametrize("name,first_workers", [("dgc", 8), ("topk", 7), ("gaussiank", 7)])
def test_auto_takes_the_sparse_allreduce_only_where_it_halves_the_bytes(name, first_workers):
    """At 4 workers the sparse all-reduce already sends fewer bytes, but not half: "auto"
    keeps the allgather there and switches where the model says at most half."""
    numel = 2 ** 20

    def per_worker(workers: int, aggregation: str) -> float:
        method = BY_NAME[name].build(workers, aggregation=aggregation)
        return method.network_bytes(numel, "float32", method.config.density, workers)

    assert per_worker(4, "sparse_allreduce") < per_worker(4, "allgather")
    for workers in (2, 4, first_workers - 1, first_workers, 16):
        share = per_worker(workers, "sparse_allreduce") / per_worker(workers, "allgather")
        expected = "two-stage" if share <= 0.5 else "sparse"
        assert BY_NAME[name].build(workers, aggregation="auto").family == expected, (workers, share)
        assert (expected == "two-stage") == (workers >= first_workers)
    method = build("dgc", density=0.001)
    assert method.table_class == "DGC"
    again = from_saved("DGC", dataclasses.asdict(method.config))
    assert isinstance(again, SparseAllreduce) and again.config == method.config
    assert method.state_layout(True).sharded == ("owner_residual",)
    assert method.state_layout(False).per_worker == ("momentum",)


def test_traffic_per_worker_stays_flat_while_the_allgather_grows():
    numel, density = 2_359_296, 0.001  # ResNet-50's largest convolution
    gathered = BY_NAME["dgc"].build(density=density)
    reduced = build("dgc", density=density)

    def per_worker(method, workers):
        return method.network_bytes(numel, "float32", density, workers)

    assert per_worker(gathered, 16) > 14 * per_worker(gathered, 2)
    # An all-reduce of any kind sends about (N - 1) / N of its payload: 1.75x from 2 to 8.
    assert per_worker(reduced, 8) < 1.85 * per_worker(reduced, 2)
    for workers in (4, 8, 16, 64):
        assert per_worker(reduced, workers) < 2.0 * per_worker(reduced, 4)
        assert per_worker(reduced, workers) < per_worker(gathered, workers) * 5.0 / workers
    assert per_worker(reduced, 2) > per_worker(gathered, 2)


def test_resuming_on_more_workers_re_cuts_the_owner_residuals(device):
    """Saved on 2 workers, resumed on 3: the owners' residuals, laid end to end, are the same
    tensor (cut into 3 regions now), and the workers' memories keep their average."""
    from horovod_dgc.core.state import redistribute, state_frame

    numel, method = 1001, build("dgc", density=0.01)
    gen = torch.Generator().manual_seed(3)
    parts = []
    for rank in range(2):
        state = method.init_state(ops, torch.zeros(numel, device=device), True, 2)
        state = {key: randn(value.numel(), generator=gen, device=device) for key, value in state.items()}
        parts.append(state_frame(method, world_size=2, rank=rank, epoch=1.0, steps={"w": 5},
                                 states={"w": state}))
    shares = [redistribute(ops, parts, 3, rank) for rank in range(3)]
    assert [s["states"]["w"]["owner_residual"].numel() for s in shares] == [334] * 3
    owners = torch.cat([p["states"]["w"]["owner_residual"] for p in parts])[:numel]
    torch.testing.assert_close(torch.cat([s["states"]["w"]["owner_residual"] for s in shares])[:numel],
                               owners)
    for key in ("momentum", "velocity"):
        before = sum(p["states"]["w"][key] for p in parts) / 2
        torch.testing.assert_close(sum(s["states"]["w"][key] for s in shares) / 3, before)


def test_the_torch_factory_resolves_auto_by_the_number_of_workers(monkeypatch):
    import horovod_dgc.torch.compression as adapter

    monkeypatch.setattr(adapter, "_workers", lambda: None)
    with pytest.raises(ValueError, match="hvd.init"):
        Compression.dgc(aggregation="auto")
    for workers, family in ((2, "sparse"), (4, "sparse"), (8, "two-stage")):
        monkeypatch.setattr(adapter, "_workers", lambda: workers)
        assert Compression.dgc(aggregation="auto").method.family == family
    assert Compression.topk(aggregation="sparse_allreduce").method.family == "two-stage"
