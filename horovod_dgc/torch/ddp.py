"""Any horovod_dgc compressor as a PyTorch ``DistributedDataParallel`` communication hook.

::

    import torch.distributed as dist
    from horovod_dgc.torch import Compression, ddp

    dist.init_process_group("gloo")                      # under torchrun
    model = torch.nn.parallel.DistributedDataParallel(net)
    compression = Compression.dgc(density=0.001, warmup_epochs=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)  # momentum lives in DGC
    state = ddp.register(model, compression, optimizer=optimizer)
    # per epoch: state.set_epoch(epoch); checkpoints: state.state_dict() on every rank

How a bucket travels. DDP hands the hook one flat bucket of gradients at a time, in bucket
order. The hook splits it into its parameters' gradients (``bucket.gradients()``, views of the
flat buffer; a complex one as its real view) and names each by its parameter
(``ddp_model.module.named_parameters()``): every tensor keeps its own k, memories and warm-up,
exactly as on the Horovod paths, while its bucket is the unit of work: one pass over the
compressed tensors together (where the settings allow) and one collective per stage, through
the compressor's ``launch``/``finish``. Memories are keyed by parameter name, so they survive
DDP rebuilding its buckets after the first iteration. With ``adaptive=``, each DDP bucket is
one of the switch's buckets (``bucket<index>``): dense where that is predicted faster, decided
at the end of a step by every rank alike (docs/algorithms.md#adaptive).

Each hook launches its bucket's collectives asynchronously (``torch.distributed`` with
``async_op=True``, :mod:`horovod_dgc.torch.dist_collectives`) and returns a pending
``torch.futures.Future``; the hook of the last bucket waits for every bucket of the step,
writes the averaged gradients into the buckets' buffers and completes every future. A step is
therefore kept or dropped whole, as on the Horovod paths: if any rank's gradient of any
tensor was not finite, every memory of every rank stays as it was before the step.

Horovod need not be installed and is never initialised here: the collectives are
``torch.distributed``'s, over DDP's own process group (Gloo on CPU, NCCL for CUDA tensors).
"""
# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from ..core.callers import values_among_callers
from ..core.collectives import ALLREDUCE
from ..core.methods import METHODS
from ..core.stats import CompressionStats
from .compression import MethodCompressor, check_plain_optimizer
from .dist_collectives import DistTransport, Pending
from .engine import DenseExchange, Engine

_FACTORIES = ", ".join(f"Compression.{spec.name}" for spec in METHODS)
_INSTEAD = ("use an optimizer without it (torch.optim.SGD(momentum=0, weight_decay=0)): with a "
            "DDP hook the compressor applies them")


@dataclass
class _BucketInFlight:
    """One DDP bucket between its hook and the end of the step.

    Attributes:
        index: DDP's bucket index.
        buffer: the flat bucket (the gradients of ``views`` side by side, in their dtype).
        views: each parameter's gradient, a view of ``buffer`` (``bucket.gradients()``).
        names: each parameter's name.
        future: what the hook returned to DDP; completed with ``buffer`` by :meth:`finish`.
        exchange: the compressed tensors' exchange (the family's), or None.
        compressed: positions in ``views`` of the compressed tensors, in ``exchange`` order.
        passed: (position, launched all-reduce) of every tensor that passes through
            untouched (zero-element or not floating-point).
        dense: the tensors the method sends dense, in flight (``launch_dense`` of the
            compressor: one all-reduce per dtype), and their positions in ``views``.
        used: the all-reduce of whether each rank used each parameter, when the model may
            leave parameters unused (else None).
    """

    index: int
    buffer: torch.Tensor
    views: List[torch.Tensor]
    names: List[str]
    future: torch.futures.Future
    exchange: Any = None
    compressed: List[int] = field(default_factory=list)
    passed: List[Tuple[int, Pending]] = field(default_factory=list)
    dense: Optional[Tuple[DenseExchange, List[int]]] = None
    used: Optional[Pending] = None


