"""The DDP communication hook (``horovod_dgc.torch.ddp``) under ``torchrun``, Gloo on CPU.

Modes (first argument, comma-separated):

* ``aggregate``: one step with fixed per-rank gradients; every rank checks that its averaged
  gradient equals the dense reference built from all ranks' sent values (gradient minus
  what the memory kept), bit for bit, and that Top-k and DGC sent the exact top-k.
* ``complex``: the same for a model with a complex parameter beside a real one: the complex
  gradient, which DDP keeps in its bucket as its real view, is averaged whole; the hook's
  state saved and loaded into a fresh model gives the next step exactly.
* ``subgroups`` (4 ranks): two DDP models on process groups of ranks 0-1 and 2-3; each group's
  parameters against its own ranks' gradients and what their memories owe.
* ``join``: uneven inputs under ``model.join()`` (rank r takes 3 + 2r steps), with and without
  ``find_unused_parameters``: the parameters DDP hands every rank at the end against the sum of
  every rank's own gradients and what the memories owe.
* ``train --out DIR``: 20 steps of every method of ``--methods`` with fixed per-rank
  gradients, a float32 and a bfloat16 model, parameters saved to ``DIR/ddp_rank{r}.pt``
  under ``method/dtype``. With ``--horovod`` (run under
  ``horovodrun``) the same steps go through the stock ``hvd.DistributedOptimizer`` instead
  and are saved to ``DIR/horovod_rank{r}.pt``: the test compares the two.
* ``accumulate``: gradient accumulation under DDP's ``no_sync`` equals one pass of the sum.
* ``checkpoint``: the hook's state saved after 3 steps and loaded into a fresh model and
  compressor continues exactly as the original; another rank's or method's state is refused.
* ``misuse``: what ``register`` refuses, and with which error.
* ``unused``: a parameter no rank used in a step keeps its memories (DDP applies nothing to it).
* ``adaptive``: the adaptive switch through the hook: every method forced dense for steps
  10-19 and compressed again loses no gradient mass (the parameters against the sum of the
  mean gradients minus what the memories owe); with the link given slow, fast and probed,
  every rank takes the same decisions.
* ``compiled``: ``torch.compile`` of the DDP model gives the eager model's parameters (the
  first of ``--methods`` only: a compile takes seconds, and the hook's path through a
  compiled backward is the same for every method).

Every mode but ``--horovod`` runs with Horovod's import blocked, as where it is not installed:
the hook's path needs none of it.

The model takes the gradients as its input (``loss = sum(p * g)``), so every step's gradient
is known exactly; its two layers differ 100x in scale, and DDP's buckets (``bucket_cap_mb``
small) split them differently before and after DDP rebuilds its buckets.
"""
import argparse
import gc
import io
import sys
from pathlib import Path
from typing import Dict, List, Tuple

if "--horovod" not in sys.argv:
    # The hook's path must run where Horovod is not installed: from here on, importing it fails.
    sys.modules["horovod"] = None

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

import horovod_dgc.torch as hdgc
from horovod_dgc.core.adaptive import COMPRESSED, DENSE, Adaptive
from horovod_dgc.core.selection import top_count
from horovod_dgc.torch import ddp
from horovod_dgc.torch.dist_collectives import DistTransport
from shared_torch import PLAIN, compiled_fresh, conservation_error, exact_topk_dense, memories_empty, sent_values

STEPS = 20
# train: the model's dtypes (bfloat16: DDP's buckets and the hook's dense all-reduces of it).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BUCKET_CAP_MB = 0.07  # a few buckets, some holding two parameters
LAYER_SCALE = (1.0, 1.0, 0.01, 0.01)
# Run name -> (method, options).
KINDS = {"dgc": ("dgc", dict(density=0.01)), "topk": ("topk", dict(density=0.01)),
         "gaussiank": ("gaussiank", dict(density=0.01)), "scalecom": ("scalecom", dict(density=0.01)),
         "blocksign": ("blocksign", dict(momentum=0.5)),
         "dgc-sar": ("dgc", dict(density=0.01, aggregation="sparse_allreduce"))}


