"""Per-tensor state and the core calls for PyTorch, shared by both Horovod paths.

An :class:`Engine` knows nothing of Horovod: it turns a named gradient into either a sparse
message (bytes) or a dense tensor to all-reduce, and turns gathered messages back into the
averaged dense gradient. ``compression.py`` (stock ``hvd.DistributedOptimizer``) and
``optimizer.py`` (our own, fused) put the collectives around it.

**A step is kept or dropped whole.** The memories a step computes are staged, not kept, until
every tensor exchanged in the step has come back: if any rank's gradient of any tensor was
not finite (every rank learns of it from the messages), every staged memory is dropped, so
every memory of every rank is exactly what it was before the step; else all are kept. On a
GPU the step's checks and finiteness flags are read once, when its last tensor comes back
(``TorchOps(defer_checks=True)``): one wait per step instead of several per tensor.

**Buckets.** :meth:`Engine.compress_bucket` compresses several tensors as one
(:mod:`horovod_dgc.core.bucket`): their gradients copied into one flat buffer, one memory
per bucket (kept flat; :meth:`Engine.state_dict` saves it tensor by tensor, as the
per-tensor path does, so a checkpoint loads into either), one message.

**Loss scaling.** With a mixed-precision loss scaler attached (:meth:`Engine.use_loss_scale`),
gradients are divided by the scale before they reach the memories, and the averaged gradients
are multiplied by it again, so that the scaler's ``unscale_`` finds what it expects.
"""
from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from ..core.bucket import Bucket, Plan
from ..core.collectives import ALLGATHER, ALLREDUCE, network_bytes
from ..core.method import BucketCall, CompressCall, Method
from ..core.ops import Pieces
from ..core.sparse import Compressed
from ..core.nonfinite import NonFiniteGradientError
from ..core.state import check_loadable, state_frame
from ..core.stats import CompressionStats, StatsRecorder
from ..core.twostage import StageHandover
from ..core.warmup import WarmupWatch
from ..core.wire import MessageLayout
from .ops import TorchOps, dtype_name


@dataclass
class OutgoingMessage:
    """A compressed tensor's sparse message, and what decompress needs to rebuild it."""

    name: str
    message: torch.Tensor
    layout: MessageLayout
    step: int
    shape: torch.Size
    dtype: torch.dtype
    loss_scale: float = 1.0
    # The flat gradient the message was built from, when the average may be written over it.
    destination: Optional[torch.Tensor] = None
    # A bucket's message: the bucket, and its members' shapes (``shape`` is the flat buffer's).
    bucket: Optional[Bucket] = None
    shapes: Tuple[torch.Size, ...] = ()


@dataclass
class DenseUpdate:
    """A tensor that travels dense, or a bucket's tensors as one (``bucket``): what to
    all-reduce, and how to give the result back."""

    name: str
    tensor: torch.Tensor
    dtype: torch.dtype
    loss_scale: float = 1.0
    bucket: Optional[Bucket] = None


@dataclass
class DenseExchange:
    """Dense updates in flight: per update, its all-reduce, the update, and its tensors'
    places among the entries it was made from; the step they belong to."""

    launched: List[Tuple[Any, DenseUpdate, List[int]]]
    step: int


# What one tensor brings to an exchange: its name, gradient and parameter.
Entry = Tuple[str, torch.Tensor, Optional[torch.nn.Parameter]]


