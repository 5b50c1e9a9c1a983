"""A bucket of tensors compressed as one (horovod_dgc.core.bucket, SparseMethod.compress_bucket,
Engine.compress_bucket): each segment's selection against a sort of that segment alone, and
whole steps of several ranks against the per-tensor path, bit for bit."""
import math
import random
from statistics import NormalDist

import pytest
import torch

from horovod_dgc.core.bucket import (ALIGN, Bucket, GaussianPlan, Plan, Segment, next_bounds, segment_thresholds,
                                     select_candidates, select_gaussian, select_segments)
from horovod_dgc.core.ops import BlockBounds, Candidates
from horovod_dgc.core.methods import BY_NAME
from horovod_dgc.core.nonfinite import NonFiniteGradientError
from horovod_dgc.core.wire import MessageError
from horovod_dgc.torch.engine import Engine
from horovod_dgc.torch.ops import TorchOps

from conftest import WaitingOps, two_stage_bucket, two_stages

# Edge sizes: one element, a block's and ALIGN's edges, tensors larger and smaller than
# EXACT_BELOW_NUMEL (the per-tensor path's switch to a full top-k).
SIZES = (1, 2, 7, 8, 9, ALIGN - 1, ALIGN, ALIGN + 1, 100, 1000, 4095, 4096, 5000, 20000)


def naive_top(values: torch.Tensor, k: int):
    """Positions of the k largest magnitudes, ties to the lowest positions, by a Python sort
    (ascending positions)."""
    listed = values.tolist()
    return sorted(sorted(range(len(listed)), key=lambda i: (-abs(listed[i]), i))[:k])


def random_bucket(rng: random.Random, dtype: str = "float32"):
    numels = [rng.choice(SIZES) for _ in range(rng.randint(1, 9))]
    return Bucket.of("b", [(f"t{i}", n, n < 4096) for i, n in enumerate(numels)], dtype)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "tied"])
@pytest.mark.parametrize("ops", [TorchOps(), WaitingOps()], ids=["own-choice", "as-on-a-gpu"])
def test_each_segment_sends_its_own_largest(ops, ties):
    """Against a sort of each segment alone; with ``ties`` the values are small integers, so
    most magnitudes tie and the k-th largest is shared by many entries."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        bucket = random_bucket(rng)
        densities = [rng.choice([0.001, 0.01, 0.05, 0.3, 1.0]) for _ in bucket.segments]
        plan = Plan.at(bucket, densities)
        x = torch.zeros(bucket.numel)
        for s in bucket.segments:
            x[s.offset:s.end] = torch.randn(s.numel, generator=gen)
            if ties:
                x[s.offset:s.end] = torch.round(x[s.offset:s.end] * 2)
        got = select_segments(ops, x, plan).tolist()
        want = []
        for s, k in zip(bucket.segments, plan.ks):
            assert k == min(s.numel, max(1, -(-round(densities[bucket.segments.index(s)] * s.numel, 6) // 1)))
            want += [s.offset + i for i in naive_top(x[s.offset:s.end], k)]
        assert got == want, (bucket, plan.ks)


def naive_gaussian(values, k: int):
    """Gaussian-k of one tensor as the paper's rule reads (docs/algorithms.md#gaussiank), in
    float64 Python: threshold |mean| + std * Phi^-1(1 - k/n / 2), at most three adjustments
    (x0.5 below 2k/3 entries, x1.5 above 4k/3), the lowest threshold tried if the last is
    still below 2k/3, at most ceil(4k/3) entries sent (the largest, ties to the lowest
    positions), the whole tensor when that holds it: (positions ascending, adjustments made)."""
    v, n = [float(a) for a in values], len(values)
    capacity = min(n, math.ceil(4 * k / 3))
    if capacity >= n:
        return list(range(n)), 0
    mean = sum(v) / n
    t = abs(mean) + math.sqrt(max(sum(a * a for a in v) / n - mean * mean, 0.0)) * NormalDist().inv_cdf(1 - k / n / 2)
    reached = sum(abs(a) >= t for a in v)
    tried = [t]
    for _ in range(3):
        if 2 * k / 3 <= reached <= 4 * k / 3:
            break
        t *= 0.5 if reached < 2 * k / 3 else 1.5
        reached = sum(abs(a) >= t for a in v)
        tried.append(t)
    if reached < math.ceil(2 * k / 3):
        t = min(tried)
    chosen = [i for i in range(n) if abs(v[i]) >= t]
    return sorted(sorted(chosen, key=lambda i: (-abs(v[i]), i))[:capacity]), len(tried) - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ops", [TorchOps(), WaitingOps()], ids=["own-choice", "as-on-a-gpu"])
def test_each_segment_sends_its_own_gaussian_selection(ops, dtype):
    """Against the rule written plainly for each segment alone, on segments of other scales
    and means (their thresholds differ), so that a threshold or count taken across segments,
    or one segment's k or capacity used for another, sends other entries. (The float64
    reference's thresholds differ from float32's in their last bits; this data holds no entry
    that close to one.)"""
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    adjustments, over_capacity = [], 0
    for _ in range(30):
        bucket = random_bucket(rng, str(dtype).replace("torch.", ""))
        densities = [rng.choice([0.001, 0.01, 0.05, 0.3]) for _ in bucket.segments]
        plan = Plan.at(bucket, densities)
        x = torch.zeros(bucket.numel, dtype=dtype)
        for s in bucket.segments:
            # Heavy tails (normal entries of log-normal scales) push the first threshold out
            # of range.
            spread = torch.exp(torch.randn(s.numel, generator=gen) * rng.choice([0.0, 1.5]))
            values = torch.randn(s.numel, generator=gen) * spread * rng.choice([1.0, 0.01])
            x[s.offset:s.end] = (values + rng.choice([0.0, 0.3])).to(dtype)
        gaussian = GaussianPlan.of(plan)
        got = select_gaussian(ops, x, gaussian).tolist()
        want = []
        for s, k, capacity in zip(bucket.segments, plan.ks, gaussian.capacities):
            chosen, adjusted = naive_gaussian(x[s.offset:s.end].float().tolist(), k)
            want += [s.offset + i for i in chosen]
            adjustments.append(adjusted)
            over_capacity += len(chosen) == capacity < s.numel
        assert got == want, (bucket, plan.ks)
    # Every number of adjustments, and the capacity's cut, were taken.
    assert set(adjustments) == {0, 1, 2, 3} and over_capacity > 5, (sorted(adjustments), over_capacity)


def test_a_segment_of_zeros_sends_zeros_of_its_own():
    """Ties at zero: the k entries come from the segment's own positions, never its padding."""
    bucket = Bucket.of("b", [("a", 3, True), ("b", 5000, False)], "float32")
    plan = Plan.at(bucket, [1.0, 0.01])
    x = torch.zeros(bucket.numel)
    x[bucket.segments[1].offset:bucket.segments[1].end] = torch.randn(5000)
    for ops in (TorchOps(), WaitingOps()):
        got = select_segments(ops, x, plan).tolist()
        assert got[:3] == [0, 1, 2]
        assert all(bucket.segments[1].offset <= p < bucket.segments[1].end for p in got[3:])


