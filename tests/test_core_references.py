"""Pieces of the methods against naive references written here (a loop, a sort, the
paper's equation), never against the core itself: Gaussian-k's threshold, blocksign's
scaled sign, ScaleCom's leader and low-pass memory, the average over N workers, and what
16-bit gradients and loss scales do to the wire and the memories."""
import statistics

import pytest
import torch

from horovod_dgc.core import (CompressCall, DGC, DGCConfig, ScaleCom,
                              ScaleComConfig, TopK, TopKConfig)
from horovod_dgc.core.collectives import cut_buckets, emulate, backward_buckets
from horovod_dgc.core.selection import gaussian_threshold, top_count
from horovod_dgc.core.blocksign import BlockSign, BlockSignConfig, block_scales
from horovod_dgc.core.ops import TensorOps
from horovod_dgc.core.twostage import simulate_step
from horovod_dgc.torch.engine import Engine
from horovod_dgc.torch.ops import TorchOps

from conftest import exchange, randn

ops = TorchOps()


def call(name="w", rank=0, world=1, step=0, density=0.01, **more) -> CompressCall:
    return CompressCall(name, rank, world, step, density, **more)


def naive_topk(values, k):
    """Positions of the k largest magnitudes, by a sort of Python floats."""
    return set(sorted(range(len(values)), key=lambda i: -abs(values[i]))[:k])


@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
def test_gaussian_threshold_is_mean_plus_std_times_the_normal_quantile(density, device):
    values = (torch.randn(10_000, generator=torch.Generator().manual_seed(4), device="cpu") * 3 + 0.5).tolist()
    mean = sum(values) / len(values)
    std = statistics.pstdev(values)
    expected = abs(mean) + std * statistics.NormalDist().inv_cdf(1 - density / 2)
    got = float(gaussian_threshold(ops, torch.tensor(values, device=device), density))
    assert got == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("sign_compress", [TorchOps.sign_compress, TensorOps.sign_compress],
                         ids=["kernel", "composition"])
