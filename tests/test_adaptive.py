"""The adaptive switch: a compressed bucket's dense step (the flush) against the equations
written out here, the conservation law across forced switches for every method, and the
decision rule and its cost model against hand-computed predictions."""
import importlib
import math

import pytest
import torch

from horovod_dgc.core.adaptive import (COMPRESSED, DENSE, PROBE_BYTES, Adaptive, BucketCost, BucketTraffic, Link,
                                      StepEnd, Switch, decide)
from horovod_dgc.core.collectives import ALLGATHER, ALLREDUCE
from horovod_dgc.core.methods import BY_NAME
from horovod_dgc.torch.engine import Engine

from conftest import OneRankTransport, two_stage_bucket

SHAPES = [(40, 3, 3, 3), (40,), (1,), (64, 80), (1000,), (5, 2048), (3, 5)]
NAMES = [f"t{i}" for i in range(len(SHAPES))]
# Every method with the memories whose conservation law is a plain sum (no momentum, no
# low-pass filter), so that the law can be written out over a step that switches.
PLAIN = {
    "topk": ("topk", {}),
    "gaussiank": ("gaussiank", {}),
    "dgc": ("dgc", {"momentum": 0.0}),
    "dgc-sar": ("dgc", {"momentum": 0.0, "aggregation": "sparse_allreduce"}),
    "scalecom": ("scalecom", {"beta": 1.0}),
    "blocksign": ("blocksign", {"momentum": 0.0}),
}


def engines_of(method: str, world: int, **options):
    return [Engine(BY_NAME[method].build(**options), world, r) for r in range(world)]


def compressed_step(engines, grads):
    """Every rank's averages of one compressed step of the bucket of ``grads[rank]``."""
    nones = [None] * len(NAMES)
    if engines[0].method.family == "two-stage":
        return two_stage_bucket(engines, NAMES, grads, nones)
    buckets = [e.bucket("layer", list(zip(NAMES, gs))) for e, gs in zip(engines, grads)]
    sent = [e.compress_bucket(b, [g.clone() for g in gs], nones) for e, b, gs in zip(engines, buckets, grads)]
    gathered = torch.cat([o.message for o in sent])
    return [[t.clone() for t in e.decompress(gathered, [o])] for e, o in zip(engines, sent)]


def dense_step(engines, grads):
    """Every rank's averages of one flushed step: an averaging all-reduce, written out."""
    buckets = [e.bucket("layer", list(zip(NAMES, gs))) for e, gs in zip(engines, grads)]
    updates = [e.flush_bucket(b, [g.clone() for g in gs], [None] * len(NAMES))
               for e, b, gs in zip(engines, buckets, grads)]
    average = sum(u.tensor for u in updates) / len(engines)
    return [[t.clone() for t in e.bucket_received(u, average.clone())] for e, u in zip(engines, updates)]


def owed(engines, name: str, numel: int) -> torch.Tensor:
    """What the memories still owe tensor ``name``'s average: the mean of the workers' pending
    memories plus its sharded memory (every rank's shard, in rank order)."""
    method = engines[0].method
    pending = sum(e.memories(name)[method.pending_memory].double() for e in engines) / len(engines)
    for key in method.state_layout(True).sharded:
        pending = pending + torch.cat([e.memories(name)[key].double() for e in engines])[:numel]
    return pending


