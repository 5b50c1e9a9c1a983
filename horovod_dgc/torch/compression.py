"""``compression=`` for the stock ``hvd.DistributedOptimizer`` (unmodified Horovod).

Horovod calls ``compress(p.grad)`` on the autograd thread and all-reduces what it returns;
later ``decompress(result, ctx)`` on the caller's thread. A sparse compressor therefore
launches its own allgather of the message from ``compress`` (named after the parameter, so
ranks that reach tensors in different orders still match) and hands Horovod a one-element
placeholder; ``decompress`` waits for the allgather and rebuilds the averaged gradient.
A float32 gradient handed to ``compress`` is consumed: sent alone, its memory receives that
average; sent in a bucket, the average is a view of the bucket's buffer (either is what
``p.grad.set_`` then installs), which spares a gradient-size allocation or copy per step.

The family classes (:class:`SparseCompressor`, :class:`TwoStageCompressor`) run their
collectives through a transport: Horovod's by default, ``torch.distributed``'s when
:mod:`horovod_dgc.torch.ddp` registers the compressor as a DDP communication hook. The DDP
hook's users need not install Horovod: beyond its ``Compressor`` base class (where installed),
Horovod is imported where a Horovod path first needs it.
"""
from __future__ import annotations

import dataclasses
import gc
import itertools
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

try:
    from horovod.torch.compression import Compression as HorovodCompression
    from horovod.torch.compression import Compressor as HorovodCompressor
    HOROVOD_MISSING: Optional[ImportError] = None
except ImportError as error:  # the DDP hook needs no Horovod; the Horovod paths raise this
    HorovodCompression, HorovodCompressor, HOROVOD_MISSING = None, object, error

from ..core.adaptive import STATE_KEY, Adaptive
from ..core.bucket import Bucket
from ..core.callers import caller_frames, calling_object, values_among_callers
from ..core.collectives import ALLGATHER, ALLREDUCE, Transport, backward_buckets, join, joined_chunks, split
from ..core.config import keeping_yours
from ..core.controls import CompressorControls
from ..core.hosts import Hosts
from ..core.method import Method
from ..core.methods import METHODS, MethodSpec, spec_of
from ..core.one_worker import refuse_or_warn
from ..core.twostage import StageHandover
from .adaptive import AdaptiveExchanges
from .engine import DenseExchange, DenseUpdate, Engine, Entry, OutgoingMessage, in_entry_order
from .queue import Queued, StockQueue

if TYPE_CHECKING:  # imported by the hierarchical path only: it needs Horovod
    from .hierarchy import HostReductions

_NO_TRANSPORT = ("this compressor exchanges through Horovod unless it is registered as a DDP "
                 "communication hook, and {}: call hvd.init() before using it on a Horovod path, "
                 "or horovod_dgc.torch.ddp.register(model, compression) before any other use of "
                 "it (set_epoch, attach_grad_scaler, ...) under DDP")

NamedParameters = Iterable[Tuple[str, torch.nn.Parameter]]