def make_compression(kind: str, **options):
    method, defaults = KINDS[kind]
    return getattr(hdgc.Compression, method)(**{**defaults, **options})


class Injected(torch.nn.Module):
    """Two linear layers whose forward takes each parameter's gradient and returns
    ``sum(p * g)``: backward then gives exactly those gradients."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 50))

    def forward(self, grads: List[torch.Tensor]) -> torch.Tensor:
        return sum((p * g).sum() for p, g in zip(self.net.parameters(), grads))


def gradients(model: torch.nn.Module, rank: int, step: int) -> List[torch.Tensor]:
    return [(torch.randn(p.shape, generator=torch.Generator().manual_seed(10_000 * rank + 100 * step + i))
             * LAYER_SCALE[i]).to(p.dtype) for i, p in enumerate(model.parameters())]


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def ddp_model(module: torch.nn.Module, **ddp_options) -> torch.nn.parallel.DistributedDataParallel:
    return torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=BUCKET_CAP_MB, **ddp_options)


def setup(method: str, dtype: torch.dtype = torch.float32, **overrides):
    """A fresh model (of ``dtype``), its DDP wrapper, the hook's state and plain SGD."""
    module = Injected().to(dtype)
    model = ddp_model(module)
    compression = make_compression(method, **overrides)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ddp.register(model, compression, optimizer=sgd)
    return module, model, state, sgd


def ddp_steps(model, module, state, sgd, steps) -> None:
    for step in steps:
        state.set_epoch(0)
        sgd.zero_grad()
        model(gradients(module, dist.get_rank(), step)).backward()
        sgd.step()


def mean_over_ranks(sent: torch.Tensor) -> torch.Tensor:
    """The dense reference of an average: every rank's ``sent`` summed in rank order, then
    scaled by 1 / world size, as the exchanges do."""
    everyone: List[torch.Tensor] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sent)
    reference = torch.zeros_like(sent)
    for each in everyone:
        reference = reference + each
    return reference * (1.0 / len(everyone))


# -- aggregate -----------------------------------------------------------------------------
def aggregate(method: str) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    # float32 values: the sent values are then exactly the selected gradient entries.
    module, model, state, _ = setup(method, value_dtype="float32")
    grads = gradients(module, rank, 0)
    model(grads).backward()
    config, engine = state.compression.config, state.compression.engine
    for (name, param), grad in zip(module.named_parameters(), grads):
        compressed = engine.compresses(grad)
        mine = sent_values(state.compression, name, grad) if compressed else grad
        if compressed:
            k = top_count(config.density_floor(tuple(grad.shape)) or config.density, grad.numel())
            assert torch.equal(mine, exact_topk_dense(grad, k)), f"{name}: not the exact top-k"
        reference = mean_over_ranks(mine)
        if compressed:
            assert torch.equal(param.grad, reference), f"rank {rank} {method} {name}: not bit-exact"
        else:
            torch.testing.assert_close(param.grad, reference, rtol=1e-6, atol=1e-7)
    stats = state.stats()
    assert 0 < stats.bytes_sent < stats.dense_bytes, stats
    print(f"rank {rank}/{size} {method} ddp aggregate ok", flush=True)


