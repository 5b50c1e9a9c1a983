"""Compressor checkpoints on real Horovod ranks (tests/workers/checkpoint_torch.py)."""
import pytest
import torch

from conftest import horovodrun
from horovod_dgc.core.blocksign import shard_length
from horovod_dgc.torch.checkpoint import redistribute
from horovod_dgc.core.state import STATE_FORMAT

METHODS = ("dgc", "topk", "gaussiank", "scalecom", "blocksign")


def test_every_method_round_trips_exactly_and_refuses_foreign_states():
    out = horovodrun("checkpoint_torch.py", 2, ["--mode", "roundtrip"])
    for method in METHODS:
        for path in ("stock", "own"):
            assert out.count(f"{method} {path} roundtrip ok") == 2, out


@pytest.mark.slow
def test_resuming_on_more_workers_keeps_the_averaged_memories(tmp_path):
    horovodrun("checkpoint_torch.py", 2, ["--mode", "save", "--dir", str(tmp_path)])
    out = horovodrun("checkpoint_torch.py", 3, ["--mode", "resume", "--dir", str(tmp_path)])
    for method in METHODS:
        assert out.count(f"{method} resumed on 3 from 2 ok") == 3, out


def fake_part(rank: int, world: int, numel: int, shard: int, steps=None) -> dict:
    """A blocksign-like part: a per-worker residual and this rank's server shard."""
    gen = torch.Generator().manual_seed(rank)
    server = torch.randn(shard, generator=gen)
    server[max(0, min(shard, numel - rank * shard)):] = 0  # padding past the tensor stays zero
    return {"format": STATE_FORMAT, "method": "BlockSign",
            "config": {"block_size": None, "momentum": 0.0}, "world_size": world, "rank": rank,
            "epoch": 1.0, "steps": steps or {"w": 3},
            "states": {"w": {"residual": torch.randn(numel, generator=gen), "server": server},
                       "b": {}}}


def test_redistribute_keeps_the_average_memory_and_reshards_the_server_residual():
    numel, old, new = 100, 2, 3
    parts = [fake_part(r, old, numel, shard_length(numel, old, None)) for r in range(old)]
    assert redistribute(parts, old, 1) is parts[1]
    shares = [redistribute(parts, new, r) for r in range(new)]
    for r, share in enumerate(shares):
        assert (share["world_size"], share["rank"], share["steps"]) == (new, r, {"w": 3})
        assert share["states"]["w"]["server"].numel() == shard_length(numel, new, None)
    before = sum(p["states"]["w"]["residual"] for p in parts) / old
    after = sum(s["states"]["w"]["residual"] for s in shares) / new
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-7)
    old_server = torch.cat([p["states"]["w"]["server"] for p in parts])[:numel]
    new_server = torch.cat([s["states"]["w"]["server"] for s in shares])
    assert torch.equal(new_server[:numel], old_server) and not new_server[numel:].any()


def test_redistribute_refuses_parts_of_different_runs_or_missing_ranks():
    shard = shard_length(100, 2, None)
    with pytest.raises(ValueError, match="expected rank 1 of 2"):
        redistribute([fake_part(0, 2, 100, shard), fake_part(0, 2, 100, shard)], 3, 0)
    with pytest.raises(ValueError, match="other steps"):
        redistribute([fake_part(0, 2, 100, shard), fake_part(1, 2, 100, shard, {"w": 4})], 3, 0)
    with pytest.raises(ValueError, match="not a horovod_dgc compressor state"):
        redistribute([{"epoch": 0}], 1, 0)


def test_a_state_saved_before_the_coded_message_format_is_refused_by_name():
    shard = shard_length(100, 2, None)
    part = dict(fake_part(0, 2, 100, shard), format=1)
    with pytest.raises(ValueError, match=f"format 1 is not {STATE_FORMAT}: it was saved by an earlier"):
        redistribute([part, dict(fake_part(1, 2, 100, shard), format=1)], 3, 0)