class MethodCompressor(CompressorControls, HorovodCompressor):
    """A core method as a Horovod compressor (a subclass of Horovod's ``Compressor`` where
    Horovod is installed) and as the DDP hook's: what every horovod_dgc compressor shares.

    Args:
        method: the core method (config included).
        named_parameters: the model's ``named_parameters()``, used to key each tensor's
            memory by parameter name and to read parameters for weight decay. Optional: on
            the stock path the compressor takes the names ``hvd.DistributedOptimizer`` gave
            the parameters (yours, or its ``allreduce.noname.<group>.<index>``), the same on
            every rank. If given, pass a fresh ``model.named_parameters()``.
    """

    def __init__(self, method: Method, named_parameters: Optional[NamedParameters] = None,
                 adaptive: "bool | Adaptive" = False):
        self.method = method
        self.config = method.config
        self._params: Dict[str, torch.nn.Parameter] = {}
        self._by_grad: Dict[int, Tuple[str, torch.nn.Parameter]] = {}
        self._lock = threading.Lock()
        self._engine: Optional[Engine] = None
        self._optimizer_checked = False
        self._sparse_bypass_to_tell = False
        self._scaler_told = False
        self._scaler_checked = False
        self._one_worker_told = False
        # Stock path: the tensors exchanged since the newest backward pass, and whether their
        # averages went back (see _handed_over_again).
        self._exchanged: set = set()
        self._averages_delivered = False
        self._transport: Optional[Transport] = None
        self._host_reductions: Optional[HostReductions] = None
        self._queue: Optional[StockQueue] = None
        self._dense_queue: Optional[StockQueue] = None
        self._adaptive = AdaptiveExchanges(self, Adaptive.of(adaptive))
        if adaptive:
            method.require_bucketed()
        if named_parameters is not None:
            self.bind(named_parameters)

    # -- set-up ------------------------------------------------------------------------------
    def bind(self, named_parameters: NamedParameters) -> None:
        """Key the per-tensor memories by these parameter names. Bound again (an optimizer
        built anew over the same model), every name must stay on its parameter and some
        parameter must be the same: the memories belong to one model."""
        params = list(named_parameters)
        names = [name for name, _ in params]
        if len(set(names)) != len(names):
            raise ValueError("named_parameters holds duplicate names")
        if not params:
            raise ValueError("named_parameters is empty (a generator already consumed? pass a "
                             "fresh model.named_parameters())")
        self._check_same_model(dict(params))
        self._params = dict(params)

    def _check_same_model(self, params: Dict[str, torch.nn.Parameter]) -> None:
        """Raise ValueError if ``params`` are another model's than the bound ones."""
        if not self._params:
            return
        renamed = [name for name, p in params.items() if self._params.get(name, p) is not p]
        bound = {id(p) for p in self._params.values()}
        if renamed or not any(id(p) in bound for p in params.values()):
            named = f" ({renamed[:3]} name other tensors now)" if renamed else ""
            raise ValueError(f"this compressor is bound to another model's parameters already{named}: "
                             f"its memories are kept per parameter name, and two models (a GAN's "
                             f"generator and discriminator, say) would share them; give each "
                             f"optimizer (or DDP model) its own compressor (state_dict() and "
                             f"load_state_dict() carry memories over to a new one)")

    def reconfigure(self, **changes) -> None:
        """Replace settings of the method's config (validated again); only before training."""
        self.method = self.method.with_config(dataclasses.replace(self.config, **changes))
        self.config = self.method.config
        if self._engine is not None:
            self._engine.set_method(self.method)

    @property
    def transport(self) -> Transport:
        """Where this compressor's collectives run: Horovod's unless :meth:`use_transport`
        named another (:func:`horovod_dgc.torch.ddp.register` names ``torch.distributed``'s)."""
        if self._transport is None:
            if HOROVOD_MISSING is not None:
                raise ImportError(_NO_TRANSPORT.format(
                    f"Horovod cannot be imported ({HOROVOD_MISSING})")) from HOROVOD_MISSING
            from .collectives import HOROVOD, hvd
            if not hvd.is_initialized():
                raise ValueError(_NO_TRANSPORT.format("Horovod is not initialized"))
            self._transport = HOROVOD
        return self._transport

    def use_transport(self, transport: Transport) -> None:
        """Run this compressor's collectives through ``transport`` (Horovod's by default;
        :func:`horovod_dgc.torch.ddp.register` gives it ``torch.distributed``'s)."""
        if self.hierarchical:
            raise ValueError("a compressor built with hierarchical=True exchanges through "
                             "Horovod's process sets; build it without for a DDP hook")
        self._join(transport)

    def _join(self, transport: Transport) -> None:
        self._transport = transport
        if self._engine is not None:
            self._engine.join(transport.size(), transport.rank())

    def exchange_between_hosts(self, hosts: Hosts) -> None:
        """Average each compressed gradient densely inside the host first and run the method
        between hosts only (see :mod:`horovod_dgc.torch.hierarchy`); only before training."""
        from .hierarchy import HostReductions, HostTransport
        self._host_reductions = HostReductions(hosts)
        self._join(HostTransport(hosts))

    @property
    def hierarchical(self) -> bool:
        """Whether the method runs between hosts only (:meth:`exchange_between_hosts`)."""
        return self._host_reductions is not None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = Engine(self.method, world_size=self.transport.size(),
                                  rank=self.transport.rank())
        return self._engine

    def attach_grad_scaler(self, scaler: Optional["torch.amp.GradScaler"]) -> None:
        """Mixed precision: gradients arrive multiplied by ``scaler``'s current scale; the
        memories keep them unscaled (so that a change of scale does not change what they
        hold) and the averaged gradients go back scaled, as ``scaler.unscale_`` expects.
        Horovod's recipe then works unchanged (``optimizer.synchronize()``,
        ``scaler.unscale_(optimizer)``, ``with optimizer.skip_synchronize():
        scaler.step(optimizer)``, ``scaler.update()``). Without this call, the first step
        through Horovod's optimizer or ours refuses an enabled GradScaler found among its
        callers' variables; ``None`` says that no scaler scales these gradients (one that is
        there scales another loss)."""
        self._scaler_told = True
        self.engine.use_loss_scale(lambda: 1.0 if scaler is None else scaler.get_scale())

    def state_dict(self) -> dict:
        """This rank's memories, step counters and epoch, for checkpoints: save every rank's.
        With ``adaptive``, each bucket's mode too (under ``"adaptive"``)."""
        state = self.engine.state_dict()
        if self.adaptive is not None:
            state[STATE_KEY] = self._adaptive.switch.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore this rank's part (same method, config, world size and rank, and tensors
        of the same sizes; ValueError otherwise). A state without modes (saved without
        ``adaptive``) starts every bucket compressed."""
        with self._lock:
            # A complex parameter's memories are of its real view (the DDP hook's).
            numels = {name: p.numel() * (2 if p.is_complex() else 1) for name, p in self._parameters().items()}
        state = dict(state)
        modes = state.pop(STATE_KEY, None)
        self.engine.load_state_dict(state, numels)
        self._adaptive.restore(modes, max(state["steps"].values(), default=0))

    # -- the adaptive switch (horovod_dgc.core.adaptive) -------------------------------------------
    def force_mode(self, mode: Optional[str], labels: Optional[Sequence[str]] = None) -> None:
        """Hold buckets in ``mode`` (``"compressed"`` or ``"dense"``; None: back to the
        adaptive decisions, or compressed without ``adaptive``), from their next exchange;
        ``labels``: the buckets' collective names (None: every bucket exchanged so far).
        Call it with the same arguments on every rank, between steps."""
        if self.hierarchical:
            raise ValueError("bucket modes are not supported with hierarchical=True")
        if labels is None:
            labels = self._adaptive.labels
        self._adaptive.switch.force(mode, list(labels))

    def _parameters(self) -> Dict[str, torch.nn.Parameter]:
        """The named parameters; without ``named_parameters=``, those of the one
        ``hvd.DistributedOptimizer`` this compressor was given to. Caller holds the lock."""
        if not self._params:
            self.bind(_names_from_optimizer(self))
        return self._params

    # -- Horovod's interface -----------------------------------------------------------------------
    def _lookup(self, tensor: torch.Tensor) -> Tuple[str, torch.nn.Parameter]:
        with self._lock:
            entry = self._by_grad.get(id(tensor))
            if entry is None or entry[1].grad is not tensor:
                self._by_grad = {id(p.grad): (n, p) for n, p in self._parameters().items()
                                 if p.grad is not None}
                entry = self._by_grad.get(id(tensor)) or self._densified_from(tensor)
            if entry is None and any(p is tensor for p in self._params.values()):
                raise ValueError("compress() got a parameter, not its gradient: Horovod's "
                                 "DistributedOptimizer with op=hvd.Adasum hands the compressor "
                                 "each parameter's change after a local step; horovod_dgc "
                                 "compressors average gradients: use op=hvd.Average")
        if entry is None:
            raise ValueError(f"compress() got a tensor of shape {tuple(tensor.shape)} that is not "
                             f"the .grad of any parameter in named_parameters (nor the dense form "
                             f"of exactly one parameter's sparse .grad)")
        return entry

    def _densified_from(self, tensor: torch.Tensor) -> Optional[Tuple[str, torch.nn.Parameter]]:
        """The parameter whose sparse gradient ``tensor`` is the dense form of: Horovod's
        ``sparse_as_dense=True`` hands compress() ``p.grad.to_dense()``, a new tensor. Values
        decide only between sparse gradients of the same shape. Caller holds the lock."""
        matches = [(n, p) for n, p in self._parameters().items()
                   if p.grad is not None and p.grad.is_sparse and p.grad.shape == tensor.shape]
        if len(matches) > 1:
            matches = [(n, p) for n, p in matches if torch.equal(p.grad.to_dense(), tensor)]
        return matches[0] if len(matches) == 1 else None

    def compress(self, tensor: torch.Tensor):
        # Before Horovod is handed anything of the step, even a tensor that passes through: a
        # peer that refused first has shut Horovod down, and a Horovod call failing on that
        # reads to elastic as a recoverable reset (the driver then waits for hosts).
        self._check_place_in_the_world()
        if Engine.passes_through(tensor):
            return tensor, None
        if not self._optimizer_checked:
            # Before anything is launched: a refusal at decompress left this step's
            # collectives in flight under names that a rebuilt optimizer uses again.
            self._check_wrapping_optimizer()
        name, param = self._lookup(tensor)
        if self._handed_over_again(name):
            return tensor.new_zeros(1, dtype=torch.float32), AlreadyAveraged(tensor)
        compressed = self.engine.compresses(tensor)
        queue = self._stock_queue() if compressed else self._dense_stock_queue()
        if queue is not None and queue.takes(name):
            exchange = queue.add(name, tensor, param)
        elif compressed:
            exchange = self.launch(name, [(name, tensor, param)])
        else:
            update = self.engine.dense(name, tensor, param)
            return update.tensor, update
        # float32 whatever the gradient's dtype: Horovod all-reduces no bfloat16.
        return tensor.new_zeros(1, dtype=torch.float32), exchange

    def _stock_queue(self) -> Optional[StockQueue]:
        """The stock path's buckets (:mod:`.queue`), for a method whose tensors compress as
        one (``bucketed``) outside the hierarchical mode: the compressed parameters cut as
        ``collectives.backward_buckets`` says."""
        if self._queue is None and self.method.bucketed and not self.hierarchical:
            self._queue = StockQueue(self._stock_buckets(compressed=True), self.launch, self.finish)
        return self._queue

    def _dense_stock_queue(self) -> Optional[StockQueue]:
        """The stock path's buckets of the tensors the method sends dense, for a method that
        takes them as one (``dense_bucketed``), as the fused path sends them."""
        if self._dense_queue is None and self.method.dense_bucketed and not self.hierarchical:
            self._dense_queue = StockQueue(self._stock_buckets(compressed=False), self.launch_dense, self.finish_dense)
        return self._dense_queue

    def _stock_buckets(self, compressed: bool) -> List[Tuple[str, ...]]:
        """The names of the parameters that are (or are not) compressed, cut as
        ``collectives.backward_buckets`` says."""
        with self._lock:
            params = [(n, p) for n, p in self._parameters().items() if p.requires_grad
                      and not Engine.passes_through(p) and self.engine.compresses(p) == compressed]
        return backward_buckets([n for n, _ in params], [p.numel() * p.element_size() for _, p in params])

    def decompress(self, tensor: torch.Tensor, ctx) -> torch.Tensor:
        self.check_grad_scaler_use()
        if self._sparse_bypass_to_tell:
            self._sparse_bypass_to_tell = False
            self._warn_of_sparse_gradients()
        self._averages_delivered = True
        if ctx is None:
            return tensor
        if isinstance(ctx, AlreadyAveraged):
            return ctx.tensor
        if isinstance(ctx, DenseUpdate):
            return self.engine.dense_received(ctx, tensor)
        if isinstance(ctx, Queued):
            averaged = ctx.queue.result(ctx)
            self.engine.record_allreduce(ctx.bucket.exchange.step, tensor.element_size())
            return averaged
        averaged = self.finish(ctx)[0]
        self.engine.record_allreduce(ctx.step, tensor.element_size())
        return averaged

    def _handed_over_again(self, name: str) -> bool:
        """Whether Horovod hands ``name``'s gradient over again, already averaged:
        ``optimizer.step()`` after ``optimizer.synchronize()`` without ``skip_synchronize()``
        synchronizes a second time (Horovod warns of the time it costs), and compressing the
        average as a new gradient would put it into the memories twice and advance the step
        counters twice. A call from a backward hook starts a new step; so does an optimizer
        step (registered by the first compress)."""
        synchronizing = _called_by_synchronize()
        with self._lock:
            if not synchronizing and self._averages_delivered:
                self._forget_the_exchanged()
            if synchronizing and name in self._exchanged:
                return True
            self._exchanged.add(name)
        return False

    def _end_stock_step(self, *_hook_arguments: Any) -> None:
        """The stock optimizer stepped: every exchange of the step is finished."""
        self.end_step()

    def _forget_the_exchanged(self, *_hook_arguments: Any) -> None:
        self._exchanged.clear()
        self._averages_delivered = False

    def _buckets(self, label: str, entries: Sequence[Entry]) -> List[Tuple[Bucket, List[int]]]:
        """The buckets of ``entries`` for a method that is ``bucketed``: one per dtype (in the
        order of their first tensors, named after ``label``), each with its members' places
        among the entries."""
        by_dtype: Dict[torch.dtype, List[int]] = {}
        for i, (_, grad, _) in enumerate(entries):
            by_dtype.setdefault(grad.dtype, []).append(i)
        return [(self.engine.bucket(label if len(by_dtype) == 1 else f"{label}.{str(dtype).replace('torch.', '')}",
                                    [entries[i][:2] for i in members]), members)
                for dtype, members in by_dtype.items()]

    # -- an exchange: one tensor (stock path) or a bucket (fused path) -----------------------
    def launch(self, label: str, entries: Sequence[Entry]):
        """Start exchanging the compressed tensors ``entries`` through collectives named
        after ``label`` (identical on every rank); returns the exchange for :meth:`finish`."""
        self._check_place_in_the_world()
        if self.hierarchical:
            return self._host_reductions.launch(label, entries)
        if self._adaptive.dense(label):
            return self._adaptive.launch(label, entries)
        # Every label is noted (force_mode holds them all); its buckets where decisions need them.
        self._adaptive.note(label, [bucket for bucket, _ in self._buckets(label, entries)]
                            if self.adaptive is not None else [], entries[0][1].device)
        return self._launch(label, entries)

    def launch_dense(self, label: str, entries: Sequence[Entry]) -> DenseExchange:
        """Start averaging ``entries``, tensors the method sends dense: one all-reduce per
        dtype where the method takes them as one (``Engine.dense_all``), named after ``label``
        (identical on every rank); :meth:`finish_dense` ends it."""
        self._check_place_in_the_world()
        return self.launch_updates("dense", self.engine.dense_all(label, entries))

    def launch_updates(self, kind: str, updates: Sequence[Tuple[DenseUpdate, List[int]]]) -> DenseExchange:
        """The averaging all-reduce of each ``(update, its tensors' places)``, named
        ``kind.`` and the update's name."""
        transport = self._dense_transport
        return DenseExchange([(transport.launch(ALLREDUCE, update.tensor, f"{kind}.{update.name}"), update, places)
                              for update, places in updates], self.engine.steps_taken - 1)

    def finish_dense(self, exchange: DenseExchange) -> List[torch.Tensor]:
        """The averages of a :class:`DenseExchange`'s tensors, in its entries' order."""
        places, averaged = [], []
        for handle, update, members in exchange.launched:
            averaged += self.engine.dense_all_received(update, self._dense_transport.wait(handle))
            places += members
        return in_entry_order(places, averaged)

    @property
    def _dense_transport(self) -> Transport:
        """Where tensors sent dense are averaged: among every worker. The hierarchical mode's
        transport runs the method between hosts only, on host averages it takes itself."""
        if self.hierarchical:
            from .collectives import HOROVOD
            return HOROVOD
        return self.transport

    def _check_place_in_the_world(self) -> None:
        """The memories, the step counters and the message layouts belong to the world the
        engine joined: a world resized by an elastic reset that did not go through
        :class:`horovod_dgc.torch.elastic.TorchState` would be read as malformed messages.
        A compressor without an engine yet belongs to the world it first exchanges in."""
        engine = self._engine
        if engine is None:
            return
        transport = self.transport
        if (transport.size(), transport.rank()) != (engine.world_size, engine.rank):
            raise RuntimeError(
                f"this compressor joined as rank {engine.rank} of {engine.world_size} workers, but "
                f"this is now rank {transport.rank()} of {transport.size()} (an elastic reset?): its "
                f"memories belong to the old world; commit them with "
                f"horovod_dgc.torch.elastic.TorchState(model, optimizer, compression=...), which "
                f"redistributes them at every reset")

    def finish(self, exchange) -> List[torch.Tensor]:
        """The averaged gradients of an exchange's tensors, shaped like them."""
        started = time.perf_counter()
        try:
            if isinstance(exchange, DenseExchange):
                return self.finish_dense(exchange)
            return self._finish_exchange(exchange)
        finally:
            self._adaptive.exchanged(time.perf_counter() - started)

    def _finish_exchange(self, exchange) -> List[torch.Tensor]:
        if not self.hierarchical:
            return self._finish(exchange)
        if exchange.exchange is None:
            self._host_reductions.start_exchanges(self._launch)
        return [averaged.to(dtype) for averaged, dtype
                in zip(self._finish(exchange.exchange), exchange.dtypes)]

    def _launch(self, label: str, entries: Sequence[Entry]):
        """The family's exchange of ``entries`` through ``self.transport``."""
        raise NotImplementedError

    def _finish(self, exchange) -> List[torch.Tensor]:
        raise NotImplementedError

    def abandon_exchanges(self) -> None:
        """Forget the exchanges of a step interrupted by an elastic reset, and the memories
        that step computed."""
        if self.hierarchical:
            self._host_reductions.forget()
            self.transport.forget()
        for queue in (self._queue, self._dense_queue):
            if queue is not None:
                queue.forget()
        self.engine.abandon_step()
        self._forget_the_exchanged()

    # -- guarding against a loss scale unknown to the memories ------------------------------------
    def check_grad_scaler_use(self, every_thread: bool = False) -> None:
        """Raise ValueError, once (the first step's ``synchronize()`` on the caller's thread,
        or the DDP hook's first bucket with ``every_thread``: the hook may run on the autograd
        engine's thread while the training loop waits in ``backward()`` on another), for a
        ``GradScaler`` used in a way that silently changes the training:

        - the averaging ran inside ``scaler.step(optimizer)`` (PyTorch's recipe, not
          Horovod's): the scaler had unscaled and checked the gradients before they were
          averaged, so the step applies the average still scaled;
        - an enabled scaler among the callers' variables was not given to
          :meth:`attach_grad_scaler`: the memories would keep its scaled gradients, and every
          change of its scale would multiply what they owe."""
        if self._scaler_checked:
            return
        self._scaler_checked = True
        running, found = _grad_scalers_among_callers(every_thread)
        if running is not None:
            raise ValueError(
                "the gradients were averaged inside scaler.step(optimizer), after the scaler had "
                "unscaled and checked them locally: the step would apply the average still "
                "scaled; use Horovod's recipe: optimizer.synchronize(); scaler.unscale_(optimizer); "
                "with optimizer.skip_synchronize(): scaler.step(optimizer)")
        if found is not None and not self._scaler_told:
            raise ValueError(
                f"a GradScaler (scale {found.get_scale()}) scales the loss, but this compressor "
                f"was not told: its memories would keep scaled gradients and every change of "
                f"scale would multiply what they owe; call compression.attach_grad_scaler(scaler) "
                f"before training (or attach_grad_scaler(None) if that scaler scales another loss)")

    # -- guarding against momentum applied twice -------------------------------------------------
    def _check_wrapping_optimizer(self) -> None:
        """Refuse an hvd.DistributedOptimizer around an optimizer that would apply momentum
        or weight decay a second time, or an op other than Average (best effort: the
        optimizer is found through the garbage collector's referrers). Once: compress runs on
        each device's autograd thread, and a second check would hook the step twice."""
        import horovod.torch as hvd
        with self._lock:
            if self._optimizer_checked:
                return
            self._optimizer_checked = True
        for optimizer in _optimizers_holding(self):
            check_optimizer_compatible(optimizer, self.config, getattr(optimizer, "op", hvd.Average))
            optimizer.register_step_post_hook(self._forget_the_exchanged)
            optimizer.register_step_post_hook(self._end_stock_step)
            process_set = getattr(optimizer, "process_set", hvd.global_process_set)
            if process_set is not hvd.global_process_set and process_set.size() != hvd.size():
                raise ValueError(
                    f"horovod_dgc compressors exchange among all {hvd.size()} workers; the "
                    f"optimizer was given a process set of {process_set.size()}: use the "
                    f"global process set (process sets are not supported)")
            # Said at the first decompress, when every gradient of the step exists.
            self._sparse_bypass_to_tell |= not getattr(optimizer, "sparse_as_dense", True)

    def _warn_of_sparse_gradients(self) -> None:
        """Horovod sends a sparse gradient by an allgather of its own, never through
        compress(): say which parameters travel so, uncompressed."""
        with self._lock:
            sparse = [n for n, p in self._parameters().items() if p.grad is not None and p.grad.is_sparse]
        if sparse:
            warnings.warn(f"the sparse gradients of {sparse} bypass the compressor: Horovod sends "
                          f"them uncompressed by a sparse allgather of its own; pass "
                          f"sparse_as_dense=True to hvd.DistributedOptimizer to compress them",
                          stacklevel=2)


@dataclass
class SparseExchange:
    """A sparse exchange in flight: the allgather, the messages it carries, and for each
    averaged gradient the place of its entry (None: the entries' order)."""

    handle: Any
    outgoing: List[OutgoingMessage]
    places: Optional[List[int]] = None

    @property
    def step(self) -> int:
        return self.outgoing[0].step


class SparseCompressor(MethodCompressor):
    """The sparse family (DGC, Top-k, Gaussian-k): one allgather of every tensor's (index,
    value) message, named after the parameter or the bucket. Several tensors of a method
    that is ``bucketed`` travel as one message per dtype (``Engine.compress_bucket``)."""

    def _launch(self, label: str, entries: Sequence[Entry]) -> SparseExchange:
        places = None
        if self.method.bucketed and len(entries) > 1:
            outgoing, places = self._compress_buckets(label, entries)
        else:
            outgoing = [self.engine.compress(name, grad, param) for name, grad, param in entries]
        transport = self.transport
        message = join(self.engine.ops, ALLGATHER, [o.message for o in outgoing], transport.size())
        return SparseExchange(transport.launch(ALLGATHER, message, label), outgoing, places)

    def _compress_buckets(self, label: str, entries: Sequence[Entry]) -> Tuple[List[OutgoingMessage], List[int]]:
        """One message per bucket of :meth:`_buckets`, and the place of each of their tensors
        among the entries."""
        outgoing, places = [], []
        for bucket, members in self._buckets(label, entries):
            outgoing.append(self.engine.compress_bucket(bucket, [entries[i][1] for i in members],
                                                        [entries[i][2] for i in members]))
            places += members
        return outgoing, places

    def _finish(self, exchange: SparseExchange) -> List[torch.Tensor]:
        averaged = self.engine.decompress(self.transport.wait(exchange.handle), exchange.outgoing)
        return averaged if exchange.places is None else in_entry_order(exchange.places, averaged)


@dataclass
class TwoStageExchange:
    """A two-stage exchange in flight: each tensor's (or bucket's) handover, and the two
    collectives. ``buckets``: for buckets, each one's members' shapes and places among the
    entries (``names`` and ``shapes`` are then the buckets' keys and flat shapes)."""

    label: str
    names: List[str]
    handovers: List[StageHandover]
    shapes: List[torch.Size]
    first: Any
    sizes: List[int]
    second: Optional[Any] = None
    second_sizes: List[int] = field(default_factory=list)
    buckets: Optional[List[Tuple[Bucket, Tuple[torch.Size, ...], List[int]]]] = None

    @property
    def step(self) -> int:
        return self.handovers[0].call.step


class TwoStageCompressor(MethodCompressor):
    """The two-stage family (ScaleCom, blocksign).

    ``launch`` runs stage 1 of every tensor and launches one FIRST collective without
    waiting. The first ``finish`` of a step waits for every pending stage 1 and launches every
    stage 2, in label order, before it waits for any stage 2: ranks that finish exchanges in
    different orders never wait on a collective another rank has not launched.
    """

    def __init__(self, method: Method, named_parameters: Optional[NamedParameters] = None,
                 adaptive: "bool | Adaptive" = False):
        super().__init__(method, named_parameters, adaptive)
        self._in_flight: Dict[str, TwoStageExchange] = {}

    def _launch(self, label: str, entries: Sequence[Entry]) -> TwoStageExchange:
        firsts, buckets = [], None
        if self.method.bucketed and len(entries) > 1:
            buckets = [(bucket, tuple(entries[i][1].shape for i in members), members)
                       for bucket, members in self._buckets(label, entries)]
            for bucket, _, members in buckets:
                firsts.append((bucket.key, torch.Size([bucket.numel]), *self.engine.first_bucket(
                    bucket, [entries[i][1] for i in members], [entries[i][2] for i in members])))
        else:
            firsts = [(name, grad.shape, *self.engine.first(name, grad, param)) for name, grad, param in entries]
        ops, method, transport = self.engine.ops, self.method, self.transport
        messages = [message for _, _, message, _ in firsts]
        handovers = [handover for _, _, _, handover in firsts]
        chunks, world = [h.chunks for h in handovers], transport.size()
        handle = transport.launch(method.FIRST, join(ops, method.FIRST, messages, world, chunks),
                                  f"1.{label}", method.root(handovers[0].call),
                                  joined_chunks(ops, method.FIRST, messages, world, chunks))
        exchange = TwoStageExchange(label, [name for name, _, _, _ in firsts], handovers,
                                    [shape for _, shape, _, _ in firsts], handle,
                                    [m.numel() for m in messages], buckets=buckets)
        with self._lock:
            self._in_flight[label] = exchange
        return exchange

    def abandon_exchanges(self) -> None:
        with self._lock:
            self._in_flight.clear()
        super().abandon_exchanges()

    def launch_second_stages(self) -> None:
        """Stage 2 of every exchange whose stage 1 is in flight, in label order."""
        with self._lock:
            waiting = sorted((x for x in self._in_flight.values() if x.second is None),
                             key=lambda x: x.label)
        ops, method, transport = self.engine.ops, self.method, self.transport
        for exchange in waiting:
            received = split(ops, method.FIRST, transport.wait(exchange.first), exchange.sizes,
                             transport.size(), exchange.names, transport.rank(),
                             [h.chunks for h in exchange.handovers])
            messages = [self.engine.second(name, r, h) for name, r, h
                        in zip(exchange.names, received, exchange.handovers)]
            exchange.second_sizes = [m.numel() for m in messages]
            exchange.second = transport.launch(
                method.SECOND, join(ops, method.SECOND, messages, transport.size()),
                f"2.{exchange.label}", method.root(exchange.handovers[0].call))

    def _finish(self, exchange: TwoStageExchange) -> List[torch.Tensor]:
        if exchange.second is None:
            self.launch_second_stages()
        with self._lock:
            self._in_flight.pop(exchange.label, None)
        received = split(self.engine.ops, self.method.SECOND, self.transport.wait(exchange.second),
                         exchange.second_sizes, self.transport.size(), exchange.names)
        if exchange.buckets is None:
            return [self.engine.finish(r, h, shape) for r, h, shape
                    in zip(received, exchange.handovers, exchange.shapes)]
        updates, places = [], []
        for r, h, (bucket, shapes, members) in zip(received, exchange.handovers, exchange.buckets):
            updates += self.engine.finish_bucket(r, h, bucket, shapes)
            places += members
        return in_entry_order(places, updates)


@dataclass(frozen=True)
class AlreadyAveraged:
    """compress()'s ctx for a gradient Horovod hands over again, already averaged: it goes
    back as it is (Horovod all-reduces a one-element placeholder instead)."""

    tensor: torch.Tensor


def _called_by_synchronize() -> bool:
    """Whether compress() runs inside Horovod's ``synchronize()`` rather than a backward
    hook: among its three callers above compress (Horovod's ``_allreduce_grad_async`` or
    ``_grouped_allreduce_grad_async``, their caller, and one more); the first three frames
    are this function, _handed_over_again and compress."""
    return any(frame.f_code.co_name == "synchronize" for frame in itertools.islice(caller_frames(), 6))


def _grad_scalers_among_callers(every_thread: bool) -> Tuple[Optional["torch.amp.GradScaler"],
                                                             Optional["torch.amp.GradScaler"]]:
    """(the GradScaler one of whose methods is among the callers, an enabled GradScaler among
    the callers' variables: :func:`~horovod_dgc.core.callers.values_among_callers`, with
    ``every_thread`` those of every thread's frames), each None if none."""
    running = calling_object(lambda owner: isinstance(owner, torch.amp.GradScaler))
    found = next((value for value in values_among_callers(every_thread)
                  if isinstance(value, torch.amp.GradScaler) and value.is_enabled()), None)
    return running, found


def _optimizers_holding(compressor: MethodCompressor):
    """The optimizers whose ``_compression`` is ``compressor`` (found through the GC)."""
    for ref in gc.get_referrers(compressor):
        owners = [ref]
        if isinstance(ref, dict) and ref.get("_compression") is compressor:
            owners = [o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref]
        for owner in owners:
            if isinstance(owner, torch.optim.Optimizer) and getattr(owner, "_compression", None) is compressor:
                yield owner


def _names_from_optimizer(compressor: MethodCompressor) -> List[Tuple[str, torch.nn.Parameter]]:
    """The (name, parameter) pairs of the one Horovod optimizer holding ``compressor``;
    ValueError when there is none (compress() called directly) or several."""
    holders = [o for o in _optimizers_holding(compressor) if hasattr(o, "_parameter_names")]
    factory = f"Compression.{spec_of(compressor.method).name}"
    if len(holders) > 1:
        raise ValueError(f"{len(holders)} optimizers share one {factory} compressor, whose "
                         f"memories are per parameter: give each optimizer its own compressor")
    if not holders:
        raise ValueError(f"{type(compressor.method).__name__} keeps a memory per tensor and finds "
                         f"the parameters through the hvd.DistributedOptimizer it is given to; "
                         f"used on its own it needs them: {factory}"
                         f"(named_parameters=model.named_parameters(), ...)")
    # In the optimizer's order (registration order), which the stock path's buckets follow.
    names = holders[0]._parameter_names
    return [(names[p], p) for group in holders[0].param_groups for p in group["params"] if p in names]


def check_optimizer_compatible(optimizer: torch.optim.Optimizer, config, op) -> None:
    """Raise ValueError if ``optimizer`` would apply what the compressor already applies:
    with a config that :attr:`~horovod_dgc.core.CompressionConfig.needs_plain_optimizer`
    (DGC's momentum correction, blocksign's momentum), any optimizer with state of its own
    (momentum, adaptive moments: Adam, AdamW, RMSprop, Adagrad, ...) applies momentum twice."""
    import horovod.torch as hvd
    if op != hvd.Average:
        raise ValueError("horovod_dgc compressors average the gradients: use op=hvd.Average")
    check_plain_optimizer(optimizer, config)


def _local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that applies the updates: a ``ZeroRedundancyOptimizer`` is judged by the
    one it builds over this rank's shard (``optimizer_class``), which holds the settings."""
    # Not imported here: importing it scripts PyTorch's functional optimizers (about a second).
    # An optimizer can only be one if the user's code imported it.
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return optimizer.optim
    return optimizer


def check_plain_optimizer(optimizer: torch.optim.Optimizer, config,
                          instead: str = "use horovod_dgc.torch.DistributedOptimizer, which moves "
                                         "SGD's momentum and weight decay into the compressor") -> None:
    """Raise ValueError if ``optimizer`` would apply momentum or weight decay that a config
    which :attr:`~horovod_dgc.core.CompressionConfig.needs_plain_optimizer` applies already
    (the rule of every path: stock, fused, DDP). ``instead``: the way out named last."""
    if not config.needs_plain_optimizer:
        return
    optimizer = _local_optimizer(optimizer)
    kind = type(optimizer).__name__
    if not isinstance(optimizer, torch.optim.SGD):
        raise ValueError(
            f"the compressor applies momentum itself ({type(config).__name__} momentum="
            f"{config.momentum}), but the wrapped optimizer {kind} keeps state of its own "
            f"(momentum or adaptive moments) and would apply it a second time: use "
            f"torch.optim.SGD(momentum=0), or a method that keeps a plain residual (topk, "
            f"gaussiank, scalecom), which works under any optimizer")
    check_not_maximizing(optimizer, getattr(config, "weight_decay", 0.0))
    for key in ("momentum", "weight_decay"):
        mine = getattr(config, key, 0.0)
        theirs = [g.get(key, 0.0) for g in optimizer.param_groups]
        if mine and any(theirs):
            setter = (" (a scheduler may have set it: OneCycleLR and CyclicLR cycle momentum "
                      "unless given cycle_momentum=False)" if key == "momentum" else "")
            nesterov = any(g.get("nesterov", False) for g in optimizer.param_groups)
            raise ValueError(
                f"the wrapped optimizer has {key}={max(theirs)}{setter} but the compressor "
                f"applies {key}={mine} itself: give the optimizer {key}=0 (the compressor "
                f"applies it){keeping_yours(config, key, set(theirs), nesterov)}, or {instead}")
    decays = [g.get("weight_decay", 0.0) for g in optimizer.param_groups]
    if hasattr(config, "weight_decay") and config.momentum and any(decays):
        # torch's SGD adds its weight decay to the gradient before its momentum; left there
        # while the compressor keeps the momentum, it would act outside it: 1 / (1 - m)
        # times weaker in steady state than in the SGD the user started from.
        raise ValueError(
            f"the wrapped optimizer has weight_decay={max(decays)}, which torch's SGD adds to "
            f"the gradient before its momentum; the compressor applies the momentum "
            f"(momentum={config.momentum}), so that decay would act outside it, "
            f"{1 / (1 - config.momentum):.3g}x weaker than in SGD(momentum={config.momentum}): "
            f"give the compressor weight_decay={max(decays)} and the optimizer weight_decay=0, "
            f"or {instead}")


def check_not_maximizing(optimizer: torch.optim.Optimizer, weight_decay: float) -> None:
    """Raise ValueError if a parameter group of ``optimizer`` has ``maximize=True`` while the
    compressor adds ``weight_decay`` to the gradient: the SGD negates what it is given, the
    decay included, which would then push the parameters away from zero (torch's SGD adds
    its decay after negating). Momentum alone is unaffected: it is linear in the gradient."""
    groups = _local_optimizer(optimizer).param_groups
    if weight_decay and any(g.get("maximize", False) for g in groups):
        raise ValueError(f"the optimizer has maximize=True, but the compressor adds weight_decay="
                         f"{weight_decay} to the gradient before the optimizer negates it, which "
                         f"would grow the parameters instead of decaying them: minimize the "
                         f"negated objective with maximize=False instead")


COMPRESSORS = {"sparse": SparseCompressor, "two-stage": TwoStageCompressor}


def _workers() -> Optional[int]:
    """The number of workers, once Horovod or ``torch.distributed`` is set up (what
    ``aggregation="auto"`` picks by)."""
    hvd = sys.modules.get("horovod.torch")  # not imported: not initialized either
    if hvd is not None and hvd.is_initialized():
        return hvd.size()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return None


_ONE_WORKER_INSTEAD = ("horovod_dgc.torch.DistributedOptimizer runs the method on any number of "
                      "workers; or train a one-worker run without the compressor")
_SKIPPED_WATCH: List[Any] = []  # the handle of the step pre-hook, once registered


def _refuse_a_skipped_compressor(optimizer: torch.optim.Optimizer, *_hook_arguments: Any) -> None:
    """A step pre-hook of every optimizer (torch's global one): refuse or warn of (see
    :mod:`~horovod_dgc.core.one_worker`) one of our compressors held by Horovod's own
    ``DistributedOptimizer`` on one worker, where Horovod registers no hooks (its condition:
    one worker and not elastic) and the compressor never runs."""
    optimizers = sys.modules.get("horovod.torch.optimizer")  # not imported: no such optimizer
    compression = getattr(optimizer, "_compression", None)
    if (optimizers is not None and isinstance(compression, MethodCompressor)
            and not compression._one_worker_told
            and getattr(type(optimizer), "synchronize", None) is optimizers._DistributedOptimizer.synchronize
            and sys.modules["horovod.torch"].size() == 1 and os.environ.get("HOROVOD_ELASTIC") != "1"):
        refuse_or_warn(compression.config, "DistributedOptimizer", _ONE_WORKER_INSTEAD)
        compression._one_worker_told = True


def _watch_for_skipped_compressors() -> None:
    if not _SKIPPED_WATCH:
        _SKIPPED_WATCH.append(register_optimizer_step_pre_hook(_refuse_a_skipped_compressor))


def _factory(spec: MethodSpec) -> Callable[..., MethodCompressor]:
    def factory(named_parameters: Optional[NamedParameters] = None, hierarchical: bool = False,
                adaptive: "bool | Adaptive" = False, **options) -> MethodCompressor:
        _watch_for_skipped_compressors()
        if hierarchical and adaptive:
            raise ValueError("adaptive=True is not supported with hierarchical=True yet")
        hosts = None
        if hierarchical:
            from .hierarchy import find_hosts
            hosts = find_hosts()
        method = spec.build(_workers() if hosts is None else hosts.count, **options)
        compressor = COMPRESSORS[method.family](method, named_parameters, adaptive)
        if hosts is not None:
            compressor.exchange_between_hosts(hosts)
        return compressor

    factory.__name__ = spec.name
    factory.__doc__ = (spec.factory_doc + " ``adaptive=True`` (or an "
                       ":class:`~horovod_dgc.core.adaptive.Adaptive`): each bucket goes dense where "
                       "that is predicted faster (docs/algorithms.md#adaptive).")
    return factory


class _HorovodOwnCompressor:
    """One of Horovod's own compressors on :class:`Compression`; where Horovod is missing,
    reading it raises."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, instance: Any, owner: type) -> Any:
        if HOROVOD_MISSING is not None:
            raise ImportError(f"Compression.{self._name} is Horovod's own compressor "
                              f"({HOROVOD_MISSING}); under DDP use DDP's own hooks "
                              f"(torch.distributed.algorithms.ddp_comm_hooks)") from HOROVOD_MISSING
        return getattr(HorovodCompression, self._name)


class Compression:
    """Horovod's ``Compression`` namespace plus every method of the table
    (:mod:`horovod_dgc.core.methods`): ``Compression.dgc(...)``, ``Compression.topk(...)``, ...

    ``none`` and ``fp16`` are Horovod's own. The factories take ``named_parameters=`` (the
    model's ``named_parameters()``) and the method's options by name; every default lives in
    the method's config class (:class:`~horovod_dgc.core.DGCConfig` and friends).
    """

    none = _HorovodOwnCompressor()
    fp16 = _HorovodOwnCompressor()


for _spec in METHODS:
    setattr(Compression, _spec.name, staticmethod(_factory(_spec)))