# -- complex ----------------------------------------------------------------------------------
class WithComplex(torch.nn.Module):
    """A real and a complex parameter whose forward takes each one's gradient (``sum(p * g)``
    over the real views): backward gives exactly those gradients."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.real = torch.nn.Parameter(torch.randn(60, 80))
        self.phase = torch.nn.Parameter(torch.randn(50, 50, dtype=torch.complex64))

    def forward(self, grads: List[torch.Tensor]) -> torch.Tensor:
        return sum((torch.view_as_real(p) if p.is_complex() else p).mul(
            torch.view_as_real(g) if g.is_complex() else g).sum() for p, g in zip(self.parameters(), grads))


def complex_gradients(module: torch.nn.Module, rank: int, step: int) -> List[torch.Tensor]:
    return [torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(rank * 7 + step * 100 + i))
            for i, p in enumerate(module.parameters())]


def complex_aggregate(method: str) -> None:
    """DDP keeps a complex gradient in its bucket as its real view: every one of its real and
    imaginary parts is averaged (the exact top-k of each rank's real view, k of its 5,000
    entries at density 0.01, summed over ranks and divided), none left as the rank's own.
    The hook's state, saved after that step and loaded into a fresh model, gives the next
    step's gradients exactly as the original does."""
    rank, size = dist.get_rank(), dist.get_world_size()
    module = WithComplex()
    model = ddp_model(module)
    state = ddp.register(model, make_compression(method, value_dtype="float32"))
    grads = complex_gradients(module, rank, 0)
    model(grads).backward()
    mine = exact_topk_dense(torch.view_as_real(grads[1]), 50)
    reference = mean_over_ranks(mine)
    assert module.phase.grad.dtype == torch.complex64
    assert torch.equal(torch.view_as_real(module.phase.grad), reference), \
        f"rank {rank} {method}: the complex gradient is not the average of the ranks' top-k"

    saved = state.state_dict()
    resumed = WithComplex()
    resumed_model = ddp_model(resumed)
    ddp.register(resumed_model, make_compression(method, value_dtype="float32")).load_state_dict(saved)
    for each, each_model in ((module, model), (resumed, resumed_model)):
        each.zero_grad()
        each_model(complex_gradients(each, rank, 1)).backward()
    for (name, original), again in zip(module.named_parameters(), resumed.parameters()):
        assert torch.equal(original.grad, again.grad), f"rank {rank} {method} {name}: the resumed step differs"
    print(f"rank {rank}/{size} {method} ddp complex ok", flush=True)


# -- unused -----------------------------------------------------------------------------------
class PartlyUsed(Injected):
    """:class:`Injected` whose second layer takes part only where ``use_second`` says."""

    def forward(self, grads: List[torch.Tensor], use_second: bool = True) -> torch.Tensor:
        used = len(grads) if use_second else 2
        return sum((p * g).sum() for p, g in list(zip(self.net.parameters(), grads))[:used])


def memories(state) -> Dict[str, Dict[str, torch.Tensor]]:
    return state.state_dict()["states"]


def unused(method: str, users_by_step: Tuple[Tuple[int, ...], ...], **ddp_options) -> None:
    """A parameter no rank used in a step (DDP ``find_unused_parameters=True`` or
    ``static_graph=True``) keeps its gradient None and its memories exactly as before that
    step: what the compressor sent for it would be lost, as DDP applies nothing to it. One
    used by one rank only gets the average, and its memories move on every rank.
    ``users_by_step``: the ranks that use the second layer, step by step (a static graph
    uses the same parameters at every step)."""
    rank = dist.get_rank()
    module = PartlyUsed()
    model = ddp_model(module, **ddp_options)
    state = ddp.register(model, make_compression(method), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    second = [n for n, _ in module.named_parameters()][2:]
    for step, users in enumerate(users_by_step):
        before = memories(state)
        module.zero_grad()
        model(gradients(module, rank, step), use_second=rank in users).backward()
        after = memories(state)
        grads = dict(module.named_parameters())
        for name in second:
            label = f"{method} {ddp_options} step {step} {name}"
            # A memory's first state is all zeros (made when the tensor is first seen).
            kept = before.get(name) or {k: torch.zeros_like(v) for k, v in after[name].items()}
            if users:
                assert grads[name].grad is not None, f"{label}: no gradient"
                assert any(not torch.equal(kept[k], v) for k, v in after[name].items()), \
                    f"{label}: memories did not move"
            else:
                assert grads[name].grad is None, f"{label}: a gradient for an unused parameter"
                assert kept.keys() == after[name].keys() and all(
                    torch.equal(kept[k], v) for k, v in after[name].items()), \
                    f"{label}: memories of a parameter no rank used changed (what was sent is lost)"
    print(f"rank {rank} {method} {sorted(ddp_options)} ddp unused ok", flush=True)


# -- train ------------------------------------------------------------------------------------
def train_ddp(method: str, dtype: torch.dtype) -> torch.Tensor:
    module, model, state, sgd = setup(method, dtype)
    ddp_steps(model, module, state, sgd, range(STEPS))
    return flat(module)


def train_horovod(method: str, dtype: torch.dtype, hvd) -> torch.Tensor:
    module = Injected().to(dtype)
    compression = make_compression(method, named_parameters=module.named_parameters())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(module.parameters(), lr=0.1),
                                         named_parameters=module.named_parameters(),
                                         compression=compression)
    for step in range(STEPS):
        compression.set_epoch(0)
        optimizer.zero_grad()
        module(gradients(module, hvd.rank(), step)).backward()
        optimizer.step()
    return flat(module)


