"""Blockwise 1-bit compression with two-way error feedback (Zheng, Huang, Kwok, NeurIPS 2019:
dist-EF-blockSGDM), docs/algorithms.md#blocksign.

    C(v)_b = (||v_b||_1 / d_b) * sign(v_b)            (sign(0) = +1: one bit per entry)
    worker i: p_i = g_i (+ Nesterov momentum) + e_i;  D_i = C(p_i);  e_i = p_i - D_i
    server:   P = mean_i D_i + E;  D = C(P);  E = P - D;  every worker applies D

Horovod has no parameter server, so the server is sharded across the workers: the flat
tensor, padded to ``N * shard`` entries, is cut into N shards; an alltoall brings shard j of
every worker's packed signs and block scales to worker j, which averages them, adds its
server residual, compresses again, and an allgather returns every shard to everyone.

**A bucket** (:meth:`BlockSign.first_bucket`) keeps each tensor's blocks and shards and sends
one message per destination: owner j's holds shard j of every tensor, laid out as the owner
keeps its server residuals (:func:`~.bucket.shards_of`), and each owner returns one message.
Shards are multiples of 8 entries and segments start at multiples of 64, so every byte of
packed signs belongs to one tensor, one shard and one block (a block size, where given, is a
multiple of 8): the moves between the two layouts are gathers of bytes. Block sums and scales
go by chunks of 64 entries (of ``gcd(64, block size)``), each inside one tensor's block
(:class:`SignShards`).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar, List, Optional, Sequence, Tuple

from . import wire
from .bucket import ALIGN, Bucket, Plan, constant_tables, shards_of
from .collectives import ALLGATHER, ALLTOALL
from .config import CompressionConfig
from .method import BucketCall, CompressCall, State, StateLayout, emptied, shard_entries, state_dtype
from .memory import reuse
from .nonfinite import flag, nan_unless, none_flagged, received_finite
from .ops import Scalar, Tensor, TensorOps
from .twostage import StageHandover, TwoStageMethod
from .validation import require_momentum, require_positive_int


@dataclass(frozen=True)
class BlockSignConfig(CompressionConfig):
    """Blocksign's settings (and :class:`CompressionConfig`'s).

    Attributes:
        block_size: elements per scaled block; None: one block per tensor on the worker
            and one per shard on the server.
        momentum: Nesterov momentum kept by each worker before compressing, in [0, 1).
    """

    block_size: Optional[int] = None
    momentum: float = 0.0
    # dist-EF-blockSGDM's momentum is Nesterov's, not an option (the fused optimizer warns when
    # it moves a plain SGD's momentum here).
    nesterov: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size is not None:
            require_positive_int("block_size", self.block_size)
        require_momentum("momentum", self.momentum)

    @property
    def needs_plain_optimizer(self) -> bool:
        return self.momentum > 0.0


def shard_length(numel: int, world_size: int, block_size: Optional[int]) -> int:
    """Entries per shard: a multiple of 8 (packed signs) and of the block size."""
    unit = 8 if block_size is None else math.lcm(8, block_size)
    return max(1, math.ceil(numel / world_size / unit)) * unit


# Block scales travel in float32 whatever the gradient's dtype: a float64 model's scales are
# rounded before its residual is taken, so the residual keeps what the rounding loses.
SCALE_DTYPE = "float32"


def block_scales(ops: TensorOps, sums: Tensor, block: int, valid: int, length: int) -> Tensor:
    """``||x_b||_1 / d_b`` (in :data:`SCALE_DTYPE`) per block of ``x`` zero-padded to
    ``length`` entries, from the block sums ``sums`` of its first ``valid`` entries; d_b
    counts the block's entries below ``valid``."""
    sums = ops.pad(sums, -(-length // block))
    full, rest = valid // block, valid % block
    parts = [ops.scale(ops.slice(sums, 0, full), 1.0 / block)]
    if rest:
        parts.append(ops.scale(ops.slice(sums, full, 1), 1.0 / rest))
    tail = ops.numel(sums) - full - (1 if rest else 0)
    if tail:
        parts.append(ops.slice(sums, ops.numel(sums) - tail, tail))
    return ops.cast(ops.concat(parts), SCALE_DTYPE)


# Entries per byte of packed signs: a bucket's layouts are mapped onto each other a byte at a time.
BYTE = 8


@dataclass(frozen=True)
class SignShards:
    """A bucket's blocksign exchange among ``world_size`` workers, as ``rank`` runs it: where
    every byte of packed signs and every block scale goes. Only the server's tables depend on
    the rank (the shard it owns).

    A tensor's worker blocks cover it padded to ``N * shard`` entries (one block in all
    without a block size), its owner blocks one shard (one per shard without a block size),
    as for the tensor alone.

    Attributes:
        bucket: the bucket.
        world_size, rank: the number of workers, and the rank these tables are for.
        block_size: the config's (None: one block per tensor and per shard).
        method_id: the id its messages carry.
        owner: one rank's shard of every tensor laid out as a bucket (the server residual's
            layout, and the messages' in both stages).
        owner_blocks: blocks of one rank's shards.
        sent_counts: per destination, the entries of its shards that lie inside their tensors
            (its messages' count word).
    """

    bucket: Bucket
    world_size: int
    rank: int
    block_size: Optional[int]
    method_id: int
    owner: Bucket
    owner_blocks: int
    sent_counts: Tuple[int, ...]

    @classmethod
    def of(cls, bucket: Bucket, world_size: int, rank: int, block_size: Optional[int],
           method_id: int) -> "SignShards":
        return _sign_shards(bucket, world_size, rank, block_size, method_id)

    @property
    def layout(self) -> wire.PartsLayout:
        """One message of either stage: the owner layout's packed signs and its block scales."""
        return wire.interned(wire.PartsLayout(
            name=self.bucket.key, method_id=self.method_id, numel=self.bucket.numel, capacity=self.owner.numel,
            part_list=(("uint8", self.owner.numel // BYTE), (SCALE_DTYPE, self.owner_blocks))))

    @property
    def worker_blocks(self) -> int:
        """Blocks of every tensor's worker scales (one per tensor without a block size, else N
        times a shard's)."""
        return (1 if self.block_size is None else self.world_size) * self.owner_blocks

    def owner_block_count(self, shard: int) -> int:
        """Blocks of one shard of ``shard`` entries."""
        return _blocks_per_shard(shard, self.block_size)

    def worker_block_count(self, shard: int) -> int:
        """Blocks of a tensor cut into shards of ``shard`` entries (one without a block size)."""
        return (1 if self.block_size is None else self.world_size) * self.owner_block_count(shard)

    def blocks_of(self, base: int, valid: int, length: int, unit: int, beyond: int) -> List[int]:
        """The block of each run of ``unit`` entries of ``length`` (a multiple of ``unit``, which
        divides the block size): ``base`` plus its block within, for the runs that start below
        ``valid``, and ``beyond`` for the rest."""
        inside = -(-valid // unit)
        if self.block_size is None:
            listed = [base] * inside
        else:
            per_block = self.block_size // unit
            listed = [base + r // per_block for r in range(inside)]
        return listed + [beyond] * (length // unit - inside)

    def block_counts(self, numel: int, blocks: int) -> List[int]:
        """Entries below ``numel`` in each of ``blocks`` blocks (one block: all of them)."""
        if self.block_size is None:
            return [numel]
        return [max(0, min(self.block_size, numel - b * self.block_size)) for b in range(blocks)]

    @property
    def chunk(self) -> int:
        """Entries summed and scaled as one: a divisor of ALIGN and of the block size, so that
        a chunk of a segment (of an owner's shard) lies in one block."""
        return ALIGN if self.block_size is None else math.gcd(ALIGN, self.block_size)

    def tables(self, ops: TensorOps, like: Tensor) -> "SignTables":
        return constant_tables(self, SignTables.build, ops, like)


@functools.lru_cache(maxsize=1024)
def _sign_shards(bucket: Bucket, world_size: int, rank: int, block_size: Optional[int],
                 method_id: int) -> SignShards:
    lengths = tuple(shard_length(s.numel, world_size, block_size) for s in bucket.segments)
    owner_blocks = sum(_blocks_per_shard(n, block_size) for n in lengths)
    sent = tuple(sum(shard_entries(s.numel, n, j) for s, n in zip(bucket.segments, lengths))
                 for j in range(world_size))
    return SignShards(bucket, world_size, rank, block_size, method_id, shards_of(bucket, lengths), owner_blocks,
                      sent)


def _blocks_per_shard(shard: int, block_size: Optional[int]) -> int:
    return 1 if block_size is None else shard // block_size


def _tail(start: int, valid: int, chunk: int) -> List[int]:
    """Positions of the padding that shares a chunk with the last of ``valid`` entries at ``start``."""
    return list(range(start + valid, start + -(-valid // chunk) * chunk))


@dataclass(frozen=True)
class SignTables:
    """The constant tensors of :class:`SignShards` on a device (int64 unless said). Chunks
    and bytes past a tensor's (on the server, a shard's) last entry take the scale of a last,
    zero slot.

    Attributes:
        worker_chunk_block: per chunk of the bucket, its worker block.
        worker_inverse: per worker block, ``1 / d_b`` (0 where it holds no entry), and the
            zero slot's 0 (in the memories' dtype).
        worker_tail: the bucket's padding that shares a chunk with a tensor's last entry
            (None: none), zeroed after each decode.
        send_frame: the :func:`~.wire.set_table` of every destination's message, destination
            after destination: its header, the packed bytes and the worker scales of its
            shards in the owner layout.
        owner_chunk_block, server_inverse, server_tail: as the worker's, for this rank's
            shards (entries past each tensor's end are padding).
        received_scales: per sender and chunk of this rank's shards, where the chunk's scale
            lies among the float32 words of the received messages (or the zero slot after
            them).
        return_frame: the :func:`~.wire.set_table` of the message this rank returns.
        gather_bytes, gather_scales: per byte of the bucket, where it and its scale lie in
            the owners' messages (bytes; float32 words, or the zero slot after them).
    """

    worker_chunk_block: Tensor
    worker_inverse: Tensor
    worker_tail: Optional[Tensor]
    send_frame: Tensor
    owner_chunk_block: Tensor
    server_inverse: Tensor
    server_tail: Optional[Tensor]
    received_scales: Tensor
    return_frame: Tensor
    gather_bytes: Tensor
    gather_scales: Tensor

    @classmethod
    def build(cls, ops: TensorOps, shards: SignShards, like: Tensor) -> "SignTables":
        world, chunk, layout = shards.world_size, shards.chunk, shards.layout
        owner_bytes, blocks = shards.owner.numel // BYTE, shards.owner_blocks
        # Scales are read as the float32 words of the received messages, and a zero slot
        # after them.
        zero_scale = world * layout.nbytes // 4
        worker_chunk_block, worker_counts, worker_tail = [], [], []
        owner_chunk_block, server_counts, server_tail = [], [], []
        gather_bytes, gather_scales = [], []
        send_bytes: List[List[int]] = [[] for _ in range(world)]
        send_scales: List[List[int]] = [[] for _ in range(world)]
        worker_base = owner_base = 0
        for s, o in zip(shards.bucket.segments, shards.owner.segments):
            n, shard = s.numel, o.numel
            worker_chunk_block += shards.blocks_of(worker_base, n, s.span, chunk, shards.worker_blocks)
            worker_counts += shards.block_counts(n, shards.worker_block_count(shard))
            worker_tail += _tail(s.offset, n, chunk)
            valid = shard_entries(n, shard, shards.rank)
            owner_chunk_block += shards.blocks_of(owner_base, valid, o.span, chunk, blocks)
            server_counts += shards.block_counts(valid, shards.owner_block_count(shard))
            server_tail += _tail(o.offset, valid, chunk)
            last_byte = (s.offset + n - 1) // BYTE
            for j in range(world):
                inside = shard_entries(n, shard, j)
                first = (s.offset + j * shard) // BYTE
                sent = -(-inside // BYTE)
                send_bytes[j] += list(range(first, first + sent)) + [last_byte] * (o.span // BYTE - sent)
                send_scales[j] += [worker_base + b + (0 if shards.block_size is None else j * shard // shards.block_size)
                                   for b in range(shards.owner_block_count(shard))]
                # This segment's bytes of shard j: where they lie among the owners' messages.
                at = wire.part_at(layout, j, 0) + o.offset // BYTE
                gather_bytes += range(at, at + sent)
                gather_scales += shards.blocks_of(wire.part_at(layout, j, 1) // 4 + owner_base, inside,
                                                  sent * BYTE, BYTE, zero_scale)
            padding = s.span // BYTE - -(-n // BYTE)
            gather_bytes += [0] * padding
            gather_scales += [zero_scale] * padding
            worker_base += shards.worker_block_count(shard)
            owner_base += shards.owner_block_count(shard)
        dtype = state_dtype(shards.bucket.dtype)

        def ints(values: Sequence[int]) -> Tensor:
            return ops.constant(list(values), "int64", like=like)

        def inverses(counts: Sequence[int]) -> Tensor:
            return ops.constant([1.0 / c if c else 0.0 for c in counts] + [0.0], dtype, like=like)

        return cls(worker_chunk_block=ints(worker_chunk_block), worker_inverse=inverses(worker_counts),
                   worker_tail=ints(worker_tail) if worker_tail else None,
                   send_frame=ints(wire.set_table(layout, list(zip(send_bytes, send_scales)),
                                                  [shards.bucket.numel // BYTE, shards.worker_blocks + 1])),
                   owner_chunk_block=ints(owner_chunk_block), server_inverse=inverses(server_counts),
                   server_tail=ints(server_tail) if server_tail else None,
                   received_scales=ints([zero_scale if b == blocks else wire.part_at(layout, r, 1) // 4 + b
                                         for r in range(world) for b in owner_chunk_block]),
                   return_frame=ints(wire.set_table(layout, [(range(owner_bytes), range(blocks))],
                                                    [owner_bytes, blocks + 1])),
                   gather_bytes=ints(gather_bytes), gather_scales=ints(gather_scales))


def _scales_by_block(ops: TensorOps, chunk_sums: Tensor, chunk_block: Tensor, inverse: Tensor) -> Tensor:
    """``||x_b||_1 / d_b`` (in :data:`SCALE_DTYPE`) per block and a last zero slot, from the
    sums of ``|x|`` over each chunk and each chunk's block. Summed in float64 and rounded
    once, as :meth:`~.ops.TensorOps.block_abs_sum` sums a tensor alone."""
    totals = ops.scatter_add(ops.zeros(ops.numel(inverse), "float64", like=chunk_sums), chunk_block,
                             ops.cast(chunk_sums, "float64"))
    return ops.cast(ops.multiply(ops.cast(totals, ops.dtype(chunk_sums)), inverse), SCALE_DTYPE)


def server_average(ops: TensorOps, total: Tensor, state: State, world_size: int) -> Tensor:
    """The server's ``P = mean_i C(p_i) + E`` from the sum of the workers' decoded shards."""
    return ops.scale_add(ops.scale(total, 1.0 / world_size), 1.0, state["server"])


def _exchanges(message_bytes: int, world_size: int) -> Tuple[Tuple[str, int], ...]:
    """The alltoall of one message per destination, then the allgather of one."""
    return (ALLTOALL, world_size * message_bytes), (ALLGATHER, message_bytes)


def _scale_words(ops: TensorOps, received: wire.Received) -> Tensor:
    """The received messages read as float32 words (where their scales lie), and a zero slot."""
    words = ops.from_bytes(received.data, SCALE_DTYPE)
    return ops.pad(words, ops.numel(words) + 1)


def _zero_tail(ops: TensorOps, x: Tensor, tail: Optional[Tensor]) -> Tensor:
    """``x`` with the padding in its tensors' last chunks zeroed (a decode gave it a sign)."""
    return x if tail is None else ops.scatter_zero(x, tail)


class BlockSign(TwoStageMethod):
    method_id = 5
    FIRST = ALLTOALL
    SECOND = ALLGATHER
    config: BlockSignConfig

    def __init__(self, config: BlockSignConfig = BlockSignConfig()):
        super().__init__(config)

    def state_layout(self, compressed: bool) -> StateLayout:
        momentum = ("momentum",) if self.config.momentum else ()
        if not compressed:
            return StateLayout(momentum)
        return StateLayout(momentum + ("residual",), sharded=("server",))

    def shard_length(self, numel: int, world_size: int) -> int:
        return shard_length(numel, world_size, self.config.block_size)

    def _worker_block(self, numel: int) -> int:
        return self.config.block_size or numel

    def _server_block(self, shard: int) -> int:
        return self.config.block_size or shard

    def layout(self, name: str, numel: int, world_size: int) -> wire.PartsLayout:
        """One shard's message (the same shape in both stages)."""
        shard = self.shard_length(numel, world_size)
        scales = shard // self._server_block(shard)
        return wire.interned(wire.PartsLayout(name=name, method_id=self.method_id, numel=numel,
                                              capacity=shard,
                                              part_list=(("uint8", shard // 8), (SCALE_DTYPE, scales))))

    def exchanges(self, numel: int, grad_dtype: str, density: float,
                  world_size: int) -> Tuple[Tuple[str, int], ...]:
        return _exchanges(self.layout("", numel, world_size).nbytes, world_size)

    def _momentum_step(self, ops: TensorOps, state: State, grad: Tensor,
                       unscale: Scalar) -> Tuple[Tensor, Scalar, State]:
        """(direction, its factor, state): ``m = mu * m + g``, and the step's direction is
        ``g + mu * m`` (Nesterov), ``g`` taken times ``unscale``."""
        mu = self.config.momentum
        if not mu:
            return grad, unscale, state
        momentum = ops.add(state["momentum"], grad, mu, unscale)
        return ops.add(grad, momentum, unscale, mu), 1.0, {**state, "momentum": momentum}

    pending_memory = "residual"

    def flush_worker(self, ops: TensorOps, state: State, grad: Tensor,
                     call: BucketCall) -> Tuple[Tensor, State]:
        """The residual plus the step's direction (``g + mu * m``, the momentum updated)."""
        direction, factor, state = self._momentum_step(ops, state, grad, call.unscale)
        return ops.add(state["residual"], direction, 1.0, factor), emptied(ops, state, "residual")

    def dense(self, ops: TensorOps, state: State, grad: Tensor, call: CompressCall) -> Tuple[Tensor, State]:
        update, state = self._dense_step(ops, state, grad, call.unscale)
        return (ops.copy(update) if update is grad else update), state

    def dense_bucket(self, ops: TensorOps, state: State, grad: Tensor,
                     call: BucketCall) -> Tuple[Tensor, State]:
        """:meth:`dense` on the bucket's own flat buffer, which it may hand back itself."""
        return self._dense_step(ops, state, grad, call.unscale)

    def _dense_step(self, ops: TensorOps, state: State, grad: Tensor, unscale: Scalar) -> Tuple[Tensor, State]:
        """The step's direction (``grad`` itself where nothing changes it), and the state."""
        direction, factor, state = self._momentum_step(ops, state, grad, unscale)
        if isinstance(factor, (int, float)) and factor == 1.0:
            return direction, state
        return ops.scale(direction, factor), state

    def first(self, ops: TensorOps, state: State, grad: Tensor,
              call: CompressCall) -> Tuple[Tensor, State, StageHandover]:
        n, world = ops.numel(grad), call.world_size
        direction, factor, state = self._momentum_step(ops, state, grad, call.unscale)
        block = self._worker_block(n)
        # p = e + direction, with its block sums, in one pass; C(p) and e = p - C(p) in another.
        p, sums, finite, _ = ops.accumulate(state["residual"], direction, factor,
                                         reuse(call.spare, "residual"), block, "sum")
        shard = self.shard_length(n, world)
        scales = block_scales(ops, sums, block, n, world * shard)
        packed, residual = ops.sign_compress(p, scales, block, world * shard)
        layout = self.layout(call.name, n, world)
        per_shard = layout.parts[1][1]
        messages, word = [], flag(ops, finite)
        for j in range(world):
            # One block per tensor: every shard carries the one scale.
            shard_scales = ops.slice(scales, 0 if self.config.block_size is None else j * per_shard, per_shard)
            header = layout.header(call.rank, call.step, shard_entries(n, shard, j), word, call.traced_id)
            messages.append(wire.encode_parts(ops, layout, header,
                                              [ops.slice(packed, j * shard // 8, shard // 8), shard_scales]))
        handover = StageHandover(call, n, ops.dtype(grad), {"layout": layout, "shard": shard})
        return ops.concat(messages), {**state, "residual": residual}, handover

    # -- a whole bucket at once ------------------------------------------------------------
    @property
    def bucketed(self) -> bool:
        """Whether a bucket's tensors compress as one: with one block per tensor, or blocks of
        a multiple of 8 entries (a byte of packed signs belongs to one block); other block
        sizes compress tensor by tensor."""
        return self.config.block_size is None or self.config.block_size % BYTE == 0

    def shards(self, bucket: Bucket, world_size: int, rank: int) -> SignShards:
        """The exchange of ``bucket`` among ``world_size`` workers, as ``rank`` runs it."""
        return SignShards.of(bucket, world_size, rank, self.config.block_size, self.method_id)

    def bucket_exchanges(self, plan: Plan, world_size: int) -> Tuple[Tuple[str, int], ...]:
        return _exchanges(self.shards(plan.bucket, world_size, 0).layout.nbytes, world_size)

    def first_bucket(self, ops: TensorOps, state: State, grad: Tensor,
                     call: BucketCall) -> Tuple[Tensor, State, StageHandover]:
        """:meth:`first` of a bucket's flat gradient (laid out as ``call.bucket``, zero
        padding): one pass over the bucket, each tensor's block scales, and one message per
        destination holding shard j of every tensor. ``state``: the worker memories laid out
        as the bucket, the server residual as :attr:`SignShards.owner`."""
        self.require_bucketed()
        shards = self.shards(call.bucket, call.world_size, call.rank)
        tables, layout = shards.tables(ops, grad), shards.layout
        direction, factor, state = self._momentum_step(ops, state, grad, call.unscale)
        chunk = shards.chunk
        p, sums, finite, _ = ops.accumulate(state["residual"], direction, factor,
                                            reuse(call.spare, "residual"), chunk, "sum")
        scales = _scales_by_block(ops, sums, tables.worker_chunk_block, tables.worker_inverse)
        packed, residual = ops.sign_compress(p, ops.gather(scales, tables.worker_chunk_block), chunk,
                                             call.bucket.numel)
        word = flag(ops, finite)
        headers = [layout.header(call.rank, call.step, count, word) for count in shards.sent_counts]
        messages = wire.encode_set(ops, layout, headers, [packed, scales], tables.send_frame)
        handover = StageHandover(call.as_call(), call.bucket.numel, ops.dtype(grad),
                                 {"layout": layout, "shards": shards})
        return messages, {**state, "residual": _zero_tail(ops, residual, tables.worker_tail)}, handover

    def _serve_bucket(self, ops: TensorOps, state: State, received: wire.Received, finite: Scalar,
                      handover: StageHandover) -> Tuple[Tensor, State]:
        """:meth:`second` of a bucket: this rank's shard of every tensor."""
        call, shards = handover.call, handover.data["shards"]
        tables, layout, numel = shards.tables(ops, received.flags), shards.layout, shards.owner.numel
        chunk, total = shards.chunk, None
        spread = ops.gather(_scale_words(ops, received), tables.received_scales)
        chunks = ops.numel(tables.owner_chunk_block)
        for r in range(call.world_size):
            total = ops.sign_decode(ops.slice(received.data, wire.part_at(layout, r, 0), numel // BYTE),
                                    ops.slice(spread, r * chunks, chunks), chunk, numel,
                                    state_dtype(handover.dtype), add_to=total)
        averaged = server_average(ops, total, state, call.world_size)
        averaged = _zero_tail(ops, averaged, tables.server_tail)
        scales = _scales_by_block(ops, ops.block_abs_sum(averaged, chunk), tables.owner_chunk_block,
                                  tables.server_inverse)
        packed, server = ops.sign_compress(averaged, ops.gather(scales, tables.owner_chunk_block), chunk, numel)
        header = layout.header(call.rank, call.step, shards.sent_counts[shards.rank], flag(ops, finite))
        message = wire.encode_set(ops, layout, [header], [packed, scales], tables.return_frame)
        return message, {**state, "server": _zero_tail(ops, server, tables.server_tail)}

    def _finish_bucket(self, ops: TensorOps, received: wire.Received, handover: StageHandover) -> Tensor:
        """:meth:`finish` of a bucket: the owners' shards in the bucket's layout."""
        shards = handover.data["shards"]
        tables = shards.tables(ops, received.flags)
        signs = ops.gather(received.data, tables.gather_bytes)
        scales = ops.gather(_scale_words(ops, received), tables.gather_scales)
        update = ops.sign_decode(signs, scales, BYTE, shards.bucket.numel, state_dtype(handover.dtype))
        return _zero_tail(ops, update, tables.worker_tail)

    def _receive(self, ops: TensorOps, received: Tensor, handover: StageHandover) -> wire.Received:
        """Each sender's shard (packed signs, scales) and flags word from a received
        concatenation, headers checked."""
        layout, call = handover.data["layout"], handover.call
        return wire.receive(ops, received, [(layout, r) for r in range(call.world_size)],
                            call.step, call.rank, call.traced_id)

    @staticmethod
    def _scale_block(ops: TensorOps, packed: Tensor, scales: Tensor) -> int:
        """Entries per scale of a received shard (packed signs, scales)."""
        return ops.numel(packed) * 8 // ops.numel(scales)

    def second(self, ops: TensorOps, state: State, received: Tensor,
               handover: StageHandover) -> Tuple[Tensor, State]:
        """The server's work on this rank's shard; a sender's non-finite flag is passed on
        (with ``nonfinite="raise"`` every server raises, naming the sender)."""
        call, layout = handover.call, handover.data["layout"]
        received = self._receive(ops, received, handover)
        finite = received_finite(ops, self.config.nonfinite, received.flags, [call.name], call.step,
                                 call.traced_id)
        if "shards" in handover.data:
            return self._serve_bucket(ops, state, received, finite, handover)
        shard = handover.data["shard"]
        dtype, total = state_dtype(handover.dtype), None
        for packed, scales in received.parts(ops):
            total = ops.sign_decode(packed, scales, self._scale_block(ops, packed, scales), shard,
                                    dtype, add_to=total)
        valid = shard_entries(handover.numel, shard, call.rank)
        averaged = server_average(ops, total, state, call.world_size)
        averaged = ops.slice(averaged, 0, valid)
        block = self._server_block(shard)
        scales = block_scales(ops, ops.block_abs_sum(averaged, block), block, valid, shard)
        packed, server = ops.sign_compress(averaged, scales, block, shard)
        server = ops.pad(server, shard)
        header = layout.header(call.rank, call.step, valid, flag(ops, finite), call.traced_id)
        return wire.encode_parts(ops, layout, header, [packed, scales]), {**state, "server": server}

    def finish(self, ops: TensorOps, received: Tensor, handover: StageHandover) -> Tuple[Tensor, Scalar]:
        received = self._receive(ops, received, handover)
        finite = none_flagged(ops, received.flags)
        update = (self._finish_bucket(ops, received, handover) if "shards" in handover.data
                  else self._finish_tensor(ops, received, handover))
        update = ops.cast(update, handover.dtype)
        return nan_unless(ops, finite, update, handover.dtype), finite

    def _finish_tensor(self, ops: TensorOps, received: wire.Received, handover: StageHandover) -> Tensor:
        shard = handover.data["shard"]
        valid = [shard_entries(handover.numel, shard, j) for j in range(handover.call.world_size)]
        messages = [(packed, scales, self._scale_block(ops, packed, scales), count)
                    for (packed, scales), count in zip(received.parts(ops), valid) if count]
        return ops.sign_decode_all(messages, state_dtype(handover.dtype))