@pytest.mark.parametrize("kind", sorted(PLAIN))
def test_no_gradient_is_lost_over_500_steps_that_switch_every_50(kind):
    """(1/N) sum of every gradient = every average applied + what the memories owe, per
    tensor, after 500 steps whose mode alternates every 50 (a float64 sum, independent of
    the core); the ranks apply identical averages; a dense step leaves float32 memories
    empty."""
    method, options = PLAIN[kind]
    world = 3
    engines = engines_of(method, world, **options)
    gen = torch.Generator().manual_seed(0)
    applied = [torch.zeros(math.prod(s), dtype=torch.float64) for s in SHAPES]
    mean_grads = [torch.zeros(math.prod(s), dtype=torch.float64) for s in SHAPES]
    for t in range(500):
        grads = [[torch.randn(s, generator=gen) * (1 + t % 5) for s in SHAPES] for _ in range(world)]
        dense = (t // 50) % 2 == 1
        results = (dense_step if dense else compressed_step)(engines, grads)
        assert all(torch.equal(a, b) for rank in results[1:] for a, b in zip(results[0], rank))
        for i in range(len(SHAPES)):
            applied[i] += results[0][i].double().reshape(-1)
            mean_grads[i] += sum(g[i].double().reshape(-1) for g in grads) / world
        if dense:
            assert all(float(owed(engines, n, math.prod(s)).abs().max()) == 0.0 for n, s in zip(NAMES, SHAPES))
    for name, s, a, g in zip(NAMES, SHAPES, applied, mean_grads):
        error = (a + owed(engines, name, math.prod(s)) - g).norm() / g.norm()
        assert error < 1e-5, (name, float(error))


def test_a_dense_step_of_float16_gradients_keeps_what_the_wire_rounds_away():
    """A float16 bucket travels in float16; each rank's residual (float32) keeps exactly what
    that rounding took from its flush, ``e + g - float16(e + g)``."""
    world, engines = 2, engines_of("topk", 2)
    gen = torch.Generator().manual_seed(1)
    compressed_step(engines, [[(torch.randn(s, generator=gen) / 3).half() for s in SHAPES] for _ in range(world)])
    before = [[e.memories(n)["residual"].clone() for n in NAMES] for e in engines]
    grads = [[(torch.randn(s, generator=gen) / 3).half() for s in SHAPES] for _ in range(world)]
    buckets = [e.bucket("layer", list(zip(NAMES, gs))) for e, gs in zip(engines, grads)]
    updates = [e.flush_bucket(b, gs, [None] * len(NAMES)) for e, b, gs in zip(engines, buckets, grads)]
    average = sum(u.tensor.float() for u in updates) / world
    for e, u in zip(engines, updates):
        e.bucket_received(u, average.half())
    rounded = 0
    for r, engine in enumerate(engines):
        assert updates[r].tensor.dtype == torch.float16
        for i, (name, segment) in enumerate(zip(NAMES, buckets[r].segments)):
            total = before[r][i] + grads[r][i].float().reshape(-1)
            sent = updates[r].tensor[segment.offset:segment.end].float()
            assert torch.equal(engine.memories(name)["residual"], total - sent)
            rounded += int(engine.memories(name)["residual"].count_nonzero())
    assert rounded > 0


@pytest.mark.parametrize("nesterov", [False, True])
def test_dgc_flushes_its_velocity_and_keeps_its_momentum(nesterov):
    """DGC's dense step sends ``v + u'`` (Nesterov ``v + u' + g``) with ``u' = m u + g``
    (Nesterov ``m (u + g)``): the velocity empties, the momentum goes on."""
    world, m = 2, 0.9
    engines = engines_of("dgc", world, momentum=m, nesterov=nesterov)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        compressed_step(engines, [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(world)])
    before = [{n: {k: v.clone() for k, v in e.memories(n).items()} for n in NAMES} for e in engines]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(world)]
    results = dense_step(engines, grads)
    for i, name in enumerate(NAMES):
        sends, momenta = [], []
        for r in range(world):
            u, v, g = before[r][name]["momentum"], before[r][name]["velocity"], grads[r][i].reshape(-1)
            momentum = m * (u + g) if nesterov else m * u + g
            sends.append(v + momentum + (g if nesterov else 0))
            momenta.append(momentum)
        torch.testing.assert_close(results[0][i].reshape(-1), sum(sends) / world)
        for r, engine in enumerate(engines):
            torch.testing.assert_close(engine.memories(name)["momentum"], momenta[r])
            assert not engine.memories(name)["velocity"].any()


def test_a_dense_step_undoes_and_restores_the_loss_scale():
    """Memories hold unscaled gradients; the average goes back in the loss scale's units."""
    world, scale = 2, 8.0
    engines = engines_of("topk", world)
    for engine in engines:
        engine.use_loss_scale(lambda: scale)
    gen = torch.Generator().manual_seed(3)
    grads = [[torch.randn(s, generator=gen) * scale for s in SHAPES] for _ in range(world)]
    compressed_step(engines, grads)
    before = [[engine.memories(n)["residual"].clone() for n in NAMES] for engine in engines]
    grads = [[torch.randn(s, generator=gen) * scale for s in SHAPES] for _ in range(world)]
    results = dense_step(engines, grads)
    for i in range(len(NAMES)):
        want = sum(before[r][i] + grads[r][i].reshape(-1) / scale for r in range(world)) / world * scale
        torch.testing.assert_close(results[0][i].reshape(-1), want)


def test_a_step_not_finite_on_one_rank_leaves_every_memory_as_it_was():
    world, engines = 2, engines_of("dgc", 2)
    gen = torch.Generator().manual_seed(4)
    compressed_step(engines, [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(world)])
    before = [{n: {k: v.clone() for k, v in e.memories(n).items()} for n in NAMES} for e in engines]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(world)]
    grads[1][3][0, 0] = float("nan")
    results = dense_step(engines, grads)
    assert torch.isnan(results[0][3]).any()
    for r, engine in enumerate(engines):
        for name in NAMES:
            for key, memory in engine.memories(name).items():
                assert torch.equal(memory, before[r][name][key]), (r, name, key)


