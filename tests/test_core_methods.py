"""Each method's error feedback against the equations of ALGORITHMS.md, step by step."""
import math

import pytest
import torch

from horovod_dgc.core import (DGC, DGCConfig, GaussianK, GaussianKConfig, NonFiniteGradientError,
                              CompressCall, TopK, TopKConfig)
from horovod_dgc.core.methods import BY_NAME
from horovod_dgc.core.selection import top_count
from horovod_dgc.torch.engine import Engine
from horovod_dgc.torch.ops import TorchOps

from conftest import randn

ops = TorchOps()


def step(method, state, grad, t, world_size=1, name="w", param=None):
    """One compress; returns (dense tensor of what receivers decode, new state)."""
    return bounded_step(method, state, grad, t, world_size, name, param)[:2]


def bounded_step(method, state, grad, t, world_size=1, name="w", param=None, candidate_bound=None,
                 small=False):
    """One compress given a candidate bound; (decoded, new state, the next step's bound)."""
    ctx = CompressCall(name=name, rank=0, world_size=world_size, step=t, density=method.config.density,
                      param=param, small=small, candidate_bound=candidate_bound)
    result = method.compress(ops, state, grad, ctx)
    sent = method.decompress(ops, result.message, [result.layout], 1, t, [ops.dtype(grad)])[0][0]
    return sent, result.state, result.next_bound


def naive_topk_mask(v: torch.Tensor, k: int) -> torch.Tensor:
    values = v.tolist()  # one copy to the host, not one per entry
    order = sorted(range(v.numel()), key=lambda i: (-abs(values[i]), i))[:k]
    mask = torch.zeros(v.numel(), dtype=torch.bool, device=v.device)
    mask[order] = True
    return mask


def assert_sends_the_largest(sent: torch.Tensor, p: torch.Tensor) -> None:
    """The entries sent are the largest of ``p`` by magnitude: none left behind is larger
    than the smallest sent (a sort, independent of the core's selection)."""
    mask = sent != 0
    assert mask.any(), "nothing was sent"
    assert p[mask].abs().min() >= p[~mask].abs().max(), "an unsent entry is larger than a sent one"


def conservation_run(method, device, steps: int = 1000):
    """Sum of what was sent plus the residual, against the sum of gradients, over ``steps``;
    each step's selection is checked against a sort of the accumulated gradient. Each step
    gets the candidate bound its last step predicted, as in the adapters."""
    gen = torch.Generator().manual_seed(0)
    n = 4096
    state = method.init_state(ops, torch.zeros(n, device=device), True, 1)
    sent_total = torch.zeros(n, dtype=torch.float64, device=device)
    grad_total = torch.zeros(n, dtype=torch.float64, device=device)
    bound = None
    for t in range(steps):
        grad = randn(n, generator=gen, device=device) * (1.0 + (t % 7))
        p = state["residual"] + grad
        sent, state, bound = bounded_step(method, state, grad, t, candidate_bound=bound)
        assert_sends_the_largest(sent, p)
        sent_total += sent.double()
        grad_total += grad.double()
    lhs = sent_total + state["residual"].double()
    error = (lhs - grad_total).norm() / grad_total.norm()
    assert error < 1e-5, float(error)


@pytest.mark.parametrize("value_dtype", ["float32", "float16"])
@pytest.mark.parametrize("kind", [TopK, GaussianK], ids=["topk", "gaussiank"])
def test_conservation_sent_plus_residual_equals_sum_of_gradients_over_1000_steps(kind, value_dtype, device):
    config = TopKConfig if kind is TopK else GaussianKConfig
    conservation_run(kind(config(density=0.01, value_dtype=value_dtype)), device)


def test_the_conservation_test_fails_for_a_selector_that_ignores_magnitudes(device):
    class Blind(TopK):
        def select(self, ops, x, k, call, accumulated):
            return torch.randperm(ops.numel(x), generator=torch.Generator().manual_seed(call.step),
                                  device="cpu")[:k].sort()[0].to(x.device)

    with pytest.raises(AssertionError, match="larger than a sent one"):
        conservation_run(Blind(TopKConfig(density=0.01)), device, steps=5)


