"""``horovod_dgc.torch.DistributedOptimizer``: the full method, with fused messages.

Same signature as ``hvd.DistributedOptimizer``. Against the stock path it adds:

* the wrapped SGD's momentum (and Nesterov flag and weight decay, where the method has them)
  move into a compressor that keeps momentum itself (and out of the optimizer), so momentum
  is never applied twice;
* compressed parameters form buckets fixed at construction (reverse registration order,
  about ``bucket_cap_mb`` of dense gradient each), each launched when its last gradient is
  ready. A method that is ``bucketed`` compresses a bucket as one (one memory pass, one
  selection, one message per dtype: :mod:`horovod_dgc.core.bucket`), sending of each tensor
  what the stock path sends of it; the others compress tensor by tensor and the bucket's
  messages share one collective per stage (the compressor's family says how) instead of one
  per tensor plus a placeholder all-reduce. The tensors that travel dense form buckets of
  their own the same way, one all-reduce per bucket and dtype;
* ``backward_passes_per_step``: gradients accumulate locally and compress once;
* ``sparse_as_dense``: as Horovod's, a sparse gradient is made dense (and then compressed).
"""
from __future__ import annotations

import dataclasses
import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import horovod.torch as hvd
import torch

from ..core.callers import caller_frames
from ..core.collectives import DEFAULT_BUCKET_CAP_MB, backward_buckets
from ..core.methods import spec_of
from .compression import (Compression, MethodCompressor, check_not_maximizing, check_optimizer_compatible,
                          check_plain_optimizer)
from .engine import DenseExchange, Engine

_MOVED_AT_CONSTRUCTION = ("keep it 0 after construction, when this DistributedOptimizer moved the "
                          "SGD's momentum and weight decay into the compressor")
# The key under which the optimizer's state_dict() carries this rank's compressor part.
COMPRESSOR_STATE_KEY = "horovod_dgc"


# id(parameter) -> (a weak reference to it, its hook's handle) for the newest fused optimizer
# built over it.
_HOOKS: Dict[int, Tuple[Any, Any]] = {}


def _hook_for_the_newest_optimizer(p: torch.nn.Parameter, hook: Callable) -> None:
    """Hook ``p`` for the optimizer being built, removing the hook of an older one built over
    it. An optimizer built again (after unfreezing layers, as the refusal below advises, or
    for a new phase of training) left the old hooks firing: both optimizers exchanged every
    gradient, under the same collective names, which Horovod refuses."""
    key = id(p)
    previous = _HOOKS.get(key)
    if previous is not None and previous[0]() is p:
        previous[1].remove()

    def forget(ref: Any) -> None:
        if _HOOKS.get(key, (None,))[0] is ref:
            del _HOOKS[key]

    _HOOKS[key] = (weakref.ref(p, forget), p.register_post_accumulate_grad_hook(hook))