# -- the decision rule and its cost model --------------------------------------------------------
def test_the_link_fits_a_latency_and_a_time_per_byte_to_two_probes():
    """A ring all-reduce of B bytes among N workers sends 2 (N - 1) / N * B per worker."""
    link = Link.from_probes(small_s=0.001, large_s=0.011, large_bytes=10_000_000, world_size=4)
    assert link.latency_s == 0.001
    assert link.seconds_per_byte == pytest.approx(0.010 / (2 * 3 / 4 * 10_000_000))
    assert link.time_s(ALLREDUCE, 10_000_000, 4) == pytest.approx(0.011)


def test_a_bucket_cost_adds_compute_to_each_collectives_time():
    link = Link(latency_s=0.002, seconds_per_byte=1e-8)
    cost = BucketCost("b", dense_bytes=4_000_000, exchanges=((ALLGATHER, 10_000),), compute_s=0.005)
    compressed, dense = cost.predicted_s(link, 4)
    # Allgather: each worker sends its message to N - 1 others through the ring.
    assert compressed == pytest.approx(0.005 + 0.002 + 3 * 10_000 * 1e-8)
    assert dense == pytest.approx(0.002 + 2 * 3 / 4 * 4_000_000 * 1e-8)


@pytest.mark.parametrize("current,compressed_s,dense_s,want", [
    (COMPRESSED, 10.0, 8.9, DENSE), (COMPRESSED, 10.0, 9.1, COMPRESSED),
    (DENSE, 8.9, 10.0, COMPRESSED), (DENSE, 9.1, 10.0, DENSE), (DENSE, 20.0, 10.0, DENSE)])
def test_a_bucket_switches_only_past_the_margin(current, compressed_s, dense_s, want):
    assert decide(current, compressed_s, dense_s, margin=0.1) == want


def test_decisions_run_at_the_first_step_and_then_every_recheck_and_sample_the_steps_before():
    settings = Adaptive(recheck_steps=100, first_decision_step=20, sample_steps=5)
    assert [s for s in range(400) if settings.decides_at(s)] == [20, 120, 220, 320]
    assert [s for s in range(130) if settings.samples_at(s)] == [15, 16, 17, 18, 19, 115, 116, 117, 118, 119]


def test_the_switch_keeps_a_dense_buckets_last_compute_cost_and_a_forced_mode_wins():
    switch = Switch(Adaptive(recheck_steps=10, first_decision_step=5, sample_steps=3))
    for step in range(2, 5):
        switch.sample(step, {"a": 0.010 + step * 1e-3, "b": 0.001})
    assert switch.local_compute_s(["a", "b"]) == [pytest.approx(0.013), 0.001]
    slow_link = Link(0.0, 1e-6)
    decisions = switch.decide(5, [BucketCost("a", 1000, ((ALLGATHER, 10),), 0.013),
                                  BucketCost("b", 10_000_000, ((ALLGATHER, 1000),), 0.001)], slow_link, 2)
    assert [d.mode for d in decisions] == [DENSE, COMPRESSED]
    assert str(decisions[0]).startswith("a: dense, ") and "saved" in str(decisions[0])
    switch.sample(14, {"a": 5.0, "b": 0.002})  # a is dense: not sampled
    assert switch.local_compute_s(["a", "b"]) == [0.013, 0.002]
    switch.force(COMPRESSED, ["a"])
    assert switch.mode("a") == COMPRESSED and switch.lines()[0] == "a: compressed (forced)"
    switch.force(None, ["a"])
    assert switch.mode("a") == DENSE


def test_a_change_of_scale_between_decisions_brings_the_decision_forward():
    """The step after a decision sets the level of its modes; watches every watch_steps after
    it compare with that level."""
    switch = Switch(Adaptive(recheck_steps=200, first_decision_step=20, watch_steps=25, rescale=2.0))
    assert not any(switch.watches_at(s) for s in range(20))  # none before the first decision
    switch.decide(20, [], Link(0.0, 0.0), 2)
    assert [s for s in range(21, 80) if switch.watches_at(s) and not switch.rescaled(s, 0.010)] == [21, 46, 71]
    assert not switch.rescaled(96, 0.019) and not switch.rescaled(121, 0.0051)
    assert switch.rescaled(146, 0.020) and switch.rescaled(171, 0.005)
    switch.decide(171, [], Link(0.0, 0.0), 2)
    assert switch.watches_at(172) and not switch.rescaled(172, 0.040)  # the new modes' level


