"""Training the Fashion-MNIST CNN of ``examples/pytorch_fashion_mnist.py`` with N workers
simulated in one process, for benchmarks that look inside a two-stage method's steps.

Every worker computes its gradient on its own data shard; each compressed tensor goes through
the core's ``simulate_step`` (the method's stages and collectives, emulated); the small
tensors are averaged densely; the parameters follow plain SGD on worker 0's result. The
density is ``WARMUP_DENSITY`` for the first ``WARMUP_STEPS`` steps, then the one given.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from horovod_dgc.core import CompressCall
from horovod_dgc.core.twostage import TwoStageMethod, simulate_step
from horovod_dgc.torch.ops import TorchOps

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import _fashion_mnist as data  # noqa: E402
from pytorch_fashion_mnist import Net  # noqa: E402

OPS = TorchOps()
BATCH = 64  # images per worker per step, as in the convergence benchmark
LR = 0.05
WARMUP_STEPS, WARMUP_DENSITY = 60, 0.032

Gradients = List[Dict[str, torch.Tensor]]  # per worker: parameter name -> gradient


def train(method: TwoStageMethod, workers: int, steps: int, density: float, batch: int = BATCH,
          observe: Optional[Callable[[int, Gradients], None]] = None) -> None:
    """Train for ``steps`` steps from seed 0; ``observe(step, gradients)`` sees each step's
    gradients of every worker before they are compressed."""
    torch.manual_seed(0)
    train_split, _ = data.load()
    shards = [train_split.shard(r, workers) for r in range(workers)]
    model = Net()
    compressed = {n for n, p in model.named_parameters() if not method.config.is_small(tuple(p.shape))}
    states = {n: [method.init_state(OPS, p.detach().flatten(), True, workers) for _ in range(workers)]
              for n, p in model.named_parameters() if n in compressed}
    for step in range(steps):
        at = WARMUP_DENSITY if step < WARMUP_STEPS else density
        grads = []
        for shard in shards:
            i = (step * batch) % (len(shard.labels) - batch)
            model.zero_grad()
            F.cross_entropy(model(shard.images[i:i + batch]), shard.labels[i:i + batch]).backward()
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        if observe is not None:
            observe(step, grads)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in compressed:
                    calls = [CompressCall(n, r, workers, step, at) for r in range(workers)]
                    results, states[n] = simulate_step(OPS, method, states[n],
                                                       [g[n].flatten().clone() for g in grads], calls)
                    p -= LR * results[0].view_as(p)
                else:
                    p -= LR * sum(g[n] for g in grads) / workers
