"""Mixed precision with gradient accumulation (``backward_passes_per_step=2``), Horovod's
recipe, both paths: the compressor runs once a step on the sum of two scaled passes.

- A GradScaler whose scale doubles every step (powers of two: exact) gives parameters
  bit-identical to an unscaled twin's: the memories keep unscaled sums whatever the scale.
- Rank 1 alone overflows in the first pass of step OVERFLOW: every rank skips that step,
  halves its scale and keeps every memory as it was; parameters stay identical across ranks.
"""
import horovod.torch as hvd
import torch

import horovod_dgc.torch as hdgc
from amp_torch import horovod_recipe_step, memories

STEPS, OVERFLOW, PASSES = 6, 3, 2
KINDS = {"dgc": ("dgc", dict(density=0.05)), "scalecom": ("scalecom", dict(density=0.05)),
         "blocksign": ("blocksign", dict(momentum=0.5)),
         "dgc-sar": ("dgc", dict(density=0.05, aggregation="sparse_allreduce"))}


def train(kind: str, path: str, scaled: bool, overflow: bool) -> torch.Tensor:
    """The parameters after the steps; checks the overflow step as it goes."""
    method, options = KINDS[kind]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    compression = getattr(hdgc.Compression, method)(named_parameters=net.named_parameters(), **options)
    wrap = hvd.DistributedOptimizer if path == "stock" else hdgc.DistributedOptimizer
    optimizer = wrap(torch.optim.SGD(net.parameters(), lr=0.05), named_parameters=net.named_parameters(),
                     compression=compression, backward_passes_per_step=PASSES)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1, enabled=scaled)
    compression.attach_grad_scaler(scaler if scaled else None)
    for step in range(STEPS):
        kept, scale = memories(compression), scaler.get_scale()
        params = [p.detach().clone() for p in net.parameters()]
        optimizer.zero_grad()
        for backward_pass in range(PASSES):
            gen = torch.Generator().manual_seed(100 * step + 10 * backward_pass + hvd.rank())
            loss = torch.nn.functional.cross_entropy(net(torch.randn(16, 64, generator=gen)),
                                                     torch.randint(10, (16,), generator=gen))
            if overflow and hvd.rank() == 1 and step == OVERFLOW and backward_pass == 0:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
        horovod_recipe_step(optimizer, scaler)
        moved = any(not torch.equal(p, q) for p, q in zip(net.parameters(), params))
        if overflow and step == OVERFLOW:
            assert scaler.get_scale() == scale / 2, f"{kind}/{path}: the scale did not back off"
            assert not moved, f"{kind}/{path}: the skipped step moved the parameters"
            after = memories(compression)
            for key, value in kept.items():
                assert torch.equal(after[key], value), f"{kind}/{path}: memory {key} changed"
        else:
            assert moved, f"{kind}/{path} step {step}: no update"
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    for other in hvd.allgather_object(flat, name=f"amp.accumulation.{kind}.{path}.{scaled}.{overflow}"):
        assert torch.equal(other, flat), f"{kind}/{path}: ranks hold different parameters"
    return flat


if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    for kind in KINDS:
        for path in ("stock", "own"):
            scaled = train(kind, path, scaled=True, overflow=False)
            unscaled = train(kind, path, scaled=False, overflow=False)
            assert torch.equal(scaled, unscaled), \
                f"{kind}/{path}: a growing scale changed the training by {float((scaled - unscaled).abs().max())}"
            train(kind, path, scaled=True, overflow=True)
            print(f"rank {hvd.rank()} {kind} {path} amp accumulation ok", flush=True)
