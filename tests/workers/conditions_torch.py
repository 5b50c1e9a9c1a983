"""Training conditions beyond float32 with plain SGD, on real ranks: a bfloat16 model on every
method and both paths (Horovod all-reduces no bfloat16), a float64 model on every method and
both paths (the same parameters as the float32 model's, within float32 rounding: values and
scales travel as float32), two models with an optimizer each stepping after one backward
pass (a GAN's generator and discriminator: their collectives in flight at once), a
``torch.compile``'d model (its backward a compiled graph), Horovod's
``broadcast_optimizer_state`` before training (no training step), a channels-last
gradient and Horovod's grouped all-reduces (``groups=``), Horovod's gradient-clipping
recipe (with and without a GradScaler), a model of four dtypes, Adam under a method that
keeps a plain residual, and DGC refusing Adam (it keeps the momentum itself)."""
import horovod.torch as hvd
import torch

import horovod_dgc.torch as hdgc
from horovod_dgc.core.methods import METHODS
from amp_torch import memories
from shared_torch import compiled_fresh

OPTIONS = {"dgc": dict(density=0.05), "topk": dict(density=0.05), "gaussiank": dict(density=0.05),
           "scalecom": dict(density=0.05), "blocksign": dict()}


def model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 10)).to(dtype)


def steps(net, optimizer, count: int, dtype=torch.float32) -> None:
    for step in range(count):
        gen = torch.Generator().manual_seed(100 * step + hvd.rank())
        optimizer.zero_grad()
        net(torch.randn(16, 64, generator=gen).to(dtype)).float().pow(2).mean().backward()
        optimizer.step()


def same_on_every_rank(net, label: str) -> None:
    values = flat(net)
    assert torch.isfinite(values).all(), f"{label}: parameters not finite"
    for other in hvd.allgather_object(values, name=label):
        assert torch.equal(other, values), f"{label}: ranks hold different parameters"


def flat(net: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().double().reshape(-1) for p in net.parameters()])


def bfloat16_model(method: str, path: str) -> None:
    assert not torch.equal(trained(method, path, torch.bfloat16), flat(model(torch.bfloat16))), \
        f"bf16.{method}.{path}: no update"


def distributed(net, method: str, path: str, optimizer: torch.optim.Optimizer, prefix: str = ""):
    """(``optimizer`` wrapped by the ``path``'s DistributedOptimizer with a ``method``
    compressor of its own, the compressor); parameter names prefixed with ``prefix``."""
    compression = getattr(hdgc.Compression, method)(named_parameters=net.named_parameters(prefix),
                                                    **OPTIONS[method])
    wrap = hvd.DistributedOptimizer if path == "stock" else hdgc.DistributedOptimizer
    return wrap(optimizer, named_parameters=net.named_parameters(prefix), compression=compression), compression


def trained(method: str, path: str, dtype: torch.dtype) -> torch.Tensor:
    net = model(dtype)
    optimizer, _ = distributed(net, method, path, torch.optim.SGD(net.parameters(), lr=0.05))
    steps(net, optimizer, 3, dtype)
    same_on_every_rank(net, f"{dtype}.{method}.{path}")
    return flat(net)