def in_entry_order(places: Sequence[int], tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """``tensors`` (one per entry, in buckets' order) in the order of the entries they came
    from: ``places[i]`` is the entry of ``tensors[i]``."""
    ordered: List[Optional[torch.Tensor]] = [None] * len(tensors)
    for place, tensor in zip(places, tensors):
        ordered[place] = tensor
    return ordered


# Horovod's collectives take no bfloat16: such dense tensors travel as float32.
REDUCIBLE = {torch.bfloat16: torch.float32}
# The longest a bucket whose candidate bounds keep failing selects without them, in steps.
BOUND_BACKOFF_STEPS = 64


class Engine:
    """Holds a method, the per-tensor memories, the step counters and the statistics."""

    def __init__(self, method: Method, world_size: int, rank: int):
        # Checks and flags are read once per step (_conclude), where reading waits (a GPU).
        self.ops = TorchOps(defer_checks=True)
        self.set_method(method)
        self.world_size = world_size
        self.rank = rank
        self.epoch = 0.0
        self._states: Dict[str, dict] = {}
        self._staged: Dict[str, dict] = {}
        # Memories replaced at the last conclusion: storage for the next step's (see
        # CompressCall.spare). One more copy of the memories between steps, no page faults.
        self._spares: Dict[str, dict] = {}
        # Each tensor's candidate bound for its next step (CompressCall.candidate_bound): speed only.
        self._bounds: Dict[str, float] = {}
        # Per bucket: (candidate bounds that failed in a row, the step from which to use them again).
        self._bound_failures: Dict[str, Tuple[int, int]] = {}
        self._open: Set[str] = set()
        self._step_flags: List[Any] = []  # each concluded tensor's finiteness, this step
        self._unapplied: Set[str] = set()  # tensors whose results this step nobody applies
        self._steps: Dict[str, int] = {}
        self._lock = threading.Lock()
        self._stats = StatsRecorder()
        # Each bucket by the key its memories are kept under, and by its label and members.
        self._buckets: Dict[str, Bucket] = {}
        self._bucket_of: Dict[Tuple[str, Tuple[str, ...]], Bucket] = {}
        # Each bucket's flat buffers (its gradients, its parameters) and their members' views.
        self._flats: Dict[Tuple[str, str], Tuple[torch.Tensor, List[torch.Tensor]]] = {}
        self._paddings: Dict[str, torch.Tensor] = {}  # each bucket's padding positions, on its device
        self._loss_scale: Callable[[], float] = lambda: 1.0
        self._weight_decays: Dict[str, float] = {}
        self._compute_s: Dict[str, float] = {}

    def set_weight_decays(self, decays: Dict[str, float]) -> None:
        """Per-tensor weight decays (by name), in place of the config's: the fused
        optimizer's parameter groups."""
        self._weight_decays = dict(decays)

    def use_loss_scale(self, scale: Callable[[], float]) -> None:
        """Read the current loss scale from ``scale()`` at every compress."""
        self._loss_scale = scale

    def set_method(self, method: Method) -> None:
        """Run ``method`` (a new config, before training)."""
        self.method = method
        self._watch = WarmupWatch(method.config.schedule)

    @property
    def config(self):
        return self.method.config

    # -- schedule and statistics ------------------------------------------------------------
    def set_epoch(self, epoch: float) -> None:
        self.epoch = float(epoch)
        self._watch.epoch_set(self.epoch)

    @property
    def density(self) -> float:
        """Density in force now (after warm-up)."""
        return self.config.density_for(max(self._steps.values(), default=0), self.epoch)

    def stats(self) -> CompressionStats:
        return self._stats.snapshot()

    def reset_stats(self) -> None:
        self._stats.reset()

    # -- which path -------------------------------------------------------------------------
    def compresses(self, tensor: torch.Tensor) -> bool:
        return self.config.compresses(tuple(tensor.shape), dtype_name(tensor.dtype))

    @staticmethod
    def passes_through(tensor: torch.Tensor) -> bool:
        """Zero-element and non-floating tensors are handed on untouched."""
        return tensor.numel() == 0 or not tensor.is_floating_point()

    def _next_step(self, name: str) -> int:
        with self._lock:
            step = self._steps.get(name, 0)
            self._steps[name] = step + 1
        warning = self._watch.warning(step)
        if warning and self.rank == 0:
            warnings.warn(warning, stacklevel=4)
        return step

    def _state(self, name: str, flat: torch.Tensor, compressed: bool) -> dict:
        with self._lock:
            if name not in self._states:
                # A bucket's memories (its dense steps keep them so) become its tensors' again.
                self._split_buckets_holding([name])
            if name not in self._states:
                self._states[name] = self.method.init_state(self.ops, flat, compressed,
                                                            self.world_size)
            return self._states[name]

    def _call(self, name: str, step: int, grad: torch.Tensor, param: Optional[torch.Tensor],
              loss_scale: float) -> CompressCall:
        flat_param = None if param is None else param.detach().reshape(-1)
        small = self.config.is_small(tuple(grad.shape))
        density = self.config.density_for(step, self.epoch, small)
        with self._lock:
            spare = self._spares.pop(name, None)
        return CompressCall(name=name, rank=self.rank, world_size=self.world_size, step=step,
                            density=density, param=flat_param, loss_scale=loss_scale,
                            weight_decay=self._weight_decays.get(name), spare=spare, small=small,
                            candidate_bound=self._bounds.get(name))

    def _keep_bound(self, name: str, next_bound: Optional[Any]) -> None:
        if next_bound is not None:
            self._bounds[name] = float(next_bound)

    def _keep_bucket_bounds(self, bucket: Bucket, step: int, result: Compressed) -> None:
        """Each member's next candidate bound; after candidates that did not hold every
        segment's k, the bucket selects without them for 1, 2, 4, ... (at most
        BOUND_BACKOFF_STEPS) steps, so a bucket whose bounds keep failing (magnitudes that
        grow from step to step) does not pay for collecting them every step."""
        if result.next_bound is not None:
            self._bounds.update(zip(bucket.names, result.next_bound.tolist()))
        if result.bounds_held is not None:
            failures = 0 if result.bounds_held else self._bound_failures.get(bucket.key, (0, 0))[0] + 1
            self._bound_failures[bucket.key] = (failures, step + min(2 ** failures, BOUND_BACKOFF_STEPS))

    def _bucket_bounds(self, bucket: Bucket, step: int) -> Optional[Tuple[float, ...]]:
        """The members' candidate bounds for this step: None where one has none or the bucket
        is backing off (:meth:`_keep_bucket_bounds`)."""
        _, resume = self._bound_failures.get(bucket.key, (0, 0))
        if step < resume or not all(n in self._bounds for n in bucket.names):
            return None
        return tuple(self._bounds[n] for n in bucket.names)

    # -- keeping or dropping a step's memories --------------------------------------------------
    def _stage(self, name: str, state: dict) -> None:
        with self._lock:
            self._staged[name] = state
            self._open.add(name)

    def _staged_state(self, name: str) -> dict:
        with self._lock:
            return self._staged[name]

    def _conclude(self, names: Sequence[str], finite: Any) -> None:
        """These tensors came back, ``finite`` or not (a bool, or a 0-d tensor on a device
        where reading it waits); once every open tensor has, the step's flags and deferred
        checks are read at once (``TorchOps.settle_checks``: one wait per step on a GPU), and
        the step's staged memories are kept, or all dropped if any tensor was not finite or a
        check failed (whose error is then raised)."""
        with self._lock:
            self._step_flags.append(finite)
            self._open.difference_update(names)
            if self._open:
                return
            flags, self._step_flags = self._step_flags, []
            try:
                step_finite = all(self.ops.settle_checks(*flags))
            except BaseException:
                self._end_step(False)
                raise
            self._end_step(step_finite)

    def leave_unapplied(self, names: Iterable[str]) -> None:
        """This step's results for ``names`` will not be applied (DDP leaves the gradient of a
        parameter that no rank used untouched): their memories stay as they were before the
        step, as an optimizer's state does for a parameter without a gradient. Call it before
        the step's last tensor comes back."""
        with self._lock:
            self._unapplied.update(names)

    def _end_step(self, finite: bool) -> None:
        for name, staged in self._staged.items():
            kept = self._states.get(name)
            if finite and name in self._buckets:
                self._restore_unapplied(self._buckets[name], kept, staged)
            keep = finite and name not in self._unapplied
            if kept is not None and _disjoint(kept, staged):
                self._spares[name] = kept if keep else staged
            if keep:
                self._states[name] = staged
        self._staged.clear()
        self._unapplied.clear()

    def _restore_unapplied(self, bucket: Bucket, kept: Optional[dict], staged: dict) -> None:
        """The segments of a bucket whose results nobody applies keep their memories."""
        for name, parts in self._member_parts(bucket).items():
            if name in self._unapplied:
                for key, memory in staged.items():
                    part = memory[parts[key]]
                    part.copy_(kept[key][parts[key]]) if kept else part.zero_()

    def _member_parts(self, bucket: Bucket) -> Dict[str, Dict[str, slice]]:
        """Per member tensor, where its part of each of the bucket's flat memories lies (the
        method's :meth:`~horovod_dgc.core.method.Method.state_buckets`)."""
        layouts = self.method.state_buckets(bucket, self.world_size)
        return {s.name: {key: slice(layout.segments[i].offset, layout.segments[i].end)
                         for key, layout in layouts.items()}
                for i, s in enumerate(bucket.segments)}

    def abandon_step(self) -> None:
        """Drop the memories of a step that will not finish (an elastic reset)."""
        with self._lock:
            self._staged.clear()
            self._spares.clear()
            self._open.clear()
            self._step_flags = []
            self._unapplied.clear()
            self.ops.discard_checks()

    # -- the two paths ------------------------------------------------------------------------
    def compress(self, name: str, grad: torch.Tensor, param: Optional[torch.Tensor]) -> OutgoingMessage:
        """Sparse message for a tensor that :meth:`compresses`."""
        started = time.perf_counter()
        flat = grad.detach().reshape(-1)
        step, scale = self._next_step(name), self._loss_scale()
        result = self.method.compress(self.ops, self._state(name, flat, True), flat,
                                      self._call(name, step, grad, param, scale))
        self._stage(name, result.state)
        self._keep_bound(name, result.next_bound)
        elapsed = time.perf_counter() - started
        self._record(step, ALLGATHER, result.layout.nbytes, grad,
                     elements_sent=int(result.count), elements_compressed=grad.numel(),
                     selection_time_s=elapsed)
        return OutgoingMessage(name, result.message, result.layout, step, grad.shape, grad.dtype,
                               scale, flat if _consumed(flat, result.message, result.state) else None)

    def bucket(self, label: str, entries: Sequence[Tuple[str, torch.Tensor]], compressed: bool = True) -> Bucket:
        """The bucket of these (name, gradient) pairs under ``label`` (one dtype), made once;
        ``compressed=False`` for tensors the method sends dense (:meth:`dense_bucket`)."""
        known = self._bucket_of.get((label, tuple(name for name, _ in entries)))
        if known is not None and known.compressed == compressed and all(
                g.dtype == entries[0][1].dtype for _, g in entries) and [
                s.numel for s in known.segments] == [g.numel() for _, g in entries]:
            return known
        dtypes = {grad.dtype for _, grad in entries}
        if len(dtypes) != 1:
            raise ValueError(f"bucket {label!r} holds gradients of several dtypes: {sorted(map(str, dtypes))}")
        bucket = Bucket.of(label, [(name, grad.numel(), self.config.is_small(tuple(grad.shape)))
                                   for name, grad in entries], dtype_name(dtypes.pop()), compressed)
        with self._lock:
            bucket = self._buckets.setdefault(bucket.key, bucket)
            self._bucket_of[(label, bucket.names)] = bucket
            return bucket

    def compress_bucket(self, bucket: Bucket, grads: Sequence[torch.Tensor],
                        params: Sequence[Optional[torch.Tensor]]) -> OutgoingMessage:
        """One sparse message for the tensors of ``bucket`` (their gradients in its order)."""
        started = time.perf_counter()
        in_place = self.ops.takes_pieces(grads[0])
        call, flat = self._bucket_call(bucket, grads, params, gather=not in_place)
        grad = Pieces(flat, tuple(g.reshape(-1) for g in grads), tuple(s.offset for s in bucket.segments)
                      ) if in_place else flat
        result = self.method.compress_bucket(self.ops, self._bucket_state(bucket, flat), grad, call)
        self._keep_bucket_bounds(bucket, call.step, result)
        self._stage(bucket.key, result.state)
        self._record_bucket(call, ALLGATHER, result.layout.nbytes, flat, int(result.count), started)
        return OutgoingMessage(bucket.key, result.message, result.layout, call.step, flat.shape, grads[0].dtype,
                               call.loss_scale, flat if _consumed(flat, result.message, result.state) else None, bucket,
                               tuple(g.shape for g in grads))

    def first_bucket(self, bucket: Bucket, grads: Sequence[torch.Tensor],
                     params: Sequence[Optional[torch.Tensor]]) -> Tuple[torch.Tensor, StageHandover]:
        """Stage 1 of a two-stage method for the tensors of ``bucket`` as one: (message,
        handover); :meth:`second` takes it on under the bucket's key, :meth:`finish_bucket`
        ends it."""
        started = time.perf_counter()
        call, flat = self._bucket_call(bucket, grads, params)
        message, state, handover = self.method.first_bucket(self.ops, self._bucket_state(bucket, flat), flat, call)
        if _consumed(flat, message, state):
            handover.destination = flat
        self._stage(bucket.key, state)
        self._record_bucket(call, self.method.FIRST, message.numel() * message.element_size(), flat,
                            call.plan.total, started)
        return message, handover

    def finish_bucket(self, received: torch.Tensor, handover: StageHandover, bucket: Bucket,
                      shapes: Sequence[torch.Size]) -> List[torch.Tensor]:
        """:meth:`finish` of a bucket's exchange: the averaged update of each member, shaped
        like it (views of one flat update)."""
        return self._segments(bucket, shapes, self.finish(received, handover, torch.Size([bucket.numel])),
                              handover.destination)

    def flush_bucket(self, bucket: Bucket, grads: Sequence[torch.Tensor],
                     params: Sequence[Optional[torch.Tensor]]) -> DenseUpdate:
        """A compressed bucket's dense step (``Method.flush_bucket``: its gradients with every
        update its memories owe): what to all-reduce (averaged), flat; give the result to
        :meth:`bucket_received`."""
        call, flat = self._bucket_call(bucket, grads, params)
        wire = REDUCIBLE.get(grads[0].dtype, grads[0].dtype)
        update, state = self.method.flush_bucket(self.ops, self._bucket_state(bucket, flat), flat, call,
                                                 dtype_name(wire))
        self._stage(bucket.key, state)
        self._record(call.step, ALLREDUCE, update.numel() * update.element_size(), None,
                     dense_bytes=sum(s.numel for s in bucket.segments) * flat.element_size())
        return DenseUpdate(bucket.key, update, grads[0].dtype, call.loss_scale, bucket)

    def dense_bucket(self, bucket: Bucket, grads: Sequence[torch.Tensor],
                     params: Sequence[Optional[torch.Tensor]]) -> DenseUpdate:
        """:meth:`dense` of every tensor of ``bucket`` (made with ``compressed=False``) at
        once (``Method.dense_bucket``, on the bucket's flat buffer and memories): what to
        all-reduce (averaged), flat, float32 for bfloat16 gradients; give the result to
        :meth:`bucket_received`. The bucket's operations do not grow with its tensors."""
        self.method.require_dense_bucketed()
        call, flat = self._bucket_call(bucket, grads, params)
        update, state = self.method.dense_bucket(self.ops, self._bucket_state(bucket, flat), flat, call)
        self._stage(bucket.key, state)
        if call.loss_scale != 1.0:
            update = update * call.loss_scale
        update = update.to(REDUCIBLE.get(grads[0].dtype, grads[0].dtype))
        self._record(call.step, ALLREDUCE, update.numel() * update.element_size(), None,
                     dense_bytes=sum(s.numel for s in bucket.segments) * flat.element_size())
        return DenseUpdate(bucket.key, update, grads[0].dtype, call.loss_scale, bucket)

    def bucket_received(self, sent: DenseUpdate, averaged: torch.Tensor) -> List[torch.Tensor]:
        """The averaged gradients of a bucket sent dense (:meth:`dense_bucket`,
        :meth:`flush_bucket`), one per member shaped like it and in its dtype: views of the
        bucket's gradient buffer, where ``averaged`` is copied unless it was averaged there
        in place (valid until the bucket's next step). A result that is not finite (some
        rank's gradient was not) drops the step's memories; ``nonfinite="raise"`` names a
        tensor that was not finite."""
        bucket = sent.bucket

        def culprit() -> str:
            return next(s.name for s in bucket.segments if not bool(torch.isfinite(averaged[s.offset:s.end]).all()))

        self._received([sent.name], torch.isfinite(averaged).all(), culprit)
        own, views = self._flats[(bucket.key, "gradients")]
        if averaged.data_ptr() != own.data_ptr():
            own.copy_(averaged)
        return list(views)

    def dense_all(self, label: str, entries: Sequence[Entry]) -> List[Tuple[DenseUpdate, List[int]]]:
        """What to all-reduce (averaged) for ``entries``, tensors the method sends dense: one
        flat tensor per dtype, a bucket labelled ``label`` and the dtype (:meth:`dense_bucket`),
        where the method takes them so (``Method.dense_bucketed``), else one per tensor
        (:meth:`dense`); each with its tensors' places in ``entries``. Give each result to
        :meth:`dense_all_received`."""
        if not self.method.dense_bucketed:
            return [(self.dense(name, grad, param), [i]) for i, (name, grad, param) in enumerate(entries)]
        by_dtype: Dict[torch.dtype, List[int]] = {}
        for i, (_, grad, _) in enumerate(entries):
            by_dtype.setdefault(grad.dtype, []).append(i)
        sends = []
        for dtype, places in by_dtype.items():
            bucket = self.bucket(f"{label}.{str(dtype).replace('torch.', '')}",
                                 [entries[i][:2] for i in places], compressed=False)
            sends.append((self.dense_bucket(bucket, [entries[i][1] for i in places],
                                            [entries[i][2] for i in places]), places))
        return sends

    def dense_all_received(self, sent: DenseUpdate, averaged: torch.Tensor) -> List[torch.Tensor]:
        """The averages of the tensors of one of :meth:`dense_all`'s updates, in its order."""
        return self.bucket_received(sent, averaged) if sent.bucket is not None else [self.dense_received(sent, averaged)]

    def _record_bucket(self, call: BucketCall, kind: str, nbytes: int, flat: torch.Tensor, sent: int,
                       started: float) -> None:
        numel = sum(s.numel for s in call.bucket.segments)
        elapsed = time.perf_counter() - started
        self._spend([call.bucket.key], elapsed)
        self._record(call.step, kind, nbytes, None, dense_bytes=numel * flat.element_size(),
                     elements_sent=sent, elements_compressed=numel, selection_time_s=elapsed)

    # -- what each bucket's compute costs (the adaptive switch's input) -------------------------
    def _spend(self, keys: Sequence[str], seconds: float) -> None:
        """Count ``seconds`` of compute, shared evenly by ``keys``."""
        with self._lock:
            for key in keys:
                self._compute_s[key] = self._compute_s.get(key, 0.0) + seconds / len(keys)

    def take_compute_s(self) -> Dict[str, float]:
        """Seconds of compute per bucket key (or tensor) since the last call: the host's time
        in the engine's calls (on a GPU, the time to launch the kernels, not to run them)."""
        with self._lock:
            spent, self._compute_s = self._compute_s, {}
        return spent

    def bucket_exchanges(self, bucket: Bucket) -> Tuple[Tuple[str, int], ...]:
        """``Method.bucket_exchanges`` of ``bucket`` at the densities of its next step."""
        step = max((self._steps.get(n, 0) for n in bucket.names), default=0)
        return self.method.bucket_exchanges(
            Plan.at(bucket, [self.config.density_for(step, self.epoch, s.small) for s in bucket.segments]),
            self.world_size)

    def _bucket_call(self, bucket: Bucket, grads: Sequence[torch.Tensor], params: Sequence[Optional[torch.Tensor]],
                     gather: bool = True) -> Tuple[BucketCall, torch.Tensor]:
        """The call of a bucket's step (every member's step counter advanced), and the bucket's
        flat buffer for its gradients: holding them, unless ``gather`` is False (a method that
        reads them as :class:`~horovod_dgc.core.ops.Pieces`)."""
        steps = {self._next_step(name) for name in bucket.names}
        if len(steps) != 1:
            raise RuntimeError(f"the tensors of bucket {bucket.label!r} are at different steps "
                               f"({sorted(steps)}): a bucket's tensors are always compressed together")
        step, scale = steps.pop(), self._loss_scale()
        flat = self._flatten(bucket, grads, "gradients") if gather else self._flat_buffer(bucket, grads, "gradients")[0]
        config = self.config
        decays = (tuple(self._weight_decays.get(n, getattr(config, "weight_decay", 0.0)) for n in bucket.names)
                  if self._weight_decays else None)
        needs_param = any(decays or ()) or getattr(config, "weight_decay", 0.0) > 0
        with self._lock:
            spare = self._spares.pop(bucket.key, None)
        call = BucketCall(bucket=bucket, rank=self.rank, world_size=self.world_size, step=step,
                          densities=tuple(config.density_for(step, self.epoch, s.small) for s in bucket.segments),
                          param=(self._flatten(bucket, [p.detach() for p in params], "parameters")
                                 if needs_param and all(p is not None for p in params) else None),
                          loss_scale=scale, weight_decays=decays, spare=spare,
                          candidate_bounds=self._bucket_bounds(bucket, step))
        return call, flat

    def _flatten(self, bucket: Bucket, tensors: Sequence[torch.Tensor], role: str) -> torch.Tensor:
        """The tensors copied into the bucket's flat buffer for ``role`` (made once, zero
        padding; one copy for the whole list). The average written over the gradients'
        buffer is handed back as its views, valid until the bucket's next compress."""
        flat, views = self._flat_buffer(bucket, tensors, role)
        torch._foreach_copy_(views, list(tensors))
        return flat

    def _flat_buffer(self, bucket: Bucket, tensors: Sequence[torch.Tensor],
                     role: str) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """A bucket's flat buffer for ``role`` and its members' views shaped like ``tensors``."""
        key, like = (bucket.key, role), tensors[0]
        made = self._flats.get(key)
        if (made is None or made[0].dtype != like.dtype or made[0].device != like.device
                or any(v.shape != t.shape for v, t in zip(made[1], tensors))):
            flat = torch.zeros(bucket.numel, dtype=like.dtype, device=like.device)
            made = self._flats[key] = (flat, [flat[s.offset:s.end].view(t.shape)
                                              for s, t in zip(bucket.segments, tensors)])
        return made

    def _bucket_state(self, bucket: Bucket, flat: torch.Tensor) -> dict:
        """A bucket's memories, flat: kept ones; else assembled once from its tensors' own
        (loaded from a checkpoint, or kept by buckets of another membership, as DDP's after
        it rebuilds them), zeros for a tensor that has none."""
        with self._lock:
            if bucket.key in self._states:
                return self._states[bucket.key]
            self._split_buckets_holding(bucket.names)
            fresh = self.method.init_bucket_state(self.ops, bucket, flat, self.world_size)
            loaded = [self._states.pop(name, None) for name in bucket.names]
            if any(loaded):
                for parts, part in zip(self._member_parts(bucket).values(), loaded):
                    if part is not None:
                        for key, memory in fresh.items():
                            memory[parts[key]].copy_(part[key])
            self._states[bucket.key] = fresh
            return fresh

    def _split_buckets_holding(self, names: Sequence[str]) -> None:
        """Every kept bucket memory holding one of ``names`` becomes its tensors' own memories
        (copies). Caller holds the lock."""
        wanted = set(names)
        for key in [k for k, b in self._buckets.items() if k in self._states and wanted & set(b.names)]:
            memories = self._states.pop(key)
            self._spares.pop(key, None)
            for name, parts in self._member_parts(self._buckets[key]).items():
                self._states[name] = {k: v[parts[k]].clone() for k, v in memories.items()}

    def dense(self, name: str, grad: torch.Tensor, param: Optional[torch.Tensor]) -> DenseUpdate:
        """What to all-reduce for a tensor that does not compress (a new tensor, float32 for
        a bfloat16 gradient); give the result to :meth:`dense_received`."""
        flat = grad.detach().reshape(-1)
        step, scale = self._next_step(name), self._loss_scale()
        update, state = self.method.dense(self.ops, self._state(name, flat, False), flat,
                                          self._call(name, step, grad, param, scale))
        self._stage(name, state)
        if scale != 1.0:
            update = update * scale
        update = update.to(REDUCIBLE.get(grad.dtype, grad.dtype)).reshape(grad.shape)
        if update.data_ptr() == grad.data_ptr():
            update = update.clone()
        self._record(step, ALLREDUCE, update.numel() * update.element_size(), grad)
        return DenseUpdate(name, update, grad.dtype, scale)

    def dense_received(self, sent: DenseUpdate, averaged: torch.Tensor) -> torch.Tensor:
        """The all-reduced ``sent.tensor`` in the gradient's dtype; a non-finite result (some
        rank's gradient was not finite) drops the step's memories."""
        self._received([sent.name], torch.isfinite(averaged.sum(dtype=torch.float32)), lambda: sent.name)
        return averaged.to(sent.dtype)

    def _received(self, names: Sequence[str], finite: Any, culprit: Callable[[], str]) -> None:
        """These dense tensors came back, ``finite`` or not; with ``nonfinite="raise"`` a
        non-finite one raises, naming ``culprit()``, once the step's checks are read."""
        if self.config.nonfinite == "raise":
            def explain() -> None:
                raise NonFiniteGradientError(f"gradient of tensor {culprit()!r} held NaN or Inf on "
                                             f"some rank; every memory was left as it was before "
                                             f"this step")
            if self.ops.defers_checks(finite):
                finite = self.ops.verify(finite, [], explain, finite)
            elif not bool(finite):
                self._conclude(names, False)
                explain()
        self._conclude(names, finite)

    def first(self, name: str, grad: torch.Tensor,
              param: Optional[torch.Tensor]) -> Tuple[torch.Tensor, StageHandover]:
        """Stage 1 of a two-stage method: (message for its FIRST collective, handover)."""
        started = time.perf_counter()
        flat = grad.detach().reshape(-1)
        step, scale = self._next_step(name), self._loss_scale()
        message, state, handover = self.method.first(self.ops, self._state(name, flat, True), flat,
                                                    self._call(name, step, grad, param, scale))
        self._stage(name, state)
        self._keep_bound(name, handover.next_bound)
        self._record(step, self.method.FIRST, message.numel() * message.element_size(), grad,
                     elements_sent=round(grad.numel() * handover.call.density),
                     elements_compressed=grad.numel(), selection_time_s=time.perf_counter() - started)
        return message, handover

    def second(self, name: str, received: torch.Tensor, handover: StageHandover) -> torch.Tensor:
        """Stage 2: the message for the SECOND collective."""
        started = time.perf_counter()
        try:
            message, state = self.method.second(self.ops, self._staged_state(name), received, handover)
        except NonFiniteGradientError:
            self._conclude([name], False)
            raise
        self._stage(name, state)
        elapsed = time.perf_counter() - started
        self._spend([name], elapsed)
        self._record(handover.call.step, self.method.SECOND, message.numel() * message.element_size(),
                     None, selection_time_s=elapsed)
        return message

    def finish(self, received: torch.Tensor, handover: StageHandover, shape: torch.Size) -> torch.Tensor:
        """The averaged update of a two-stage method, shaped like the gradient."""
        started = time.perf_counter()
        try:
            update, finite = self.method.finish(self.ops, received, handover)
        except NonFiniteGradientError:
            self._conclude([handover.call.name], False)
            raise
        self._conclude([handover.call.name], finite)
        update = _rescaled(update, handover.call.loss_scale).reshape(shape)
        self._spend([handover.call.name], time.perf_counter() - started)
        return update

    def record_allreduce(self, step: int, nbytes: int) -> None:
        """Count the bytes of an all-reduce that carries no gradient: the placeholder Horovod
        all-reduces beside a sparse message, the adaptive switch's probes and measurements."""
        self._record(step, ALLREDUCE, nbytes, None)

    def _record(self, step: int, kind: str, nbytes: int, grad: Optional[torch.Tensor],
                dense_bytes: int = 0, **counts) -> None:
        """Count ``nbytes`` handed to collective ``kind`` (and on the network), for the
        gradient ``grad`` (None: more bytes of a gradient counted already, or of gradients
        whose ``dense_bytes`` are given)."""
        dense = dense_bytes if grad is None else grad.numel() * grad.element_size()
        self._stats.record(step=step, bytes_sent=nbytes, dense_bytes=dense,
                           network_bytes=network_bytes(kind, nbytes, self.world_size),
                           dense_network_bytes=network_bytes(ALLREDUCE, dense, self.world_size),
                           **counts)

    def decompress(self, gathered: torch.Tensor, outgoing: Sequence[OutgoingMessage]) -> List[torch.Tensor]:
        """Averaged dense gradients of ``outgoing`` from the allgather of every rank's
        messages (concatenated in the same order on every rank): one per message, a bucket's
        message giving one per member tensor, in its order."""
        started = time.perf_counter()
        layouts = [o.layout for o in outgoing]
        dtypes = [dtype_name(o.dtype) for o in outgoing]
        steps = {o.step for o in outgoing}
        if len(steps) != 1:
            raise RuntimeError(f"tensors of one fused message are at different steps: {sorted(steps)}")
        names = [o.name for o in outgoing]
        try:
            flats, finite = self.method.decompress(self.ops, gathered, layouts, self.world_size,
                                                   steps.pop(), dtypes,
                                                   [o.destination for o in outgoing])
        except NonFiniteGradientError:
            self._conclude(names, False)
            raise
        self._conclude(names, finite)
        averaged = []
        for flat, o in zip(flats, outgoing):
            flat = _rescaled(flat, o.loss_scale)
            if o.bucket is None:
                averaged.append(flat.reshape(o.shape))
            else:
                averaged += self._segments(o.bucket, o.shapes, flat, o.destination)
        self._spend(names, time.perf_counter() - started)
        return averaged

    def _segments(self, bucket: Bucket, shapes: Sequence[torch.Size], flat: torch.Tensor,
                  destination: Optional[torch.Tensor]) -> List[torch.Tensor]:
        """A bucket's averages, one per member, shaped like it: the views made once of the
        gradients' buffer where ``flat`` was written over it or may be copied there (it is
        the step's ``destination``: no message or memory holds it), else views of ``flat``.
        One copy costs a pass over the bucket; a view per member costs two operations each."""
        own = self._flats.get((bucket.key, "gradients"))
        if own is not None and own[0].shape == flat.shape and own[0].dtype == flat.dtype and (
                own[0].data_ptr() == flat.data_ptr() or destination is own[0]):
            if own[0].data_ptr() != flat.data_ptr():
                own[0].copy_(flat)
            self._zero_padding(bucket, own[0])
            return list(own[1])
        return [flat[s.offset:s.end].view(shape) for s, shape in zip(bucket.segments, shapes)]

    def _zero_padding(self, bucket: Bucket, flat: torch.Tensor) -> None:
        """0 over ``flat``'s padding, which the next step reads as zeros: the average of a
        step some rank could not send is NaN there too."""
        if not bucket.padding:
            return
        positions = self._paddings.get(bucket.key)
        if positions is None or positions.device != flat.device:
            positions = self._paddings[bucket.key] = torch.tensor(bucket.padding, device=flat.device)
        self.ops.scatter_zero(flat, positions)

    def memories(self, name: str) -> Dict[str, torch.Tensor]:
        """Tensor ``name``'s memories as kept now (flat; views of its bucket's, where a
        bucket keeps them), by memory name; KeyError for a tensor with none yet."""
        with self._lock:
            if name in self._states:
                return dict(self._states[name])
            for key, bucket in self._buckets.items():
                if name in bucket.names and key in self._states:
                    parts = self._member_parts(bucket)[name]
                    return {k: v[parts[k]] for k, v in self._states[key].items()}
        raise KeyError(name)

    @property
    def steps_taken(self) -> int:
        """Steps of the most advanced tensor (the same on every rank: restored by checkpoints
        and elastic resets)."""
        with self._lock:
            return max(self._steps.values(), default=0)

    # -- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's part: memories, step counters and epoch, tagged with the method, its
        config and the world they belong to (checked by :meth:`load_state_dict`)."""
        with self._lock:
            states = {}
            for key, memories in self._states.items():
                bucket = self._buckets.get(key)
                members = ({key: {k: slice(None) for k in memories}} if bucket is None
                           else self._member_parts(bucket))
                for name, parts in members.items():
                    states[name] = {k: v[parts[k]].clone() for k, v in memories.items()}
            return state_frame(self.method, world_size=self.world_size, rank=self.rank,
                               epoch=self.epoch, steps=self._steps, states=states)

    def load_state_dict(self, state: dict, numels: Dict[str, int]) -> None:
        """Restore this rank's part saved by :meth:`state_dict`.

        Args:
            state: the part saved by this rank (same world size and rank).
            numels: elements of every tensor this compressor may keep a memory for; a state
                holding another tensor, or one of another size, is refused.
        """
        check_loadable(self.ops, state, self.method, numels, self.world_size, self.rank,
                       "load every rank's part with horovod_dgc.torch.checkpoint.redistribute"
                       "(parts, world_size, rank) instead")
        self._watch.epoch_set(float(state["epoch"]))
        with self._lock:
            self.epoch = float(state["epoch"])
            self._steps = dict(state["steps"])
            self._states = {n: {k: v.clone() for k, v in s.items()} for n, s in state["states"].items()}
            self._staged.clear()
            self._spares.clear()
            self._open.clear()

    def join(self, world_size: int, rank: int) -> None:
        """Take a new place in a resized world (elastic reset); load a matching state next."""
        with self._lock:
            self.world_size, self.rank = world_size, rank



def _disjoint(a: dict, b: dict) -> bool:
    """Whether no tensor of state ``a`` shares storage with a tensor of state ``b``."""
    held = {t.untyped_storage().data_ptr() for t in b.values()}
    return all(t.untyped_storage().data_ptr() not in held for t in a.values())


def _consumed(flat: torch.Tensor, message: torch.Tensor, state: dict) -> bool:
    """Whether the average may be written over the gradient ``flat`` once its ``message`` is
    built: float32 (the dtype of the sums) and held by neither the message nor a memory of
    ``state``."""
    return flat.dtype == torch.float32 and _disjoint({"gradient": flat}, {"message": message, **state})


def _rescaled(update: torch.Tensor, loss_scale: float) -> torch.Tensor:
    """An averaged update back in the loss scale's units (see the module docstring)."""
    return update if loss_scale == 1.0 else update.mul_(loss_scale)