class _TwoRanks:
    """The collectives of rank 0 of 2 whose peer measures ``peer_factor`` times what it does;
    its all-reduces take a fixed latency plus a ring's bytes at a fixed rate."""

    def __init__(self, latency_s: float, seconds_per_byte: float, peer_factor: float = 3.0) -> None:
        self.latency_s, self.seconds_per_byte, self.peer_factor = latency_s, seconds_per_byte, peer_factor
        self.probed, self.means = [], []

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0

    def mean(self, values, name):
        self.means.append(name)
        return [(v + self.peer_factor * v) / 2 for v in values]

    def allreduce_s(self, numel, name):
        self.probed.append(numel)
        return self.latency_s + 2 * (2 - 1) / 2 * 4 * numel * self.seconds_per_byte


def test_a_step_end_decides_on_the_ranks_averaged_measurements_and_probes_the_link():
    """At the decision step: each bucket's compute cost is the ranks' average of their sample
    medians, the link is fitted to the probes (averaged over the ranks), and the modes follow
    the predictions written out here."""
    switch = Switch(Adaptive(recheck_steps=10, first_decision_step=3, sample_steps=2))
    collectives = _TwoRanks(latency_s=1e-3, seconds_per_byte=1e-9)
    step_end = StepEnd(switch, collectives)
    traffic = {"a": BucketTraffic(100_000_000, ((ALLGATHER, 100_000),)), "b": BucketTraffic(40_000, ((ALLGATHER, 400),))}
    for step, compute_s in enumerate([{"a": 9.0, "b": 9.0}, {"a": 0.010, "b": 0.002}, {"a": 0.012, "b": 0.004}]):
        assert step_end(step, compute_s, lambda: traffic) == []
    decisions = step_end(3, {"a": 0.011, "b": 0.003}, lambda: traffic)
    # Samples of steps 1 and 2 (the medians 0.011 and 0.003), averaged with a peer's 3x.
    assert switch.compute_s == {"a": pytest.approx(0.022), "b": pytest.approx(0.006)}
    # One element, 4 MiB, then the largest bucket's 100 MB (predicted under 0.5 s), 3 runs each.
    assert collectives.probed == [1] * 3 + [PROBE_BYTES // 4] * 3 + [100_000_000 // 4] * 3
    link = Link(latency_s=2 * (1e-3 + 4e-9), seconds_per_byte=2 * 1e-9)  # the peer's 3x, averaged
    want = {label: BucketCost(label, t.dense_bytes, t.exchanges, switch.compute_s[label]).predicted_s(link, 2)
            for label, t in traffic.items()}
    for decision in decisions:
        compressed_s, dense_s = want[decision.label]
        assert (decision.compressed_s, decision.dense_s) == (pytest.approx(compressed_s, rel=1e-3),
                                                             pytest.approx(dense_s, rel=1e-3))
        assert decision.mode == (DENSE if dense_s < 0.9 * compressed_s else COMPRESSED)
    assert [d.mode for d in decisions] == [COMPRESSED, DENSE]


def test_a_step_end_with_the_link_given_runs_no_probe_and_its_watch_brings_a_decision_forward():
    switch = Switch(Adaptive(recheck_steps=100, first_decision_step=2, sample_steps=1, link_bytes_per_s=1e9,
                             watch_steps=5))
    collectives = _TwoRanks(latency_s=0.0, seconds_per_byte=0.0, peer_factor=1.0)
    step_end = StepEnd(switch, collectives)
    traffic = {"a": BucketTraffic(4_000, ((ALLGATHER, 40),))}
    decided = []
    for step in range(20):
        step_end.exchanged(0.010 if step < 10 else 0.100)  # the link slows down at step 10
        decided += [d.step for d in step_end(step, {"a": 0.001}, lambda: traffic)]
    assert collectives.probed == []
    # The schedule's decision at 2; the watch sets the level at 3, keeps it at 8, sees 10x at 13.
    assert decided == [2, 13]


def test_a_step_end_that_skips_steps_still_takes_the_decisions_due_in_between():
    """Keras calls back once per ``steps_per_execution`` steps: a decision step among the
    skipped ones is taken at the next call."""
    switch = Switch(Adaptive(recheck_steps=10, first_decision_step=5, sample_steps=1, link_bytes_per_s=1e9))
    step_end = StepEnd(switch, _TwoRanks(latency_s=0.0, seconds_per_byte=0.0))
    traffic = {"a": BucketTraffic(4_000, ((ALLGATHER, 40),))}
    decided = [d.step for step in range(3, 40, 4) for d in step_end(step, {"a": 0.001}, lambda: traffic)]
    assert decided == [7, 15, 27, 35]  # due at 5, 15, 25, 35


def test_a_restored_step_end_keeps_the_checkpoints_modes_until_the_next_decision_due():
    """Steps before a checkpoint count as ended: a decision due among them is not taken again
    at the first step after the restore (which would override the restored modes at once)."""
    saved = Switch(Adaptive(recheck_steps=5, first_decision_step=4, sample_steps=1, link_bytes_per_s=1e9))
    saved.decide(9, [BucketCost("a", 4_000, ((ALLGATHER, 40),), 0.001)], Link(0.0, 1e-9), 2)
    settings = Adaptive(recheck_steps=5, first_decision_step=4, sample_steps=1, link_bytes_per_s=1e9)
    switch = Switch(settings)
    step_end = StepEnd(switch, _TwoRanks(latency_s=0.0, seconds_per_byte=0.0))
    step_end.restore(saved.state_dict(), steps_taken=13)
    traffic = {"a": BucketTraffic(4_000, ((ALLGATHER, 40),))}
    assert step_end(13, {"a": 0.001}, lambda: traffic) == []  # 9 was decided before the checkpoint
    assert switch.mode("a") == saved.mode("a") and step_end.last_step == 13
    assert [d.step for d in step_end(14, {"a": 0.001}, lambda: traffic)] == [14]


def test_modes_and_their_decisions_survive_a_checkpoint_and_an_older_state_starts_compressed():
    switch = Switch(Adaptive())
    switch.decide(20, [BucketCost("a", 10 ** 7, ((ALLGATHER, 10),), 0.5)], Link(0.0, 1e-9), 2)
    switch.force(DENSE, ["b"])
    loaded = Switch(Adaptive())
    loaded.load_state_dict(switch.state_dict())
    assert loaded.mode("a") == DENSE and loaded.lines() == switch.lines()[:1]
    assert loaded.mode("b") == COMPRESSED
    loaded.load_state_dict(None)
    assert loaded.mode("a") == COMPRESSED and loaded.lines() == ()


def test_settings_are_checked_at_construction():
    with pytest.raises(ValueError, match="sample_steps"):
        Adaptive(sample_steps=30, first_decision_step=20)
    with pytest.raises(ValueError, match="margin"):
        Adaptive(margin=1.5)
    with pytest.raises(ValueError, match="link_bytes_per_s"):
        Adaptive(link_bytes_per_s=0)
    with pytest.raises(ValueError, match="rescale"):
        Adaptive(rescale=1.0)
    with pytest.raises(ValueError, match="adaptive must be"):
        Adaptive.of("yes")


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_a_compressor_refuses_what_the_switch_does_not_support_at_construction(framework):
    if framework == "tensorflow":
        pytest.importorskip("tensorflow")
    Compression = importlib.import_module(f"horovod_dgc.{framework}").Compression
    with pytest.raises(TypeError, match="does not compress in buckets"):
        Compression.dgc(adaptive=True, clip_norm=1.0)
    with pytest.raises(ValueError, match="hierarchical"):
        Compression.dgc(adaptive=True, hierarchical=True)
    with pytest.raises(ValueError, match="adaptive must be"):
        Compression.topk(adaptive="yes")
    assert Compression.blocksign(adaptive=Adaptive(margin=0.2)).adaptive.margin == 0.2
    assert Compression.topk().adaptive is None


def test_a_label_no_longer_exchanged_is_not_decided_on():
    """DDP numbers its buckets anew when it rebuilds them after the first step: the labels of
    the first step that no step exchanges again get no decision and no line."""
    from horovod_dgc.torch import Compression
    compression = Compression.topk(adaptive=Adaptive(link_bytes_per_s=1e15, first_decision_step=2,
                                                     sample_steps=1, recheck_steps=2))
    compression.use_transport(OneRankTransport())
    params = {name: torch.zeros(5000) for name in "abc"}
    compression.bind(list(params.items()))
    decided = []
    for labels in (("bucket0", "bucket1"), ("bucket0", "bucket1"), ("bucket0",), ("bucket0",)):
        for label, names in zip(labels, ("ab", "c") if len(labels) == 2 else ("abc",)):
            entries = [(name, torch.randn(5000), params[name]) for name in names]
            compression.finish(compression.launch(label, entries))
        decided += [decision.label for decision in compression.end_step()]
    assert decided == ["bucket0"]
    assert list(compression.bucket_modes()) == ["bucket0"]
    assert [line.split(":")[0] for line in compression.stats().buckets] == ["bucket0"]
