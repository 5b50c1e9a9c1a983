"""Blockwise 1-bit compression with two-way error feedback (Zheng, Huang, Kwok, NeurIPS 2019:
dist-EF-blockSGDM), docs/algorithms.md#blocksign.

    C(v)_b = (||v_b||_1 / d_b) * sign(v_b)            (sign(0) = +1: one bit per entry)
    worker i: p_i = g_i (+ Nesterov momentum) + e_i;  D_i = C(p_i);  e_i = p_i - D_i
    server:   P = mean_i D_i + E;  D = C(P);  E = P - D;  every worker applies D

Horovod has no parameter server, so the server is sharded across the workers: the flat
tensor, padded to ``N * shard`` entries, is cut into N shards; an alltoall brings shard j of
every worker's packed signs and block scales to worker j, which averages them, adds its
server residual, compresses again, and an allgather returns every shard to everyone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

from . import wire
from .collectives import ALLGATHER, ALLTOALL
from .config import CompressionConfig
from .method import CompressCall, State, StateLayout, shard_entries, state_dtype
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
        shard = self.layout("", numel, world_size).nbytes
        return (ALLTOALL, world_size * shard), (ALLGATHER, shard)

    def _momentum_step(self, ops: TensorOps, state: State, grad: Tensor,
                       unscale: Scalar) -> Tuple[Tensor, Scalar, State]:
        """(direction, its factor, state): ``m = mu * m + g``, and the step's direction is
        ``g + mu * m`` (Nesterov), ``g`` taken times ``unscale``."""
        mu = self.config.momentum
        if not mu:
            return grad, unscale, state
        momentum = ops.add(state["momentum"], grad, mu, unscale)
        return ops.add(grad, momentum, unscale, mu), 1.0, {**state, "momentum": momentum}

    def dense(self, ops: TensorOps, state: State, grad: Tensor, call: CompressCall) -> Tuple[Tensor, State]:
        direction, factor, state = self._momentum_step(ops, state, grad, call.unscale)
        update = ops.copy(direction) if direction is grad else direction
        if not (isinstance(factor, (int, float)) and factor == 1.0):
            update = ops.scale(update, factor)
        return update, state

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
        messages = []
        for j in range(world):
            # One block per tensor: every shard carries the one scale.
            shard_scales = ops.slice(scales, 0 if self.config.block_size is None else j * per_shard, per_shard)
            header = layout.header(call.rank, call.step, shard_entries(n, shard, j), flag(ops, finite),
                                   call.traced_id)
            messages.append(wire.encode_parts(ops, layout, header,
                                              [ops.slice(packed, j * shard // 8, shard // 8), shard_scales]))
        handover = StageHandover(call, n, ops.dtype(grad), {"layout": layout, "shard": shard})
        return ops.concat(messages), {**state, "residual": residual}, handover

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
        call, layout, shard = handover.call, handover.data["layout"], handover.data["shard"]
        received = self._receive(ops, received, handover)
        finite = received_finite(ops, self.config.nonfinite, received.flags, [call.name], call.step,
                                 call.traced_id)
        dtype, total = state_dtype(handover.dtype), None
        for packed, scales in received.parts:
            total = ops.sign_decode(packed, scales, self._scale_block(ops, packed, scales), shard,
                                    dtype, add_to=total)
        valid = shard_entries(handover.numel, shard, call.rank)
        averaged = ops.scale_add(ops.scale(total, 1.0 / call.world_size), 1.0, state["server"])
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
        shard, dtype = handover.data["shard"], state_dtype(handover.dtype)
        valid = [shard_entries(handover.numel, shard, j) for j in range(handover.call.world_size)]
        messages = [(packed, scales, self._scale_block(ops, packed, scales), count)
                    for (packed, scales), count in zip(received.parts, valid) if count]
        update = ops.cast(ops.sign_decode_all(messages, dtype), handover.dtype)
        return nan_unless(ops, finite, update, handover.dtype), finite