# -- accumulate -------------------------------------------------------------------------------
def accumulate(method: str) -> None:
    """Gradient accumulation under ``no_sync``: a first backward pass outside DDP's
    synchronisation, a second inside it, each step, give the parameters one backward pass of
    the two gradients' sum gives (autograd adds the passes with the same rounding). Catches a
    hook whose state counts something per pass or drops what ``no_sync`` accumulated."""
    rank, size = dist.get_rank(), dist.get_world_size()
    runs = []
    for passes in (2, 1):
        module, model, state, sgd = setup(method)
        for step in range(STEPS):
            state.set_epoch(0)
            sgd.zero_grad()
            first, second = gradients(module, rank, 2 * step), gradients(module, rank, 2 * step + 1)
            if passes == 2:
                with model.no_sync():
                    model(first).backward()
                model(second).backward()
            else:
                model([a + b for a, b in zip(first, second)]).backward()
            sgd.step()
        runs.append(flat(module))
    difference = float((runs[0] - runs[1]).abs().max())
    assert float((runs[1] - flat(Injected())).abs().max()) > 0.01, f"{method}: nothing moved"
    assert difference <= 1e-6, f"rank {rank} {method}: accumulation under no_sync differs by {difference}"
    print(f"rank {rank}/{size} {method} ddp accumulate ok", flush=True)


# -- adaptive ---------------------------------------------------------------------------------
def _mean(tensor: torch.Tensor, _name: str, group=None) -> torch.Tensor:
    dist.all_reduce(tensor, group=group)
    return tensor / dist.get_world_size(group)


def _gather(tensor: torch.Tensor, _name: str, group=None) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts)


def plain_setup(kind: str, **ddp_options):
    """:class:`Injected` under DDP (``ddp_options``) with ``kind``'s plain settings (``PLAIN``):
    the module, the DDP model, the parameters at the start, the compressor, the hook's state
    and SGD with lr 0.1."""
    method, options = PLAIN[kind]
    module = Injected()
    model = ddp_model(module, **ddp_options)
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    compression = getattr(hdgc.Compression, method)(**options)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ddp.register(model, compression, optimizer=sgd)
    return module, model, start, compression, state, sgd


def conservation_errors(compression, module: torch.nn.Module, start: Dict[str, torch.Tensor],
                        steps_of: Dict[int, int], group=None) -> Dict[str, float]:
    """:func:`conservation_error` of ``module`` trained by the ranks of ``steps_of`` (rank ->
    its steps, each rank's gradients of its own steps averaged over those ranks), the
    memories averaged and gathered in ``group``."""
    index = {name: i for i, (name, _) in enumerate(module.named_parameters())}

    def mean_gradient_sum(name: str, _shape) -> torch.Tensor:
        return sum(gradients(module, r, t)[index[name]].double()
                   for r, steps in steps_of.items() for t in range(steps)) / len(steps_of)

    return conservation_error(compression, start, module.named_parameters(), mean_gradient_sum, 0.1,
                              lambda t, n: _mean(t, n, group), lambda t, n: _gather(t, n, group))