def test_a_bucket_refuses_what_is_not_a_layout():
    with pytest.raises(ValueError, match="no tensors"):
        Bucket("b", (), "float32")
    with pytest.raises(ValueError, match="twice"):
        Bucket.of("b", [("a", 3, True), ("a", 3, True)], "float32")
    with pytest.raises(ValueError, match="expected a non-empty one at 64"):
        Bucket("b", (Segment("a", 3, 0), Segment("c", 3, 3)), "float32")
    with pytest.raises(ValueError, match="expected a non-empty one at 0"):
        Bucket("b", (Segment("a", 0, 0),), "float32")


SHAPES = [(64, 3, 3, 3), (64,), (1,), (256, 64, 1, 1), (1000,), (10, 2048), (3, 5)]


def run_steps(method: str, world: int, steps: int, dtype=torch.float32, nan_at=None, loss_scale=None,
              **options):
    """``steps`` steps of ``world`` ranks, tensor by tensor and as one bucket, on the same
    gradients (times ``loss_scale``, which the engines are told of): (per-tensor averages,
    bucketed averages, both engines) per step."""
    per = [Engine(BY_NAME[method].build(**options), world, r) for r in range(world)]
    bucketed = [Engine(BY_NAME[method].build(**options), world, r) for r in range(world)]
    for engine in per + bucketed:
        if loss_scale is not None:
            engine.use_loss_scale(lambda: loss_scale)
    names = [f"t{i}" for i in range(len(SHAPES))]
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
    results = []
    for t in range(steps):
        grads = [[(torch.randn(s, generator=gen) * (loss_scale or 1.0)).to(dtype) for s in SHAPES]
                 for _ in range(world)]
        if nan_at == t:
            grads[1][3][0, 0] = float("nan")
        if per[0].method.family == "two-stage":
            results.append((two_stage_per_tensor(per, names, grads, params),
                            two_stage_bucket(bucketed, names, grads, params)))
            continue
        outs = [[e.compress(n, g.clone(), p) for n, g, p in zip(names, gs, params)] for e, gs in zip(per, grads)]
        gathered = torch.cat([o.message for rank in outs for o in rank])
        per_avg = [e.decompress(gathered, outs[r]) for r, e in enumerate(per)]
        sent = []
        for e, gs in zip(bucketed, grads):
            bucket = e.bucket("layer", list(zip(names, gs)))
            sent.append(e.compress_bucket(bucket, [g.clone() for g in gs], params))
        gathered = torch.cat([o.message for o in sent])
        # Clones: a bucket's averages are views of its buffer, valid until its next compress.
        results.append((per_avg, [[t.clone() for t in e.decompress(gathered, [sent[r]])]
                                  for r, e in enumerate(bucketed)]))
    return results, per, bucketed


def two_stage_per_tensor(engines, names, grads, params):
    """Every rank's averages of a two-stage method, tensor by tensor: ``[rank][tensor]``."""
    by_tensor = []
    for i, name in enumerate(names):
        firsts = [e.first(name, gs[i].clone(), params[i]) for e, gs in zip(engines, grads)]
        by_tensor.append(two_stages(engines, firsts, lambda r, got, h: engines[r].second(name, got, h),
                                     lambda r, got, h: engines[r].finish(got, h, grads[r][i].shape)))
    return [list(rank) for rank in zip(*by_tensor)]


