"""Mixed precision in Horovod's documented recipe (``torch.amp`` autocast in float16 with a
``GradScaler``), through the stock ``hvd.DistributedOptimizer`` and the fused optimizer; with
``--ddp`` (under ``torchrun``), in PyTorch's recipe through the DDP hook. At step OVERFLOW
rank 1 alone overflows: every rank must skip that step, back its scale off, keep every memory
(dense tensors' momentum included) exactly as it was, and keep parameters identical to the
other ranks'; the steps after it train on.
"""
import argparse
import gc

import horovod.torch as hvd
import torch
import torch.distributed as dist

import horovod_dgc.torch as hdgc
from horovod_dgc.torch import ddp

STEPS, OVERFLOW = 6, 3


def build(method: str, path: str):
    """(the module, what runs it, the compressor, the optimizer, the scaler)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    options = dict(density=0.05) if method != "blocksign" else dict(momentum=0.5)
    if method == "dgc-sar":  # the overflow's flag crosses the owners of the sparse all-reduce
        method, options = "dgc", dict(options, aggregation="sparse_allreduce")
    compression = getattr(hdgc.Compression, method)(named_parameters=net.named_parameters(), **options)
    model, sgd = net, torch.optim.SGD(net.parameters(), lr=0.05)
    if path == "ddp":
        model, optimizer = torch.nn.parallel.DistributedDataParallel(net), sgd
        ddp.register(model, compression, optimizer=optimizer)
    else:
        wrap = hvd.DistributedOptimizer if path == "stock" else hdgc.DistributedOptimizer
        optimizer = wrap(sgd, named_parameters=net.named_parameters(), compression=compression)
    # A growing scale (every 2 good steps) shows that memories do not follow the scale.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    compression.attach_grad_scaler(scaler)
    return net, model, compression, optimizer, scaler


def horovod_recipe_step(optimizer, scaler) -> None:
    """Horovod's documented recipe after the scaled backward pass(es)."""
    optimizer.synchronize()
    scaler.unscale_(optimizer)
    with optimizer.skip_synchronize():
        scaler.step(optimizer)
    scaler.update()


def memories(compression) -> dict:
    return {f"{n}.{k}": v.clone() for n, s in compression.state_dict()["states"].items()
            for k, v in s.items()}


def run(method: str, path: str) -> None:
    rank = dist.get_rank() if path == "ddp" else hvd.rank()
    net, model, compression, optimizer, scaler = build(method, path)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, labels = torch.randn(32, 64, generator=gen), torch.randint(10, (32,), generator=gen)
        params = [p.detach().clone() for p in net.parameters()]
        kept, scale = memories(compression), scaler.get_scale()
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), labels)
        if rank == 1 and step == OVERFLOW:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if path == "ddp":  # PyTorch's recipe: the hook averaged the gradients in backward
            scaler.step(optimizer)
            scaler.update()
        else:
            horovod_recipe_step(optimizer, scaler)
        moved = any(not torch.equal(p, q) for p, q in zip(net.parameters(), params))
        if step == OVERFLOW:
            assert scaler.get_scale() == scale * 0.5, f"{method}/{path}: the scale did not back off"
            assert not moved, f"{method}/{path}: a skipped step changed the parameters"
            after = memories(compression)
            assert after.keys() == kept.keys()
            for key, value in kept.items():
                assert torch.equal(after[key], value), f"{method}/{path}: memory {key} changed"
        else:
            assert moved, f"{method}/{path} step {step}: no update"
            assert scaler.get_scale() >= scale, f"{method}/{path} step {step}: scale fell"
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    assert torch.isfinite(flat).all()
    if path == "ddp":
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, flat)
    else:
        everyone = hvd.allgather_object(flat, name=f"amp.{method}.{path}")
    for other in everyone:
        assert torch.equal(other, flat), f"{method}/{path}: ranks hold different parameters"
    print(f"rank {rank} {method} {path} amp ok", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", default="dgc,dgc-sar,topk,scalecom,blocksign")
    parser.add_argument("--ddp", action="store_true", help="the DDP hook, under torchrun")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.ddp:
        dist.init_process_group("gloo")
    else:
        hvd.init()
    for path in ("ddp",) if args.ddp else ("stock", "own"):
        for method in args.methods.split(","):
            run(method, path)
    if args.ddp:
        # The DDP models hold the process group and are freed by the cycle collector: left to
        # the interpreter's exit, that freeing aborted a rank now and then ("terminate called
        # without an active exception"). So they go first, then the group, after every rank
        # has received the last collective's bytes.
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
