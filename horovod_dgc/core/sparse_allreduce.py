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
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

from . import wire
from .collectives import ALLGATHER, ALLTOALL
from .config import GatheredConfig
from .method import CompressCall, Method, State, StateLayout, shard_entries, state_dtype
from .nonfinite import flag, nan_like, none_flagged, received_finite
from .ops import Scalar, Tensor, TensorOps
from .selection import select_exact, top_count
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
        gathered = self.inner.capacity(k, numel)
        fmt = wire.value_format(grad_dtype, self.config.value_dtype)

        def layout(capacity: int) -> wire.MessageLayout:
            return wire.interned(wire.MessageLayout(name=name, method_id=self.method_id, numel=region,
                                                    capacity=min(region, capacity), value_format=fmt))

        return (layout(math.ceil(REGION_SLACK * gathered / world_size)),
                layout(math.ceil(FORWARD_SLACK * k / world_size)))

    def exchanges(self, numel: int, grad_dtype: str, density: float,
                  world_size: int) -> Tuple[Tuple[str, int], ...]:
        to_owner, forward = self.region_layouts("", numel, grad_dtype, density, world_size)
        return (ALLTOALL, world_size * to_owner.nbytes), (ALLGATHER, forward.nbytes)

    # -- the method's work ------------------------------------------------------------------
    def dense(self, ops: TensorOps, state: State, grad: Tensor, call: CompressCall) -> Tuple[Tensor, State]:
        return self.inner.dense(ops, state, grad, call)

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
                 handover: StageHandover) -> Tuple[Tensor, List[Tuple[Tensor, Tensor]]]:
        """(each sender's flags word, each sender's (positions, values) in the state dtype)
        from the concatenation of one ``layout`` message per rank, headers and positions
        checked."""
        call = handover.call
        expected = [(layout, r) for r in range(call.world_size)]
        flags, messages = wire.decode_received(ops, received, expected, call.step,
                                               [state_dtype(handover.dtype)] * len(expected), call.rank,
                                               call.traced_id)
        return flags, [(where, values) for where, values, _ in messages]

    def second(self, ops: TensorOps, state: State, received: Tensor,
               handover: StageHandover) -> Tuple[Tensor, State]:
        """The owner's work on its region; a sender's non-finite flag is passed on (with
        ``nonfinite="raise"`` every owner raises, naming the sender)."""
        call, to_owner, forward = handover.call, handover.data["to_owner"], handover.data["forward"]
        world, region = call.world_size, to_owner.numel
        flags, entries = self._receive(ops, received, to_owner, handover)
        finite = received_finite(ops, self.config.nonfinite, flags, [call.name], call.step,
                                 call.traced_id)
        dtype = state_dtype(handover.dtype)
        total = ops.copy(state["owner_residual"])
        for where, values in entries:
            total = ops.scatter_add(total, where, ops.scale(ops.copy(values), 1.0 / world))
        valid = shard_entries(handover.numel, region, call.rank)
        capacity = min(forward.capacity, valid)
        if capacity:
            chosen = select_exact(ops, ops.slice(total, 0, valid), capacity)
        else:
            chosen = ops.zeros(0, "int64", like=total)
        header = forward.header(call.rank, call.step, capacity, flag(ops, finite), call.traced_id)
        message, sent = forward.encode(ops, header, chosen, capacity, ops.gather(total, chosen))
        owner = ops.scatter_sub(total, chosen, ops.cast(ops.slice(sent, 0, capacity), dtype))
        return message, {**state, "owner_residual": owner}

    def finish(self, ops: TensorOps, received: Tensor, handover: StageHandover) -> Tuple[Tensor, Scalar]:
        forward = handover.data["forward"]
        flags, entries = self._receive(ops, received, forward, handover)
        finite = none_flagged(ops, flags)
        update = ops.zeros(handover.numel, state_dtype(handover.dtype), like=received)
        for r, (where, values) in enumerate(entries):
            if shard_entries(handover.numel, forward.numel, r):
                update = ops.scatter_add(update, where + r * forward.numel, values)
        update = ops.cast(update, handover.dtype)
        return ops.cond(finite, lambda: update,
                        lambda: nan_like(ops, handover.numel, handover.dtype, update)), finite


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