def test_blocksign_sends_the_l1_mean_of_each_block_times_its_signs_and_zero_counts_as_plus(sign_compress,
                                                                                          device):
    x = torch.tensor([1.0, -2.0, 0.0, 4.0, -1.0, 0.0, 0.0, 3.0, 5.0, -5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                     device=device)
    block, valid = 4, 10  # the last block holds 2 valid entries, then padding
    scales = block_scales(ops, ops.block_abs_sum(x[:valid], block), block, valid, 16)
    packed, residual = sign_compress(ops, x[:valid].clone(), scales, block, 16)
    decoded = x[:valid] - residual
    values = x.tolist()
    bits = [(byte >> j) & 1 for byte in packed.tolist() for j in range(8)]
    assert bits == [int(v >= 0) for v in values]  # padding counts as +
    for b in range(0, 16, block):
        entries = [values[i] for i in range(b, min(b + block, valid))]
        scale = sum(abs(v) for v in entries) / len(entries) if entries else 0.0
        assert float(scales[b // block]) == pytest.approx(scale)
        for i in range(b, min(b + block, valid)):
            sign = 1.0 if values[i] >= 0 else -1.0
            assert float(decoded[i]) == pytest.approx(sign * scale), i


def test_scalecom_sends_the_leaders_own_topk_and_keeps_a_low_pass_memory(device):
    beta, workers, n, density = 0.5, 3, 2000, 0.01
    method = ScaleCom(ScaleComConfig(density=density, beta=beta, value_dtype="float32"))
    k = top_count(density, n)
    gen = torch.Generator().manual_seed(2)
    states = [method.init_state(ops, torch.zeros(n, device=device), True, workers) for _ in range(workers)]
    memories = [[0.0] * n for _ in range(workers)]
    for t in range(6):
        grads = [randn(n, generator=gen, device=device) for _ in range(workers)]
        calls = [call(rank=r, world=workers, step=t, density=density) for r in range(workers)]
        p = [[m + g for m, g in zip(memories[r], grads[r].tolist())] for r in range(workers)]
        leader = t % workers
        firsts = [method.first(ops, s, g, c) for s, g, c in zip(states, grads, calls)]
        received = emulate(ops, method.FIRST, [m for m, _, _ in firsts], leader)
        seconds = [method.second(ops, s, r, h) for (_, s, h), r in zip(firsts, received)]
        chosen = set(firsts[0][2].data["indices"].tolist())
        assert chosen == naive_topk(p[leader], k), f"step {t}: not the leader's top-k"
        for r in range(workers):
            memories[r] = [(1 - beta) * memories[r][i] + beta * (0.0 if i in chosen else p[r][i])
                           for i in range(n)]
            assert seconds[r][1]["memory"].tolist() == pytest.approx(memories[r], abs=1e-5)
        states = [state for _, state in seconds]


def test_the_averaged_update_is_the_mean_of_every_ranks_top_k(device):
    world, n, density = 4, 3000, 0.02
    method = TopK(TopKConfig(density=density, value_dtype="float32"))
    grads = [randn(n, generator=torch.Generator().manual_seed(10 + r), device=device) for r in range(world)]
    messages, layout = [], None
    for r, grad in enumerate(grads):
        result = method.compress(ops, method.init_state(ops, grad, True, world), grad,
                                 call(rank=r, world=world, density=density))
        messages.append(result.message)
        layout = result.layout
    averaged, finite = method.decompress(ops, torch.cat(messages), [layout], world, 0, ["float32"])
    expected = [0.0] * n
    for grad in grads:
        values = grad.tolist()
        for i in naive_topk(values, top_count(density, n)):
            expected[i] += values[i] / world
    assert bool(finite)
    assert averaged[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_the_average_written_over_a_consumed_gradient_is_the_mean_of_every_ranks_top_k(device):
    """decompress(outs=) reuses a buffer whose contents are stale: they must not leak into
    the average (a buffer not zeroed first would add them)."""
    world, n, density = 3, 2000, 0.01
    method = TopK(TopKConfig(density=density, value_dtype="float32"))
    grads = [randn(n, generator=torch.Generator().manual_seed(40 + r), device=device) for r in range(world)]
    messages = []
    for r, grad in enumerate(grads):
        result = method.compress(ops, method.init_state(ops, grad, True, world), grad,
                                 call(rank=r, world=world, density=density))
        messages.append(result.message)
    stale = torch.full((n,), 7.0, device=device)
    averaged, _ = method.decompress(ops, torch.cat(messages), [result.layout], world, 0,
                                    ["float32"], [stale])
    expected = [0.0] * n
    for grad in grads:
        values = grad.tolist()
        for i in naive_topk(values, top_count(density, n)):
            expected[i] += values[i] / world
    assert averaged[0].data_ptr() == stale.data_ptr()
    assert averaged[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_the_engine_writes_the_average_over_a_float32_gradient_only_when_no_memory_holds_it(device):
    engine = Engine(TopK(TopKConfig(density=0.05, value_dtype="float32")), world_size=1, rank=0)
    grad = randn(50, 40, generator=torch.Generator().manual_seed(3), device=device)
    kept = grad.clone()
    message = engine.compress("w", grad, None)
    averaged = engine.decompress(message.message, [message])[0]
    assert averaged.data_ptr() == grad.data_ptr()
    residual = engine.state_dict()["states"]["w"]["residual"]
    # What was sent plus what stays in the memory is the gradient (nothing lost to the overwrite).
    torch.testing.assert_close(averaged.reshape(-1) + residual, kept.reshape(-1), rtol=0, atol=1e-6)
    half = grad.half()
    message = engine.compress("w", half, None)
    assert engine.decompress(message.message, [message])[0].data_ptr() != half.data_ptr()


def test_a_value_beyond_float16_is_clamped_on_the_wire_and_the_excess_stays_in_the_memory(device):
    method = TopK(TopKConfig(density=0.01, value_dtype="float16"))
    grad = torch.zeros(1000, device=device)
    grad[3] = 1e6
    result = method.compress(ops, method.init_state(ops, grad, True, 1), grad, call())
    sent, _ = method.decompress(ops, result.message, [result.layout], 1, 0, ["float32"])
    assert float(sent[0][3]) == 65504.0 and torch.isfinite(sent[0]).all()
    assert float(result.state["residual"][3]) == 1e6 - 65504.0


def test_float16_gradients_too_large_to_sum_in_float16_are_still_finite_and_clipped_right(device):
    method = DGC(DGCConfig(density=0.01, clip_norm=1.0, momentum=0.0))
    # Sum 6e6, squares 1.8e9: Inf in float16.
    grad = torch.full((20_000,), 300.0, dtype=torch.float16, device=device)
    result = method.compress(ops, method.init_state(ops, grad, True, 1), grad, call())
    sent, finite = method.decompress(ops, result.message, [result.layout], 1, 0, ["float16"])
    assert bool(finite) and torch.isfinite(sent[0]).all()
    norm = (300.0 ** 2 * 20_000) ** 0.5
    assert float(sent[0].float().abs().max()) == pytest.approx(300.0 / norm, rel=1e-3)


EVERY_EXCHANGE = [("dgc", {}), ("topk", {}), ("gaussiank", {}), ("scalecom", {}), ("blocksign", {}),
                  ("blocksign", {"block_size": 64}), ("dgc", {"aggregation": "sparse_allreduce"})]


@pytest.mark.parametrize("name,options", EVERY_EXCHANGE)
def test_float64_gradients_travel_as_their_float32_twins_and_keep_float64_memories(name, options,
                                                                                   device):
    """A float64 model's values and scales travel in the wire's float32 and come back float64;
    each step's update equals the float32 gradient's within float32 rounding. Catches float64
    bytes cut into a float32 part of the message (blocksign's scales were: its updates came
    back 1e18 and then NaN) and float64 memories rounded to float32."""
    from horovod_dgc.core.methods import BY_NAME

    spec = BY_NAME[name]
    single, double = (Engine(spec.build(**options), world_size=1, rank=0) for _ in range(2))
    for t in range(3):
        grad = randn(64, 64, generator=torch.Generator().manual_seed(t), device=device)
        want, got = exchange(single, grad), exchange(double, grad.double())
        assert got.dtype == torch.float64
        torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-7)
    memories = double.state_dict()["states"]["w"]
    assert {m.dtype for m in memories.values()} == {torch.float64}, sorted(memories)


@pytest.mark.parametrize("name,options", [("dgc", {}), ("topk", {}), ("scalecom", {}), ("blocksign", {}),
                                          ("dgc", {"aggregation": "sparse_allreduce"})])
def test_memories_hold_unscaled_gradients_whatever_the_loss_scale(name, options, device):
    from horovod_dgc.core.methods import BY_NAME

    spec = BY_NAME[name]
    plain, scaled = (Engine(spec.build(**options), world_size=1, rank=0) for _ in range(2))
    scaled.use_loss_scale(lambda: 1024.0)
    grads = [randn(64, 64, generator=torch.Generator().manual_seed(t), device=device) for t in range(3)]
    for grad in grads:
        outputs = [exchange(plain, grad), exchange(scaled, grad * 1024.0)]
        torch.testing.assert_close(outputs[1], outputs[0] * 1024.0, rtol=1e-6, atol=0)
    for key, value in plain.state_dict()["states"]["w"].items():
        torch.testing.assert_close(scaled.state_dict()["states"]["w"][key], value, rtol=1e-6, atol=1e-7)


def test_memories_written_into_the_storage_of_older_ones_equal_new_ones_through_a_dropped_step(device):
    """The engine hands each compress the memories two steps old as storage (spare). Rank 0's
    memories must equal those of the functional core step after step, through a step dropped
    because rank 1's gradient held a NaN (rank 0's was finite and already accumulated), and the
    storage must really be reused."""
    method = DGC(DGCConfig(density=0.01, value_dtype="float32"))
    engines = [Engine(method, world_size=2, rank=r) for r in range(2)]
    grads = [[randn(64, 64, generator=torch.Generator().manual_seed(60 + 10 * r + t), device=device)
              for t in range(6)] for r in range(2)]
    grads[1][3][1, 7] = float("nan")
    state, storages = method.init_state(ops, grads[0][0].reshape(-1), True, 2), []
    for t in range(6):
        result = method.compress(ops, {k: v.clone() for k, v in state.items()},
                                 grads[0][t].clone().reshape(-1),
                                 call(rank=0, world=2, step=t, density=0.01))
        if t != 3:
            state = result.state
        messages = [engine.compress("w", grads[r][t].clone(), None) for r, engine in enumerate(engines)]
        gathered = torch.cat([m.message for m in messages])
        for engine, message in zip(engines, messages):
            engine.decompress(gathered, [message])
        kept = engines[0].state_dict()["states"]["w"]
        for key in ("momentum", "velocity"):
            assert torch.equal(kept[key], state[key]), (t, key)
        storages.append(engines[0]._states["w"]["velocity"].untyped_storage().data_ptr())
    assert len(set(storages)) < len(storages)


def test_blocksign_momentum_is_nesterovs_on_the_unscaled_gradient(device):
    """dist-EF-blockSGDM's worker (docs/algorithms.md#blocksign), under a loss scale S:
    ``mom = mu * mom + g; q = g + mu * mom; p = e + q; e = p - C(p)`` with g unscaled and
    C(p) the L1 mean times the signs. Catches plain momentum (q = mom) in place of Nesterov's
    direction, and a momentum that accumulates the scaled gradient S * g."""
    mu, workers, n, scale = 0.9, 2, 1001, 256.0
    method = BlockSign(BlockSignConfig(momentum=mu))
    gen = torch.Generator().manual_seed(8)
    states = [method.init_state(ops, torch.zeros(n, device=device), True, workers) for _ in range(workers)]
    moms = [[0.0] * n for _ in range(workers)]
    errors = [[0.0] * n for _ in range(workers)]
    for t in range(4):
        grads = [randn(n, generator=gen, device=device) for _ in range(workers)]
        calls = [call(rank=r, world=workers, step=t, density=1.0, loss_scale=scale) for r in range(workers)]
        _, states = simulate_step(ops, method, states, [g * scale for g in grads], calls)
        for r in range(workers):
            g = grads[r].tolist()
            moms[r] = [mu * a + b for a, b in zip(moms[r], g)]
            p = [e + b + mu * a for e, a, b in zip(errors[r], moms[r], g)]
            l1 = sum(abs(v) for v in p) / n
            errors[r] = [v - (l1 if v >= 0 else -l1) for v in p]
            assert states[r]["momentum"].tolist() == pytest.approx(moms[r], rel=1e-5, abs=1e-5), (t, r)
            assert states[r]["residual"].tolist() == pytest.approx(errors[r], rel=1e-4, abs=1e-4), (t, r)


def test_buckets_close_before_the_item_that_would_pass_the_cap():
    # By hand: 40 + 50 fit 100; 30 would make 120; 100 alone is exactly the cap; 150 alone
    # passes it and still gets a bucket; 1 + 1 follow it in a new one.
    assert cut_buckets([40, 50, 30, 100, 150, 1, 1], 100) == [[0, 1], [2], [3], [4], [5, 6]]
    assert cut_buckets([50, 50], 100) == [[0, 1]]  # reaching the cap is not passing it
    assert cut_buckets([], 100) == []


def test_buckets_take_the_tensors_in_reverse_order_as_backward_produces_them():
    # Registered a, b, c, d (forward order); backward yields d first: d + c fill 100, b and
    # a follow in a bucket of their own.
    assert backward_buckets(["a", "b", "c", "d"], [30, 40, 50, 50], 100) == [("d", "c"), ("b", "a")]
    assert backward_buckets([], [], 100) == []