class _FusedDistributedOptimizer(torch.optim.Optimizer):
    """Mixed into a subclass of the wrapped optimizer's class (Horovod's own pattern)."""

    def __init__(self, params, named_parameters: List[Tuple[str, torch.nn.Parameter]],
                 compression: MethodCompressor, backward_passes_per_step: int,
                 bucket_cap_mb: float, sparse_as_dense: bool):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._names: Dict[torch.nn.Parameter, str] = {p: n for n, p in named_parameters}
        self._params: List[torch.nn.Parameter] = [p for _, p in named_parameters if p.requires_grad]
        self.backward_passes_per_step = backward_passes_per_step
        self._buckets = self._make_buckets(bucket_cap_mb, compressed=True)
        self._bucket_of = {p: i for i, bucket in enumerate(self._buckets) for p in bucket}
        self._dense_buckets = self._make_buckets(bucket_cap_mb, compressed=False)
        self._dense_bucket_of = {p: i for i, bucket in enumerate(self._dense_buckets) for p in bucket}
        self._reset_step()
        self._should_synchronize = True
        self._synchronized = False
        for p in self._params:
            _hook_for_the_newest_optimizer(p, self._hook)

    # -- construction helpers ------------------------------------------------------------------------
    def _make_buckets(self, cap_mb: float, compressed: bool) -> List[List[torch.nn.Parameter]]:
        """The compressed parameters, or the others, in reverse registration order (roughly
        the order backward produces them), cut into buckets of about ``cap_mb`` dense
        megabytes."""
        engine = self._compression.engine
        params = [p for p in self._params if (engine.compresses(p) and not Engine.passes_through(p)) == compressed]
        return [list(bucket)
                for bucket in backward_buckets(params, [p.numel() * p.element_size() for p in params], cap_mb * 2 ** 20)]

    def _reset_step(self) -> None:
        """Ready for a new step: nothing submitted or in flight, every parameter's backward
        passes to count again."""
        self._delay = {p: self.backward_passes_per_step for p in self._params}
        self._ready: set = set()
        self._exchanges: Dict[int, object] = {}
        # A dense tensor waits in _dense_ready until its bucket is complete; the bucket then
        # sends one all-reduce per dtype.
        self._dense_ready: set = set()
        self._dense_exchanges: Dict[int, Tuple[Optional[DenseExchange], List[torch.nn.Parameter]]] = {}

    # -- per-parameter work as gradients become ready ------------------------------------------------
    def _hook(self, p: torch.nn.Parameter) -> None:
        if p not in self._delay:
            return
        if self._delay[p] <= 0:
            raise AssertionError("gradients were computed more than backward_passes_per_step "
                                 "times before step(); raise backward_passes_per_step")
        self._delay[p] -= 1
        self._synchronized = False
        if self._delay[p] == 0:
            self._submit(p)

    def _submit(self, p: torch.nn.Parameter) -> None:
        if not self._ready and not self._dense_ready:
            # The step's first gradient, before anything is launched: what moved into the
            # compressor at construction may have been set again in param_groups since, by a
            # scheduler that cycles momentum.
            check_plain_optimizer(self, self._compression.config, _MOVED_AT_CONSTRUCTION)
        if p.grad.is_sparse:
            if not self._sparse_as_dense:
                raise ValueError(f"parameter {self._names[p]!r} has a sparse gradient (an "
                                 "nn.Embedding(sparse=True)?): compression takes dense gradients; "
                                 "pass sparse_as_dense=True, as to Horovod's DistributedOptimizer, "
                                 "to compress it as a dense one")
            p.grad = p.grad.to_dense()
        if p in self._dense_bucket_of:
            self._dense_ready.add(p)
            bucket = self._dense_bucket_of[p]
            if all(q in self._dense_ready for q in self._dense_buckets[bucket]):
                self._dense_exchanges[bucket] = self._launch_dense(bucket)
            return
        self._ready.add(p)
        bucket = self._bucket_of[p]
        if all(q in self._ready for q in self._buckets[bucket]):
            members = self._buckets[bucket]
            self._exchanges[bucket] = self._compression.launch(
                self._label("bucket", members), [(self._names[q], q.grad, q) for q in members])

    def _label(self, kind: str, members: List[torch.nn.Parameter]) -> str:
        """A bucket's collective name: its first parameter's, which no other bucket of this
        optimizer or of another one in flight at once shares (Horovod's rule for its own
        names: unique parameter names, e.g. ``named_parameters(prefix=...)`` per model). A
        bucket's number would be the same in two optimizers stepping in one backward pass."""
        return f"{kind}.{self._names[members[0]]}"

    def _launch_dense(self, bucket: int) -> Tuple[Optional[DenseExchange], List[torch.nn.Parameter]]:
        """The bucket's dense tensors averaged as one flat tensor per dtype (the compressor's
        ``launch_dense``), under names that no step changes: Horovod negotiates every cycle
        over one bit per name it has seen, and one name per tensor made that several times
        larger. A tensor of zero elements has nothing to average (parameters are
        floating-point: complex ones are refused at construction)."""
        sent = [p for p in self._dense_buckets[bucket] if p.grad.numel()]
        exchange = self._compression.launch_dense(self._names[sent[0]], [(self._names[p], p.grad, p) for p in sent]
                                                  ) if sent else None
        return exchange, sent

    def _finish_dense(self) -> None:
        """Write every dense bucket's averaged gradients to ``.grad``."""
        for bucket in sorted(self._dense_exchanges):
            exchange, sent = self._dense_exchanges[bucket]
            if exchange is not None:
                torch._foreach_copy_([p.grad for p in sent], self._compression.finish_dense(exchange))

    def _finish_buckets(self) -> None:
        """Install every bucket's averaged gradients as ``.grad``: views of the bucket's buffer
        where the average was written over it (valid until the bucket's next exchange, as
        DDP's ``gradient_as_bucket_view``), so that no copy of the whole gradient is made."""
        for bucket in sorted(self._exchanges):
            grads = self._compression.finish(self._exchanges[bucket])
            for p, averaged in zip(self._buckets[bucket], grads):
                p.grad = averaged

    # -- Horovod's optimizer interface -------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every exchange of this step and write the averaged gradients to ``.grad``.
        A second call before ``step()`` does nothing: the gradients are averaged already
        (compressing them again would send the average once more)."""
        if self._synchronized:
            return
        unregistered = self._unregistered_gradients()
        if unregistered:
            # Finished first, so that no collective stays in flight under a name that a
            # rebuilt optimizer would use again (Horovod refuses a name in flight).
            self._finish_buckets()
            self._finish_dense()
            self._reset_step()
            raise ValueError(f"parameters {unregistered[:5]} have gradients but were frozen when "
                             f"the DistributedOptimizer was built (or added by add_param_group "
                             f"since), so nothing averages them and each rank would apply its own: "
                             f"build the optimizer again after unfreezing them (or set a stale "
                             f".grad to None)")
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self._delay[p] > 0 and p not in self._ready and p not in self._dense_ready:
                self._delay[p] = 0
                self._submit(p)
        self._finish_buckets()
        self._finish_dense()
        self._reset_step()
        self._compression.check_grad_scaler_use()  # with nothing left in flight
        self._compression.end_step()
        self._synchronized = True

    def abandon_step(self) -> None:
        """Forget a step that an elastic reset interrupted: the gradients submitted and the
        exchanges in flight (:class:`horovod_dgc.torch.elastic.TorchState` calls it). Without
        it the next ``zero_grad()`` finds the old step's gradients still waiting."""
        self._reset_step()
        self._synchronized = False
        self._compression.abandon_exchanges()

    def _unregistered_gradients(self) -> List[str]:
        """The parameters with a gradient but no hook: frozen when the optimizer was built (or
        added later by ``add_param_group``), their gradients would be applied unaveraged and
        the ranks would drift apart, silently."""
        return [self._names.get(p, f"param_groups[{i}][{j}]")
                for i, group in enumerate(self.param_groups) for j, p in enumerate(group["params"])
                if p.grad is not None and p not in self._delay]

    @contextmanager
    def skip_synchronize(self):
        """``optimizer.synchronize(); with optimizer.skip_synchronize(): optimizer.step()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if _stepped_by_horovods_state_broadcast():
            # It creates a new optimizer's state with a step of zero gradients, which it takes
            # locally on its own DistributedOptimizer; an exchange here would count as a
            # training step (the compressor's step counter, which turns leaders and warm-up).
            return super(self.__class__, self).step(closure)
        if self._should_synchronize:
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._ready or self._dense_ready:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize()")
        return super(self.__class__, self).zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {**self.wrapped_state_dict(), COMPRESSOR_STATE_KEY: self._compression.state_dict()}

    def wrapped_state_dict(self) -> dict:
        """The wrapped optimizer's own state, without this rank's compressor part (which
        ``state_dict()`` adds: a copy of every memory)."""
        return super(self.__class__, self).state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        compression_state = state_dict.pop(COMPRESSOR_STATE_KEY, None)
        super(self.__class__, self).load_state_dict(state_dict)
        if compression_state is not None:
            self._compression.load_state_dict(compression_state)


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is this module's ``DistributedOptimizer`` (a class made for each
    wrapped optimizer class, as Horovod makes its own)."""
    return type(optimizer).__dict__.get("synchronize") is _FusedDistributedOptimizer.__dict__["synchronize"]


