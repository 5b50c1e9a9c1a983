"""A rank that stops without dying (SIGSTOP: a stuck data loader, a swapping host) in the middle
of training with dgc: the other rank's step raises, naming the collective it waited for, once
Gloo's timeout runs out. Rank 0 prints ``STALLED <seconds> <error>`` and exits 1."""
import argparse
import os
import signal
import sys
import time

import horovod.torch as hvd
import torch

import horovod_dgc.torch as hdgc


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--path", choices=["stock", "fused"], default="fused")
    args = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    wrap = hvd.DistributedOptimizer if args.path == "stock" else hdgc.DistributedOptimizer
    optimizer = wrap(sgd, named_parameters=model.named_parameters(),
                     compression=hdgc.Compression.dgc(density=0.1, named_parameters=model.named_parameters())
                     if args.path == "stock" else hdgc.Compression.dgc(density=0.1))
    for step in range(4):
        if step == 2 and hvd.rank() == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        optimizer.zero_grad()
        model(torch.randn(8, 100)).sum().backward()
        started = time.perf_counter()
        try:
            optimizer.step()
        except Exception as error:
            print(f"STALLED {time.perf_counter() - started:.1f} {type(error).__name__}: {error}", flush=True)
            sys.exit(1)
    print(f"rank {hvd.rank()}: no error", flush=True)


if __name__ == "__main__":
    main()
