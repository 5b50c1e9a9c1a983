"""ScaleCom and blocksign in the core's N-worker simulation: conservation laws and checks."""
import pytest
import torch

from horovod_dgc.core import MessageError, CompressCall
from horovod_dgc.core.blocksign import BlockSign, BlockSignConfig, shard_length
from horovod_dgc.core.collectives import emulate
from horovod_dgc.core.twostage import simulate_step
from horovod_dgc.core.scalecom import ScaleCom, ScaleComConfig
from horovod_dgc.torch import Compression
from horovod_dgc.torch.ops import TorchOps

from conftest import randn

ops = TorchOps()


def contexts(n_workers: int, step: int, density: float = 1.0, name: str = "w"):
    return [CompressCall(name, r, n_workers, step, density) for r in range(n_workers)]


@pytest.mark.parametrize("block_size", [None, 64])
def test_blocksign_conserves_gradient_mass_over_200_steps(block_size, device):
    method, workers, n = BlockSign(BlockSignConfig(block_size=block_size)), 3, 5003
    gen = torch.Generator().manual_seed(0)
    states = [method.init_state(ops, torch.zeros(n, device=device), True, workers) for _ in range(workers)]
    applied = torch.zeros(n, dtype=torch.float64, device=device)
    mean_grads = torch.zeros(n, dtype=torch.float64, device=device)
    for step in range(200):
        grads = [randn(n, generator=gen, device=device) * (1 + step % 5) for _ in range(workers)]
        results, states = simulate_step(ops, method, states, grads, contexts(workers, step))
        assert all(torch.equal(results[0], r) for r in results[1:])
        applied += results[0].double()
        mean_grads += sum(g.double() for g in grads) / workers
    shard = shard_length(n, workers, block_size)
    server = torch.cat([s["server"] for s in states])[:n].double()
    assert torch.count_nonzero(torch.cat([s["server"] for s in states])[n:]) == 0
    worker = sum(s["residual"].double() for s in states) / workers
    error = (applied + worker + server - mean_grads).norm() / mean_grads.norm()
    assert error < 1e-5, float(error)
    assert shard % 8 == 0


def test_blocksign_update_is_a_scaled_sign_per_block(device):
    method = BlockSign(BlockSignConfig(block_size=16))
    grads = [randn(256, device=device) for _ in range(2)]
    states = [method.init_state(ops, grads[0], True, 2) for _ in range(2)]
    results, _ = simulate_step(ops, method, states, grads, contexts(2, 0))
    for block in results[0].view(-1, 16):
        assert torch.unique(block.abs()).numel() == 1


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_scalecom_with_beta_one_obeys_the_topk_law_per_worker(dtype, tolerance, device):
    """Every worker's values sent plus its memory equal its gradients' sum. A float64 model's
    values travel as float32: its memory keeps what that rounding loses (to float64's
    precision), which a memory updated with the values before rounding would not."""
    method, workers, n = ScaleCom(ScaleComConfig(density=0.01, beta=1.0)), 4, 4000
    gen = torch.Generator().manual_seed(1)
    states = [method.init_state(ops, torch.zeros(n, dtype=dtype, device=device), True, workers)
              for _ in range(workers)]
    sent = [torch.zeros(n, dtype=torch.float64, device=device) for _ in range(workers)]
    total = [torch.zeros(n, dtype=torch.float64, device=device) for _ in range(workers)]
    for step in range(200):
        grads = [randn(n, generator=gen, device=device).to(dtype) for _ in range(workers)]
        ctxs = contexts(workers, step, 0.01)
        firsts = [method.first(ops, s, g, c) for s, g, c in zip(states, grads, ctxs)]
        received = emulate(ops, method.FIRST, [m for m, _, _ in firsts], method.root(ctxs[0]))
        seconds = [method.second(ops, s, r, p) for (_, s, p), r in zip(firsts, received)]
        for i, ((values, state), (_, _, pending)) in enumerate(zip(seconds, firsts)):
            sent[i].index_add_(0, pending.data["indices"], values.double())
            total[i] += grads[i].double()
        states = [state for _, state in seconds]
        assert all(torch.equal(firsts[0][2].data["indices"], p.data["indices"]) for _, _, p in firsts)
    for i in range(workers):
        error = (sent[i] + states[i]["memory"].double() - total[i]).norm() / total[i].norm()
        assert error < tolerance, (i, float(error))


def test_scalecom_leaders_take_turns_and_chunked_selection_sends_k(device):
    method = ScaleCom(ScaleComConfig(density=0.01, leader_selection="chunked", chunks=8))
    n, workers = 5000, 3
    grads = [randn(n, device=device) for _ in range(workers)]
    states = [method.init_state(ops, torch.zeros(n, device=device), True, workers) for _ in range(workers)]
    for step in range(3):
        assert method.root(contexts(workers, step)[0]) == step % workers
        results, states = simulate_step(ops, method, states, grads, contexts(workers, step, 0.01))
        assert int(torch.count_nonzero(results[0])) == 50


@pytest.mark.parametrize("options,field", [(dict(beta=0.0), "beta"), (dict(beta=1.5), "beta"),
                                           (dict(density=0.0), "density"),
                                           (dict(leader_selection="random"), "leader_selection")])
