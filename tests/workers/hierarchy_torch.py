"""``hierarchical=True`` on 2 hosts x 2 workers (``horovodrun -H localhost:2,127.0.0.1:2``):
every rank checks each step's averaged gradient against a reference built from all ranks'
gradients, and that all ranks end with the same parameters and each host's workers with the
same memories.

* topk: a naive reference written here: each host averages its workers' gradients, adds
  its residual, keeps the exact top-k by magnitude (a sort), and the update is the mean of
  the hosts' kept values.
* scalecom, blocksign and dgc with the sparse all-reduce (every kind of collective between
  hosts): the core's in-process simulation of as many workers as hosts, fed the host averages.
  blocksign-bf16 is blocksign on a bfloat16 model (Horovod refuses to all-reduce bfloat16, so
  a host's average is taken in float32), against the simulation rounded to bfloat16. Not
  topk: bfloat16 gradients tie in magnitude, and top-k may break a tie either way.

Odd ranks produce their gradients in reverse order and one layer never gets a gradient, so
tensors reach the compressor in different orders on different ranks.
"""
import argparse

import horovod.torch as hvd
import torch

import horovod_dgc.torch as hdgc
from horovod_dgc.core.collectives import ALLREDUCE
from horovod_dgc.core.selection import top_count
from horovod_dgc.torch.collectives import launch, wait
from twostage_torch import check_same_parameters_on_every_rank, simulation

STEPS = 6
DENSITY = 0.01
KINDS = {"topk": ("topk", dict(density=DENSITY, value_dtype="float32")),
         "scalecom": ("scalecom", dict(density=DENSITY)),
         "blocksign": ("blocksign", dict(block_size=64)),
         "dgc-sar": ("dgc", dict(aggregation="sparse_allreduce", density=DENSITY)),
         "blocksign-bf16": ("blocksign", dict(block_size=64))}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(64, 300)
        self.second = torch.nn.Linear(300, 50)
        self.unused = torch.nn.Linear(10, 40)  # small; never gets a gradient


def gradients(rank: int, net: Net) -> dict:
    gen = torch.Generator().manual_seed(1000 + rank)
    return {n: torch.randn(p.shape, generator=gen).to(p.dtype) for n, p in net.named_parameters()
            if not n.startswith("unused")}


def host_averages(all_grads, hosts):
    """Each host's average gradient, in float32."""
    return [{n: sum(all_grads[r][n].float() for r in ranks) / len(ranks) for n in all_grads[0]}
            for ranks in hosts]


def naive_topk_updates(host_grads, names, k_of):
    """Each step's update per name: hosts keep the exact top-k (``k_of(name, step)``) of
    residual + host average."""
    residuals = [{n: torch.zeros_like(g[n]) for n in names} for g in host_grads]
    updates = []
    for step in range(STEPS):
        update = {}
        for name in names:
            k = k_of(name, step)
            kept_sum = torch.zeros_like(host_grads[0][name]).reshape(-1)
            for h, grads in enumerate(host_grads):
                acc = (residuals[h][name] + grads[name]).reshape(-1)
                order = sorted(range(acc.numel()), key=lambda i: -abs(float(acc[i])))[:k]
                kept = torch.zeros_like(acc)
                kept[order] = acc[order]
                residuals[h][name] = (acc - kept).reshape(grads[name].shape)
                kept_sum += kept
            update[name] = (kept_sum / len(host_grads)).reshape(host_grads[0][name].shape)
        updates.append(update)
    return updates


def run(kind: str, path: str, hosts) -> None:
    rank, size = hvd.rank(), hvd.size()
    method_name, options = KINDS[kind]
    torch.manual_seed(0)
    dtype = torch.bfloat16 if kind.endswith("-bf16") else torch.float32
    net = Net().to(dtype)
    compression = getattr(hdgc.Compression, method_name)(
        named_parameters=net.named_parameters(), hierarchical=True, **options)
    assert compression.engine.world_size == len(hosts), compression.engine.world_size
    wrap = hvd.DistributedOptimizer if path == "stock" else hdgc.DistributedOptimizer
    optimizer = wrap(torch.optim.SGD(net.parameters(), lr=0.01),
                     named_parameters=net.named_parameters(), compression=compression)
    compression = optimizer._compression if path == "own" else compression
    all_grads = [gradients(r, net) for r in range(size)]
    averaged = host_averages(all_grads, hosts)
    compressed = [n for n, p in net.named_parameters()
                  if n in all_grads[0] and compression.engine.compresses(p)]
    if method_name == "topk":
        config = compression.config

        def k_of(name, step):
            shape = tuple(all_grads[0][name].shape)
            return top_count(config.density_for(step, 0, config.is_small(shape)),
                             all_grads[0][name].numel())
        expected = naive_topk_updates(averaged, compressed, k_of)
    else:
        expected = simulation(compression.method, averaged, {n: [n] for n in compressed},
                              len(hosts))
    # The ranks build their references at different speeds, and the stock optimizer waits in
    # Horovod's own wait, which spins: those that finish first would take the cores from the
    # others (horovod_dgc.torch.collectives.POLL_PAUSE_S). So they meet first in a wait that sleeps.
    wait(launch(ALLREDUCE, torch.zeros(1), f"references built.{kind}.{path}"))
    mine = all_grads[rank]
    params = dict(net.named_parameters())
    for step in range(STEPS):
        optimizer.zero_grad()
        sum((params[n] * mine[n]).sum() for n in sorted(mine, reverse=rank % 2 == 1)).backward()
        optimizer.synchronize()
        for name, grad in mine.items():
            want = expected[step][name] if name in compressed else \
                sum(g[name].float() for g in all_grads) / size
            assert params[name].grad.dtype == dtype, (kind, name, params[name].grad.dtype)
            # bfloat16: within one unit of its last place (7 bits), for float32 sums that
            # differ in their last bit and round to neighbouring bfloat16 values.
            torch.testing.assert_close(params[name].grad, want.to(dtype), atol=1e-6,
                                       rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-5,
                                       msg=lambda m: f"{kind}/{path} {name} step {step}: {m}")
        with optimizer.skip_synchronize():
            optimizer.step()
    check_same_parameters_on_every_rank(net, f"{kind}.{path}")
    memories = compression.state_dict()["states"]
    host = next(ranks for ranks in hosts if rank in ranks)
    for r, theirs in enumerate(hvd.allgather_object(memories, name=f"memories.{kind}.{path}")):
        if r in host:
            for name, state in memories.items():
                for key, value in state.items():
                    if torch.is_tensor(value):
                        assert torch.equal(theirs[name][key], value), \
                            f"{kind}/{path}: rank {r}'s {key} of {name} differs from rank {rank}'s"
    print(f"rank {rank}/{size} {kind} {path} hierarchical ok", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", default=",".join(f"{k}/{p}" for p in ("stock", "own") for k in KINDS),
                        help="comma-separated KIND/PATH (PATH: stock or own)")
    args = parser.parse_args()
    hvd.init(process_sets="dynamic")
    torch.set_num_threads(1)
    hosts = [[0, 1], [2, 3]]
    assert hvd.size() == 4 and hvd.cross_rank() == hvd.rank() // 2, "run on 2 hosts x 2 workers"
    for kind_path in args.runs.split(","):
        run(*kind_path.split("/"), hosts)