def assert_matches_reference(t, sent, state, ref_sent, ref_u, ref_v):
    """A DGC step's decoded message and memories against :func:`reference_dgc`'s."""
    assert torch.equal(sent != 0, ref_sent != 0), f"step {t}: different entries selected"
    for got, ref in [(sent, ref_sent), (state["momentum"], ref_u), (state["velocity"], ref_v)]:
        # float32 sums that cancel: their rounding is relative to the largest entry, and the
        # clipping norm's to a sum over the tensor.
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()) + 1e-7)


def reference_dgc(grads, k, momentum, nesterov, clip_norm, world_size, masked=True):
    """DGC's equations written out with dense tensors and a sort (``masked``: momentum
    factor masking)."""
    u = torch.zeros_like(grads[0])
    v = torch.zeros_like(grads[0])
    out = []
    for g in grads:
        if clip_norm is not None:
            g = g * min(1.0, (clip_norm / math.sqrt(world_size)) / float(g.norm()))
        if nesterov:
            u = momentum * (u + g)
            v = v + u + g
        else:
            u = momentum * u + g
            v = v + u
        mask = naive_topk_mask(v, k)
        out.append((torch.where(mask, v, torch.zeros_like(v)), u, v))
        v = torch.where(mask, torch.zeros_like(v), v)
        if masked:
            u = torch.where(mask, torch.zeros_like(u), u)
        out[-1] = (out[-1][0], u, v)
    return out


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("clip_norm", [None, 5.0])
@pytest.mark.parametrize("hinted", [False, True], ids=["sampled", "candidate-bound"])
def test_dgc_momentum_correction_and_masking_match_the_equations_for_10_steps(nesterov, clip_norm, hinted,
                                                                               choices, monkeypatch, device):
    """With ``hinted``, each step passes the bound its last step predicted, so that the
    memory's pass collects the candidates and (checked) the sampled selection does not run
    in most steps; the selection must be the naive reference's all the same. Where sizes
    cost a wait (a GPU) no bound is predicted and neither runs: the block selection does."""
    import horovod_dgc.core.selection as selection
    sampled_at = []
    sample = selection.sampled_threshold
    monkeypatch.setattr(selection, "sampled_threshold",
                        lambda *a, **kw: sampled_at.append(t) or sample(*a, **kw))
    n, density, world_size = 5000, 0.01, 4  # above EXACT_BELOW_NUMEL: the sampled selection
    gen = torch.Generator().manual_seed(1)
    grads = [randn(n, generator=gen, device=device) for _ in range(10)]
    method = DGC(DGCConfig(density=density, momentum=0.9, nesterov=nesterov, clip_norm=clip_norm,
                           value_dtype="float32"))
    state = method.init_state(ops, grads[0], True, 1)
    expected = reference_dgc(grads, top_count(density, n), 0.9, nesterov, clip_norm, world_size)
    by_blocks = ops.sizes_cost_a_wait(grads[0])
    bound = None
    for t, (grad, (ref_sent, ref_u, ref_v)) in enumerate(zip(grads, expected)):
        sent, state, bound = bounded_step(method, state, grad, t, world_size,
                                          candidate_bound=bound if hinted else None)
        if by_blocks:
            assert bound == 0.0
        else:
            assert 0.0 < float(bound) <= float(ref_sent[ref_sent != 0].abs().min())
        assert_matches_reference(t, sent, state, ref_sent, ref_u, ref_v)
    if by_blocks:
        assert sampled_at == []
    elif hinted:
        # Only while the velocity still grows fast (the threshold doubles in the first steps)
        # do the candidates overflow and the sample run.
        assert sampled_at == list(range(len(sampled_at))) and len(sampled_at) <= 6, sampled_at
    else:
        assert sampled_at == list(range(10))


@pytest.mark.parametrize("nesterov", [False, True])
def test_dgc_clips_a_workers_gradient_to_c_over_sqrt_n_only_when_it_is_longer(nesterov, device):
    """Local gradient clipping (DGC 3.3) scales a worker's gradient down to norm C / sqrt(N)
    when it is longer, and leaves a shorter one as it is: norms from 0.2 to 3 times the bound,
    against the equations. Catches a factor ``bound / norm`` applied without its ``min(1, .)``
    (short gradients blown up to the bound) and a bound of C / N."""
    n, density, world_size, clip_norm = 5000, 0.01, 4, 2.0
    bound = clip_norm / math.sqrt(world_size)
    gen = torch.Generator().manual_seed(4)
    grads = []
    for times_bound in (0.5, 3.0, 0.9, 1.5, 0.2, 2.0):
        g = randn(n, generator=gen, device=device)
        grads.append(g * (times_bound * bound / float(g.norm())))
    method = DGC(DGCConfig(density=density, momentum=0.9, nesterov=nesterov, clip_norm=clip_norm,
                           value_dtype="float32"))
    state = method.init_state(ops, grads[0], True, 1)
    expected = reference_dgc(grads, top_count(density, n), 0.9, nesterov, clip_norm, world_size)
    for t, (grad, (ref_sent, ref_u, ref_v)) in enumerate(zip(grads, expected)):
        sent, state, _ = bounded_step(method, state, grad, t, world_size)
        assert_matches_reference(t, sent, state, ref_sent, ref_u, ref_v)