def adaptive_forced(kind: str, steps: int = 30, dense_steps: range = range(10, 20)) -> None:
    """Every bucket forced dense for ``dense_steps``, compressed before and after: the
    memories are empty after each dense step and no gradient mass is lost."""
    module, model, start, compression, state, sgd = plain_setup(kind)
    for step in range(steps):
        if step in (dense_steps.start, dense_steps.stop):
            compression.force_mode(DENSE if step == dense_steps.start else None)
        ddp_steps(model, module, state, sgd, [step])
        if step in dense_steps:
            assert memories_empty(compression, module.named_parameters()), (kind, step)
    assert set(compression.bucket_modes().values()) == {COMPRESSED}, compression.bucket_modes()
    errors = conservation_errors(compression, module, start, {r: steps for r in range(dist.get_world_size())})
    assert max(errors.values()) < 1e-5, f"{kind}: {errors}"
    print(f"rank {dist.get_rank()} {kind} ddp forced switches ok", flush=True)


# -- subgroups --------------------------------------------------------------------------------
def subgroups(kind: str, steps: int = 3) -> None:
    """Two DDP models on two process groups of two ranks each (``process_group=``): each
    group's collectives stay in it (ranks and roots are the group's), so each group's
    parameters are its own ranks' gradients less what their memories owe, the same on both of
    its ranks and unlike the other group's."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    members = (2 * (rank // 2), 2 * (rank // 2) + 1)
    module, model, start, compression, state, sgd = plain_setup(kind, process_group=group)
    ddp_steps(model, module, state, sgd, range(steps))
    errors = conservation_errors(compression, module, start, {r: steps for r in members}, group)
    assert max(errors.values()) < 1e-5, f"rank {rank} {kind}: {errors}"
    everyone: List[torch.Tensor] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, flat(module))
    assert torch.equal(everyone[members[0]], everyone[members[1]]), f"rank {rank} {kind}: group differs"
    assert not torch.equal(everyone[0], everyone[2]), f"{kind}: the groups trained alike"
    print(f"rank {rank} {kind} ddp subgroups ok", flush=True)


# -- join -------------------------------------------------------------------------------------
def join(kind: str, **ddp_options) -> None:
    """Uneven inputs under DDP's ``model.join()``: rank r takes 3 + 2r steps; a rank that ran
    out shadows the others' steps with zero gradients through the hook, and DDP hands every
    rank the last one's parameters at the end. Those are the start less lr times (the sum of
    every rank's gradients of its own steps over the world size, less what the memories owe):
    a joined rank's shadow steps keep sending what its memories held, and lose nothing."""
    rank = dist.get_rank()
    module, model, start, compression, state, sgd = plain_setup(kind, **ddp_options)
    steps_of = {r: 3 + 2 * r for r in range(dist.get_world_size())}
    with model.join():
        ddp_steps(model, module, state, sgd, range(steps_of[rank]))
    errors = conservation_errors(compression, module, start, steps_of)
    assert max(errors.values()) < 1e-5, f"rank {rank} {kind} {ddp_options}: {errors}"
    print(f"rank {rank} {kind} {sorted(ddp_options)} ddp join ok", flush=True)


