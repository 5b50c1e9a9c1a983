"""Deep Gradient Compression (Lin et al., ICLR 2018), docs/algorithms.md#dgc.

Momentum correction (momentum accumulated locally, before selection), local gradient
clipping scaled by 1/sqrt(N), momentum factor masking, warm-up sparsity, and the sampled
threshold with exact re-selection among the candidates. The optimizer that applies the
result must be plain SGD: the momentum and weight decay live here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from .bucket import Plan
from .config import GatheredConfig
from .memory import Accumulated, MomentumCorrectionMemory
from .method import BucketCall, CompressCall, State
from .ops import Scalar, Tensor, TensorOps
from .selection import MAX_RETRIES, RETRY_FACTOR, SAMPLE_RATIO, sampling_offset, select_sampled
from .sparse import SparseMethod
from .validation import (optional_positive, require_fraction, require_momentum, require_non_negative,
                         require_open_fraction, require_positive_int)


@dataclass(frozen=True)
class DGCConfig(GatheredConfig):
    """DGC's settings (and :class:`GatheredConfig`'s).

    Attributes:
        density: fraction of each compressed tensor sent per step (0.1% in the paper).
        momentum: momentum coefficient m of momentum correction, in [0, 1).
        nesterov: Nesterov momentum (``u = m * (u + g); v = v + u + g``).
        weight_decay: L2 coefficient folded into the gradient before compression.
        clip_norm: global gradient-norm bound C; each worker clips each tensor's gradient
            to ``C / sqrt(N)`` (None: no clipping).
        sample_ratio: fraction of entries sampled to estimate the threshold, in (0, 1].
        max_retries: times the threshold is lowered when too few entries reach it.
        retry_factor: factor the threshold is lowered by, in (0, 1).
    """

    density: float = 0.001
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    clip_norm: Optional[float] = None
    sample_ratio: float = SAMPLE_RATIO
    max_retries: int = MAX_RETRIES
    retry_factor: float = RETRY_FACTOR

    def __post_init__(self) -> None:
        super().__post_init__()
        require_momentum("momentum", self.momentum)
        require_non_negative("weight_decay", self.weight_decay)
        optional_positive("clip_norm", self.clip_norm)
        require_fraction("sample_ratio", self.sample_ratio)
        require_positive_int("max_retries", self.max_retries)
        require_open_fraction("retry_factor", self.retry_factor)

    @property
    def needs_plain_optimizer(self) -> bool:
        return self.momentum > 0.0 or self.weight_decay > 0.0


class DGC(SparseMethod):
    method_id = 2
    filters_blocks = True
    collects_candidates = True
    selects_buckets = True
    config: DGCConfig

    def __init__(self, config: DGCConfig = DGCConfig()):
        super().__init__(config)
        self._small_memory = MomentumCorrectionMemory(config.momentum, config.nesterov, masked=False)

    def make_memory(self) -> MomentumCorrectionMemory:
        return MomentumCorrectionMemory(self.config.momentum, self.config.nesterov)

    def memory_for(self, call: CompressCall) -> MomentumCorrectionMemory:
        """The paper's masked memory for the large tensors. The paper sends the small ones
        dense with their whole momentum; compressed at the small density they keep it too
        (unmasked: the same updates, delayed). Masked, an entry sent every 20 steps (5%) moved
        at 0.6 of momentum SGD's pace, and dgc lost 0.3 points more on Fashion-MNIST
        (docs/benchmarks.md)."""
        return self._small_memory if call.small else self.memory

    def prepare(self, ops: TensorOps, grad: Tensor, call: CompressCall) -> Tuple[Tensor, Scalar]:
        """The loss scale undone, weight decay added, then local clipping to ``C / sqrt(N)``
        (the unscaling and the clipping as one factor)."""
        cfg = self.config
        weight_decay = cfg.weight_decay if call.weight_decay is None else call.weight_decay
        factor = call.unscale
        if weight_decay > 0.0:
            if call.param is None:
                raise ValueError(f"weight_decay needs the parameter of tensor {call.name!r}")
            grad, factor = ops.add(grad, call.param, factor, weight_decay), 1.0
        if cfg.clip_norm is None:
            return grad, factor
        bound = cfg.clip_norm / call.world_size ** 0.5
        norm = ops.sqrt(ops.dot(grad, grad)) * factor
        return grad, ops.minimum(bound / ops.maximum(norm, 1e-30), 1.0) * factor

    def select(self, ops: TensorOps, x: Tensor, k: int, call: CompressCall,
               accumulated: Accumulated) -> Tensor:
        cfg = self.config
        return select_sampled(ops, x, k, cfg.sample_ratio, sampling_offset(call.step, call.tensor_id),
                              cfg.max_retries, cfg.retry_factor,
                              accumulated.block_max, accumulated.candidates)

    # -- a whole bucket at once: the same steps, per segment where they differ ----------------
    @property
    def bucketed(self) -> bool:
        """Clipping bounds each tensor's own norm, which a bucket's pass does not take: a
        config with ``clip_norm`` compresses tensor by tensor."""
        return self.config.clip_norm is None

    @property
    def dense_bucketed(self) -> bool:
        """Clipping bounds each tensor's own norm, the tensors sent dense too: a config with
        ``clip_norm`` sends them one by one."""
        return self.config.clip_norm is None

    def prepare_bucket(self, ops: TensorOps, grad: Tensor, call: BucketCall) -> Tuple[Tensor, Scalar]:
        """:meth:`prepare` of every segment: the loss scale undone and each segment's weight
        decay added (one factor for the bucket when they are all alike)."""
        segments = call.bucket.segments
        decays = call.weight_decays or (self.config.weight_decay,) * len(segments)
        if not any(decays):
            return grad, call.unscale
        if call.param is None:
            raise ValueError(f"weight_decay needs the parameters of bucket {call.bucket.label!r}")
        grad = ops.gathered(grad)
        if len(set(decays)) == 1:
            return ops.add(grad, call.param, call.unscale, decays[0]), 1.0
        per_entry = ops.repeat_each(ops.constant(list(decays), "float32", like=grad),
                                    ops.constant([s.span for s in segments], "int64", like=grad),
                                    call.bucket.numel)
        return ops.add(grad, ops.multiply(call.param, ops.cast(per_entry, ops.dtype(call.param))),
                       call.unscale), 1.0

    def update_bucket(self, ops: TensorOps, state: State, positions: Tensor, sent: Tensor,
                      plan: Plan, large: Optional[Tensor] = None) -> State:
        """Every sent velocity entry removed; the momentum masked in the large segments only
        (see :meth:`memory_for`)."""
        state = self._small_memory.update(ops, state, positions, sent)
        segments = plan.bucket.segments
        if all(s.small for s in segments):
            return state
        if not any(s.small for s in segments):
            large = positions
        elif large is None:
            large = ops.gather(positions, plan.tables(ops, positions).large_picks)
        return {**state, "momentum": ops.scatter_zero(state["momentum"], large)}