def states(engine):
    return engine.state_dict()["states"]


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_a_sparse_allreduce_bucket_exchanges_each_tensor_as_the_protocol_says(workers, choices):
    """Top-k by sparse all-reduce with tensors of 1 to 1,001 entries in one bucket, against
    the protocol written with sorts for each tensor alone (``reference_topk_step``: regions,
    ``C_in``, the owners' ``C_out``). Gradients grow along each tensor, so its last regions
    hold more than their share of its selection: the bucket must hold the excess back per
    tensor and region, and a region past a tiny tensor's end must forward nothing. As on a
    GPU, each owner's message takes its run of the sorted selection with the run's length
    left on the device (``wire.encode_runs``; its kernel where Triton runs)."""
    from test_core_sparse_allreduce import REGION_SLACK, largest, reference_topk_step

    density, numels = 0.02, [1, 2, 7, 64, 65, 257, 1000, 1001]
    engines = [Engine(BY_NAME["topk"].build(aggregation="sparse_allreduce", density=density, small_density=None,
                                            min_numel=1, value_dtype="float32"), workers, r) for r in range(workers)]
    names = [f"t{i}" for i in range(len(numels))]
    residuals = [[[0.0] * n for _ in range(workers)] for n in numels]
    owners = [[[0.0] * math.ceil(n / workers) for _ in range(workers)] for n in numels]
    gen = torch.Generator().manual_seed(workers)
    overflowed = False
    for step in range(6):
        grads = [[torch.randn(n, generator=gen) * torch.linspace(0.1, 3.0, n) for n in numels]
                 for _ in range(workers)]
        if step == 0:  # every residual zero: the selection is the gradient's top-k
            for t, n in enumerate(numels):
                k, region = max(1, math.ceil(density * n)), math.ceil(n / workers)
                for g in grads:
                    regions = [pos // region for pos, _ in largest(list(enumerate(g[t].tolist())), k)]
                    overflowed |= max(map(regions.count, regions)) > min(region, math.ceil(REGION_SLACK * k / workers))
        got = two_stage_bucket(engines, names, grads, [None] * len(numels))
        for t, n in enumerate(numels):
            k = max(1, math.ceil(density * n))
            want = reference_topk_step(residuals[t], owners[t], [g[t].double().tolist() for g in grads], k, workers)
            for rank in got:
                torch.testing.assert_close(rank[t].double(), torch.tensor(want, dtype=torch.float64),
                                           rtol=1e-5, atol=1e-6)
        for r, engine in enumerate(engines):
            saved = states(engine)
            for t, name in enumerate(names):
                torch.testing.assert_close(saved[name]["residual"].double(), torch.tensor(residuals[t][r], dtype=torch.float64),
                                           rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(saved[name]["owner_residual"].double(),
                                           torch.tensor(owners[t][r], dtype=torch.float64), rtol=1e-5, atol=1e-5)
    assert overflowed  # some region held more than C_in of a selection


@pytest.mark.parametrize("workers", [3, 4, 8])
def test_a_sparse_allreduce_bucket_sends_no_slots_for_a_region_past_a_tensors_end(workers):
    """Owner j's message holds, for each tensor, its ``C_in`` or the entries of the tensor's
    region j if fewer (none past the tensor's end), each region cut from the tensor by a
    slice here; the alltoall's chunks are those messages' bytes, the same for every sender.
    Catches a tiny tensor given ``C_in`` slots in every owner's message, or the bytes of
    one owner's message taken for all."""
    from test_core_sparse_allreduce import REGION_SLACK

    density, numels = 0.02, [1, 2, 7, 64, 65, 1000]
    engines = [Engine(BY_NAME["topk"].build(aggregation="sparse_allreduce", density=density, small_density=None,
                                            min_numel=1, value_dtype="float32"), workers, r) for r in range(workers)]
    names = [f"t{i}" for i in range(len(numels))]
    gen = torch.Generator().manual_seed(workers)
    grads = [[torch.randn(n, generator=gen) for n in numels] for _ in range(workers)]
    buckets = [e.bucket("b", list(zip(names, gs))) for e, gs in zip(engines, grads)]
    firsts = [e.first_bucket(b, gs, [None] * len(numels)) for e, b, gs in zip(engines, buckets, grads)]
    expected = []
    for j in range(workers):
        slots = 0
        for n in numels:
            k, region = math.ceil(density * n), math.ceil(n / workers)
            slots += min(math.ceil(REGION_SLACK * k / workers), len(range(n)[j * region:(j + 1) * region]))
        expected.append(slots)
    regions = firsts[0][1].data["regions"]
    assert [layout.capacity for layout in regions.to_owners] == expected
    assert len(set(expected)) > 1  # the tiny tensors' regions past their ends are empty
    for message, handover in firsts:
        assert handover.chunks == tuple(layout.nbytes for layout in regions.to_owners)
        assert sum(handover.chunks) == message.numel()
        assert handover.data["to_owner"] is regions.to_owners[handover.call.rank]


@pytest.mark.parametrize("method", ["dgc", "topk", "gaussiank", "scalecom"])
def test_a_bucket_undoes_the_loss_scale_as_each_tensor_does(method):
    """Gradients 1024 times too large, with the engines told so: a bucket's averages and
    memories equal the per-tensor ones (a bucket whose memory took the gradients in the
    loss scale's units would remember 1024 times too much)."""
    results, per, bucketed = run_steps(method, world=2, steps=3, loss_scale=1024.0)
    for per_avg, bucket_avg in results:
        for rank_a, rank_b in zip(per_avg, bucket_avg):
            assert all(torch.equal(a, b) for a, b in zip(rank_a, rank_b))
    for e, f in zip(per, bucketed):
        mine, theirs = states(e), states(f)
        assert all(torch.equal(mine[n][k], theirs[n][k]) for n in mine for k in mine[n])


@pytest.mark.parametrize("method,options", [
    ("dgc", {}), ("topk", {}), ("dgc", {"nesterov": True, "weight_decay": 1e-4}),
    ("dgc", {"warmup_epochs": 1, "steps_per_epoch": 2}), ("topk", {"value_dtype": "float32"}),
    ("dgc", {"small_density": None, "min_numel": 1, "density": 0.02}),
    ("gaussiank", {}), ("gaussiank", {"density": 0.05, "value_dtype": "float16"}),
    ("scalecom", {}), ("scalecom", {"beta": 0.3, "density": 0.05}),
    ("dgc", {"aggregation": "sparse_allreduce"}), ("topk", {"aggregation": "sparse_allreduce"}),
    ("gaussiank", {"aggregation": "sparse_allreduce", "density": 0.05, "value_dtype": "float16"}),
    ("dgc", {"aggregation": "sparse_allreduce", "small_density": None, "min_numel": 1, "density": 0.02}),
])
def test_bucketed_steps_equal_the_per_tensor_steps(method, options):
    results, per, bucketed = run_steps(method, world=3, steps=5, **options)
    for per_avg, bucket_avg in results:
        for rank_a, rank_b in zip(per_avg, bucket_avg):
            for a, b in zip(rank_a, rank_b):
                assert a.shape == b.shape and torch.equal(a, b)
    for e, f in zip(per, bucketed):
        mine, theirs = states(e), states(f)
        assert sorted(mine) == sorted(theirs)
        for name in mine:
            for key in mine[name]:
                assert torch.equal(mine[name][key], theirs[name][key]), (name, key)


def test_per_tensor_weight_decays_and_a_loss_scale_in_one_bucket():
    per, bucketed = [], []
    names = [f"t{i}" for i in range(len(SHAPES))]
    decays = {n: (0.0 if i % 2 else 5e-4) for i, n in enumerate(names)}
    for engines in (per, bucketed):
        for r in range(2):
            e = Engine(BY_NAME["dgc"].build(), 2, r)
            e.set_weight_decays(decays)
            e.use_loss_scale(lambda: 1024.0)
            engines.append(e)
    gen = torch.Generator().manual_seed(2)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    for t in range(4):
        grads = [[1024.0 * torch.randn(s, generator=gen) for s in SHAPES] for _ in range(2)]
        outs = [[e.compress(n, g.clone(), p) for n, g, p in zip(names, gs, params)] for e, gs in zip(per, grads)]
        gathered = torch.cat([o.message for rank in outs for o in rank])
        want = [e.decompress(gathered, outs[r]) for r, e in enumerate(per)]
        sent = [e.compress_bucket(e.bucket("b", list(zip(names, gs))), [g.clone() for g in gs], params)
                for e, gs in zip(bucketed, grads)]
        gathered = torch.cat([o.message for o in sent])
        got = [e.decompress(gathered, [sent[r]]) for r, e in enumerate(bucketed)]
        for rank_a, rank_b in zip(want, got):
            for a, b in zip(rank_a, rank_b):
                torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_a_bfloat16_bucket_keeps_float32_memories_and_sends_a_top_k_of_each_tensor():
    """bfloat16 magnitudes tie, so the check is a sort's: in every tensor no entry left
    behind is larger than the smallest sent, and k were sent."""
    engine = Engine(BY_NAME["topk"].build(), 1, 0)
    names = [f"t{i}" for i in range(len(SHAPES))]
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in SHAPES]
    bucket = engine.bucket("b", list(zip(names, grads)))
    out = engine.compress_bucket(bucket, [g.clone() for g in grads], [None] * len(grads))
    plan = Plan.at(bucket, [engine.config.density_for(0, 0.0, s.small) for s in bucket.segments])
    for g, sent, k in zip(grads, engine.decompress(out.message, [out]), plan.ks):
        assert sent.dtype == torch.bfloat16
        mask = sent != 0
        assert int(mask.sum()) == k
        assert torch.equal(sent[mask], g[mask])
        if not mask.all():
            assert g[mask].abs().min() >= g[~mask].abs().max()
    assert all(m.dtype == torch.float32 for s in states(engine).values() for m in s.values())


@pytest.mark.parametrize("method,nan_at,options", [
    ("dgc", 2, {}), ("topk", 2, {}), ("gaussiank", 2, {}), ("scalecom", 2, {}), ("scalecom", 1, {}),
    ("blocksign", 2, {}), ("dgc", 2, {"aggregation": "sparse_allreduce"})],
    ids=["dgc", "topk", "gaussiank", "scalecom", "scalecom-on-its-leader", "blocksign", "dgc-sar"])
def test_a_step_not_finite_on_one_rank_is_dropped_by_every_rank(method, nan_at, options, choices):
    """Rank 1's gradient holds a NaN at step ``nan_at`` (ScaleCom's leader at step 1); its
    flag, where a GPU leaves it on the device, reaches every destination's header. The next
    step is finite again everywhere (a NaN average left in the gradients' buffer, its padding
    included, would flag every later step)."""
    results, _, bucketed = run_steps(method, world=3, steps=nan_at + 1, nan_at=nan_at, **options)
    _, _, two_steps = run_steps(method, world=3, steps=nan_at, **options)
    for rank in results[nan_at][1]:
        assert any(torch.isnan(t).any() for t in rank)
    after, _, _ = run_steps(method, world=3, steps=nan_at + 2, nan_at=nan_at, **options)
    for rank in after[nan_at + 1][1]:
        assert all(torch.isfinite(t).all() for t in rank)
    for e, f in zip(bucketed, two_steps):
        mine, theirs = states(e), states(f)
        for name in mine:
            for key in mine[name]:
                assert torch.equal(mine[name][key], theirs[name][key])


def test_topk_conserves_every_gradient_across_a_bucket():
    """What was sent plus the residual is every gradient, segment by segment (float64 sums)."""
    engine = Engine(BY_NAME["topk"].build(), 1, 0)
    names = [f"t{i}" for i in range(len(SHAPES))]
    gen = torch.Generator().manual_seed(3)
    sent_total = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    grad_total = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    for t in range(30):
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        out = engine.compress_bucket(engine.bucket("b", list(zip(names, grads))), [g.clone() for g in grads],
                                     [None] * len(grads))
        for total, sent, g, got in zip(grad_total, sent_total, grads, engine.decompress(out.message, [out])):
            total += g
            sent += got
    for name, s, g in zip(names, sent_total, grad_total):
        residual = states(engine)[name]["residual"].double().reshape(g.shape)
        torch.testing.assert_close(s + residual, g, rtol=0, atol=1e-4)


def test_another_membership_on_one_rank_is_named():
    names = ["a", "b"]
    engines = [Engine(BY_NAME["dgc"].build(), 2, r) for r in range(2)]
    grads = [torch.randn(5000), torch.randn(300)]
    own = engines[0].compress_bucket(engines[0].bucket("b0", list(zip(names, grads))), grads, [None, None])
    other = engines[1].compress_bucket(engines[1].bucket("b0", list(zip(["a", "c"], grads))), grads,
                                       [None, None])
    with pytest.raises(MessageError, match=r"rank 1 .*tensor 'b0#"):
        engines[0].decompress(torch.cat([own.message, other.message]), [own])


def test_a_bucket_checkpoint_loads_tensor_by_tensor_and_back():
    """The saved state of a bucket is per tensor: a per-tensor engine takes it and continues
    as the bucketed one does, and a bucketed engine takes a per-tensor one."""
    _, per, bucketed = run_steps("dgc", world=1, steps=3)
    names = [f"t{i}" for i in range(len(SHAPES))]
    numels = {n: torch.Size(s).numel() for n, s in zip(names, SHAPES)}
    crossed_per = Engine(BY_NAME["dgc"].build(), 1, 0)
    crossed_per.load_state_dict(bucketed[0].state_dict(), numels)
    crossed_bucket = Engine(BY_NAME["dgc"].build(), 1, 0)
    crossed_bucket.load_state_dict(per[0].state_dict(), numels)
    grads = [torch.randn(s) for s in SHAPES]
    outs = [crossed_per.compress(n, g.clone(), None) for n, g in zip(names, grads)]
    want = crossed_per.decompress(torch.cat([o.message for o in outs]), outs)
    out = crossed_bucket.compress_bucket(crossed_bucket.bucket("layer", list(zip(names, grads))),
                                         [g.clone() for g in grads], [None] * len(grads))
    for a, b in zip(want, crossed_bucket.decompress(out.message, [out])):
        assert torch.equal(a, b)


def test_what_a_bucket_does_not_take_compresses_tensor_by_tensor():
    """int8 values carry one scale a message and clipping bounds each tensor's norm: neither is
    bucketed (a bucket would change what they send)."""
    assert not BY_NAME["topk"].build(value_dtype="int8").bucketed
    assert not BY_NAME["gaussiank"].build(value_dtype="int8").bucketed
    assert not BY_NAME["dgc"].build(clip_norm=1.0).bucketed
    assert all(BY_NAME[m].build().bucketed for m in ("dgc", "topk", "gaussiank"))
    engine = Engine(BY_NAME["topk"].build(value_dtype="int8"), 1, 0)
    grads = [torch.randn(5000)]
    with pytest.raises(TypeError, match="tensor by tensor"):
        engine.compress_bucket(engine.bucket("b", [("a", grads[0])]), grads, [None])


def test_buckets_of_another_membership_take_their_tensors_memories_along():
    """DDP rebuilds its buckets after the first step: the tensors' memories move with them."""
    names = [f"t{i}" for i in range(len(SHAPES))]
    gen = torch.Generator().manual_seed(5)
    per, regrouped = Engine(BY_NAME["dgc"].build(), 1, 0), Engine(BY_NAME["dgc"].build(), 1, 0)
    for t, groups in enumerate([[names], [names[:2], names[2:5], names[5:]], [names[3:], names[:3]]]):
        grads = dict(zip(names, (torch.randn(s, generator=gen) for s in SHAPES)))
        outs = [per.compress(n, grads[n].clone(), None) for n in names]
        want = dict(zip(names, per.decompress(torch.cat([o.message for o in outs]), outs)))
        for group in groups:
            out = regrouped.compress_bucket(regrouped.bucket("bucket0", [(n, grads[n]) for n in group]),
                                            [grads[n].clone() for n in group], [None] * len(group))
            for n, got in zip(group, regrouped.decompress(out.message, [out])):
                assert torch.equal(got, want[n]), (t, n)


def reference_blocksign_step(errors, servers, grads, world, block, moms=None, mu=0.0):
    """One step of dist-EF-blockSGDM for one tensor, written from the paper's equations with
    Python floats (docs/algorithms.md#blocksign), its server sharded as the method shards it:
    each worker's ``p = e + g (+ Nesterov momentum)``, ``C(p)`` the L1 mean of each block
    times the signs (``sign(0) = +1``), ``e = p - C(p)``; owner j averages the ``C(p)`` of
    its shard, adds its residual, and compresses again per block of the shard. Updates the
    lists in place and returns the update everyone applies."""
    n = len(grads[0])
    unit = 8 if block is None else math.lcm(8, block)
    shard = max(1, math.ceil(n / world / unit)) * unit

    def compressed(values):
        size = block or len(values)
        out = []
        for b in range(0, len(values), size):
            part = values[b:b + size]
            scale = sum(abs(v) for v in part) / len(part)
            out += [scale if v >= 0 else -scale for v in part]
        return out

    sent = []
    for r in range(world):
        g = grads[r]
        if mu:
            moms[r] = [mu * m + x for m, x in zip(moms[r], g)]
            g = [x + mu * m for x, m in zip(g, moms[r])]
        p = [e + x for e, x in zip(errors[r], g)]
        c = compressed(p)
        errors[r] = [a - b for a, b in zip(p, c)]
        sent.append(c)
    update = []
    for j in range(world):
        valid = max(0, min(shard, n - j * shard))
        averaged = [sum(c[j * shard + i] for c in sent) / world + servers[j][i] for i in range(valid)]
        d = compressed(averaged) if valid else []
        servers[j] = [a - b for a, b in zip(averaged, d)] + [0.0] * (shard - valid)
        update += d
    return update


@pytest.mark.parametrize("world,block,mu", [(2, None, 0.0), (3, None, 0.9), (4, None, 0.0), (2, 16, 0.0),
                                            (3, 64, 0.9)])
def test_a_blocksign_bucket_runs_each_tensor_as_the_paper_says(world, block, mu):
    """Tensors of 1 to 1,001 entries (a byte's and a shard's edges: 7, 8, 9, 65, 129) in one
    bucket, against :func:`reference_blocksign_step` for each tensor alone: the update, each
    worker's residual and momentum and each owner's server residual. A segment's byte or
    block taken from its neighbour, a scale summed across segments, or a shard of one
    tensor's length used for all would each move some tensor's numbers."""
    numels = [1, 7, 8, 9, 65, 129, 1000, 1001]
    names = [f"t{i}" for i in range(len(numels))]
    engines = [Engine(BY_NAME["blocksign"].build(block_size=block, momentum=mu, min_numel=1), world, r)
               for r in range(world)]
    unit = 8 if block is None else math.lcm(8, block)
    errors = [[[0.0] * n for _ in range(world)] for n in numels]
    moms = [[[0.0] * n for _ in range(world)] for n in numels]
    servers = [[[0.0] * (max(1, math.ceil(n / world / unit)) * unit) for _ in range(world)] for n in numels]
    gen = torch.Generator().manual_seed(world)
    for step in range(4):
        grads = [[torch.randn(n, generator=gen) * torch.linspace(0.1, 3.0, n) for n in numels] for _ in range(world)]
        got = two_stage_bucket(engines, names, grads, [None] * len(numels))
        for t in range(len(numels)):
            want = reference_blocksign_step(errors[t], servers[t], [g[t].double().tolist() for g in grads], world,
                                            block, moms[t], mu)
            for rank in got:
                assert rank[t].tolist() == pytest.approx(want, rel=1e-5, abs=1e-6), (step, t)
        for r, engine in enumerate(engines):
            saved = states(engine)
            for t, name in enumerate(names):
                assert saved[name]["residual"].tolist() == pytest.approx(errors[t][r], rel=1e-4, abs=1e-5)
                assert saved[name]["server"].tolist() == pytest.approx(servers[t][r], rel=1e-4, abs=1e-5)
                if mu:
                    assert saved[name]["momentum"].tolist() == pytest.approx(moms[t][r], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("method,options", [("blocksign", {}), ("scalecom", {}),
                                            ("dgc", {"aggregation": "sparse_allreduce"})])
def test_a_two_stage_buckets_averages_cost_no_operation_per_tensor(method, options):
    """The finish of a bucket of 80 tensors dispatches as many operations as one of 8 of the
    same total size: the averages are the views made once of the bucket's gradient buffer
    (a slice and a view per member and step would add 144). Their values are the bucketed
    steps' tests' concern."""
    from benchmarks.model_step import OpCounter

    def finish(shapes):
        engines = [Engine(BY_NAME[method].build(**options), 2, r) for r in range(2)]
        names = [f"t{i}" for i in range(len(shapes))]
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
            buckets = [e.bucket("layer", list(zip(names, gs))) for e, gs in zip(engines, grads)]
            firsts = [e.first_bucket(b, gs, [None] * len(gs)) for e, b, gs in zip(engines, buckets, grads)]
            counters = [OpCounter(), OpCounter()]

            def counted(r, got, h):
                with counters[r]:
                    return engines[r].finish_bucket(got, h, buckets[r], shapes)
            averages = two_stages(engines, firsts, lambda r, got, h: engines[r].second(buckets[r].key, got, h),
                                  counted)
            assert [a.shape for a in averages[0]] == [torch.Size(s) for s in shapes]
        return [c.count for c in counters]

    assert finish([(640,)] * 8) == finish([(64,)] * 80)


@pytest.mark.parametrize("options,dtype", [({}, torch.float32), ({"momentum": 0.9}, torch.float32),
                                           ({"block_size": 64}, torch.float32), ({"block_size": 24}, torch.float32),
                                           ({}, torch.bfloat16)], ids=["one-block", "momentum", "block-64",
                                                                       "block-24", "bfloat16"])
def test_blocksign_buckets_equal_the_per_tensor_steps_but_for_summation_order(options, dtype):
    """A tensor's scale is summed over its entries at once alone and a byte at a time in a
    bucket: the two agree to float32's rounding, not bit for bit."""
    results, per, bucketed = run_steps("blocksign", world=3, steps=5, dtype=dtype, **options)
    for per_avg, bucket_avg in results:
        for rank_a, rank_b in zip(per_avg, bucket_avg):
            for a, b in zip(rank_a, rank_b):
                assert a.shape == b.shape and a.dtype == b.dtype
                torch.testing.assert_close(b.float(), a.float(), rtol=1e-6, atol=1e-6 * float(a.abs().max()))
    for e, f in zip(per, bucketed):
        mine, theirs = states(e), states(f)
        assert sorted(mine) == sorted(theirs)
        for name in mine:
            assert sorted(mine[name]) == sorted(theirs[name])
            for key in mine[name]:
                torch.testing.assert_close(theirs[name][key], mine[name][key], rtol=1e-6, atol=1e-6)


def test_blocksign_blocks_that_split_a_byte_compress_tensor_by_tensor():
    assert BY_NAME["blocksign"].build().bucketed and BY_NAME["blocksign"].build(block_size=256).bucketed
    method = BY_NAME["blocksign"].build(block_size=20)
    assert not method.bucketed
    engine = Engine(method, 1, 0)
    grads = [torch.randn(5000)]
    with pytest.raises(TypeError, match="tensor by tensor"):
        engine.first_bucket(engine.bucket("b", [("a", grads[0])]), grads, [None])


def _candidates_at(x: torch.Tensor, plan: Plan, bounds):
    """What a bucket's memory pass collects at each segment's bound: every entry reaching it
    (by a plain mask), and each block's count."""
    per_block = torch.tensor([bounds[s] for s, seg in enumerate(plan.bucket.segments)
                              for _ in range(seg.span // plan.block)], dtype=torch.float32)
    mask = x.abs() >= per_block.repeat_interleave(plan.block)
    positions = mask.nonzero().flatten()
    counts = torch.zeros(per_block.numel(), dtype=torch.int64).index_add_(
        0, positions // plan.block, torch.ones(positions.numel(), dtype=torch.int64))
    return Candidates(positions, x.abs()[positions], counts, BlockBounds(per_block))


class SortedCandidates(TorchOps):
    """TorchOps without the kernel that selects from a bucket's candidates: the core's sort."""

    def top_of_segments(self, *args):
        return None


@pytest.mark.parametrize("ops", [TorchOps(), SortedCandidates()], ids=["kernel", "composition"])
@pytest.mark.parametrize("seed", range(4))
def test_a_bucket_selects_from_its_candidates_when_each_segment_holds_its_k(seed, ops):
    """Each segment's bound near its k-th largest: above it for one segment in some runs, whose
    top k then is not all among the candidates (None, and the counts say which), below it for
    all in the others, where the selection is each segment's top k by a sort."""
    rng = random.Random(seed)
    bucket = random_bucket(rng)
    plan = Plan.at(bucket, [0.05] * len(bucket.segments))
    gen = torch.Generator().manual_seed(seed)
    x = torch.zeros(bucket.numel)
    for s in bucket.segments:
        x[s.offset:s.end] = torch.randn(s.numel, generator=gen)
    kth = [sorted(x[s.offset:s.end].abs().tolist(), reverse=True)[k - 1] for s, k in zip(bucket.segments, plan.ks)]
    short = seed % 2 == 1
    bounds = [v * 0.9 for v in kth]
    if short:
        bounds[-1] = kth[-1] * 1.0001 + 1e-6
    got = select_candidates(ops, plan, _candidates_at(x, plan, bounds))
    assert got.counts.tolist() == [int((x[s.offset:s.end].abs() >= torch.tensor(b)).sum())
                                   for s, b in zip(bucket.segments, bounds)]
    if short:
        assert got.positions is None and got.thresholds is None
        return
    want = [s.offset + p for s, k in zip(bucket.segments, plan.ks) for p in naive_top(x[s.offset:s.end], k)]
    assert got.positions.tolist() == want
    assert got.thresholds.tolist() == pytest.approx(kth)


def test_next_bounds_aim_below_each_segments_kth_largest():
    """Without counts each bound is 0.99 times its segment's k-th largest; a small segment's
    (fewer than 4,096 entries) is 0: all of it is collected."""
    bucket = Bucket.of("b", [("a", 5000, False), ("c", 100, True), ("d", 8000, False)], "float32")
    plan = Plan.at(bucket, [0.01, 0.05, 0.01])
    gen = torch.Generator().manual_seed(9)
    magnitudes = torch.rand(plan.total, generator=gen) + 0.5
    thresholds = segment_thresholds(TorchOps(), magnitudes, plan)
    got = next_bounds(TorchOps(), plan, thresholds, None, None).tolist()
    starts = plan.pick_starts
    smallest = [float(magnitudes[a:a + k].min()) for a, k in zip(starts, plan.ks)]
    assert thresholds.tolist() == smallest
    assert got == pytest.approx([0.99 * smallest[0], 0.0, 0.99 * smallest[2]])


def test_a_bucket_whose_bounds_fail_backs_off_1_2_4_steps(monkeypatch):
    """Gradients 100 times larger every step: every predicted bound is far too low (more
    candidates than their room), so the bucket selects without bounds for 1, then 2, then 4
    steps; the averages are the per-tensor ones throughout."""
    engine, per = Engine(BY_NAME["topk"].build(), 1, 0), Engine(BY_NAME["topk"].build(), 1, 0)
    bounded, compress = [], engine.method.compress_bucket

    def recording(ops, state, grad, call):
        bounded.append(call.candidate_bounds is not None)
        return compress(ops, state, grad, call)

    monkeypatch.setattr(engine.method, "compress_bucket", recording)
    names, shapes = ["a", "b"], [(300, 40), (50, 100)]
    gen = torch.Generator().manual_seed(6)
    for step in range(10):
        grads = [torch.randn(s, generator=gen) * 100.0 ** step for s in shapes]
        out = engine.compress_bucket(engine.bucket("b", list(zip(names, grads))), [g.clone() for g in grads],
                                     [None, None])
        got = engine.decompress(out.message, [out])
        outs = [per.compress(n, g.clone(), None) for n, g in zip(names, grads)]
        want = per.decompress(torch.cat([o.message for o in outs]), outs)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
    assert [i for i, b in enumerate(bounded) if b] == [1, 3, 7]


@pytest.mark.parametrize("method", ["topk", "gaussiank"])
def test_buckets_hold_their_candidates_on_steady_gradients(method):
    """Gradients of one scale: after two steps every bucket step takes each segment's top
    (Gaussian-k: its capacity + 1 largest) from its candidates, and sends what the per-tensor
    path sends."""
    engine = Engine(BY_NAME[method].build(), 1, 0)
    held, compress = [], engine.method.compress_bucket

    def recording(ops, state, grad, call):
        result = compress(ops, state, grad, call)
        held.append(result.bounds_held)
        return result

    engine.method.compress_bucket = recording
    per = Engine(BY_NAME[method].build(), 1, 0)
    names, shapes = ["a", "b", "c"], [(300, 40), (50, 100), (64,)]
    gen = torch.Generator().manual_seed(7)
    for step in range(8):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        out = engine.compress_bucket(engine.bucket("b", list(zip(names, grads))), [g.clone() for g in grads],
                                     [None] * 3)
        got = engine.decompress(out.message, [out])
        outs = [per.compress(n, g.clone(), None) for n, g in zip(names, grads)]
        want = per.decompress(torch.cat([o.message for o in outs]), outs)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
    assert held[3:] == [True] * 5, held


# Tensors sent dense, and what one worker sends for each at every step, with its momentum m
# (float32): blocksign's Nesterov momentum, DGC's momentum with each tensor's weight decay
# (the decayed gradient in the gradient's dtype), Top-k's gradient as it is.
DENSE_SENDS = {
    "blocksign": ({"momentum": 0.9}, lambda g, p, m, wd, dtype: (0.9 * m + g, g + 0.9 * (0.9 * m + g))),
    "dgc": ({"small_density": None},
            lambda g, p, m, wd, dtype: (0.9 * m + (g + wd * p).to(dtype).float(),) * 2),
    "topk": ({"small_density": None}, lambda g, p, m, wd, dtype: (m, g)),
}


@pytest.mark.parametrize("in_place", [False, True], ids=["averaged-elsewhere", "averaged-in-place"])
@pytest.mark.parametrize("method", sorted(DENSE_SENDS))
def test_dense_tensors_sent_as_one_flat_tensor_per_dtype_follow_each_tensors_equation(method, in_place):
    """Engine.dense_all (the fused optimizer's and the DDP hook's dense tensors): one flat
    tensor per dtype; on one worker each tensor's average is what the method's equation sends
    for it (its own momentum and weight decay, bfloat16 tensors rounded once), step after
    step, the memories kept per tensor as the equation's, and a checkpoint laid out per tensor
    as the stock path's (tensor by tensor) is."""
    options, equation = DENSE_SENDS[method]
    gen = torch.Generator().manual_seed(2)
    shapes = {"a.bias": (5,), "b.weight": (2, 3), "c.bias": (7,), "d.bias": (1,)}
    dtypes = {"a.bias": torch.float32, "b.weight": torch.bfloat16, "c.bias": torch.float32,
              "d.bias": torch.bfloat16}
    decays = {"a.bias": 0.0, "b.weight": 1e-2, "c.bias": 0.5, "d.bias": 0.0} if method == "dgc" else {}
    params = {n: torch.randn(shapes[n], generator=gen).to(dtypes[n]) for n in shapes}
    together, alone = (Engine(BY_NAME[method].build(**options), 1, 0) for _ in range(2))
    for engine in (together, alone):
        engine.set_weight_decays(decays)
    momenta = {n: torch.zeros(shapes[n]) for n in shapes}
    for step in range(3):
        grads = {n: torch.randn(shapes[n], generator=gen).to(dtypes[n]) for n in shapes}
        sends = together.dense_all("dense", [(n, grads[n], params[n]) for n in shapes])
        assert [update.tensor.dtype for update, _ in sends] == [torch.float32] * 2
        got = {}
        for update, places in sends:
            averaged = update.tensor if in_place else update.tensor.clone()
            for i, result in zip(places, together.dense_all_received(update, averaged)):
                got[list(shapes)[i]] = result
        for n in shapes:
            momenta[n], want = equation(grads[n].float(), params[n].float(), momenta[n], decays.get(n, 0.0),
                                        dtypes[n])
            assert got[n].dtype == dtypes[n] and got[n].shape == shapes[n], n
            torch.testing.assert_close(got[n].float(), want.to(dtypes[n]).float(), rtol=1e-6, atol=1e-6,
                                       msg=f"{n} at step {step}")
            if method != "topk":
                torch.testing.assert_close(together.memories(n)["momentum"].reshape(shapes[n]), momenta[n],
                                           rtol=1e-6, atol=1e-6, msg=f"{n}'s momentum at step {step}")
            update = alone.dense(n, grads[n], params[n])
            alone.dense_received(update, update.tensor)
    saved, each = together.state_dict()["states"], alone.state_dict()["states"]
    assert {n: sorted(kept) for n, kept in saved.items()} == {n: sorted(kept) for n, kept in each.items()}
    assert all(torch.equal(saved[n][k], each[n][k]) for n in each for k in each[n])


@pytest.mark.parametrize("deferred", [False, True], ids=["checked-at-once", "checks-deferred-as-on-a-gpu"])
def test_a_non_finite_average_of_dense_tensors_sent_as_one_names_the_tensor_and_keeps_memories(deferred):
    """A NaN in one tensor's part of a dense bucket's average: with nonfinite="raise" the
    error names that tensor, every memory is left as it was before the step, and the next
    step goes on (nothing of the NaN kept in the bucket's buffers)."""
    gen = torch.Generator().manual_seed(0)
    grads = {"a.bias": torch.randn(5, generator=gen), "b.bias": torch.randn(2, 3, generator=gen),
             "c.bias": torch.randn(7, generator=gen)}
    engine = Engine(BY_NAME["blocksign"].build(nonfinite="raise", momentum=0.9), 1, 0)
    engine.ops = WaitingOps(defer_checks=True) if deferred else engine.ops
    for poisoned in (None, ALIGN + 2, None):  # an entry of b.bias (each starts at a multiple of ALIGN)
        before = {n: engine.memories(n)["momentum"].clone() for n in grads} if poisoned else None
        [(update, _)] = engine.dense_all("dense", [(n, g, None) for n, g in grads.items()])
        averaged = update.tensor.clone()
        if poisoned is None:
            assert all(torch.isfinite(r).all() for r in engine.dense_all_received(update, averaged))
            continue
        averaged[poisoned] = float("nan")
        with pytest.raises(NonFiniteGradientError, match="gradient of tensor 'b.bias' held NaN"):
            engine.dense_all_received(update, averaged)
        assert all(torch.equal(engine.memories(n)["momentum"], before[n]) for n in grads)


def test_dense_tensors_of_a_method_that_clips_each_go_one_by_one():
    """DGC with clip_norm bounds each tensor's own norm, which a bucket's pass does not take:
    Engine.dense_all sends each tensor sent dense on its own, as Engine.dense does."""
    gen = torch.Generator().manual_seed(3)
    grads = {"a.bias": torch.randn(5, generator=gen), "b.bias": torch.randn(3, generator=gen)}
    together, alone = (Engine(BY_NAME["dgc"].build(small_density=None, clip_norm=0.5), 1, 0) for _ in range(2))
    sends = together.dense_all("dense", [(n, g, None) for n, g in grads.items()])
    assert [places for _, places in sends] == [[0], [1]]
    for (update, _), (n, g) in zip(sends, grads.items()):
        want = alone.dense(n, g, None).tensor
        assert update.bucket is None and torch.equal(update.tensor, want)
        assert torch.linalg.vector_norm(want) <= 0.5 + 1e-6