def test_dgc_small_tensors_keep_their_momentum_when_sent_for_10_steps(device):
    """The paper sends small tensors dense, their momentum whole; compressed, they keep it
    unmasked (momentum SGD with error feedback), where large tensors are masked."""
    n, density = 300, 0.05
    gen = torch.Generator().manual_seed(2)
    grads = [randn(n, generator=gen, device=device) for _ in range(10)]
    method = DGC(DGCConfig(density=density, momentum=0.9, value_dtype="float32"))
    state = method.init_state(ops, grads[0], True, 1)
    expected = reference_dgc(grads, top_count(density, n), 0.9, False, None, 1, masked=False)
    for t, (grad, (ref_sent, ref_u, ref_v)) in enumerate(zip(grads, expected)):
        sent, state, _ = bounded_step(method, state, grad, t, small=True)
        assert_matches_reference(t, sent, state, ref_sent, ref_u, ref_v)


@pytest.mark.parametrize("shape, masked", [((64,), False), ((64, 64), True)], ids=["small", "large"])
def test_the_torch_engine_masks_the_momentum_of_large_tensors_only(shape, masked):
    engine = Engine(BY_NAME["dgc"].build(density=0.01, small_density=0.05, value_dtype="float32"),
                    world_size=1, rank=0)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    # First step: u = v = g, the top-k of |g| sent; masking zeroes u there.
    expected = grad.reshape(-1).clone()  # the decode is written over the gradient
    outgoing = engine.compress("w", grad, None)
    engine.decompress(outgoing.message, [outgoing])
    if masked:
        expected[torch.topk(expected.abs(), top_count(0.01, grad.numel())).indices] = 0.0
    assert torch.equal(engine.state_dict()["states"]["w"]["momentum"], expected)


def test_dgc_weight_decay_is_folded_into_the_gradient(device):
    n = 2048
    grad, param = randn(n, device=device), randn(n, device=device)
    method = DGC(DGCConfig(density=1.0, momentum=0.0, weight_decay=0.1, value_dtype="float32"))
    sent, _ = step(method, method.init_state(ops, grad, True, 1), grad, 0, param=param)
    torch.testing.assert_close(sent, grad + 0.1 * param)


@pytest.mark.parametrize("config_decay,tensor_decay", [(0.0, 0.1), (0.1, 0.0), (0.1, 0.3)])
def test_dgc_takes_a_tensors_own_weight_decay_over_the_configs(config_decay, tensor_decay, device):
    """A tensor's own decay (the fused optimizer's parameter groups: none on biases, say)
    replaces the config's, also when it is 0. Catches a core that reads the config's decay
    for every tensor, which a check of the settings alone lets through."""
    n = 2048
    grad, param = randn(n, device=device), randn(n, device=device)
    method = DGC(DGCConfig(density=1.0, momentum=0.0, weight_decay=config_decay, value_dtype="float32"))
    call = CompressCall("w", 0, 1, 0, 1.0, param=param, weight_decay=tensor_decay)
    result = method.compress(ops, method.init_state(ops, grad, True, 1), grad, call)
    sent = method.decompress(ops, result.message, [result.layout], 1, 0, [ops.dtype(grad)])[0][0]
    expected = [g + tensor_decay * w for g, w in zip(grad.tolist(), param.tolist())]
    assert sent.tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_dgc_dense_tensors_still_get_momentum(device):
    method = DGC(DGCConfig(momentum=0.9))
    g1, g2 = randn(10, device=device), randn(10, device=device)
    state = method.init_state(ops, g1, False, 1)
    ctx = CompressCall("bias", 0, 1, 0, 0.001)
    out1, state = method.dense(ops, state, g1, ctx)
    out2, state = method.dense(ops, state, g2, ctx)
    torch.testing.assert_close(out2, 0.9 * g1 + g2)
    assert out2.data_ptr() != state["momentum"].data_ptr(), "the update must not alias the memory"