def adaptive_decisions(settings: Adaptive) -> List[str]:
    """Each bucket's mode after 16 steps of dgc with ``settings``; the decision lines and the
    parameters identical on every rank."""
    module = Injected()
    model = ddp_model(module)
    compression = hdgc.Compression.dgc(adaptive=settings)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    state = ddp.register(model, compression, optimizer=sgd)
    ddp_steps(model, module, state, sgd, range(16))
    lines = compression.stats().buckets
    assert lines and all(line.startswith("bucket") for line in lines), lines
    everyone: List[Tuple[str, ...]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, lines)
    assert all(theirs == lines for theirs in everyone), everyone  # the same numbers, to the digit
    params: List[torch.Tensor] = [None] * dist.get_world_size()
    dist.all_gather_object(params, flat(module))
    assert all(torch.equal(theirs, flat(module)) for theirs in params), "parameters differ"
    return [line.split(": ")[1].split(",")[0] for line in lines]


def adaptive() -> None:
    for kind in PLAIN:
        adaptive_forced(kind)
    every = dict(recheck_steps=5, first_decision_step=4, sample_steps=2)
    slow = adaptive_decisions(Adaptive(link_bytes_per_s=1e3, **every))
    assert set(slow) == {COMPRESSED}, slow
    fast = adaptive_decisions(Adaptive(link_bytes_per_s=1e15, **every))
    assert set(fast) == {DENSE}, fast
    adaptive_decisions(Adaptive(**every))
    print(f"rank {dist.get_rank()} ddp decisions agree", flush=True)


# -- compiled ---------------------------------------------------------------------------------
def compiled(method: str) -> None:
    """``torch.compile`` of the DDP model (dynamo splits its graph at DDP's buckets, the
    backward runs from AOTAutograd's graph, which inductor also runs under) gives the
    parameters of the eager DDP model, bit for bit. DDP's default buckets: dynamo refuses a
    first bucket larger than the others, which ``bucket_cap_mb`` below 1 MB makes."""
    rank = dist.get_rank()
    results = []
    for compile_it in (False, True):
        module = Injected()
        model = torch.nn.parallel.DistributedDataParallel(module)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        state = ddp.register(model, make_compression(method), optimizer=sgd)
        forward, graphs = compiled_fresh(model) if compile_it else (model, None)
        ddp_steps(forward, module, state, sgd, range(3))
        results.append(flat(module))
    assert graphs() >= 1, f"{method}: dynamo compiled no graph"
    assert not torch.equal(results[0], flat(Injected())), f"{method}: no update"
    assert torch.equal(*results), f"rank {rank} {method}: the compiled model differs from the eager one"
    print(f"rank {rank} {method} compiled ok", flush=True)


# -- checkpoint -------------------------------------------------------------------------------
def checkpoint(method: str) -> None:
    rank = dist.get_rank()
    module, model, state, sgd = setup(method)
    ddp_steps(model, module, state, sgd, range(3))
    buffer = io.BytesIO()
    torch.save({"model": module.state_dict(), "compression": state.state_dict()}, buffer)
    ddp_steps(model, module, state, sgd, range(3, 6))
    original = flat(module)

    buffer.seek(0)
    saved = torch.load(buffer)
    module, model, state, sgd = setup(method)
    module.load_state_dict(saved["model"])
    state.load_state_dict(saved["compression"])
    ddp_steps(model, module, state, sgd, range(3, 6))
    assert torch.equal(flat(module), original), f"rank {rank} {method}: resumed run differs"

    parts: List[dict] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, saved["compression"])
    other = parts[(rank + 1) % len(parts)]
    try:
        state.load_state_dict(other)
    except ValueError as error:
        assert f"saved by rank {(rank + 1) % len(parts)}" in str(error), error
    else:
        raise AssertionError("another rank's state was loaded")
    other_method = "topk" if method != "topk" else "dgc"
    _, _, foreign, _ = setup(other_method)
    try:
        foreign.load_state_dict(saved["compression"])
    except ValueError as error:
        assert "is from method" in str(error), error
    else:
        raise AssertionError(f"a {method} state was loaded into {other_method}")
    print(f"rank {rank} {method} checkpoint ok", flush=True)