class DDPCompressionState:
    """The state of the hook :func:`register` installs: the compressor, the parameter names,
    the buckets of the step in flight; and the user's controls, delegated to the compressor.

    Not picklable (it holds the compressor and its locks): checkpoint it with
    :meth:`state_dict`.
    """

    __slots__ = ("compression", "transport", "_names", "_in_flight", "_optimizer", "_optimizer_sought",
                 "_used")

    def __init__(self, compression: MethodCompressor,
                 named_parameters: Iterable[Tuple[str, torch.nn.Parameter]],
                 transport: DistTransport):
        named = list(named_parameters)
        self.compression = compression
        self.transport = transport
        self._names: Dict[int, Tuple[str, torch.nn.Parameter]] = {id(p): (n, p) for n, p in named}
        self._in_flight: List[_BucketInFlight] = []
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self._optimizer_sought = False
        self._used: Optional[Set[str]] = None
        compression.use_transport(transport)
        compression.bind(named)

    # -- the user's controls ------------------------------------------------------------------
    def set_epoch(self, epoch: float) -> None:
        """Drive the warm-up schedule (epochs; same value on every rank)."""
        self.compression.set_epoch(epoch)

    def set_step(self, step: int, steps_per_epoch: int) -> None:
        """Step-based form of :meth:`set_epoch`."""
        self.compression.set_step(step, steps_per_epoch)

    @property
    def density(self) -> float:
        """Fraction of elements sent now (after warm-up)."""
        return self.compression.density

    def stats(self) -> CompressionStats:
        """Bytes handed to the collectives and sent on the network (this rank's, per step),
        dense-equivalent bytes, density, selection time in seconds."""
        return self.compression.stats()

    def reset_stats(self) -> None:
        self.compression.reset_stats()

    def state_dict(self) -> dict:
        """This rank's part (memories, step counters, epoch; tagged with the method, config,
        world size and rank): save every rank's."""
        return self.compression.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore this rank's part; ValueError naming what differs for another method,
        config, world size, rank, tensor set or size."""
        self.compression.load_state_dict(state)

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse (ValueError) an optimizer that would apply momentum or weight decay the
        compressor applies already (DGC; blocksign with momentum), by the rule of the Horovod
        paths: it must be ``torch.optim.SGD`` with ``momentum=0`` (and ``weight_decay=0``
        with DGC, whose momentum the SGD's decay would miss). DDP never sees the optimizer:
        call this once, pass ``optimizer=`` to :func:`register`, or leave it to the first
        step, which checks the one PyTorch optimizer holding the model's parameters among the
        training loop's variables, if there is exactly one. The optimizer is checked again at
        every step (a scheduler that cycles momentum sets it in ``param_groups``)."""
        check_plain_optimizer(optimizer, self.compression.config, _INSTEAD)
        self._optimizer = optimizer

    def _seek_optimizer(self) -> None:
        """Without ``optimizer=``: take for it the one torch optimizer among the training loop's
        variables (every thread's frames: on a GPU the hook runs on the autograd engine's
        thread) that holds this model's parameters, as if it had been given; where there are
        several (a GAN's), or none, the user checks with :meth:`check_optimizer`. Only
        PyTorch's own optimizers are judged (``ZeroRedundancyOptimizer`` by the one it wraps);
        another library's may keep its settings elsewhere."""
        self._optimizer_sought = True
        if not self.compression.config.needs_plain_optimizer:
            return
        ours = {id(p) for _, p in self._names.values()}
        found = {id(value): value for value in values_among_callers(every_thread=True)
                 if isinstance(value, torch.optim.Optimizer)
                 and type(value).__module__.startswith("torch.")
                 and any(id(p) in ours for group in value.param_groups for p in group["params"])}
        if len(found) == 1:  # checked by the caller, now and at every step, as if given
            self._optimizer = next(iter(found.values()))

    # -- the hook's work -------------------------------------------------------------------------
    def track_usage(self) -> None:
        """Note which parameters get a gradient on this rank, for a model that may leave some
        unused (``find_unused_parameters=True``, ``static_graph=True``): DDP leaves the
        gradient of a parameter no rank used untouched, so what the compressor sent for it
        would be lost; its memories are left as they were instead (see :meth:`finish`)."""
        self._used = set()
        for name, param in self._names.values():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(lambda _, name=name: self._used.add(name))

    def _name_of(self, param: torch.Tensor) -> Tuple[str, torch.nn.Parameter]:
        entry = self._names.get(id(param))
        if entry is None or entry[1] is not param:
            raise ValueError(f"rank {self.transport.rank()}: DDP's bucket holds a parameter of "
                             f"shape {tuple(param.shape)} that is not in ddp_model.module."
                             f"named_parameters() as it was at register()")
        return entry

    def exchange(self, bucket: dist.GradBucket) -> "torch.futures.Future[torch.Tensor]":
        """Launch one bucket's collectives; the last bucket of a step finishes them all."""
        params, buffer = bucket.parameters(), bucket.buffer()
        names = [self._name_of(p)[0] for p in params]
        views = [_as_real_in(buffer, view, p) for p, view in zip(params, bucket.gradients())]
        params = [torch.view_as_real(p.detach()) if p.is_complex() else p for p in params]
        flight = _BucketInFlight(bucket.index(), buffer, views, names, torch.futures.Future())
        try:
            if not self._in_flight:  # a step's first bucket
                self.compression.check_grad_scaler_use(every_thread=True)
                if self._optimizer is None and not self._optimizer_sought:
                    self._seek_optimizer()
                if self._optimizer is not None:
                    check_plain_optimizer(self._optimizer, self.compression.config, _INSTEAD)
            self._launch(flight, params)
        except BaseException as error:
            self._fail(error)
            flight.future.set_exception(error)
            raise
        self._in_flight.append(flight)
        if bucket.is_last():
            self.finish()
        return flight.future

    def _launch(self, flight: _BucketInFlight, params: List[torch.Tensor]) -> None:
        engine, transport = self.compression.engine, self.transport
        if flight.buffer.is_sparse:
            # DDP hands a sparse gradient over as a bucket of its own with no dense views:
            # returning it unchanged would apply each rank's local gradient.
            raise ValueError(f"rank {transport.rank()}: the gradient of {flight.names} is sparse "
                             f"(an nn.Embedding(sparse=True)?); this hook averages dense "
                             f"gradients only: make that layer's gradient dense (sparse=False)")
        if self._used is not None:
            flags = torch.tensor([float(name in self._used) for name in flight.names],
                                 device=flight.buffer.device)  # NCCL takes CUDA tensors only
            flight.used = transport.launch(ALLREDUCE, flags, f"used.bucket{flight.index}")
        entries, dense = [], []
        for position, (name, param, grad) in enumerate(zip(flight.names, params, flight.views)):
            if grad.numel() and not _inside(grad, flight.buffer):
                raise RuntimeError(f"rank {transport.rank()}: DDP's gradient of {name!r} is not a "
                                   f"view of its bucket's buffer; this hook writes its results there")
            if Engine.passes_through(grad):
                flight.passed.append((position, transport.launch(ALLREDUCE, grad.reshape(-1), f"dense.{name}")))
            elif not engine.compresses(grad):
                dense.append((position, (name, grad, param)))
            else:
                flight.compressed.append(position)
                entries.append((name, grad, param))
        if dense:
            flight.dense = (self.compression.launch_dense(f"bucket{flight.index}", [entry for _, entry in dense]),
                            [position for position, _ in dense])
        if entries:
            flight.exchange = self.compression.launch(f"bucket{flight.index}", entries)

    def finish(self) -> None:
        """Wait for every bucket of the step, write the averaged gradients into the buckets'
        buffers, end the compressor's step (the adaptive switch's decisions) and complete the
        buckets' futures (in bucket order)."""
        engine, transport = self.compression.engine, self.transport
        try:
            unused = [name for flight in self._in_flight if flight.used is not None
                      for name, users in zip(flight.names, transport.wait(flight.used).tolist())
                      if users == 0]
            engine.leave_unapplied(unused)
            for flight in self._in_flight:
                if flight.exchange is not None:
                    results = self.compression.finish(flight.exchange)
                    torch._foreach_copy_([flight.views[position] for position in flight.compressed], results)
                for position, handle in flight.passed:
                    flight.views[position].copy_(transport.wait(handle).reshape(flight.views[position].shape))
                if flight.dense is not None:
                    exchange, positions = flight.dense
                    torch._foreach_copy_([flight.views[position] for position in positions],
                                         self.compression.finish_dense(exchange))
            self.compression.end_step()
        except BaseException as error:
            self._fail(error)
            raise
        finished, self._in_flight = self._in_flight, []
        if self._used is not None:
            self._used.clear()
        for flight in finished:
            flight.future.set_result(flight.buffer)

    def _fail(self, error: BaseException) -> None:
        """A step that will not finish: fail every pending future, drop the step's memories."""
        for flight in self._in_flight:
            if not flight.future.done():
                flight.future.set_exception(error)
        self._in_flight = []
        if self._used is not None:
            self._used.clear()
        self.compression.abandon_exchanges()


