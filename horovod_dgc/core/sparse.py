"""The pipeline every sparse method shares: accumulate, select, encode; decode, average.

A :class:`SparseMethod` is a memory (what is kept of unsent gradient, :mod:`.memory`) plus a
selector (which entries to send, :mod:`.selection`). This module runs them on one tensor:

    compress:   grad -> memory.accumulate -> select k -> values rounded to the wire dtype
                -> memory.update(what receivers will decode) -> message bytes
    decompress: N messages (one per rank, from an allgather) -> checked headers
                -> (1/N) * sum_r scatter_add(indices_r, values_r)

:meth:`SparseMethod.compress_bucket` runs the same stages once for a whole bucket of tensors
(:mod:`.bucket`), for the methods whose selection takes every segment at once (``bucketed``):
one memory pass over the flat buffer, every segment's selection at once, one message; its
decode is :meth:`~SparseMethod.decompress` of that one message.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, List, Optional, Sequence, Tuple

from . import wire
from .bucket import (Bucket, FromCandidates, Plan, block_bounds, next_bounds, segment_thresholds, select_candidates,
                     select_segments)
from .collectives import ALLGATHER
from .config import SparseConfig
from .memory import Accumulated
from .method import BucketCall, CompressCall, Method, State, StateLayout, state_dtype
from .nonfinite import flag, nan_unless, none_flagged, received_finite
from .ops import Scalar, Tensor, TensorOps, buffer_of
from .selection import candidate_capacity, filter_block, predict_bound, top_count, uses_bounds


@dataclass(frozen=True)
class Compressed:
    """One tensor's outgoing message and what it says, for statistics. ``state`` is the
    memory after this step, to be kept only if every rank's gradient was finite.
    ``next_bound``: the next step's ``CompressCall.candidate_bound`` (0 after a skipped
    step) for a method that ``collects_candidates``, else None; for a bucket, a tensor of each
    segment's (``BucketCall.candidate_bounds``; None after a skipped step). ``bounds_held``:
    for a bucket given bounds, whether its candidates held every segment's k (else it
    selected without them)."""

    message: Tensor
    state: State
    count: Scalar
    layout: wire.MessageLayout
    next_bound: Optional[Scalar] = None
    bounds_held: Optional[bool] = None


class SparseMethod(Method):
    """A sparse compression method; subclasses give the memory, selector and wire id."""

    family: ClassVar[str] = "sparse"
    # Whether select() filters candidates by block maxima (filter_block), which the memory's
    # accumulation then computes in the same pass.
    filters_blocks: ClassVar[bool] = False
    # Whether select() takes exactly the top-k and so can start from the candidates that the
    # memory's pass collects at a bound known before it (selection.predict_bound).
    collects_candidates: ClassVar[bool] = False
    config: SparseConfig

    def __init__(self, config: SparseConfig):
        super().__init__(config)
        self.memory = self.make_memory()

    @abstractmethod
    def make_memory(self) -> Any:
        """The error-feedback memory (an object of :mod:`.memory`)."""

    def memory_for(self, call: CompressCall) -> Any:
        """The memory that keeps ``call``'s tensor (the same state layout for every tensor)."""
        return self.memory

    @abstractmethod
    def select(self, ops: TensorOps, x: Tensor, k: int, call: CompressCall,
               accumulated: Accumulated) -> Tensor:
        """Positions (int64, ascending) of the entries of ``x`` to send; ``accumulated``: what
        the memory's pass made of the gradient (``x`` itself, its block maxima over blocks of
        ``filter_block(k, numel)`` entries for a method that ``filters_blocks``, candidates
        for one that ``collects_candidates``)."""

    def capacity(self, k: int, numel: int) -> int:
        """Slots in the message for a target of k entries."""
        return k

    def prepare(self, ops: TensorOps, grad: Tensor, call: CompressCall) -> Tuple[Tensor, Scalar]:
        """The gradient the memory accumulates, and a factor to scale it by (at least the
        inverse of the loss scale)."""
        return grad, call.unscale

    # -- per-tensor layout and state ----------------------------------------------------------
    def layout(self, name: str, numel: int, grad_dtype: str, density: float) -> wire.MessageLayout:
        k = top_count(density, numel)
        return wire.interned(wire.MessageLayout(
            name=name, method_id=self.method_id, numel=numel, capacity=self.capacity(k, numel),
            value_format=wire.value_format(grad_dtype, self.config.value_dtype)))

    def state_layout(self, compressed: bool) -> StateLayout:
        return StateLayout(self.memory.state_names if compressed else self.memory.dense_state_names)

    def exchanges(self, numel: int, grad_dtype: str, density: float,
                  world_size: int) -> Tuple[Tuple[str, int], ...]:
        return ((ALLGATHER, self.layout("", numel, grad_dtype, density).nbytes),)

    # -- a whole bucket at once ------------------------------------------------------------
    @property
    def bucketed(self) -> bool:
        """Whether :meth:`compress_bucket` takes this method's tensors: those whose selection
        runs on every segment of a bucket at once (``selects_buckets``), with values in a
        format that has no scale per message (int8's one scale would be the bucket's, not
        each tensor's)."""
        return self.selects_buckets and self.config.value_dtype != "int8"

    # Whether select_bucket() selects what select() would of each segment alone.
    selects_buckets: ClassVar[bool] = False

    def top_plan(self, plan: Plan) -> Plan:
        """The plan of the exact top of each segment that a bucket's selection starts from
        (:meth:`pick_from_top`): by default ``plan`` itself, each segment's top-k."""
        return plan

    def pick_from_top(self, ops: TensorOps, x: Tensor, plan: Plan, top: Tensor) -> Tuple[Tensor, Scalar]:
        """(positions in the bucket's flat numbering, ascending; how many) of what every
        segment of the flat buffer ``x`` sends, from ``top``, the positions of the exact top of
        each segment at :meth:`top_plan`: by default all of them."""
        return top, plan.total

    def select_bucket(self, ops: TensorOps, x: Tensor, plan: Plan,
                      maxima: Optional[Tensor] = None) -> Tuple[Tensor, Scalar]:
        """:meth:`pick_from_top` of :func:`~.bucket.select_segments` at :meth:`top_plan`.
        ``maxima``: ``x``'s block maxima at ``plan.block``, where the memory's pass took them."""
        return self.pick_from_top(ops, x, plan, select_segments(ops, x, self.top_plan(plan), maxima))

    def bucket_capacity(self, plan: Plan) -> int:
        """Slots in a bucket's message: by default ``plan.total``, every segment's k."""
        return plan.total

    def bucket_layout(self, bucket: Bucket, plan: Plan) -> wire.MessageLayout:
        """The message of a bucket: one header, up to ``bucket_capacity(plan)`` positions in
        the bucket's flat numbering, then their values."""
        return wire.interned(wire.MessageLayout(
            name=bucket.key, method_id=self.method_id, numel=bucket.numel, capacity=self.bucket_capacity(plan),
            value_format=wire.value_format(bucket.dtype, self.config.value_dtype)))

    def bucket_exchanges(self, plan: Plan, world_size: int) -> Tuple[Tuple[str, int], ...]:
        return ((ALLGATHER, self.bucket_layout(plan.bucket, plan).nbytes),)

    def prepare_bucket(self, ops: TensorOps, grad: Tensor, call: BucketCall) -> Tuple[Tensor, Scalar]:
        """:meth:`prepare` of every segment at once."""
        return grad, call.unscale

    def bucket_memory(self) -> Any:
        """The memory whose pass runs over a bucket's flat buffer (elementwise, so one pass
        serves every segment); :meth:`update_bucket` applies what differs per segment."""
        return self.memory

    def update_bucket(self, ops: TensorOps, state: State, positions: Tensor, sent: Tensor,
                      plan: Plan, large: Optional[Tensor] = None) -> State:
        """The memories after sending ``sent`` at ``positions``: ``plan``'s selection, segment
        after segment, or with ``large`` (those of ``positions`` in segments that are not
        small) any of its entries in any order."""
        return self.memory.update(ops, state, positions, sent)

    def compress_bucket(self, ops: TensorOps, state: State, grad: Tensor, call: BucketCall) -> Compressed:
        """The message of a bucket's flat gradient (laid out as ``call.bucket``, zero padding;
        or its :class:`~.ops.Pieces`, which only the memory's pass reads where they lie),
        and the memories after sending it: every segment's k entries of largest magnitude, as
        :meth:`compress` sends each of them, in one message. ``state``: the memories as flat
        buffers of the bucket's layout. Where sizes cost no wait, the exact top of each
        segment (:meth:`top_plan`) is taken from the candidates the memory's pass collects at
        each segment's bound (``call.candidate_bounds``) where they hold it, and the next
        bounds are predicted (``next_bound``)."""
        self.require_bucketed()
        plan = call.plan
        top_plan = self.top_plan(plan)
        layout = self.bucket_layout(call.bucket, plan)
        like = buffer_of(grad)
        bounded = call.keeps_bounds and uses_bounds(ops, like)
        bounds, capacity = block_bounds(ops, top_plan, call.candidate_bounds, like) if bounded else (None, 0)
        accumulated = self.bucket_memory().accumulate(ops, state, *self.prepare_bucket(ops, grad, call),
                                                      spare=call.spare, block=plan.block, bound=bounds,
                                                      capacity=capacity)

        def send(flags: Any = 0):
            x = accumulated.x
            found = (select_candidates(ops, top_plan, accumulated.candidates)
                     if accumulated.candidates is not None else FromCandidates(None, None, None))
            top, thresholds = found.positions, found.thresholds
            held = None if bounds is None else top is not None
            if top is None:
                top = select_segments(ops, x, top_plan, accumulated.block_max)
            positions, count = self.pick_from_top(ops, x, plan, top)
            header = layout.header(call.rank, call.step, count, flags)
            selected = ops.gather(x, positions)
            message, decoded = layout.encode(ops, header, positions, count, selected)
            sent = ops.cast(ops.slice(decoded, 0, count), ops.dtype(x))
            next_bound = None
            if bounded:
                if thresholds is None:
                    reached = selected if top is positions else ops.gather(x, top)
                    thresholds = segment_thresholds(ops, ops.cast(ops.abs(reached), "float32"), top_plan)
                next_bound = next_bounds(ops, top_plan, thresholds, bounds, found.counts)
            return (self.update_bucket(ops, accumulated.state, positions, sent, plan), message, count,
                    next_bound, held)

        def skip():
            header = layout.header(call.rank, call.step, 0, wire.FLAG_NONFINITE)
            return state, layout.empty(ops, header, like=like), 0, None, None

        if ops.defers_checks(like):
            new_state, message, count, next_bound, held = send(flag(ops, accumulated.finite))
        else:
            new_state, message, count, next_bound, held = ops.cond(accumulated.finite, send, skip)
        return Compressed(message=message, state=new_state, count=count, layout=layout, next_bound=next_bound,
                          bounds_held=held)

    # -- the two halves ---------------------------------------------------------------------
    def accumulate(self, ops: TensorOps, state: State, grad: Tensor,
                   call: CompressCall) -> Tuple[Accumulated, int]:
        """The memory's accumulation of a flat gradient (new tensors: a step that is not
        finite simply drops them), and k, how many entries to select from it."""
        numel = ops.numel(grad)
        k = top_count(call.density, numel)
        block = filter_block(k, numel) if self.filters_blocks else 0
        bounded = self.collects_candidates and block and uses_bounds(ops, grad)
        bound = call.candidate_bound if bounded else None
        capacity = candidate_capacity(bound, k, numel)
        memory = self.memory_for(call)
        return memory.accumulate(ops, state, *self.prepare(ops, grad, call), spare=call.spare,
                                 block=block, bound=bound if capacity else None,
                                 capacity=capacity), k

    def compress(self, ops: TensorOps, state: State, grad: Tensor, call: CompressCall) -> Compressed:
        """Message for a flat gradient, and the memory after sending it."""
        layout = self.layout(call.name, ops.numel(grad), ops.dtype(grad), call.density)
        accumulated, k = self.accumulate(ops, state, grad, call)

        def send(flags: Any = 0):
            x = accumulated.x
            positions = self.select(ops, x, k, call, accumulated)
            count = ops.size(positions)
            header = layout.header(call.rank, call.step, count, flags, call.traced_id)
            selected = ops.gather(x, positions)
            message, decoded = layout.encode(ops, header, positions, count, selected)
            sent = ops.cast(ops.slice(decoded, 0, count), ops.dtype(x))
            next_bound = 0.0
            if self.collects_candidates and uses_bounds(ops, x):
                next_bound = predict_bound(ops, ops.min_abs(selected), k, accumulated.candidates)
            return (self.memory_for(call).update(ops, accumulated.state, positions, sent), message, count,
                    next_bound)

        def skip():
            header = layout.header(call.rank, call.step, 0, wire.FLAG_NONFINITE, call.traced_id)
            return state, layout.empty(ops, header, like=grad), 0, 0.0

        if ops.defers_checks(grad):
            # No branch on the device's flag: a step that is not finite sends its selection
            # flagged, its memory (NaN) is staged like any other, and every rank drops the step.
            new_state, message, count, next_bound = send(flag(ops, accumulated.finite))
        else:
            new_state, message, count, next_bound = ops.cond(accumulated.finite, send, skip)
        return Compressed(message=message, state=new_state, count=count, layout=layout,
                          next_bound=next_bound if self.collects_candidates else None)

    def dense(self, ops: TensorOps, state: State, grad: Tensor, call: CompressCall) -> Tuple[Tensor, State]:
        """What to all-reduce for a tensor that is not compressed, and the new state."""
        return self.memory.dense(ops, state, *self.prepare(ops, grad, call), spare=call.spare)

    def dense_bucket(self, ops: TensorOps, state: State, grad: Tensor,
                     call: BucketCall) -> Tuple[Tensor, State]:
        return self.memory.dense(ops, state, *self.prepare_bucket(ops, grad, call), spare=call.spare)

    @property
    def pending_memory(self) -> str:
        return self.memory.pending

    def flush_worker(self, ops: TensorOps, state: State, grad: Tensor,
                     call: BucketCall) -> Tuple[Tensor, State]:
        return self.bucket_memory().flush(ops, state, *self.prepare_bucket(ops, ops.gathered(grad), call))

    def decompress(self, ops: TensorOps, gathered: Tensor, layouts: Sequence[wire.MessageLayout],
                   world_size: int, step: Any, out_dtypes: Sequence[str],
                   outs: Optional[Sequence[Optional[Tensor]]] = None,
                   traced_id: Any = None) -> Tuple[List[Tensor], Scalar]:
        """Average the messages of all ranks. ``gathered`` is the allgather of each rank's
        messages for ``layouts``, concatenated in that order. Returns one flat dense tensor
        per layout, ``sum over ranks r = 0..N-1 of scatter_add(indices_r, values_r / N)``
        (NaN for a tensor some rank flagged as not finite), and whether no rank flagged any.

        ``outs``: per layout, a flat tensor of its size in the state dtype whose contents are
        no longer needed (the gradient the message was built from), or None. Where the
        framework allows, the average is written over it: a fresh full-size tensor costs
        more than the whole decode (its first touch faults every page in).

        ``traced_id``: the id of the one tensor of ``layouts`` at run time, where one trace
        serves several tensors (``CompressCall.traced_id``)."""
        outs = list(outs) if outs is not None else [None] * len(layouts)
        sums = [ops.scratch(layout.numel, state_dtype(dtype), like=gathered) if out is None else out
                for layout, dtype, out in zip(layouts, out_dtypes, outs)]
        flags = None if traced_id is not None else ops.decode_sums(gathered, layouts, world_size, step,
                                                                     sums, 1.0 / world_size)
        if flags is None:
            sums, flags = _sum_messages(ops, gathered, layouts, world_size, step, sums, traced_id)
        averaged = [ops.cast(s, dtype) for s, dtype in zip(sums, out_dtypes)]
        names = [layout.name for layout in layouts]
        finite = received_finite(ops, self.config.nonfinite, flags, names, step, traced_id)

        def unflagged(t: int) -> Scalar:
            return none_flagged(ops, ops.strided_sample(flags, t, len(layouts)))

        def poisoned() -> List[Tensor]:
            # Only the tensors some rank flagged become NaN.
            return [nan_unless(ops, unflagged(t), a, d) for t, (a, d) in enumerate(zip(averaged, out_dtypes))]

        if ops.defers_checks(gathered):
            return poisoned(), finite  # no branch on the flags: see nan_unless
        return ops.cond(finite, lambda: averaged, poisoned), finite


def _sum_messages(ops: TensorOps, gathered: Tensor, layouts: Sequence[wire.MessageLayout],
                  world_size: int, step: Any, sums: List[Tensor],
                  traced_id: Any = None) -> Tuple[List[Tensor], Tensor]:
    """``TensorOps.decode_sums`` composed: every header checked, every rank's message of a
    tensor decoded at once and its positions checked (``wire.decode_senders``), then
    ``sums[t]`` = (1/N) * the sum over ranks of tensor t's messages. Returns the sums and
    each message's flags word."""
    flags, decoded = wire.decode_senders(ops, gathered, layouts, world_size, step,
                                         [ops.dtype(s) for s in sums], traced_id=traced_id)
    # Every rank's message of a tensor as one: a single scatter, in rank order.
    return ([ops.sum_sparse(s, [(positions, values, ops.numel(positions))], 1.0 / world_size)
             for s, (positions, values) in zip(sums, decoded)], flags)
