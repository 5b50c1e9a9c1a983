"""Compressor checkpoints on real Horovod ranks (tests/workers/checkpoint_torch.py), and the
core's checks and redistribution of saved parts in this process."""
import pytest
import torch

from conftest import horovodrun
from horovod_dgc.core.blocksign import shard_length
from horovod_dgc.torch.checkpoint import redistribute
from horovod_dgc.core.state import STATE_FORMAT
from horovod_dgc.torch.ops import TorchOps

ops = TorchOps()
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


def _topk_part(method, world: int, rank: int, tensors=("w",)) -> dict:
    """A Top-k compressor's part, as an engine's ``state_dict()`` frames it."""
    from horovod_dgc.core.state import state_frame

    return state_frame(method, world_size=world, rank=rank, epoch=0.0,
                       steps={name: 2 for name in tensors},
                       states={name: {"residual": torch.zeros(100)} for name in tensors})


@pytest.mark.parametrize("change, message", [
    (dict(format=1), "format 1 is not"),
    (dict(rank=0), "saved by rank 0 of 2 workers; this is rank 1 of 2"),
    (dict(world_size=3), "saved by rank 1 of 3 workers; this is rank 1 of 2"),
    (dict(config=None), "density: saved 0.2, now 0.1"),
])
def test_a_part_of_another_format_place_or_config_is_refused_at_load(change, message):
    """check_loadable refuses a format-1 state (not only redistribute), a part saved by another
    rank of the same world size, and one saved with the same fields at other values.
    Catches a format check that only refuses newer formats, a place check of the world size
    alone, and a config check comparing field names only."""
    from horovod_dgc.core import TopK, TopKConfig
    from horovod_dgc.core.state import check_loadable

    method = TopK(TopKConfig(density=0.1))
    part = _topk_part(method, 2, 1)
    check_loadable(ops, part, method, {"w": 100}, 2, 1, "redistribute")
    if "config" in change:  # the same fields, another density
        change = dict(config=_topk_part(TopK(TopKConfig(density=0.2)), 2, 1)["config"])
    with pytest.raises(ValueError, match=message):
        check_loadable(ops, {**part, **change}, method, {"w": 100}, 2, 1, "redistribute")


def test_a_part_may_lack_tensors_of_the_model_but_not_hold_others():
    """A model tensor with no memory yet (never compressed before the save) is fine; a saved
    tensor the model lacks is refused by name. Catches the set difference taken the wrong way
    round (which refuses the first and fails on the second with a KeyError)."""
    from horovod_dgc.core import TopK, TopKConfig
    from horovod_dgc.core.state import check_loadable

    method = TopK(TopKConfig(density=0.1))
    check_loadable(ops, _topk_part(method, 2, 1), method, {"w": 100, "b": 100}, 2, 1, "")
    with pytest.raises(ValueError, match=r"does not have: \['x'\]"):
        check_loadable(ops, _topk_part(method, 2, 1, ("w", "x")), method, {"w": 100}, 2, 1, "")


def test_a_sharded_memory_is_checked_against_this_worlds_shard_length():
    """Blocksign's server residual of rank j holds ceil-to-block(numel / N) entries: a part of
    a 2-worker run loads, one whose shard has the 1-worker length is refused. Catches the
    shard length computed for another world size."""
    from horovod_dgc.core.blocksign import BlockSign
    from horovod_dgc.core.state import check_loadable, state_frame

    method, numel, world = BlockSign(), 1000, 2
    shard = shard_length(numel, world, None)
    assert shard < numel
    frame = dict(method=method, world_size=world, rank=1, epoch=0.0, steps={"w": 1})
    good = state_frame(**frame, states={"w": {"residual": torch.zeros(numel),
                                              "server": torch.zeros(shard)}})
    check_loadable(ops, good, method, {"w": numel}, world, 1, "")
    bad = state_frame(**frame, states={"w": {"residual": torch.zeros(numel),
                                             "server": torch.zeros(numel)}})
    with pytest.raises(ValueError, match=f"elements in 'server', expected {shard}"):
        check_loadable(ops, bad, method, {"w": numel}, world, 1, "")


def test_parts_of_a_bigger_world_are_refused_even_in_rank_order():
    """Two parts saved by ranks 0 and 1 of a 3-worker run are not a whole run. Catches a
    check of the ranks alone."""
    shard = shard_length(100, 3, None)
    with pytest.raises(ValueError, match="expected rank 0 of 2"):
        redistribute([fake_part(0, 3, 100, shard), fake_part(1, 3, 100, shard)], 2, 0)


def test_an_engine_resumes_with_the_saved_step_counters_epoch_and_memories():
    """A state saved after two steps and loaded into a fresh engine: the next message is the
    tensor's step 2 (its header and the warm-up depend on it), the epoch and the residual are
    the saved ones. Catches a load that leaves the step counters at 0."""
    from horovod_dgc.core.methods import BY_NAME
    from horovod_dgc.torch.engine import Engine

    method = BY_NAME["topk"].build(density=0.05, value_dtype="float32")
    saved = Engine(method, world_size=1, rank=0)
    saved.set_epoch(1.5)
    for t in range(2):
        grad = torch.randn(64, 64, generator=torch.Generator().manual_seed(t))
        outgoing = saved.compress("w", grad, None)
        saved.decompress(outgoing.message, [outgoing])
    state = saved.state_dict()
    assert state["steps"] == {"w": 2} and state["epoch"] == 1.5
    resumed = Engine(method, world_size=1, rank=0)
    resumed.load_state_dict(state, {"w": 64 * 64})
    assert resumed.state_dict()["steps"] == {"w": 2} and resumed.epoch == 1.5
    assert torch.equal(resumed.state_dict()["states"]["w"]["residual"], state["states"]["w"]["residual"])
    assert resumed.compress("w", torch.ones(64, 64), None).step == 2


def test_pooled_shards_are_cut_back_to_the_tensor():
    """Pooling concatenates the ranks' server shards, whose padding runs past the tensor: the
    pooled memory holds the tensor's 100 entries, rank 0's shard then rank 1's. Catches the
    padding kept in the pooled state."""
    from horovod_dgc.core.state import pool

    numel, shard = 100, shard_length(100, 2, None)
    parts = [fake_part(r, 2, numel, shard) for r in range(2)]
    server = pool(ops, parts)["states"]["w"]["server"]
    assert server.numel() == numel
    assert torch.equal(server[:shard], parts[0]["states"]["w"]["server"])
    assert torch.equal(server[shard:], parts[1]["states"]["w"]["server"][:numel - shard])