class MixedPrecisionNet(torch.nn.Module):
    """float16 and bfloat16 linear layers around a float32 BatchNorm, then a float64 head
    (a half-precision model that keeps its normalisation in float32, as apex's O2 did)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(64, 128).half()
        self.norm = torch.nn.BatchNorm1d(128)
        self.second = torch.nn.Linear(128, 64).bfloat16()
        self.head = torch.nn.Linear(64, 10).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.norm(self.first(x.half()).float()))
        return self.head(self.second(hidden.bfloat16()).double())


def mixed_dtypes(method: str) -> None:
    """Four dtypes in one model (the fused optimizer's buckets and dense all-reduces hold
    several): the same parameters on both paths and every rank, bit for bit."""
    trained = {}
    for path in ("stock", "own"):
        net = MixedPrecisionNet()
        # The same names on both paths: a name seeds DGC's sampling, which decides among
        # float16 gradients of equal magnitude at the threshold.
        optimizer, _ = distributed(net, method, path, torch.optim.SGD(net.parameters(), lr=0.05),
                                   prefix="mixed")
        steps(net, optimizer, 3)
        same_on_every_rank(net, f"mixed.{method}.{path}")
        trained[path] = flat(net)
    assert not torch.equal(trained["stock"], flat(MixedPrecisionNet())), f"mixed.{method}: no update"
    assert torch.equal(trained["stock"], trained["own"]), f"mixed.{method}: the paths differ"


def float64_model(method: str, path: str) -> None:
    difference = float((trained(method, path, torch.float64) - trained(method, path, torch.float32)).abs().max())
    assert difference < 1e-5, f"float64.{method}.{path}: {difference} from the float32 model"


def compiled_model(method: str, path: str) -> None:
    """``torch.compile`` (AOTAutograd, which inductor also runs under) gives the parameters
    of the eager model: the gradients reach the parameters from a compiled backward graph."""
    label = f"compiled.{method}.{path}"
    results = []
    for compile_it in (False, True):
        net = model()
        forward, graphs = compiled_fresh(net) if compile_it else (net, None)
        optimizer, _ = distributed(net, method, path, torch.optim.SGD(net.parameters(), lr=0.05))
        steps(forward, optimizer, 3)
        results.append(flat(net))
    assert graphs() >= 1, f"{label}: dynamo compiled no graph"
    assert not torch.equal(results[0], flat(model())), f"{label}: no update"
    assert torch.equal(*results), f"{label}: differs from the eager model"


def two_optimizers(method: str, path: str, one_backward: bool) -> torch.Tensor:
    """Two models (names prefixed, as Horovod asks), each with its own optimizer and
    compressor, trained by one backward pass of both losses or by one pass each."""
    nets, optimizers = [], []
    for prefix in ("generator", "discriminator"):
        net = model()
        optimizers.append(distributed(net, method, path, torch.optim.SGD(net.parameters(), lr=0.05),
                                      prefix)[0])
        nets.append(net)
    for step in range(3):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * step + hvd.rank()))
        losses = [nets[0](x).pow(2).mean(), nets[1](x).abs().mean()]
        if one_backward:
            sum(losses).backward()
        for optimizer, loss in zip(optimizers, losses):
            if not one_backward:
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return torch.cat([flat(net) for net in nets])


def optimizers_in_flight_at_once(method: str, path: str) -> None:
    """Catches collectives named by bucket number (the fused path's were: two optimizers'
    first buckets shared a name, and Horovod refused the second)."""
    together, apart = (two_optimizers(method, path, one_backward) for one_backward in (True, False))
    assert torch.equal(together, apart), f"two optimizers.{method}.{path}: one backward pass differs"


def state_broadcast_is_no_step(method: str) -> None:
    """Horovod's recipe broadcasts the optimizer's state before training; for a new optimizer
    it steps it once on zero gradients, locally for its own DistributedOptimizer. Catches the
    fused optimizer exchanging then (a compressor step: ScaleCom's leader moves on, DGC's
    weight decay applies once more)."""
    results = []
    for broadcast in (True, False):
        net = model()
        # DGC takes the momentum and weight decay over; ScaleCom's SGD would apply its own.
        moved = dict(momentum=0.9, weight_decay=0.01) if method == "dgc" else {}
        optimizer, compression = distributed(net, method, "own",
                                             torch.optim.SGD(net.parameters(), lr=0.05, **moved))
        if broadcast:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        steps(net, optimizer, 3)
        assert compression.stats().steps == 3, f"{method}: {compression.stats().steps} steps"
        results.append(flat(net))
    assert torch.equal(*results), f"{method}: the state broadcast changed the training"


def injected(channels_last: bool) -> torch.nn.Module:
    """A convolution's weight (channels-last if asked: its gradient is then laid out so, as
    AccumulateGrad follows the parameter's strides) and a bias, for a loss ``sum(p * x)``."""
    torch.manual_seed(0)
    net = torch.nn.Module()
    net.conv = torch.nn.Parameter(torch.randn(32, 16, 3, 3))
    net.bias = torch.nn.Parameter(torch.randn(32))
    if channels_last:
        net.conv.data = net.conv.data.to(memory_format=torch.channels_last)
    return net


def trained_injected(method: str, path: str, channels_last: bool = False, **horovod_options) -> torch.Tensor:
    net = injected(channels_last)
    label = f"{method}.{path}.{channels_last}.{sorted(horovod_options)}"
    compression = getattr(hdgc.Compression, method)(named_parameters=net.named_parameters(label),
                                                    **OPTIONS[method])
    wrap = hvd.DistributedOptimizer if path == "stock" else hdgc.DistributedOptimizer
    optimizer = wrap(torch.optim.SGD(net.parameters(), lr=0.05), named_parameters=net.named_parameters(label),
                     compression=compression, **horovod_options)
    for step in range(4):
        gen = torch.Generator().manual_seed(100 * step + hvd.rank())
        optimizer.zero_grad()
        sum((p * torch.randn(p.shape, generator=gen)).sum() for p in net.parameters()).backward()
        assert net.conv.grad.is_contiguous() != channels_last, f"{label}: gradient layout"
        optimizer.step()
    return flat(net)


