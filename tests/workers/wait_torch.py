"""A rank that waits for a peer running late (1.5 s) sleeps through the wait: its main
thread's CPU time stays a small part of the wait, for a collective of the transport and for a
step of horovod_dgc's DistributedOptimizer. Horovod's own wait spins a core the whole time;
where workers outnumber cores, those spins starved the workers still computing and Horovod's
background threads, and a hierarchical step stalled past Gloo's 30 s timeout."""
import time
from typing import Callable

import horovod.torch as hvd
import torch

import horovod_dgc.torch as hdgc
from horovod_dgc.core.collectives import ALLREDUCE
from horovod_dgc.torch.collectives import launch, wait

LATE_S = 1.5
MOST_CPU_PER_WAIT = 0.25  # a spinning wait uses 0.9-1.0 s of CPU per second


def timed_wait(label: str, run: Callable[[], None]) -> None:
    """Rank 1 runs ``run`` ``LATE_S`` late; rank 0 checks the CPU time its wait took."""
    if hvd.rank() == 1:
        time.sleep(LATE_S)
    started_s, cpu_started_s = time.perf_counter(), time.thread_time()
    run()
    wall_s, cpu_s = time.perf_counter() - started_s, time.thread_time() - cpu_started_s
    if hvd.rank() == 0:
        assert wall_s > 0.8 * LATE_S, f"{label}: waited {wall_s:.2f} s only, for a peer {LATE_S} s late"
        assert cpu_s < MOST_CPU_PER_WAIT * wall_s, \
            f"{label}: the wait of {wall_s:.2f} s spun {cpu_s:.2f} s of CPU"
    print(f"rank {hvd.rank()} {label} waited {wall_s:.2f} s on {cpu_s:.3f} s of CPU ok", flush=True)


def main() -> None:
    hvd.init()
    torch.set_num_threads(1)
    timed_wait("transport", lambda: wait(launch(ALLREDUCE, torch.ones(10), "late")))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))
    optimizer = hdgc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          named_parameters=model.named_parameters(),
                                          compression=hdgc.Compression.dgc(density=0.1))

    def step() -> None:
        optimizer.zero_grad()
        model(torch.randn(8, 100)).sum().backward()
        optimizer.step()
    step()  # the first step's checks and negotiation, untimed
    timed_wait("optimizer step", step)


if __name__ == "__main__":
    main()
