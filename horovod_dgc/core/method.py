"""What every method offers an engine, whatever its family: its identity and config, the
memories it keeps per tensor, and the update of a tensor it does not compress.

A family (:class:`~.sparse.SparseMethod`, :class:`~.twostage.TwoStageMethod`) adds how one
compressed tensor is exchanged; a method (``dgc.py``, ``scalecom.py``, ...) adds its memory
and selection. ``methods.py`` lists them all.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Optional, Tuple

from .bucket import Bucket, Plan, shards_of
from .collectives import network_bytes
from .config import CompressionConfig
from .ops import Scalar, Tensor, TensorOps
from .wire import tensor_id

State = Dict[str, Tensor]


def emptied(ops: TensorOps, state: State, name: str) -> State:
    """``state`` with memory ``name`` replaced by zeros (new storage: the old state may be
    kept if the step is dropped)."""
    held = state[name]
    return {**state, name: ops.zeros(ops.numel(held), ops.dtype(held), like=held)}


@dataclass(frozen=True)
class CompressCall:
    """What one compress call of one tensor knows besides the gradient.

    Attributes:
        name: the tensor's name, identical on every rank (the parameter name).
        rank, world_size: this worker and the number of workers.
        step: how many times this tensor was compressed before (0-based; a 0-d tensor
            inside a TensorFlow graph).
        density: density in force for this step (after warm-up).
        param: the parameter tensor (flat), needed only for weight decay.
        loss_scale: the factor the gradient was multiplied by (a mixed-precision loss
            scale; a number or a 0-d tensor): memories hold ``grad / loss_scale``, and the
            averaged update comes back in those unscaled units.
        weight_decay: this tensor's weight decay, when it differs from the config's (the
            fused optimizer's parameter groups); None: the config's.
        spare: memories of this tensor that nothing needs any more (those two steps old),
            whose storage the new memories may take, by name; None: new tensors. A fresh
            gradient-size tensor costs several read passes in page faults on its first touch.
        small: whether the tensor is small (``SparseConfig.is_small``), compressed at the
            small density; a method may keep its memory differently for those
            (:meth:`SparseMethod.memory_for`).
        candidate_bound: a magnitude predicted to lie a little below this step's k-th
            largest, from the tensor's last step (``Compressed.next_bound``; ScaleCom's
            ``StageHandover.next_bound``, from the rank's last step as leader), or None. Only
            for speed: with it the memory's pass of a method that ``collects_candidates`` (DGC,
            Top-k, ScaleCom's exact leader selection) collects its selection's candidates
            (``selection.predict_bound``); the selection is the exact top-k with or without it.
        traced_id: the tensor's id (``wire.tensor_id``) as a run-time value (a 0-d integer
            tensor), where one trace serves several tensors of one size and ``name`` is only
            the first of them (TensorFlow's shared exchanges); None: the id of ``name``.
    """

    name: str
    rank: int
    world_size: int
    step: Any
    density: float
    param: Optional[Tensor] = None
    loss_scale: Any = 1.0
    weight_decay: Optional[float] = None
    spare: Optional[State] = None
    small: bool = False
    candidate_bound: Optional[float] = None
    traced_id: Any = None

    @property
    def tensor_id(self) -> Any:
        """The tensor's id on the wire: ``traced_id``, else that of ``name``."""
        return tensor_id(self.name) if self.traced_id is None else self.traced_id

    @property
    def unscale(self) -> Any:
        """The factor that brings the gradient back to unscaled units."""
        return 1.0 / self.loss_scale


@dataclass(frozen=True)
class BucketCall:
    """What one compress of a bucket knows besides its flat gradient (``CompressCall``'s
    fields, per segment where they differ between tensors).

    Attributes:
        bucket: the bucket.
        rank, world_size: this worker and the number of workers.
        step: the step of every member tensor (they are compressed together).
        densities: each segment's density in force (after warm-up; a small segment's own).
        param: the parameters as a flat buffer laid out as the bucket (zero padding), needed
            only for weight decay.
        loss_scale: the factor the gradients were multiplied by (see ``CompressCall``).
        weight_decays: each segment's weight decay, when they differ from the config's; None:
            the config's for every segment.
        spare: memories nothing needs any more, by name, whose storage the new ones may take.
        candidate_bounds: each segment's ``CompressCall.candidate_bound`` (its tensor's, from
            its last step), or None where some tensor has none.
        keeps_bounds: whether the caller keeps the predicted bounds (``next_bound``) for the
            next step; a traced graph (TensorFlow's engine) has no host to keep them in.
    """

    bucket: Bucket
    rank: int
    world_size: int
    step: Any
    densities: Tuple[float, ...]
    param: Optional[Tensor] = None
    loss_scale: Any = 1.0
    weight_decays: Optional[Tuple[float, ...]] = None
    spare: Optional[State] = None
    candidate_bounds: Optional[Tuple[float, ...]] = None
    keeps_bounds: bool = True

    @property
    def unscale(self) -> Any:
        return 1.0 / self.loss_scale

    @property
    def plan(self) -> Plan:
        return Plan.at(self.bucket, self.densities)

    def as_call(self) -> CompressCall:
        """The bucket as one tensor's call, named by its key (for the stages of a two-stage
        method, which take one); its density is the share of the bucket's entries sent."""
        numel = sum(s.numel for s in self.bucket.segments)
        return CompressCall(name=self.bucket.key, rank=self.rank, world_size=self.world_size,
                            step=self.step, density=self.plan.total / numel, loss_scale=self.loss_scale)


@dataclass(frozen=True)
class StateLayout:
    """The memories a method keeps for one tensor, by name.

    Attributes:
        per_worker: state tensors with one entry per element of the tensor, on every worker.
        sharded: state tensors cut across the workers: rank j keeps entries
            ``[j * shard, (j + 1) * shard)`` of the tensor zero-padded to ``N * shard``,
            ``shard`` being :meth:`Method.shard_length` (blocksign's server residual).
    """

    per_worker: Tuple[str, ...] = ()
    sharded: Tuple[str, ...] = ()

    @property
    def names(self) -> Tuple[str, ...]:
        return self.per_worker + self.sharded


def shard_entries(numel: int, shard: int, j: int) -> int:
    """Entries of a tensor of ``numel`` elements inside rank j's shard of ``shard`` entries
    (:class:`StateLayout`'s sharding; the rest of the shard is padding)."""
    return max(0, min(shard, numel - j * shard))


def state_dtype(grad_dtype: str) -> str:
    """Memories of 16-bit gradients are kept in float32 so small updates are not lost."""
    return "float32" if grad_dtype in ("float16", "bfloat16") else grad_dtype


class Method(ABC):
    """A compression method as an engine runs it.

    Class attributes:
        method_id: the id its messages carry (unique: ``methods.py`` checks it).
        family: ``"sparse"`` or ``"two-stage"``, set by the family class.
    """

    method_id: ClassVar[int]
    family: ClassVar[str]
    config: CompressionConfig

    def __init__(self, config: CompressionConfig):
        self.config = config

    @property
    def table_class(self) -> str:
        """The class the method table lists this method under (saved with its state)."""
        return type(self).__name__

    @property
    def bucketed(self) -> bool:
        """Whether several tensors compress as one bucket (``SparseMethod.compress_bucket``);
        else each is compressed on its own."""
        return False

    @property
    def dense_bucketed(self) -> bool:
        """Whether :meth:`dense_bucket` takes a bucket of the tensors sent dense (doing to
        each what :meth:`dense` does); else each goes on its own."""
        return True

    def require_dense_bucketed(self) -> None:
        """Raises TypeError unless :attr:`dense_bucketed`."""
        if not self.dense_bucketed:
            raise TypeError(f"{type(self).__name__} with these settings sends its dense tensors "
                            f"one by one")

    def require_bucketed(self) -> None:
        """Raises TypeError unless the method compresses a bucket as one (:attr:`bucketed`)."""
        if not self.bucketed:
            raise TypeError(f"{type(self).__name__} with these settings does not compress in buckets "
                            f"and compresses tensor by tensor")

    def with_config(self, config: CompressionConfig) -> "Method":
        """The same method with other settings."""
        return type(self)(config)

    @abstractmethod
    def exchanges(self, numel: int, grad_dtype: str, density: float,
                  world_size: int) -> Tuple[Tuple[str, int], ...]:
        """The collectives (kinds of :mod:`.collectives`) one compressed tensor of ``numel``
        elements goes through at ``density`` among ``world_size`` workers, with the bytes
        each worker hands to each: the traffic model's input."""

    def bucket_exchanges(self, plan: Plan, world_size: int) -> Tuple[Tuple[str, int], ...]:
        """:meth:`exchanges` of the tensors of ``plan``'s bucket compressed as one (a method
        that is :attr:`bucketed`)."""
        raise NotImplementedError(f"{type(self).__name__} compresses tensor by tensor")

    def network_bytes(self, numel: int, grad_dtype: str, density: float, world_size: int) -> float:
        """Bytes one worker sends on the network for such a tensor: :meth:`exchanges` through
        Gloo's ring collectives (``collectives.network_bytes``)."""
        return sum(network_bytes(kind, nbytes, world_size)
                   for kind, nbytes in self.exchanges(numel, grad_dtype, density, world_size))

    @abstractmethod
    def state_layout(self, compressed: bool) -> StateLayout:
        """The memories of a tensor that is (or is not) compressed."""

    def shard_length(self, numel: int, world_size: int) -> int:
        """Entries of each rank's shard of a sharded memory (only methods that declare one)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no sharded memory")

    def init_state(self, ops: TensorOps, grad: Tensor, compressed: bool, world_size: int) -> State:
        """Zeroed memories for a flat gradient like ``grad``."""
        layout = self.state_layout(compressed)
        dtype, numel = state_dtype(ops.dtype(grad)), ops.numel(grad)
        state = {name: ops.zeros(numel, dtype, like=grad) for name in layout.per_worker}
        if layout.sharded:
            shard = self.shard_length(numel, world_size)
            state.update({name: ops.zeros(shard, dtype, like=grad) for name in layout.sharded})
        return state

    def state_buckets(self, bucket: Bucket, world_size: int) -> Dict[str, Bucket]:
        """Per memory, the layout of its flat buffer when ``bucket``'s tensors keep their
        memories as one: ``bucket`` itself for a per-worker memory, this rank's shards of every
        tensor (:func:`~.bucket.shards_of`, :meth:`shard_length` entries each) for a sharded one
        (the memories of a compressed tensor, or of one sent dense: ``bucket.compressed``)."""
        layout = self.state_layout(bucket.compressed)
        layouts = {name: bucket for name in layout.per_worker}
        if layout.sharded:
            shards = shards_of(bucket, tuple(self.shard_length(s.numel, world_size) for s in bucket.segments))
            layouts.update({name: shards for name in layout.sharded})
        return layouts

    def init_bucket_state(self, ops: TensorOps, bucket: Bucket, like: Tensor, world_size: int) -> State:
        """Zeroed memories of ``bucket``'s tensors kept as one, laid out as
        :meth:`state_buckets` says; ``like``: the bucket's flat gradient."""
        dtype = state_dtype(ops.dtype(like))
        return {name: ops.zeros(layout.numel, dtype, like=like)
                for name, layout in self.state_buckets(bucket, world_size).items()}

    def dense(self, ops: TensorOps, state: State, grad: Tensor,
              call: CompressCall) -> Tuple[Tensor, State]:
        """What to all-reduce for a tensor that is not compressed, and the new state."""
        return grad, state

    def dense_bucket(self, ops: TensorOps, state: State, grad: Tensor,
                     call: BucketCall) -> Tuple[Tensor, State]:
        """:meth:`dense` of every tensor of a bucket that is not compressed, at once:
        ``grad`` and ``state`` flat as the bucket lays them out (``state_buckets``)."""
        return grad, state

    # -- a compressed tensor sent dense (an adaptive switch, docs/algorithms.md#adaptive) -------
    @property
    def pending_memory(self) -> str:
        """The per-worker memory that holds what a worker has not sent yet (the residual;
        DGC's velocity), which a flush empties."""
        raise NotImplementedError(f"{type(self).__name__} cannot send a compressed tensor dense")

    def flush_worker(self, ops: TensorOps, state: State, grad: Tensor,
                     call: BucketCall) -> Tuple[Tensor, State]:
        """(a bucket's flat gradient, prepared as a compress prepares it, plus what the
        per-worker memories hold back; the state with :attr:`pending_memory` emptied), in the
        state's dtype and unscaled units."""
        raise NotImplementedError(f"{type(self).__name__} cannot send a compressed bucket dense")

    def flush_bucket(self, ops: TensorOps, state: State, grad: Tensor, call: BucketCall,
                     wire_dtype: str) -> Tuple[Tensor, State]:
        """A compressed bucket's dense step: what this worker hands to an averaging all-reduce
        for its flat gradient, in ``wire_dtype`` and the loss scale's units, and the new state
        (the memories the compressed steps keep, laid out as :meth:`state_buckets` says). A
        tensor alone is a bucket of one.

        The average of every worker's flush is every update the bucket owes: each worker's
        gradient and per-worker memories, and (a sharded memory such as blocksign's server
        residual or the sparse all-reduce's owner residual) ``world_size`` times this rank's
        shard added where the shard lies. The memories are then empty but for what
        ``wire_dtype`` rounds away (kept in :attr:`pending_memory`, so that nothing is lost),
        and a momentum continues. A bucket that stays dense flushes every step: its memories
        hold only that rounding, and its updates are momentum SGD's (or SGD's)."""
        total, state = self.flush_worker(ops, state, grad, call)
        layout = self.state_layout(True)
        if layout.sharded:
            shards = self.state_buckets(call.bucket, call.world_size)[layout.sharded[0]]
            total, state = self._spread_shards(ops, total, state, call.bucket, shards, call.world_size, call.rank)
        return self._on_the_wire(ops, total, state, wire_dtype, call.loss_scale)

    def _spread_shards(self, ops: TensorOps, total: Tensor, state: State, bucket: Bucket, shards: Bucket,
                       world_size: int, rank: int) -> Tuple[Tensor, State]:
        """``total`` (laid out as ``bucket``) with ``world_size`` times this rank's shard of
        every sharded memory (laid out as ``shards``) added where it lies, and those memories
        emptied."""
        sharded = self.state_layout(True).sharded
        pieces, cursor = [], 0
        for segment, shard in zip(bucket.segments, shards.segments):
            length = shard_entries(segment.numel, shard.numel, rank)
            if length == 0:
                continue
            start = segment.offset + rank * shard.numel
            if start > cursor:
                pieces.append(ops.slice(total, cursor, start - cursor))
            part = ops.slice(total, start, length)
            for name in sharded:
                part = ops.add(part, ops.slice(state[name], shard.offset, length), 1.0, world_size)
            pieces.append(part)
            cursor = start + length
        if cursor < ops.numel(total):
            pieces.append(ops.slice(total, cursor, ops.numel(total) - cursor))
        for name in sharded:
            state = emptied(ops, state, name)
        return ops.concat(pieces), state

    def _on_the_wire(self, ops: TensorOps, total: Tensor, state: State, wire_dtype: str,
                     loss_scale: Scalar) -> Tuple[Tensor, State]:
        """``total`` in ``wire_dtype`` and the loss scale's units, and the state whose
        :attr:`pending_memory` keeps what that rounds away."""
        unscaled = isinstance(loss_scale, (int, float)) and loss_scale == 1.0
        if unscaled and wire_dtype == ops.dtype(total):
            return total, state
        sent = ops.cast(total if unscaled else ops.scale(ops.copy(total), loss_scale), wire_dtype)
        arrived = ops.cast(sent, ops.dtype(total))
        return sent, {**state, self.pending_memory: ops.add(total, arrived, 1.0, -1.0 / loss_scale)}
