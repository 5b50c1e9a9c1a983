"""Configuration shared by every method, and by every sparse method.

Every hyper-parameter has exactly one default, in the frozen dataclass that owns it; the
framework factories (``Compression.dgc(...)`` and friends) pass keywords straight through.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Tuple

from .validation import require_choice, require_fraction, require_positive_int
from .warmup import DensitySchedule
from .wire import VALUE_FORMATS

NONFINITE_POLICIES = ("raise", "skip")


@dataclass(frozen=True)
class CompressionConfig:
    """Settings every method has.

    Attributes:
        min_numel: tensors with fewer elements are small (biases, norm layers, a small
            classifier): they travel dense, or at a density of their own (``small_density``).
            Below 4096 elements, 0.1% of a tensor is a handful of entries a step, too few for
            a layer to learn from in short runs (a 3200-weight classifier lost 1.5 points of
            accuracy on Fashion-MNIST), while sending such a tensor costs little.
        compress_1d: 1-D tensors of at least ``min_numel`` elements are compressed as the
            large ones (the DGC reference compresses only tensors with more than one
            dimension); else they count as small.
        nonfinite: what a NaN or Inf gradient on any rank does. Either way every rank learns
            of it (the sender flags its message) and the step is dropped: every memory of
            every rank stays as it was before the step, dense tensors' momentum included.
            ``"skip"`` (the default, what a dense all-reduce does): every rank's averaged
            gradient of that tensor is NaN, so a mixed-precision loss scaler skips the
            optimizer step and lowers its scale on every rank alike. ``"raise"``: every rank
            raises :class:`~horovod_dgc.core.NonFiniteGradientError` naming the tensor, the
            step and the sending rank.
    """

    min_numel: int = 4096
    compress_1d: bool = False
    nonfinite: str = "skip"

    def __post_init__(self) -> None:
        require_positive_int("min_numel", self.min_numel)
        require_choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)

    def is_small(self, shape: tuple) -> bool:
        """Whether a tensor of this shape is small (see ``min_numel``)."""
        return math.prod(shape) < self.min_numel or (len(shape) <= 1 and not self.compress_1d)

    def compresses(self, shape: tuple, dtype: str) -> bool:
        """Whether a tensor of this shape and dtype is compressed (else it goes dense)."""
        floating = dtype in ("float16", "bfloat16", "float32", "float64")
        return floating and not self.is_small(shape)

    def density_at(self, epoch: float) -> float:
        """Fraction of elements sent during ``epoch`` (1 for methods that send every one)."""
        return 1.0

    def density_for(self, step: int, epoch: float, small: bool = False) -> float:
        """Fraction of elements a tensor sends at its ``step``, the epoch last set being
        ``epoch`` (``small``: a small tensor's, see ``small_density``)."""
        return 1.0

    def density_floor(self, shape: tuple) -> Optional[float]:
        """The least density of a tensor of this shape (a small one's), or None."""
        return None

    @property
    def schedule(self) -> Optional[DensitySchedule]:
        """The density schedule (None: every entry is sent)."""
        return None

    @property
    def needs_plain_optimizer(self) -> bool:
        """Whether the compressor applies momentum or weight decay itself, so that the
        optimizer applying its result must keep no state of its own (plain SGD)."""
        return False


def keeping_yours(config: CompressionConfig, key: str, theirs: set, nesterov: bool) -> str:
    """The end of a refusal that moves the optimizer's ``key`` (``"momentum"``,
    ``"weight_decay"``) to the compressor: how to keep the optimizer's own setting, given its
    values ``theirs`` and whether it said ``nesterov`` (which the optimizer drops with its
    momentum); "" when the compressor's already match."""
    advice = []
    mine = getattr(config, key)
    if len(theirs) == 1 and not math.isclose(next(iter(theirs)), mine, rel_tol=1e-6):
        advice.append(f"{key}={next(iter(theirs)):.6g}")
    if key == "momentum" and nesterov and getattr(config, "nesterov", True) is False:
        advice.append("nesterov=True")
    return f" and the compressor {', '.join(advice)} to keep yours" if advice else ""


@dataclass(frozen=True)
class SparseConfig(CompressionConfig):
    """Settings common to the sparse (index, value) methods, besides
    :class:`CompressionConfig`'s.

    Attributes:
        density: fraction of a tensor's elements sent each step, in (0, 1].
        value_dtype: how the values travel: ``"float16"`` (the default; clamped to its
            range), ``"float32"``, or ``"int8"`` (one byte a value and one float32 scale a
            message). With ``"float16"``, bfloat16 gradients travel as bfloat16, without loss.
            Whatever the format rounds away stays in the memory.
        warmup_epochs: epochs W of warm-up sparsity (0: none). The density of epoch e < W is
            ``c ** (e + 1)`` with ``c = density ** (1 / (W + 1))`` (DGC's exponential ramp:
            about 25%, 6.3%, 1.6%, 0.4% before 0.1% with W = 4), or ``warmup_densities[e]``.
            The compressor's ``set_epoch`` (or ``set_step``) tells it the epoch, unless
            ``steps_per_epoch`` is given.
        warmup_factor: ratio between successive warm-up densities, instead of ``c``.
        warmup_densities: explicit density per warm-up epoch, instead of the formula.
        steps_per_epoch: optimizer steps per epoch: the compressor then follows the schedule
            by its own step count, without ``set_epoch``.
        small_density: small tensors (``min_numel``) are compressed too, at this density (or
            the warm-up's, when larger), each with its own memory; None: they travel dense
            (an all-reduce in float32, as Horovod sends them). ResNet-50's 54,120 norm and
            bias parameters take 216 kB a step dense, about 20 kB at 5%.
    """

    density: float = 0.01
    value_dtype: str = "float16"
    warmup_epochs: int = 0
    warmup_factor: Optional[float] = None
    warmup_densities: Optional[Tuple[float, ...]] = None
    steps_per_epoch: Optional[int] = None
    small_density: Optional[float] = 0.05

    def __post_init__(self) -> None:
        super().__post_init__()
        require_fraction("density", self.density)
        if self.small_density is not None:
            require_fraction("small_density", self.small_density)
        require_choice("value_dtype", self.value_dtype, VALUE_FORMATS)
        self.schedule  # built once here, which validates the warm-up fields

    @functools.cached_property
    def schedule(self) -> DensitySchedule:
        """The density schedule these settings describe (built once per config)."""
        densities = None if self.warmup_densities is None else tuple(self.warmup_densities)
        return DensitySchedule(self.density, self.warmup_epochs, self.warmup_factor, densities,
                               self.steps_per_epoch)

    def density_at(self, epoch: float) -> float:
        return self.schedule.density(epoch)

    def compresses(self, shape: tuple, dtype: str) -> bool:
        floating = dtype in ("float16", "bfloat16", "float32", "float64")
        return floating and (self.small_density is not None or not self.is_small(shape))

    def density_for(self, step: int, epoch: float, small: bool = False) -> float:
        density = self.schedule.density(self.schedule.epoch_at(step, epoch))
        # With small_density None a small tensor travels dense: its density is never used.
        return max(density, self.small_density) if small and self.small_density is not None else density

    def density_floor(self, shape: tuple) -> Optional[float]:
        return self.small_density if self.is_small(shape) else None


AGGREGATIONS = ("allgather", "sparse_allreduce", "auto")


@dataclass(frozen=True)
class GatheredConfig(SparseConfig):
    """Settings of the methods whose workers each choose their own entries (DGC, Top-k,
    Gaussian-k), besides :class:`SparseConfig`'s.

    Attributes:
        aggregation: how the workers' messages are combined. ``"allgather"``: every worker
            receives every other worker's message, so each sends N - 1 messages' bytes a
            step. ``"sparse_allreduce"``: the tensor is cut into N regions; an alltoall
            brings every worker's entries of region j to worker j, which sums them, adds
            what it kept from earlier steps, and forwards its largest to everyone by an
            allgather (``core/sparse_allreduce.py``): about the same bytes whatever N.
            ``"auto"``: the sparse all-reduce where it sends at most half the allgather's
            bytes for the number of workers the compressor is built for (from 7 or 8 workers at
            the defaults), else the allgather (``sparse_allreduce.aggregated``).
    """

    aggregation: str = "allgather"

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice("aggregation", self.aggregation, AGGREGATIONS)