def _as_real_in(buffer: torch.Tensor, view: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient in its bucket's buffer: ``view`` itself, or for a complex
    parameter its real view (``torch.view_as_real``'s layout, shape ``(*param.shape, 2)``).
    DDP stores a complex gradient in a real buffer as its real view, yet its
    ``bucket.gradients()`` hands over a real tensor of the parameter's shape, which covers
    only the first half of it."""
    if not param.is_complex():
        return view
    start = (view.data_ptr() - buffer.data_ptr()) // buffer.element_size()
    return buffer[start:start + 2 * param.numel()].view(*param.shape, 2)


def _inside(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether ``view``'s first element lies in ``buffer``'s memory."""
    start = buffer.data_ptr()
    return start <= view.data_ptr() < start + buffer.numel() * buffer.element_size()


def hook(state: DDPCompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: ``ddp_model.register_comm_hook(state, hook)``. Its
    future's value is the bucket's flat buffer holding the averaged gradients."""
    return state.exchange(bucket)


def register(ddp_model: torch.nn.parallel.DistributedDataParallel, compression: MethodCompressor,
             optimizer: Optional[torch.optim.Optimizer] = None) -> "DDPCompressionState":
    """Compress ``ddp_model``'s gradient exchange with ``compression``.

    Args:
        ddp_model: a ``DistributedDataParallel`` model, no communication hook registered yet.
            Its process group carries the collectives.
        compression: a compressor of :class:`horovod_dgc.torch.Compression` (``dgc``,
            ``topk``, ``gaussiank``, ``scalecom``, ``blocksign``), not yet used. Its memories
            are keyed by the names of ``ddp_model.module.named_parameters()``
            (``named_parameters=`` given to the factory is replaced by them).
        optimizer: the optimizer that applies the averaged gradients, checked at once by
            :meth:`DDPCompressionState.check_optimizer` (recommended with DGC, whose momentum
            must not be applied twice).

    Returns:
        The hook's state: ``stats()``, ``set_epoch()``, ``state_dict()``,
        ``load_state_dict()``, ``check_optimizer()``.

    Raises:
        TypeError: ``ddp_model`` is not a ``DistributedDataParallel``, or ``compression`` not
            one of ours (Horovod's ``Compression.none``/``fp16`` included: use DDP's own
            hooks for those).
        ValueError: the optimizer would apply momentum twice, or an embedding of the model
            has sparse gradients (``sparse=True``).
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register() needs a torch.nn.parallel.DistributedDataParallel model, "
                        f"got {type(ddp_model).__name__}")
    if not isinstance(compression, MethodCompressor):
        raise TypeError(f"compression must be a horovod_dgc compressor ({_FACTORIES} of "
                        f"horovod_dgc.torch), got {type(compression).__module__}."
                        f"{type(compression).__qualname__}; for no compression or float16 use "
                        f"DDP's own hooks (torch.distributed.algorithms.ddp_comm_hooks)")
    sparse = [name for name, module in ddp_model.module.named_modules()
              if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse]
    if sparse:
        raise ValueError(f"the model's embeddings {sparse} have sparse=True: DDP hands a sparse "
                         f"gradient to the hook as a bucket of its own, which it can neither "
                         f"compress nor average; build them with sparse=False (their gradients "
                         f"are then compressed like any other)")
    transport = DistTransport(ddp_model.process_group)
    state = DDPCompressionState(compression, ddp_model.module.named_parameters(), transport)
    if ddp_model.find_unused_parameters or ddp_model.static_graph:
        state.track_usage()
    if optimizer is not None:
        state.check_optimizer(optimizer)
    ddp_model.register_comm_hook(state, hook)
    return state