def test_bfloat16_gradients_travel_without_loss(device):
    method = TopK(TopKConfig(density=0.1, value_dtype="float16"))
    grad = torch.randn(4096, device="cpu").to(torch.bfloat16).to(device)
    sent, state = step(method, method.init_state(ops, grad, True, 1), grad, 0)
    assert sent.dtype == torch.bfloat16
    mask = sent != 0
    assert torch.equal(sent[mask], grad[mask])
    assert torch.count_nonzero(state["residual"][mask]) == 0


@pytest.mark.parametrize("method", [TopK(TopKConfig(nonfinite="raise")), DGC(DGCConfig(nonfinite="raise")),
                                    GaussianK(GaussianKConfig(nonfinite="raise"))],
                         ids=["topk", "dgc", "gaussiank"])
def test_nan_gradient_raises_naming_the_tensor_and_keeps_the_memory(method, device):
    grad = randn(5000, device=device)
    state = method.init_state(ops, grad, True, 1)
    _, state = step(method, state, grad, 0, name="layer3.weight")
    before = {k: v.clone() for k, v in state.items()}
    bad = grad.clone()
    bad[17] = float("nan")
    with pytest.raises(NonFiniteGradientError, match="layer3.weight"):
        step(method, state, bad, 1, name="layer3.weight")
    for key in before:
        assert torch.equal(state[key], before[key]), key


def test_skip_policy_passes_nan_on_and_keeps_the_residual(device):
    method = TopK(TopKConfig(density=0.01))
    grad = randn(5000, device=device)
    state = method.init_state(ops, grad, True, 1)
    _, state = step(method, state, grad, 0)
    before = state["residual"].clone()
    sent, state = step(method, state, torch.full((5000,), float("inf"), device=device), 1)
    assert torch.isnan(sent).all()
    assert torch.equal(state["residual"], before)