# -- misuse -------------------------------------------------------------------------------------
def expect(error_type, words, call) -> str:
    try:
        call()
    except error_type as error:
        message = str(error)
        for word in words:
            assert word in message, f"{word!r} not in: {message}"
        return message
    raise AssertionError(f"{call} was not refused")


def misuse() -> None:
    rank = dist.get_rank()
    module = Injected()

    def register_with(compression, optimizer=None):
        return lambda: ddp.register(ddp_model(module), compression, optimizer=optimizer)

    momentum_sgd = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    expect(ValueError, ["momentum=0.9", "compressor applies"],
           register_with(hdgc.Compression.dgc(), momentum_sgd))
    expect(ValueError, ["Adam", "momentum"],
           register_with(hdgc.Compression.dgc(), torch.optim.Adam(module.parameters())))
    state = ddp.register(ddp_model(module), hdgc.Compression.dgc())
    expect(ValueError, ["momentum"], lambda: state.check_optimizer(momentum_sgd))
    state.check_optimizer(torch.optim.SGD(module.parameters(), lr=0.1))
    # Methods with a plain residual work under any optimizer.
    ddp.register(ddp_model(module), hdgc.Compression.topk(), optimizer=momentum_sgd)
    expect(TypeError, ["horovod_dgc compressor", "Compression.dgc", "object"],
           register_with(object()))
    expect(ImportError, ["Horovod's own compressor", "DDP's own hooks"],
           lambda: hdgc.Compression.fp16)
    expect(ImportError, ["Horovod cannot be imported", "ddp.register(model, compression) before"],
           lambda: hdgc.Compression.topk().set_epoch(0))
    expect(TypeError, ["DistributedDataParallel", "Injected"],
           lambda: ddp.register(module, hdgc.Compression.topk()))
    sparse_misuse()
    momentum_cycled_by_a_scheduler(module)
    grad_scaler_not_told()
    optimizer_found_among_the_loop_variables()
    print(f"rank {rank} misuse ok", flush=True)


def momentum_cycled_by_a_scheduler(module: torch.nn.Module) -> None:
    """OneCycleLR sets the SGD's momentum after register() checked the optimizer: the hook
    refuses it at the next step, before DGC's momentum is applied twice."""
    sgd = torch.optim.SGD(module.parameters(), lr=0.1)
    model = ddp_model(module)
    ddp.register(model, hdgc.Compression.dgc(), optimizer=sgd)
    torch.optim.lr_scheduler.OneCycleLR(sgd, max_lr=0.1, total_steps=10)
    expect(Exception, ["cycle_momentum=False", "compressor applies"],
           lambda: model(gradients(module, dist.get_rank(), 0)).backward())


