"""Counts the bytes each path hands to Horovod per step (by wrapping the real collectives):
dense and DGC on a model of over 1M parameters, and dense, ScaleCom and blocksign on one
1M-element tensor; rank 0 prints the figures."""
import argparse
import json

import horovod.torch as hvd
import horovod.torch.optimizer as hvd_optimizer
import torch

import horovod_dgc.torch as hdgc

handed_bytes = [0]


def counting(collective):
    def wrapper(tensor, *args, **kwargs):
        handed_bytes[0] += tensor.numel() * tensor.element_size()
        return collective(tensor, *args, **kwargs)
    return wrapper


# Every collective horovod_dgc or Horovod's optimizer launches for gradients goes through these.
for collective in ("allgather_async", "allreduce_async", "allreduce_async_", "broadcast_async",
                   "alltoall_async"):
    setattr(hvd, collective, counting(getattr(hvd, collective)))
hvd_optimizer.allreduce_async_ = counting(hvd_optimizer.allreduce_async_)


OPTIONS = {"dgc": dict(density=0.001, value_dtype="float16"), "scalecom": dict(density=0.001),
           "blocksign": dict()}


def model(single_tensor: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if single_tensor:
        return torch.nn.Linear(1024, 1024, bias=False)
    return torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))


def bytes_per_step(path: str, compression_name: str, single_tensor: bool, steps: int = 3) -> dict:
    net = model(single_tensor)
    sgd = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9 if compression_name == "dense" else 0.0)
    if compression_name == "dense":
        compression = hdgc.Compression.none
    else:
        compression = getattr(hdgc.Compression, compression_name)(
            named_parameters=net.named_parameters(), **OPTIONS[compression_name])
    wrap = hvd.DistributedOptimizer if path == "stock" else hdgc.DistributedOptimizer
    optimizer = wrap(sgd, named_parameters=net.named_parameters(), compression=compression)
    handed_bytes[0] = 0
    for _ in range(steps):
        optimizer.zero_grad()
        net(torch.randn(32, 1024)).square().mean().backward()
        optimizer.step()
    result = {"bytes_per_step": handed_bytes[0] / steps,
              "params": sum(p.numel() for p in net.parameters())}
    if compression_name != "dense":
        stats = optimizer._compression.stats()
        result["stats_bytes_per_step"] = stats.bytes_sent_per_step
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", choices=["stock", "own"], required=True)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    figures = {name: bytes_per_step(args.path, name, single_tensor=False) for name in ("dense", "dgc")}
    figures.update({f"{name}-1M": bytes_per_step(args.path, name, single_tensor=True)
                    for name in ("dense", "scalecom", "blocksign")})
    if hvd.rank() == 0:
        print("TRAFFIC " + json.dumps(figures), flush=True)