@pytest.mark.parametrize("weight_decay,clip_norm", [(0.0, 0.5), (0.1, None), (0.1, 0.5)])
def test_dgc_undoes_the_loss_scale_before_weight_decay_and_clipping(weight_decay, clip_norm, device):
    """With a loss scale S the gradient arrives as S * g: weight decay is added to g (not to
    S * g), the clipping bound applies to the norm of g + wd * w, and the memories hold
    ``c * (g + wd * w)`` whatever S is. Catches the unscale factor dropped when weight decay
    is folded in, the norm taken of the scaled gradient, and a clipping factor that loses
    the unscale (each leaves the memories S times too large or too small)."""
    n, world, scale, density, m = 2048, 4, 1024.0, 0.01, 0.9
    gen = torch.Generator().manual_seed(21)
    g, w = randn(n, generator=gen, device=device), randn(n, generator=gen, device=device)
    method = DGC(DGCConfig(density=density, momentum=m, weight_decay=weight_decay, clip_norm=clip_norm,
                           value_dtype="float32"))
    state = method.init_state(ops, g, True, world)
    ctx = CompressCall("w", 0, world, 0, density, param=w, loss_scale=scale)
    result = method.compress(ops, state, g * scale, ctx)
    # The equations of docs/algorithms.md#dgc in plain Python, on the unscaled gradient.
    d = [gi + weight_decay * wi for gi, wi in zip(g.tolist(), w.tolist())]
    c = 1.0
    if clip_norm is not None:
        c = min(1.0, clip_norm / math.sqrt(world) / math.sqrt(sum(x * x for x in d)))
    u = [c * x for x in d]  # u = m * 0 + c * g
    order = sorted(range(n), key=lambda i: -abs(u[i]))[:top_count(density, n)]
    sent = set(order)
    expected_v = [0.0 if i in sent else u[i] for i in range(n)]  # v = u, then v[I] -= v[I]
    expected_u = [0.0 if i in sent else u[i] for i in range(n)]  # masked momentum
    assert result.state["velocity"].tolist() == pytest.approx(expected_v, rel=1e-5, abs=1e-7)
    assert result.state["momentum"].tolist() == pytest.approx(expected_u, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("loss_scale", [1.0, 512.0])
def test_dgc_dense_tensors_with_nesterov_send_the_momentum_plus_the_gradient(loss_scale, device):
    """Dense tensors under Nesterov: ``u = m * (u + g)`` and the update is ``u + g``
    (docs/algorithms.md#dgc), both in unscaled units under a loss scale S (gradients S * g).
    Catches an update that sends ``u`` alone (plain momentum's), and one that adds the
    gradient still scaled (``u + S * g``)."""
    m = 0.9
    method = DGC(DGCConfig(momentum=m, nesterov=True))
    gen = torch.Generator().manual_seed(11)
    g1, g2 = randn(10, generator=gen, device=device), randn(10, generator=gen, device=device)
    state = method.init_state(ops, g1, False, 1)
    ctx = CompressCall("bias", 0, 1, 0, 0.001, loss_scale=loss_scale)
    out1, state = method.dense(ops, state, g1 * loss_scale, ctx)
    out2, state = method.dense(ops, state, g2 * loss_scale, ctx)
    u1 = [m * a for a in g1.tolist()]
    u2 = [m * (u + b) for u, b in zip(u1, g2.tolist())]
    # Entries of order 1 in float32: sums that cancel are checked to their absolute rounding.
    close = dict(rel=1e-6, abs=1e-6)
    assert out1.tolist() == pytest.approx([u + a for u, a in zip(u1, g1.tolist())], **close)
    assert out2.tolist() == pytest.approx([u + b for u, b in zip(u2, g2.tolist())], **close)
    assert state["momentum"].tolist() == pytest.approx(u2, **close)


@pytest.mark.parametrize("method", [TopK(TopKConfig()), GaussianK(GaussianKConfig()),
                                    DGC(DGCConfig(momentum=0.0))], ids=["topk", "gaussiank", "dgc"])
def test_dense_tensors_leave_the_loss_scale_out_of_the_update(method, device):
    """A tensor that travels dense under a loss scale S (gradient S * g) all-reduces g, in
    the unscaled units the compressed tensors' memories use. Catches a dense path that
    forgets to unscale (the update S times too large)."""
    scale = 512.0
    g = randn(10, device=device)
    state = method.init_state(ops, g, False, 1)
    ctx = CompressCall("bias", 0, 1, 0, 0.001, loss_scale=scale)
    update, _ = method.dense(ops, state, g * scale, ctx)
    assert update.tolist() == pytest.approx(g.tolist(), rel=1e-6)


def test_a_flagged_step_names_the_first_flagged_tensor_its_rank_and_the_step():
    """Flags arrive one word per message, the messages of every tensor rank after rank: with
    tensors (a, b) on 2 ranks, word 1 is b on rank 0 and word 2 is a on rank 1. The error names
    the first flagged message, counts the others and gives the step. Catches the rank and
    tensor read from the wrong end of the index, the last flagged message named, the count
    including the one named, and the flags in place of the step."""
    from horovod_dgc.core.nonfinite import received_finite
    from horovod_dgc.core.wire import FLAG_NONFINITE

    names = ["a", "b"]
    clean = torch.zeros(4, dtype=torch.int32)
    assert bool(received_finite(ops, "raise", clean, names, 7))
    flags = torch.tensor([0, FLAG_NONFINITE, FLAG_NONFINITE, 0], dtype=torch.int32)
    assert not bool(received_finite(ops, "skip", flags, names, 7))
    with pytest.raises(NonFiniteGradientError,
                       match=r"^gradient of tensor 'b' on rank 0 \(and 1 more\) held NaN or Inf at step 7;"):
        received_finite(ops, "raise", flags, names, 7)
    only = torch.tensor([0, 0, FLAG_NONFINITE, 0], dtype=torch.int32)
    with pytest.raises(NonFiniteGradientError, match=r"^gradient of tensor 'a' on rank 1 held NaN"):
        received_finite(ops, "raise", only, names, 3)


@pytest.mark.parametrize("name", sorted(BY_NAME))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_memories_of_16_bit_gradients_are_kept_in_float32(name, dtype):
    """A 16-bit memory would round away the small updates that error feedback accumulates.
    Catches bfloat16 (or float16) memories kept in the gradient's dtype."""
    method = BY_NAME[name].build()
    grad = torch.zeros(8192, dtype=dtype)
    for compressed in (True, False):
        state = method.init_state(ops, grad, compressed, 2)
        assert {v.dtype for v in state.values()} <= {torch.float32}, (compressed, state.keys())
