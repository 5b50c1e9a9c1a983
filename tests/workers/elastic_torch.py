"""Elastic training with error feedback where every quantity can be checked.

Each rank's gradient at step t is a fixed float64 tensor g(t, rank, size); plain SGD with
lr = 1 applies the averaged update. ``grad_sum``, committed with the model, accumulates the
average gradient of every step that was kept. Conservation of gradient mass:

    W0 - W  +  mean over ranks of the residual  ==  grad_sum

(the bias is not compressed: ``b0 - b == grad_sum``). The worker on host ``--victim`` kills
itself in the middle of the commit interval; survivors roll back to the last commit and go
on with fewer workers. With ``--event return`` the victim's host comes back once Horovod's
blacklist cooldown is over: the survivors wait for it at the commit of step 20, and its new
worker joins there. With ``--event grow`` a third host appears instead (the discovery
script lists it once ``--marker`` exists) and its worker joins at the commit of step 10. On
every entry into the training function (after each reset) every rank checks that the
parameters and residuals are identical on all ranks and that the law holds; at the end it checks the law again. Top-k's law holds exactly (every value's rounding to
the wire stays in its residual); ScaleCom's all-reduce sums float32 values, whose rounding no
residual keeps. ``--path fused`` trains with our fused optimizer: the reset interrupts its
step with gradients submitted and exchanges in flight. ``--lag-after-reset-s``: rank 0 of a
resized world waits that long before its first step there, so that a peer which stops at
its own first step has shut Horovod down by then (a forced interleaving).
"""
import argparse
import os
import signal
import time
from pathlib import Path
from typing import Optional

import horovod.torch as hvd
import torch

from horovod_dgc.torch import Compression, DistributedOptimizer
from horovod_dgc.torch.elastic import TorchState

STEPS = 24
COMMIT_EVERY = 5
KILL_AT = 12  # two steps after the commit at step 10
GROW_AT = 10  # at the commit
RETURN_AT = 20  # the killed host's worker rejoins at this commit
# What the law may miss by: the float32 all-reduce's rounding for ScaleCom, nothing for Top-k.
TOLERANCE = {"topk": 1e-12, "scalecom": 1e-5}


def make_model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(64, 48).double()  # weight and bias both compressed, each with a residual


def gradients(step: int, rank: int, size: int, model: torch.nn.Linear) -> dict:
    gen = torch.Generator().manual_seed(1_000 * step + 10 * rank + size)
    return {n: torch.randn(p.shape, generator=gen, dtype=torch.float64)
            for n, p in model.named_parameters()}


def average_gradient(step: int, size: int, model) -> dict:
    every = [gradients(step, r, size, model) for r in range(size)]
    return {n: sum(g[n] for g in every) / size for n in every[0]}


def check(state, model, compression, initial: dict, label: str, same_residuals: bool,
          tolerance: float) -> None:
    """Identical parameters on all ranks; conservation of gradient mass."""
    for name, p in model.named_parameters():
        everyone = hvd.allgather_object(p.detach().clone(), name=f"check.{label}.{name}")
        assert all(torch.equal(everyone[0], q) for q in everyone), \
            f"rank {hvd.rank()} {label}: {name} differs between ranks"
    for name, p in model.named_parameters():
        memories = compression.state_dict()["states"].get(name, {})
        residual = memories.get("residual", memories.get("memory"))  # ScaleCom's, with beta = 1
        residual = torch.zeros(p.numel(), dtype=torch.float64) if residual is None else residual
        if same_residuals:
            everyone = hvd.allgather_object(residual.clone(), name=f"check.{label}.residual.{name}")
            assert all(torch.equal(everyone[0], r) for r in everyone), \
                f"rank {hvd.rank()} {label}: {name} residuals differ between ranks after the reset"
        mean_residual = hvd.allreduce(residual, op=hvd.Average, name=f"check.{label}.mean.{name}")
        law = initial[name] - p.detach() + mean_residual.view_as(p)
        torch.testing.assert_close(law, state.grad_sum[name], rtol=0, atol=tolerance,
                                   msg=f"{label}: {name} mass not conserved")
    print(f"rank {hvd.rank()} of {hvd.size()} {label} at step {state.step}: identical and "
          f"conserved ok", flush=True)


def wait_for_a_host(state, marker: Optional[Path] = None) -> None:
    """Every rank polls until Horovod interrupts with a host added; with ``marker``, rank 0
    first asks the discovery script for a third host."""
    if hvd.rank() == 0 and marker is not None:
        marker.write_text(f"host added at step {state.step}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state.check_host_updates()  # raises HostsUpdatedInterrupt once the driver has it
        time.sleep(0.2)
    raise TimeoutError("no host was added within 60 s")


def main(victim: str, marker: Path, method: str, path: str, event: str, state_kind: str,
         lag_after_reset_s: float) -> None:
    hvd.init()
    torch.set_num_threads(1)
    model = make_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    compression = getattr(Compression, method)(named_parameters=model.named_parameters(), density=0.05)
    wrap = DistributedOptimizer if path == "fused" else hvd.DistributedOptimizer
    optimizer = wrap(torch.optim.SGD(model.parameters(), lr=1.0),
                     named_parameters=model.named_parameters(), compression=compression)
    counters = dict(step=0, grad_sum={n: torch.zeros_like(p) for n, p in initial.items()})
    if state_kind == "horovods":  # which knows nothing of the compressor: refused at the reset
        state = hvd.elastic.TorchState(model, optimizer, **counters)
    else:  # the fused optimizer's state commits its own compressor unasked
        state = TorchState(model, optimizer, compression=compression if path == "stock" else None,
                           **counters)
    host = os.environ.get("HOROVOD_HOSTNAME", "")

    @hvd.elastic.run
    def train(state):
        if state_kind == "ours" or state.step == 0:
            check(state, model, compression, initial, "entry", True, TOLERANCE[method])
        if hvd.size() == 2 and hvd.rank() == 0 and state.step > 0:
            time.sleep(lag_after_reset_s)
        while state.step < STEPS:
            if event == "grow" and state.step == GROW_AT and hvd.size() == 2:
                wait_for_a_host(state, marker)
            if event == "return" and state.step == RETURN_AT and hvd.size() == 2:
                wait_for_a_host(state)
            if event in ("kill", "return") and host == victim and state.step == KILL_AT and not marker.exists():
                marker.write_text(f"killed at step {state.step}")
                os.kill(os.getpid(), signal.SIGKILL)
            grads = gradients(state.step, hvd.rank(), hvd.size(), model)
            optimizer.zero_grad()
            loss = sum((p * grads[n]).sum() for n, p in model.named_parameters())
            loss.backward()
            optimizer.step()
            average = average_gradient(state.step, hvd.size(), model)
            state.grad_sum = {n: state.grad_sum[n] + average[n] for n in average}
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                state.commit()

    train(state)
    check(state, model, compression, initial, "final", False, TOLERANCE[method])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--event", choices=("kill", "return", "grow"), default="kill")
    parser.add_argument("--victim", help="host name whose worker dies (--event kill, return)")
    parser.add_argument("--marker", type=Path, required=True,
                        help="file written when the worker dies or the host is asked for")
    parser.add_argument("--method", choices=sorted(TOLERANCE), default="topk")
    parser.add_argument("--path", choices=("stock", "fused"), default="stock")
    parser.add_argument("--state", choices=("ours", "horovods"), default="ours")
    parser.add_argument("--lag-after-reset-s", type=float, default=0.0)
    args = parser.parse_args()
    main(args.victim, args.marker, args.method, args.path, args.event, args.state, args.lag_after_reset_s)