def _stepped_by_horovods_state_broadcast() -> bool:
    """Whether ``hvd.broadcast_optimizer_state`` is on the call stack."""
    return any(frame.f_code is hvd.broadcast_optimizer_state.__code__ for frame in caller_frames())


def _move_sgd_hyperparameters(optimizer: torch.optim.Optimizer, compression: MethodCompressor,
                              named: List[Tuple[str, torch.nn.Parameter]]) -> MethodCompressor:
    """Make a compressor that keeps momentum itself (the method table's
    ``momentum_in_compressor``) apply the SGD's momentum, and its Nesterov flag and weight
    decay where the config has them; they are then zeroed in the optimizer. Parameter groups
    with different weight decays (none on norms and biases, say) keep theirs, per tensor.
    Other methods and optimizers are checked instead."""
    config = compression.config
    if not spec_of(compression.method).momentum_in_compressor or not isinstance(optimizer, torch.optim.SGD):
        check_optimizer_compatible(optimizer, config, hvd.Average)
        return compression
    fields = {f.name for f in dataclasses.fields(config)}
    keys = [key for key in ("momentum", "nesterov") if key in fields]
    values = {key: {g.get(key, 0.0) for g in optimizer.param_groups} for key in keys}
    for key, found in values.items():
        if len(found) > 1:
            raise ValueError(f"param_groups disagree on {key} ({sorted(found)}); "
                             f"{spec_of(compression.method).name} applies one {key} to every tensor")
    chosen = {key: found.pop() for key, found in values.items()}
    moved = {}
    if chosen["momentum"]:
        _check_momentum_form(optimizer, config, spec_of(compression.method).name,
                             settable_nesterov="nesterov" in fields)
        moved["momentum"] = float(chosen["momentum"])
        if "nesterov" in chosen:
            moved["nesterov"] = bool(chosen["nesterov"])
    if "weight_decay" in fields:
        names = {id(p): n for n, p in named}
        decays = {names[id(p)]: float(g.get("weight_decay", 0.0))
                  for g in optimizer.param_groups for p in g["params"] if id(p) in names}
        check_not_maximizing(optimizer, max(decays.values(), default=0.0))
        if len(set(decays.values())) > 1:
            compression.engine.set_weight_decays(decays)
        elif any(decays.values()):
            moved["weight_decay"] = next(iter(decays.values()))
    for group in optimizer.param_groups:
        group.update(momentum=0.0, nesterov=False)
        if "weight_decay" in fields:
            group["weight_decay"] = 0.0
    if moved:
        compression.reconfigure(**moved)
    return compression


