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
