"""Bytes at the limit, read from stats() and checked against the messages themselves: DGC
on ResNet-50's 161 gradients at the paper's density, and the network figures of each
collective."""
import sys

import pytest
import torch

from conftest import ROOT
from horovod_dgc.core.collectives import network_bytes
from horovod_dgc.core.methods import BY_NAME
from horovod_dgc.torch.engine import Engine

sys.path.insert(0, str(ROOT / "examples"))
from _resnet import resnet50  # noqa: E402

RESNET50_PARAMS = 25_557_032


def one_step(engine: Engine, model: torch.nn.Module) -> int:
    """Every gradient through the engine once (the fused path: no placeholders); returns the
    bytes of the messages and dense tensors it produced."""
    produced = 0
    for name, p in model.named_parameters():
        grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)))
        if engine.compresses(grad):
            produced += engine.compress(name, grad, p).message.numel()
        else:
            update = engine.dense(name, grad, p).tensor
            produced += update.numel() * update.element_size()
    return produced


def test_dgc_hands_horovod_at_least_550x_fewer_bytes_than_dense_on_resnet50():
    model = resnet50()
    assert sum(p.numel() for p in model.parameters()) == RESNET50_PARAMS
    engine = Engine(BY_NAME["dgc"].build(), world_size=4, rank=0)
    produced = one_step(engine, model)
    stats = engine.stats()
    assert stats.bytes_sent == produced, "stats() disagrees with the messages"
    assert stats.dense_bytes == 4 * RESNET50_PARAMS
    print(f"dgc on ResNet-50: {produced} B handed to Horovod, {stats.handed_ratio:.0f}x fewer "
          f"than dense; {stats.network_bytes:.0f} B on the network at 4 workers, {stats.ratio:.0f}x")
    assert stats.handed_ratio >= 550
    assert stats.network_bytes == pytest.approx(3 * produced)  # every message by allgather
    assert stats.ratio == pytest.approx(2 * 3 / 4 * stats.dense_bytes / stats.network_bytes)


@pytest.mark.parametrize("kind,expected", [("allgather", 3 * 1000), ("allreduce", 1500),
                                           ("alltoall", 750), ("broadcast", 750)])
def test_network_bytes_per_worker_of_each_collective_at_four_workers(kind, expected):
    assert network_bytes(kind, 1000, 4) == expected
    assert network_bytes(kind, 1000, 1) == 0


def test_stats_total_the_tensors_of_a_step_and_count_each_step_once():
    """Two tensors recorded at each of steps 5 and 6 (a record per collective): the totals
    are the sums of the records, ``steps`` is 2, the per-step means divide by 2, and a reset
    starts counting afresh from the next step recorded. Catches a step count off by one, a
    counter that keeps the last record instead of the sum, and a reset that keeps the first
    step."""
    from horovod_dgc.core.stats import StatsRecorder

    recorder = StatsRecorder()
    records = [(5, 100, 4000, 300.0, 6000.0, 10, 1000), (5, 40, 400, 120.0, 600.0, 4, 100),
               (6, 100, 4000, 300.0, 6000.0, 10, 1000), (6, 40, 400, 120.0, 600.0, 4, 100)]
    for step, sent, dense, net, dense_net, elements, numel in records:
        recorder.record(step=step, bytes_sent=sent, dense_bytes=dense, network_bytes=net,
                        dense_network_bytes=dense_net, elements_sent=elements,
                        elements_compressed=numel, selection_time_s=0.25)
    stats = recorder.snapshot()
    assert (stats.steps, stats.bytes_sent, stats.dense_bytes) == (2, 280, 8800)
    assert (stats.network_bytes, stats.dense_network_bytes) == (840.0, 13200.0)
    assert (stats.elements_sent, stats.elements_compressed) == (28, 2200)
    assert stats.bytes_sent_per_step == 140 and stats.network_bytes_per_step == 420
    assert stats.selection_time_per_step_s == 0.5
    assert stats.ratio == pytest.approx(13200 / 840) and stats.handed_ratio == pytest.approx(8800 / 280)
    assert stats.density == pytest.approx(28 / 2200)
    recorder.reset()
    assert recorder.snapshot().steps == 0
    recorder.record(step=9, bytes_sent=1, dense_bytes=4, network_bytes=3.0, dense_network_bytes=6.0)
    assert recorder.snapshot().steps == 1


def test_one_worker_ratio_falls_back_to_the_bytes_handed_to_horovod():
    """With one worker nothing crosses the network: the ratio is dense bytes over bytes handed."""
    from horovod_dgc.core.stats import CompressionStats

    stats = CompressionStats(steps=1, bytes_sent=50, dense_bytes=400)
    assert stats.ratio == 8.0


@pytest.mark.parametrize("name,options", [("dgc", {}), ("dgc", {"aggregation": "sparse_allreduce"}),
                                          ("gaussiank", {"aggregation": "sparse_allreduce"}), ("scalecom", {})])
def test_what_the_model_says_a_bucket_sends_is_what_its_messages_hold(name, options):
    """``Method.bucket_exchanges`` (the traffic model's input for a bucket) against the bytes
    of the messages 4 engines hand to each collective for one bucket of ResNet-50's first
    tensors, compressed as one."""
    from horovod_dgc.core.bucket import Plan
    from horovod_dgc.core.collectives import emulate

    workers = 4
    shapes = [tuple(p.shape) for p in resnet50().parameters()][:12]
    engines = [Engine(BY_NAME[name].build(**options), workers, r) for r in range(workers)]
    names = [f"t{i}" for i in range(len(shapes))]
    grads = [[torch.randn(s) for s in shapes] for _ in range(workers)]
    buckets = [e.bucket("b", list(zip(names, g))) for e, g in zip(engines, grads)]
    method, ops = engines[0].method, engines[0].ops
    config = method.config
    plan = Plan.at(buckets[0], [config.density_for(0, 0.0, s.small) for s in buckets[0].segments])
    if method.family == "sparse":
        sent = [(e.compress_bucket(b, g, [None] * len(shapes)).message,) for e, b, g in zip(engines, buckets, grads)]
    else:
        firsts = [e.first_bucket(b, g, [None] * len(shapes)) for e, b, g in zip(engines, buckets, grads)]
        received = emulate(ops, method.FIRST, [m for m, _ in firsts], method.root(firsts[0][1].call),
                           firsts[0][1].chunks)
        sent = [(m, e.second(b.key, got, h)) for e, b, got, (m, h) in zip(engines, buckets, received, firsts)]
    for rank in sent:
        assert [(kind, nbytes) for kind, nbytes in method.bucket_exchanges(plan, workers)] == [
            (kind, m.numel() * m.element_size()) for (kind, _), m in zip(method.bucket_exchanges(plan, workers), rank)]
    assert [kind for kind, _ in method.bucket_exchanges(plan, workers)] == (
        ["allgather"] if method.family == "sparse" else [method.FIRST, method.SECOND])
