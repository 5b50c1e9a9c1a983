"""Sparse all-reduce for the gathered sparse methods (DGC, Top-k, Gaussian-k), after Ok-Topk
(Li and Hoefler, PPoPP 2022), docs/algorithms.md#sparse-allreduce: each worker's traffic
stays about flat as workers are added, where an allgather's grows with N - 1.

The flat tensor is cut into N regions of ``R = ceil(numel / N)`` entries; worker j owns
region j and keeps an owner residual ``E_j`` for it (averaged units)::

    worker i:  p_i = the method's accumulation;  I_i = its selection of k entries
               to worker j (alltoall): the entries of I_i in region j, at most C_in of them
               (the largest); the rest stay in the worker's memory, as unselected ones do
    owner j:   P_j = E_j + (1/N) sum_i received_i
               J_j = exact top C_out of |P_j|;  E_j = P_j - P_j[J_j] as sent
    everyone:  update = sum_j scatter(J_j, P_j[J_j])      (an allgather of the N forwards)

``C_in = ceil(REGION_SLACK * capacity / N)`` and ``C_out = ceil(FORWARD_SLACK * k / N)`` are
fixed per tensor and density, so messages keep a fixed size. Nothing is lost, only delayed:
``(1/N) sum_i (sent_i) = update + change of sum_j E_j`` every step.

Regions are fixed, equal slices (not re-balanced from the selected indices): a region
holding more than its share of a worker's selection delays the excess by a step, in that
worker's memory (``make bench-regions`` measures how little that holds back).

**A bucket** (:meth:`SparseAllreduce.first_bucket`) keeps every tensor's regions, ``C_in``
and ``C_out``, and sends one message per destination: owner j's holds region j of every
tensor, in the numbering of :class:`BucketRegions`' ``owner`` layout (each tensor's region
at its own offset, as the owner keeps its residuals: one flat buffer, the tensors' shards
one after another), and each owner forwards one message with every tensor's ``C_out``. The
headers are then O(N) per bucket, not per tensor. The message to owner j has no slots for a
tensor whose region j is empty (one of fewer than N entries, past its end), so the alltoall's
chunks differ by destination (the same from every sender). A rank whose region of a tiny tensor is
shorter than ``C_out`` (the last rank's, past the tensor's end) may forward entries past
it: they are zero (nothing is ever added there), and the receivers add them to the tensor's
last entry, which leaves it as it is.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Tuple

from . import wire
from .bucket import Bucket, Plan, constant_tables, interned, select_segments, shards_of
from .collectives import ALLGATHER, ALLTOALL
from .config import GatheredConfig
from .method import BucketCall, CompressCall, Method, State, StateLayout, shard_entries, state_dtype
from .nonfinite import flag, nan_like, none_flagged, received_finite
from .ops import Scalar, Tensor, TensorOps
from .selection import magnitude_bits, select_exact, top_count
from .sparse import SparseMethod
from .twostage import StageHandover, TwoStageMethod

# Room per destination in the alltoall, relative to an even share of a worker's selection.
REGION_SLACK = 1.5
# Entries each owner forwards, relative to an even share of k: room for regions that hold
# more than their share of the largest sums (a fixed share per region delays them).
FORWARD_SLACK = 2.0
# Messages of the sparse all-reduce carry their method's id plus this, so that a rank set up
# for the other aggregation is named by the header check.
METHOD_ID_OFFSET = 16
# The tensor size "auto" compares the two aggregations on.
AUTO_NUMEL = 2 ** 20
# "auto" takes the sparse all-reduce only where it sends at most this share of the
# allgather's bytes: it costs a second collective, about twice the compute, and part of each
# update a step's delay in the owners' residuals, which a few percent of bytes do not repay
# (at 4 workers it sent 5% fewer bytes in steps 3x as long; docs/benchmarks.md).
AUTO_MOST_BYTES_SHARE = 0.5


# Sort keys of a region over its room: (group + 1) * 2**32 - (magnitude bits + 1), a group's
# entries together and its largest first (float32 magnitude bits are below 2**31).
_GROUP_SHIFT = 2 ** 32


@dataclass(frozen=True)
class BucketRegions:
    """A bucket's sparse all-reduce among ``world_size`` workers: what every rank's messages
    look like (the same on every rank).

    Attributes:
        plan: the bucket's plan (each tensor's k).
        world_size: the number of workers.
        owner: the owners' layout (:func:`~.bucket.shards_of`): tensor s's region of
            ``R_s = ceil(numel_s / N)`` entries at its own offset; an owner's residual and the
            positions of the messages to and from it are in this numbering.
        bounds: where each (tensor s, region j) starts in the bucket's numbering, s major,
            then where the last tensor ends: ascending, so that counting the selected
            positions below each gives every group's start.
        group_capacity: each group's ``C_in``: its tensor's, or the group's size if smaller
            (0 for a region past the tensor's end).
        group_shift: per group, what takes a bucket position in it to its sort key,
            ``owner offset_s - offset_s - j R_s + j * owner.numel`` (its owner position plus
            ``j * owner.numel``): sorting lays the positions out destination by destination,
            and destination j's keys less ``j * owner.numel`` are its owner positions.
        to_owners: the message to each destination: its groups' capacities.
        forward_plan: the owner's selection, each tensor's ``min(C_out, R_s)`` largest.
        forward: an owner's message.
        large_groups: per group, whether its tensor is large (DGC masks its momentum).
    """

    plan: Plan
    world_size: int
    owner: Bucket
    bounds: Tuple[int, ...]
    group_capacity: Tuple[int, ...]
    group_shift: Tuple[int, ...]
    to_owners: Tuple[wire.MessageLayout, ...]
    forward_plan: Plan
    forward: wire.MessageLayout
    large_groups: Tuple[bool, ...]

    @property
    def groups(self) -> int:
        return len(self.group_capacity)

    @property
    def chunks(self) -> Optional[Tuple[int, ...]]:
        """The alltoall's bytes to each destination, where they are not all equal."""
        sizes = tuple(layout.nbytes for layout in self.to_owners)
        return None if len(set(sizes)) == 1 else sizes

    def tables(self, ops: TensorOps, like: Tensor) -> "RegionTables":
        return constant_tables(self, RegionTables.build, ops, like)


@dataclass(frozen=True)
class RegionTables:
    """The constant tensors of :class:`BucketRegions` on a device: each group's capacity,
    shift and largeness, and per sending owner r the bucket position of each of its
    forwarded entries less its owner position (``sender_shifts``, rank after rank), capped at
    its tensor's last entry (``last_entries``, rank after rank)."""

    group_ids: Tensor
    group_capacity: Tensor
    group_shift: Tensor
    large_groups: Tensor
    sender_shifts: Tensor
    last_entries: Tensor

    @classmethod
    def build(cls, ops: TensorOps, regions: BucketRegions, like: Tensor) -> "RegionTables":
        def ints(values) -> Tensor:
            return ops.constant(list(values), "int64", like=like)

        bucket, owner, world = regions.plan.bucket, regions.owner, regions.world_size
        picks = regions.forward_plan.ks
        shifts = ints(v for r in range(world) for s, o, k in zip(bucket.segments, owner.segments, picks)
                      for v in [s.offset + r * o.numel - o.offset] * k)
        return cls(group_ids=ints(range(regions.groups)), group_capacity=ints(regions.group_capacity),
                   group_shift=ints(regions.group_shift),
                   large_groups=ops.greater_equal(ints(int(v) for v in regions.large_groups), 1),
                   sender_shifts=shifts,
                   last_entries=ints(v for _ in range(world) for s, k in zip(bucket.segments, picks)
                                     for v in [s.end - 1] * k))


class SparseAllreduce(TwoStageMethod):
    """A gathered sparse method (its memory and selection) exchanged by a sparse all-reduce."""

    FIRST = ALLTOALL
    SECOND = ALLGATHER
    config: GatheredConfig

    def __init__(self, inner: SparseMethod):
        super().__init__(inner.config)
        self.inner = inner
        self.method_id = inner.method_id + METHOD_ID_OFFSET

    @property
    def table_class(self) -> str:
        return self.inner.table_class

    def with_config(self, config: GatheredConfig) -> "SparseAllreduce":
        return SparseAllreduce(self.inner.with_config(config))

    # -- layout ---------------------------------------------------------------------------
    def state_layout(self, compressed: bool) -> StateLayout:
        worker = self.inner.state_layout(compressed)
        return StateLayout(worker.per_worker, ("owner_residual",) if compressed else ())

    def shard_length(self, numel: int, world_size: int) -> int:
        return math.ceil(numel / world_size)

    def region_layouts(self, name: str, numel: int, grad_dtype: str, density: float,
                       world_size: int) -> Tuple[wire.MessageLayout, wire.MessageLayout]:
        """(one region's message to its owner, an owner's forward): positions relative to
        the region's start."""
        region = self.shard_length(numel, world_size)
        k = top_count(density, numel)
        fmt = wire.value_format(grad_dtype, self.config.value_dtype)

        def layout(capacity: int) -> wire.MessageLayout:
            return wire.interned(wire.MessageLayout(name=name, method_id=self.method_id, numel=region,
                                                    capacity=capacity, value_format=fmt))

        return (layout(self.room_to_owner(k, numel, region, world_size)),
                layout(room_forwarded(k, region, world_size)))

    def room_to_owner(self, k: int, numel: int, region: int, world_size: int) -> int:
        """``C_in``: the most entries of a tensor's selection (of target ``k``) that one region's
        message to its owner holds."""
        return min(region, math.ceil(REGION_SLACK * self.inner.capacity(k, numel) / world_size))

    def exchanges(self, numel: int, grad_dtype: str, density: float,
                  world_size: int) -> Tuple[Tuple[str, int], ...]:
        to_owner, forward = self.region_layouts("", numel, grad_dtype, density, world_size)
        return (ALLTOALL, world_size * to_owner.nbytes), (ALLGATHER, forward.nbytes)

    # -- the method's work ------------------------------------------------------------------
    def dense(self, ops: TensorOps, state: State, grad: Tensor, call: CompressCall) -> Tuple[Tensor, State]:
        return self.inner.dense(ops, state, grad, call)

    @property
    def pending_memory(self) -> str:
        return self.inner.pending_memory

    def flush_worker(self, ops: TensorOps, state: State, grad: Tensor,
                     call: BucketCall) -> Tuple[Tensor, State]:
        return self.inner.flush_worker(ops, state, grad, call)

    # -- a whole bucket at once ------------------------------------------------------------
    @property
    def bucketed(self) -> bool:
        """Whether the inner method selects in buckets: then each tensor's regions travel
        in one message per destination and bucket (see the module's docstring)."""
        return self.inner.bucketed

    def bucket_exchanges(self, plan: Plan, world_size: int) -> Tuple[Tuple[str, int], ...]:
        regions = self.regions(plan, world_size)
        return (ALLTOALL, sum(layout.nbytes for layout in regions.to_owners)), (ALLGATHER, regions.forward.nbytes)

    def regions(self, plan: Plan, world_size: int) -> BucketRegions:
        """The sparse all-reduce of ``plan``'s bucket among ``world_size`` workers."""
        return _regions(self, plan, world_size)

    def first_bucket(self, ops: TensorOps, state: State, grad: Tensor,
                     call: BucketCall) -> Tuple[Tensor, State, StageHandover]:
        """:meth:`first` of a bucket's flat gradient (laid out as ``call.bucket``, zero
        padding): one message per destination holding every tensor's region. ``state``: the
        worker memories laid out as the bucket, the owner residual as ``regions.owner``."""
        plan, world = call.plan, call.world_size
        regions = self.regions(plan, world)
        to_owners = regions.to_owners
        memory = self.inner.bucket_memory()
        accumulated = memory.accumulate(ops, state, *self.inner.prepare_bucket(ops, grad, call), spare=call.spare,
                                        block=plan.block)

        def send() -> Tuple[State, Tensor]:
            x = accumulated.x
            positions, count = self.inner.select_bucket(ops, x, plan, accumulated.block_max)
            positions, groups = _fitted(ops, x, positions, count, regions)
            tables = regions.tables(ops, x)
            keys, order = ops.sort(ops.add(positions, ops.gather(tables.group_shift, groups), 1, 1))
            bases = [j * regions.owner.numel for j in range(world + 1)]
            starts = ops.searchsorted(keys, bases)
            headers = [layout.header(call.rank, call.step, 0, 0) for layout in to_owners]
            large = None
            if any(regions.large_groups) and not all(regions.large_groups):
                large = ops.gather(positions, ops.nonzero(ops.gather(tables.large_groups, groups)))
            positions = ops.gather(positions, order)
            message, decoded = wire.encode_runs(ops, to_owners, headers, keys, starts, x, positions, bases[:-1])
            worker = self.inner.update_bucket(ops, accumulated.state, positions, ops.cast(decoded, ops.dtype(x)),
                                              plan, large)
            return {**state, **worker}, message

        def skip() -> Tuple[State, Tensor]:
            return state, ops.concat([layout.empty(ops, layout.header(call.rank, call.step, 0, wire.FLAG_NONFINITE),
                                                   like=grad) for layout in to_owners])

        new_state, message = ops.cond(accumulated.finite, send, skip)
        handover = StageHandover(call.as_call(), call.bucket.numel, ops.dtype(grad),
                                 {"to_owner": to_owners[call.rank], "forward": regions.forward, "regions": regions},
                                 chunks=regions.chunks)
        return message, new_state, handover

    def first(self, ops: TensorOps, state: State, grad: Tensor,
              call: CompressCall) -> Tuple[Tensor, State, StageHandover]:
        numel, world = ops.numel(grad), call.world_size
        to_owner, forward = self.region_layouts(call.name, numel, ops.dtype(grad), call.density, world)
        region = to_owner.numel
        accumulated, k = self.inner.accumulate(ops, state, grad, call)

        def send() -> Tuple[State, Tensor]:
            x = accumulated.x
            positions = self.inner.select(ops, x, k, call, accumulated)
            starts = ops.searchsorted(positions, [j * region for j in range(world + 1)])
            messages, sent_positions, sent_values = [], [], []
            for j in range(world):
                start = ops.gather(starts, j)
                mine = self._fit(ops, x, ops.slice(positions, start, ops.gather(starts, j + 1) - start),
                                 to_owner.capacity)
                count = ops.size(mine)
                header = to_owner.header(call.rank, call.step, count, 0, call.traced_id)
                message, decoded = to_owner.encode(ops, header, mine - j * region, count,
                                                   ops.gather(x, mine))
                messages.append(message)
                sent_positions.append(mine)
                sent_values.append(ops.cast(ops.slice(decoded, 0, count), ops.dtype(x)))
            worker = self.inner.memory_for(call).update(ops, accumulated.state, ops.concat(sent_positions),
                                                        ops.concat(sent_values))
            return {**state, **worker}, ops.concat(messages)

        def skip() -> Tuple[State, Tensor]:
            header = to_owner.header(call.rank, call.step, 0, wire.FLAG_NONFINITE, call.traced_id)
            return state, ops.concat([to_owner.empty(ops, header, like=grad)] * world)

        new_state, message = ops.cond(accumulated.finite, send, skip)
        handover = StageHandover(call, numel, ops.dtype(grad),
                                 {"to_owner": to_owner, "forward": forward})
        return message, new_state, handover

    @staticmethod
    def _fit(ops: TensorOps, x: Tensor, positions: Tensor, capacity: int) -> Tensor:
        """``positions`` (ascending), or the ``capacity`` of them where ``|x|`` is largest."""
        def largest() -> Tensor:
            return ops.sort(ops.gather(positions, ops.topk_abs(ops.gather(x, positions), capacity)))[0]

        return ops.cond(ops.size(positions) > capacity, largest, lambda: positions)

    @staticmethod
    def _receive(ops: TensorOps, received: Tensor, layout: wire.MessageLayout,
                 handover: StageHandover) -> Tuple[Tensor, Tensor, Tensor]:
        """(each sender's flags word; every sender's ``capacity`` positions and values in the
        state dtype, 0 past its count, rank after rank) from the concatenation of one
        ``layout`` message per rank, headers and positions checked."""
        call = handover.call
        return wire.decode_end_to_end(ops, received, [(layout, r) for r in range(call.world_size)], call.step,
                                      state_dtype(handover.dtype), call.rank, call.traced_id)

    def second(self, ops: TensorOps, state: State, received: Tensor,
               handover: StageHandover) -> Tuple[Tensor, State]:
        """The owner's work on its region (of every tensor of a bucket); a sender's non-finite
        flag is passed on (with ``nonfinite="raise"`` every owner raises, naming the sender)."""
        call, to_owner, forward = handover.call, handover.data["to_owner"], handover.data["forward"]
        world, regions = call.world_size, handover.data.get("regions")
        flags, where, values = self._receive(ops, received, to_owner, handover)
        finite = received_finite(ops, self.config.nonfinite, flags, [call.name], call.step,
                                 call.traced_id)
        dtype = state_dtype(handover.dtype)
        # Rank after rank, as the senders' order sums them; the slots past a count add 0.
        total = ops.scatter_add(ops.copy(state["owner_residual"]), where, ops.scale(values, 1.0 / world))
        if regions is not None:
            capacity = forward.capacity
            chosen = select_segments(ops, total, regions.forward_plan)
        else:
            valid = shard_entries(handover.numel, to_owner.numel, call.rank)
            capacity = min(forward.capacity, valid)
            chosen = (select_exact(ops, ops.slice(total, 0, valid), capacity) if capacity
                      else ops.zeros(0, "int64", like=total))
        header = forward.header(call.rank, call.step, capacity, flag(ops, finite), call.traced_id)
        message, sent = forward.encode(ops, header, chosen, capacity, ops.gather(total, chosen))
        owner = ops.scatter_sub(total, chosen, ops.cast(ops.slice(sent, 0, capacity), dtype))
        return message, {**state, "owner_residual": owner}

    def finish(self, ops: TensorOps, received: Tensor, handover: StageHandover) -> Tuple[Tensor, Scalar]:
        forward, regions = handover.data["forward"], handover.data.get("regions")
        flags, where, values = self._receive(ops, received, forward, handover)
        finite = none_flagged(ops, flags)
        dtype = state_dtype(handover.dtype)
        update = (ops.zeros(handover.numel, dtype, like=received) if handover.destination is None
                  else ops.zeroed(handover.destination))
        if regions is not None:
            tables = regions.tables(ops, received)
            # Entries past a tensor's end (zeros: see the module's docstring) land on its last.
            update = ops.scatter_add(update, ops.minimum(ops.add(where, tables.sender_shifts, 1, 1),
                                                         tables.last_entries), values)
        else:
            capacity = forward.capacity
            for r in range(handover.call.world_size):
                if shard_entries(handover.numel, forward.numel, r):
                    update = ops.scatter_add(update, ops.slice(where, r * capacity, capacity) + r * forward.numel,
                                             ops.slice(values, r * capacity, capacity))
        update = ops.cast(update, handover.dtype)
        return ops.cond(finite, lambda: update,
                        lambda: nan_like(ops, handover.numel, handover.dtype, update)), finite


def room_forwarded(k: int, region: int, world_size: int) -> int:
    """``C_out``: the most entries an owner forwards of a tensor's region (target ``k``)."""
    return min(region, math.ceil(FORWARD_SLACK * k / world_size))


@functools.lru_cache(maxsize=1024)
def _regions(method: SparseAllreduce, plan: Plan, world_size: int) -> BucketRegions:
    bucket = plan.bucket
    lengths = tuple(method.shard_length(s.numel, world_size) for s in bucket.segments)
    owner = shards_of(bucket, lengths)
    bounds, capacity, shift, large, forward_ks = [], [], [], [], []
    for s, o, k, region in zip(bucket.segments, owner.segments, plan.ks, lengths):
        room = method.room_to_owner(k, s.numel, region, world_size)
        forward_ks.append(room_forwarded(k, region, world_size))
        for j in range(world_size):
            bounds.append(s.offset + min(j * region, s.numel))
            capacity.append(min(room, max(0, min(region, s.numel - j * region))))
            shift.append(o.offset - s.offset - j * region + j * owner.numel)
            large.append(not s.small)
    bounds.append(bucket.segments[-1].end)
    fmt = wire.value_format(bucket.dtype, method.config.value_dtype)

    def layout(slots: int) -> wire.MessageLayout:
        return wire.interned(wire.MessageLayout(name=bucket.key, method_id=method.method_id, numel=owner.numel,
                                                capacity=slots, value_format=fmt))

    forward_plan = interned(Plan(owner, tuple(forward_ks), plan.block))
    to_owners = tuple(layout(sum(capacity[j::world_size])) for j in range(world_size))
    return BucketRegions(plan=plan, world_size=world_size, owner=owner, bounds=tuple(bounds),
                         group_capacity=tuple(capacity), group_shift=tuple(shift),
                         to_owners=to_owners, forward_plan=forward_plan,
                         forward=layout(forward_plan.total), large_groups=tuple(large))


def _fitted(ops: TensorOps, x: Tensor, positions: Tensor, count: Scalar,
            regions: BucketRegions) -> Tuple[Tensor, Tensor]:
    """(the selected ``positions`` that go to their owners, ascending; each one's group):
    all of them, unless a group (tensor s, region j) holds more than its tensor's ``C_in``,
    whose largest ``|x|`` then go (the rest stay in the worker's memory, as per tensor)."""
    tables = regions.tables(ops, x)
    starts = ops.searchsorted(positions, regions.bounds)
    counts = ops.differences(starts)
    groups = ops.repeat_each(tables.group_ids, counts, count)

    def largest() -> Tuple[Tensor, Tensor]:
        keys = ops.add(ops.scale(ops.add(groups, 1, 1, 1), _GROUP_SHIFT),
                       ops.add(magnitude_bits(ops, ops.gather(x, positions)), 1, 1, 1), 1, -1)
        _, order = ops.sort(keys)
        ranked = ops.gather(groups, order)
        within = ops.add(ops.arange(count, like=positions), ops.gather(starts, ranked), 1, -1)
        kept = ops.sort(ops.gather(order, ops.nonzero(ops.greater_equal(
            ops.gather(tables.group_capacity, ranked), ops.add(within, 1, 1, 1)))))[0]
        return ops.gather(positions, kept), ops.gather(groups, kept)

    fits = ops.all_within(counts, 0, tables.group_capacity)
    return ops.cond(fits, lambda: (positions, groups), largest)


def bytes_share(inner: SparseMethod, world_size: int, numel: int = AUTO_NUMEL) -> float:
    """The bytes a worker sends by sparse all-reduce over those it sends by allgather, for a
    float32 tensor of ``numel`` elements at the config's density among ``world_size``."""
    def per_worker(method: Method) -> float:
        return method.network_bytes(numel, "float32", inner.config.density, world_size)

    return per_worker(SparseAllreduce(inner)) / per_worker(inner)


def aggregated(inner: SparseMethod, world_size: Optional[int]) -> Method:
    """``inner`` exchanged as its config's ``aggregation`` says (``"auto"`` needs
    ``world_size``)."""
    choice = inner.config.aggregation
    if choice == "auto":
        if world_size is None:
            raise ValueError("aggregation='auto' picks by the number of workers: build the "
                             "compressor after hvd.init() (for a DDP hook, after "
                             "torch.distributed.init_process_group()), or give "
                             "aggregation='allgather' or 'sparse_allreduce'")
        pays = world_size > 1 and bytes_share(inner, world_size) <= AUTO_MOST_BYTES_SHARE
        choice = "sparse_allreduce" if pays else "allgather"
    return SparseAllreduce(inner) if choice == "sparse_allreduce" else inner
