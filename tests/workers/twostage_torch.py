"""12 steps of ScaleCom, blocksign and the sparse all-reduce (DGC, Top-k, Gaussian-k with
``aggregation="sparse_allreduce"``) on fixed per-rank gradients through a Horovod path;
every rank checks each step's applied update against the in-process N-worker simulation
of the core, and that all ranks end with the same parameters.

Both paths compress each tensor on its own (the own optimizer's buckets only share the
collectives), so the simulation runs per tensor for both."""
import argparse

import horovod.torch as hvd
import torch

import horovod_dgc.torch as hdgc
from horovod_dgc.core.twostage import simulate_step
from horovod_dgc.core.method import CompressCall
from horovod_dgc.torch.ops import TorchOps

STEPS = 12  # three turns of ScaleCom's leader round 4 workers
SPARSE_ALLREDUCE = dict(aggregation="sparse_allreduce", density=0.01)
KINDS = {"scalecom": ("scalecom", dict(density=0.01)),
         "blocksign": ("blocksign", dict(block_size=None)),
         "blocksign64": ("blocksign", dict(block_size=64)),
         "dgc-sar": ("dgc", SPARSE_ALLREDUCE), "topk-sar": ("topk", SPARSE_ALLREDUCE),
         "gaussiank-sar": ("gaussiank", SPARSE_ALLREDUCE)}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 50))


def gradients(rank: int, net: torch.nn.Module) -> dict:
    gen = torch.Generator().manual_seed(1000 + rank)
    return {n: torch.randn(p.shape, generator=gen) for n, p in net.named_parameters()}


def simulation(method, all_grads, units, size):
    """Each step's update per parameter name, from the core's simulation of ``size``
    workers; ``units`` maps a compressed unit's name to the parameter names it concatenates."""
    ops = TorchOps()
    flat = {unit: [torch.cat([g[n].reshape(-1) for n in names]) for g in all_grads]
            for unit, names in units.items()}
    states = {unit: [method.init_state(ops, grads[0], True, size) for _ in range(size)]
              for unit, grads in flat.items()}
    updates = []
    for step in range(STEPS):
        per_param = {}
        for unit, names in units.items():
            (name,) = names  # small tensors (biases) have a density and a memory of their own
            small = method.config.is_small(tuple(all_grads[0][name].shape))
            density = method.config.density_for(step, 0, small)
            ctxs = [CompressCall(unit, r, size, step, density, small=small) for r in range(size)]
            results, states[unit] = simulate_step(ops, method, states[unit], flat[unit], ctxs)
            sizes = [all_grads[0][n].numel() for n in names]
            for name, part in zip(names, results[0].split(sizes)):
                per_param[name] = part.reshape(all_grads[0][name].shape)
        updates.append(per_param)
    return updates


def check_same_parameters_on_every_rank(net: torch.nn.Module, label: str) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    for other in hvd.allgather_object(flat, name=f"params.{label}"):
        assert torch.equal(other, flat), "ranks hold different parameters"


def compressed_units(compression, net) -> dict:
    """Unit name -> parameter names: every compressed tensor is its own unit."""
    return {n: [n] for n, p in net.named_parameters() if compression.engine.compresses(p)}


def run(kind: str, path: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    method_name, options = KINDS[kind]
    net = model()
    compression = getattr(hdgc.Compression, method_name)(named_parameters=net.named_parameters(),
                                                         **options)
    assert compression.method.family == "two-stage", kind
    wrap = hvd.DistributedOptimizer if path == "stock" else hdgc.DistributedOptimizer
    optimizer = wrap(torch.optim.SGD(net.parameters(), lr=0.01), named_parameters=net.named_parameters(),
                     compression=compression)
    all_grads = [gradients(r, net) for r in range(size)]
    units = compressed_units(compression, net)
    expected = simulation(compression.method, all_grads, units, size)
    mine = all_grads[rank]
    for step in range(STEPS):
        optimizer.zero_grad()
        params = dict(net.named_parameters())
        sum((params[n] * mine[n]).sum() for n in sorted(mine, reverse=rank % 2 == 1)).backward()
        optimizer.synchronize()
        for name, p in params.items():
            want = expected[step].get(name, sum(g[name] for g in all_grads) / size)
            if method_name == "scalecom":
                assert torch.equal(p.grad != 0, want != 0), f"{kind} {name} step {step}: indices differ"
            torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"{kind}/{path} {name} step {step}: {m}")
        with optimizer.skip_synchronize():
            optimizer.step()
    check_same_parameters_on_every_rank(net, f"{kind}.{path}")
    print(f"rank {rank}/{size} {kind} {path} twostage ok", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", required=True, help="stock, own, or both: stock,own")
    parser.add_argument("--kinds", default=",".join(KINDS))
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    for path in args.path.split(","):
        for kind in args.kinds.split(","):
            run(kind, path)