def _check_momentum_form(optimizer: torch.optim.SGD, config, method: str,
                         settable_nesterov: bool) -> None:
    """Refuse (ValueError) a dampening, which no method's momentum applies; warn where the
    method's momentum has a fixed form other than the SGD's Nesterov flag (blocksign's is
    always Nesterov's, the paper's): the update then follows the method, not the SGD."""
    groups = optimizer.param_groups
    dampening = max(g.get("dampening", 0.0) for g in groups)
    if dampening:
        raise ValueError(f"the SGD has dampening={dampening}, which {method}'s momentum "
                         f"(u = m u + g) does not apply: moving its momentum into the compressor "
                         f"would change the update silently; use dampening=0")
    nesterov = {bool(g.get("nesterov", False)) for g in groups}
    if not settable_nesterov and nesterov != {config.nesterov}:
        warnings.warn(f"{method} applies the SGD's momentum as "
                      f"{'Nesterov' if config.nesterov else 'plain'} momentum, its only form, "
                      f"though the SGD has nesterov={sorted(nesterov)}; pass "
                      f"SGD(nesterov={config.nesterov}) to say so", stacklevel=4)


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
                         compression=Compression.none, backward_passes_per_step: int = 1,
                         op=hvd.Average, gradient_predivide_factor: float = 1.0,
                         sparse_as_dense: bool = False,
                         bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, **horovod_options):
    """Horovod's ``DistributedOptimizer`` with fused sparse exchange.

    Args are Horovod's; with a sparse ``compression`` (``Compression.dgc()`` and friends)
    the optimizer returned is this module's, else Horovod's own. ``bucket_cap_mb``: dense
    megabytes of gradient per fused allgather. ``sparse_as_dense``: a sparse gradient
    (``nn.Embedding(sparse=True)``) is made dense and compressed like any other; without it
    such a gradient is refused at the first backward pass, naming the parameter.
    """
    if not isinstance(compression, MethodCompressor):
        return hvd.DistributedOptimizer(optimizer, named_parameters=named_parameters,
                                        compression=compression,
                                        backward_passes_per_step=backward_passes_per_step, op=op,
                                        gradient_predivide_factor=gradient_predivide_factor,
                                        sparse_as_dense=sparse_as_dense, **horovod_options)
    if op != hvd.Average or gradient_predivide_factor != 1.0 or horovod_options:
        raise ValueError("sparse compression averages the gradients itself: it supports "
                         "op=hvd.Average, gradient_predivide_factor=1.0 and no other Horovod option "
                         f"(got op={op}, gradient_predivide_factor={gradient_predivide_factor}, "
                         f"{sorted(horovod_options)})")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
    named = _named_parameters(optimizer, named_parameters)
    compression = _move_sgd_hyperparameters(optimizer, compression, named)
    compression.bind(named)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_FusedDistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named, compression, backward_passes_per_step, bucket_cap_mb,
               sparse_as_dense)


def _named_parameters(optimizer: torch.optim.Optimizer,
                      named_parameters) -> List[Tuple[str, torch.nn.Parameter]]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return [(f"param.{i}", p) for i, p in enumerate(params)]
    named = list(named_parameters)
    known = {id(p) for _, p in named}
    unnamed = [i for i, p in enumerate(params) if id(p) not in known]
    if unnamed:
        raise ValueError(f"named_parameters misses {len(unnamed)} parameter(s) of the optimizer "
                         f"(positions {unnamed[:5]}...)")
    in_optimizer = {id(p) for p in params}
    named = [(n, p) for n, p in named if id(p) in in_optimizer]
    complex_named = [n for n, p in named if p.is_complex() and p.requires_grad]
    if complex_named:
        raise ValueError(f"parameters {complex_named[:5]} are complex: Horovod all-reduces no complex "
                         "tensor, so nothing could average their gradients; hold them as real pairs "
                         "(torch.view_as_real) in the model")
    return named