def channels_last_and_grouped_all_reduces(method: str) -> None:
    """A channels-last gradient (a kernel reading its memory in storage order would select
    and keep other elements than the ones its positions name) trains exactly as a contiguous
    one on both paths; Horovod's ``groups=`` (grouped all-reduces, compress called for a
    group at once) exactly as without."""
    for path in ("stock", "own"):
        contiguous = trained_injected(method, path)
        assert not torch.equal(contiguous, flat(injected(False))), f"{method}.{path}: no update"
        assert torch.equal(trained_injected(method, path, channels_last=True), contiguous), \
            f"channels_last.{method}.{path}: differs from the contiguous model"
        if path == "stock":
            assert torch.equal(trained_injected(method, path, groups=1), contiguous), \
                f"groups.{method}: differs from ungrouped all-reduces"


def clipped_after_synchronize(method: str, path: str, scaled: bool) -> None:
    """Horovod's clipping recipe (``synchronize()``, a GradScaler's ``unscale_`` if
    ``scaled``, ``clip_grad_norm_``, ``step()`` under ``skip_synchronize()``): each step applies
    -lr times the average clipped by the norm computed here, and ``step()`` leaves the memories
    as ``synchronize()`` left them. Catches a ``step()`` that writes its own copy of the
    average over the clipped gradients, or that exchanges them again."""
    label, lr, max_norm = f"clip.{method}.{path}.{scaled}", 0.05, 0.1
    net = model()
    optimizer, compression = distributed(net, method, path, torch.optim.SGD(net.parameters(), lr=lr),
                                         prefix=label)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaled else None
    if scaled:
        compression.attach_grad_scaler(scaler)
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * step + hvd.rank())
        optimizer.zero_grad()
        loss = net(torch.randn(16, 64, generator=gen)).pow(2).mean()
        (scaler.scale(loss) if scaled else loss).backward()
        optimizer.synchronize()
        if scaled:
            scaler.unscale_(optimizer)
        average = [p.grad.double() for p in net.parameters()]
        norm = sum(float((g * g).sum()) for g in average) ** 0.5
        assert norm > max_norm, f"{label} step {step}: nothing to clip (norm {norm})"
        torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
        before, kept = [p.detach().clone() for p in net.parameters()], memories(compression)
        with optimizer.skip_synchronize():
            if scaled:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
        for p, old, g in zip(net.parameters(), before, average):
            expected = old.double() - lr * g * (max_norm / (norm + 1e-6))
            assert torch.allclose(p.detach().double(), expected, rtol=0, atol=1e-7), \
                f"{label} step {step}: the update is not -lr times the clipped average"
        after = memories(compression)
        assert after.keys() == kept.keys() and all(torch.equal(v, after[k]) for k, v in kept.items()), \
            f"{label} step {step}: step() changed the memories synchronize() left"
    same_on_every_rank(net, label)


def adam_under_a_plain_residual(path: str) -> None:
    net = model()
    optimizer, _ = distributed(net, "topk", path, torch.optim.Adam(net.parameters(), lr=1e-3))
    steps(net, optimizer, 3)
    same_on_every_rank(net, f"adam.topk.{path}")


def dgc_refuses_adam() -> None:
    for make in (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad):
        net = model()
        compression = hdgc.Compression.dgc(named_parameters=net.named_parameters())
        try:
            hdgc.DistributedOptimizer(make(net.parameters(), lr=1e-3), named_parameters=net.named_parameters(),
                                      compression=compression)
        except ValueError as error:
            assert make.__name__ in str(error) and "momentum" in str(error), str(error)
        else:
            raise AssertionError(f"the fused optimizer took DGC with {make.__name__}")
        # Names of their own: the refused step leaves its collectives in flight.
        net = model()
        compression = hdgc.Compression.dgc(named_parameters=net.named_parameters(prefix=make.__name__))
        optimizer = hvd.DistributedOptimizer(make(net.parameters(), lr=1e-3),
                                             named_parameters=net.named_parameters(prefix=make.__name__),
                                             compression=compression)
        try:
            steps(net, optimizer, 1)
        except ValueError as error:
            assert make.__name__ in str(error), str(error)
        else:
            raise AssertionError(f"the stock optimizer took DGC with {make.__name__}")


if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    for spec in METHODS:
        for path in ("stock", "own"):
            bfloat16_model(spec.name, path)
            float64_model(spec.name, path)
            optimizers_in_flight_at_once(spec.name, path)
        channels_last_and_grouped_all_reduces(spec.name)
        mixed_dtypes(spec.name)
        for path in ("stock", "own"):
            for scaled in (False, True):
                clipped_after_synchronize(spec.name, path, scaled)
    for method in ("dgc", "scalecom"):
        state_broadcast_is_no_step(method)
    compiled_model("topk", "stock")
    compiled_model("dgc", "own")
    for path in ("stock", "own"):
        adam_under_a_plain_residual(path)
    dgc_refuses_adam()
    print(f"rank {hvd.rank()} conditions ok", flush=True)