def test_bad_scalecom_settings_raise_at_construction(options, field):
    with pytest.raises(ValueError, match=field):
        Compression.scalecom(**options)


@pytest.mark.parametrize("options,field", [(dict(block_size=0), "block_size"), (dict(block_size=-4), "block_size"),
                                           (dict(momentum=1.0), "momentum")])
def test_bad_blocksign_settings_raise_at_construction(options, field):
    with pytest.raises(ValueError, match=field):
        Compression.blocksign(**options)


def test_shard_of_wrong_length_names_rank_and_tensor(device):
    method = BlockSign()
    grads = [randn(1000, device=device) for _ in range(2)]
    firsts = [method.first(ops, method.init_state(ops, g, True, 2), g, c)
              for g, c in zip(grads, contexts(2, 0, name="conv.weight"))]
    received = emulate(ops, method.FIRST, [m for m, _, _ in firsts])
    _, state, pending = firsts[1]
    with pytest.raises(MessageError, match=r"'conv.weight' on rank 1"):
        method.second(ops, state, received[1][:-8], pending)
    corrupt = received[1].clone()
    corrupt[4] ^= 1  # the method id of the first shard, sent by rank 0
    with pytest.raises(MessageError, match=r"rank 0 .*'conv.weight'.*method"):
        method.second(ops, state, corrupt, pending)


@pytest.mark.parametrize("kind", ["broadcast", "allreduce", "alltoall", "allgather"])
def test_messages_joined_into_one_collective_arrive_as_if_each_was_sent_alone(kind, device):
    from horovod_dgc.core.collectives import join, split

    world, sizes = 3, [6, 12, 3]
    gen = torch.Generator().manual_seed(7)
    messages = [[randn(size, generator=gen, device=device) for size in sizes] for _ in range(world)]
    alone = [emulate(ops, kind, [messages[w][t] for w in range(world)], root=1)
             for t in range(len(sizes))]
    joined = emulate(ops, kind, [join(ops, kind, messages[w], world) for w in range(world)], root=1)
    for w in range(world):
        parts = split(ops, kind, joined[w], sizes, world, ["a", "b", "c"], w)
        for t in range(len(sizes)):
            torch.testing.assert_close(parts[t], alone[t][w], rtol=0, atol=1e-6)


def test_an_alltoall_of_uneven_chunks_delivers_each_destination_its_chunk_of_every_sender(device):
    """Chunks of 1, 4 and 2 elements, the same on every sender, against a list reference;
    then three messages (two of uneven chunks) joined into one alltoall and split again on
    each worker arrive as if each went alone. Catches a chunk taken at an equal share's
    offset, or a worker's share of a joined message read as another's."""
    from horovod_dgc.core.collectives import join, joined_chunks, split

    world, chunks = 3, [(1, 4, 2), None, (3, 0, 3)]
    sizes = [7, 6, 6]
    messages = [[torch.arange(100 * w + 10 * t, 100 * w + 10 * t + size, dtype=torch.float32, device=device)
                 for t, size in enumerate(sizes)] for w in range(world)]
    for t, cut in enumerate(chunks):
        cut = cut or (sizes[t] // world,) * world
        starts = [sum(cut[:j]) for j in range(world)]
        got = emulate(ops, "alltoall", [messages[w][t] for w in range(world)], chunks=chunks[t])
        for j in range(world):
            expected = [v for w in range(world) for v in messages[w][t].tolist()[starts[j]:starts[j] + cut[j]]]
            assert got[j].tolist() == expected
    joined = emulate(ops, "alltoall", [join(ops, "alltoall", messages[w], world, chunks) for w in range(world)],
                     chunks=joined_chunks(ops, "alltoall", messages[0], world, chunks))
    for j in range(world):
        parts = split(ops, "alltoall", joined[j], sizes, world, ["a", "b", "c"], j, chunks)
        for t in range(len(sizes)):
            alone = emulate(ops, "alltoall", [messages[w][t] for w in range(world)], chunks=chunks[t])
            assert parts[t].tolist() == alone[j].tolist()


def test_chunks_that_do_not_cut_the_message_are_refused(device):
    with pytest.raises(ValueError, match=r"7 elements cut into chunks \[1, 4\] for 3 workers"):
        emulate(ops, "alltoall", [torch.zeros(7, device=device)] * 3, chunks=(1, 4))


def test_a_joined_collective_of_the_wrong_size_names_its_tensors(device):
    from horovod_dgc.core.collectives import split

    with pytest.raises(MessageError, match=r"allgather of tensors \['a', 'b'\] delivered 17"):
        split(ops, "allgather", torch.zeros(17, device=device), [4, 5], 2, ["a", "b"])


def test_splitting_an_alltoall_without_the_receiving_rank_is_refused(device):
    from horovod_dgc.core.collectives import split

    # Each receiver's share of an alltoall is its own: no rank to default to.
    with pytest.raises(ValueError, match="needs the receiving rank"):
        split(ops, "alltoall", torch.zeros(8, device=device), [4, 4], 2, ["a", "b"])