def grad_scaler_not_told() -> None:
    """PyTorch's recipe with a GradScaler the compressor was not given: the hook (inside
    backward()) refuses it at the first bucket, before the memories keep scaled gradients;
    attach_grad_scaler(None), said of a scaler that scales another loss, lets it train."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for told in (False, True):
        module = Injected()  # a refused backward leaves its DDP model mid-step
        model = ddp_model(module)
        state = ddp.register(model, hdgc.Compression.topk())
        if told:
            state.compression.attach_grad_scaler(None)
        loss = scaler.scale(model(gradients(module, dist.get_rank(), 0)))
        if told:
            loss.backward()
        else:
            expect(Exception, ["GradScaler (scale 1024.0)", "attach_grad_scaler(scaler)"], loss.backward)


def optimizer_found_among_the_loop_variables() -> None:
    """register() without optimizer=: the first step checks the one optimizer of the loop
    holding the model's parameters (DGC's momentum applied twice was silent); with a plain
    SGD it trains. A ZeroRedundancyOptimizer is judged by the SGD it wraps, found or given
    (given with momentum 0 it was refused as an optimizer with state of its own)."""
    def plain(params, momentum):
        return torch.optim.SGD(params, lr=0.1, momentum=momentum)

    def zero(params, momentum):
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, lr=0.1, momentum=momentum)

    for make, given in ((plain, False), (zero, False), (zero, True)):
        for momentum in (0.9, 0.0):
            module = Injected()  # a refused backward leaves its DDP model mid-step
            optimizer = make(module.parameters(), momentum)
            model = ddp_model(module)
            if given and momentum:
                expect(ValueError, ["momentum=0.9", "compressor applies"],
                       lambda: ddp.register(model, hdgc.Compression.dgc(), optimizer=optimizer))
                continue
            ddp.register(model, hdgc.Compression.dgc(), optimizer=optimizer if given else None)
            loss = model(gradients(module, dist.get_rank(), 0))
            if momentum:
                expect(Exception, ["momentum=0.9", "compressor applies"], loss.backward)
            else:
                loss.backward()
                optimizer.step()


def sparse_misuse() -> None:
    """A sparse embedding is refused by register(); the hook itself, registered by hand,
    refuses the sparse bucket DDP gives it instead of letting each rank apply its own
    gradient (what it silently did: the ranks' embeddings drifted apart)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Embedding(100, 4, sparse=True), torch.nn.Flatten(),
                                 torch.nn.Linear(8, 2))
    expect(ValueError, ["['0']", "sparse=True"], lambda: ddp.register(ddp_model(module), hdgc.Compression.topk()))
    model = ddp_model(module)
    state = ddp.DDPCompressionState(hdgc.Compression.topk(), module.named_parameters(),
                                    DistTransport(model.process_group))
    model.register_comm_hook(state, ddp.hook)
    tokens = torch.randint(100, (4, 2), generator=torch.Generator().manual_seed(dist.get_rank()))
    expect(Exception, ["['0.weight'] is sparse"], lambda: model(tokens).sum().backward())


def unused_with_each_option(method: str) -> None:
    # The second layer: everyone, no rank, rank 0 only, no rank; never.
    unused(method, ((0, 1), (), (0,), ()), find_unused_parameters=True)
    unused(method, ((), (), ()), static_graph=True)


def join_with_and_without_unused(method: str) -> None:
    join(method)
    join(method, find_unused_parameters=True)


# The modes run once per method of --methods.
PER_METHOD = {"aggregate": aggregate, "complex": complex_aggregate, "subgroups": subgroups,
              "join": join_with_and_without_unused, "accumulate": accumulate, "checkpoint": checkpoint,
              "unused": unused_with_each_option}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("modes", help="comma-separated: aggregate, complex, subgroups, join, train, accumulate, "
                                      "checkpoint, misuse, unused, adaptive, compiled")
    parser.add_argument("--methods", default="topk,dgc")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--horovod", action="store_true",
                        help="train through the stock hvd.DistributedOptimizer (under horovodrun)")
    args = parser.parse_args()
    methods = args.methods.split(",")
    torch.set_num_threads(1)
    if args.horovod:
        import horovod.torch as hvd
        hvd.init()
        results: Dict[str, torch.Tensor] = {f"{m}/{d}": train_horovod(m, DTYPES[d], hvd)
                                             for m in methods for d in DTYPES}
        torch.save(results, args.out / f"horovod_rank{hvd.rank()}.pt")
        print(f"rank {hvd.rank()} horovod trained", flush=True)
        return
    dist.init_process_group("gloo")
    for mode in args.modes.split(","):
        if mode in PER_METHOD:
            for method in methods:
                PER_METHOD[mode](method)
        elif mode == "train":
            results = {f"{m}/{d}": train_ddp(m, DTYPES[d]) for m in methods for d in DTYPES}
            torch.save(results, args.out / f"ddp_rank{dist.get_rank()}.pt")
            print(f"rank {dist.get_rank()} ddp trained", flush=True)
        elif mode == "misuse":
            misuse()
        elif mode == "adaptive":
            adaptive()
        elif mode == "compiled":
            compiled(methods[0])
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    gc.collect()  # the DDP models, which hold the group, before the group (see amp_torch.py)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
