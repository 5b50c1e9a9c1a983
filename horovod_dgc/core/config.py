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

VALUE_DTYPES = ("float32", "float16")
NONFINITE_POLICIES = ("raise", "skip")


@dataclass(frozen=True)
class CompressionConfig:
    """Settings every method has.

    Attributes:
        min_numel: tensors with fewer elements are not compressed: they go dense through
            all-reduce (biases, norm layers).
        compress_1d: also compress 1-D tensors of at least ``min_numel`` elements (the DGC
            reference compresses only tensors with more than one dimension).
        nonfinite: what a NaN or Inf gradient on any rank does. Either way every rank learns
            of it (the sender flags its message) and the step is dropped: every memory of
            every rank stays as it was before the step, dense tensors' momentum included.
            ``"skip"`` (the default, what a dense all-reduce does): every rank's averaged
            gradient of that tensor is NaN, so a mixed-precision loss scaler skips the
            optimizer step and lowers its scale on every rank alike. ``"raise"``: every rank
            raises :class:`~horovod_dgc.core.NonFiniteGradientError` naming the tensor, the
            step and the sending rank.
    """

    min_numel: int = 1024
    compress_1d: bool = False
    nonfinite: str = "skip"

    def __post_init__(self) -> None:
        require_positive_int("min_numel", self.min_numel)
        require_choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)

    def compresses(self, shape: tuple, dtype: str) -> bool:
        """Whether a tensor of this shape and dtype is compressed (else it goes dense)."""
        numel = math.prod(shape)
        floating = dtype in ("float16", "bfloat16", "float32", "float64")
        return floating and numel >= self.min_numel and (len(shape) > 1 or self.compress_1d)

    def density_at(self, epoch: float) -> float:
        """Fraction of elements sent during ``epoch`` (1 for methods that send every one)."""
        return 1.0

    def density_for(self, step: int, epoch: float) -> float:
        """Fraction of elements a tensor sends at its ``step``, the epoch last set being
        ``epoch``."""
        return 1.0

    @property
    def schedule(self) -> Optional[DensitySchedule]:
        """The density schedule (None: every entry is sent)."""
        return None

    @property
    def needs_plain_optimizer(self) -> bool:
        """Whether the compressor applies momentum or weight decay itself, so that the
        optimizer applying its result must keep no state of its own (plain SGD)."""
        return False


@dataclass(frozen=True)
class SparseConfig(CompressionConfig):
    """Settings common to the sparse (index, value) methods, besides
    :class:`CompressionConfig`'s.

    Attributes:
        density: fraction of a tensor's elements sent each step, in (0, 1].
        value_dtype: wire dtype of the values, ``"float32"`` or ``"float16"``. bfloat16
            gradients always travel as bfloat16 bits, without loss. Whatever rounding the
            wire dtype causes stays in the residual.
        warmup_epochs: epochs W of warm-up sparsity (0: none). The density of epoch e < W is
            ``c ** (e + 1)`` with ``c = density ** (1 / (W + 1))`` (DGC's exponential ramp:
            about 25%, 6.3%, 1.6%, 0.4% before 0.1% with W = 4), or ``warmup_densities[e]``.
            The compressor's ``set_epoch`` (or ``set_step``) tells it the epoch, unless
            ``steps_per_epoch`` is given.
        warmup_factor: ratio between successive warm-up densities, instead of ``c``.
        warmup_densities: explicit density per warm-up epoch, instead of the formula.
        steps_per_epoch: optimizer steps per epoch: the compressor then follows the schedule
            by its own step count, without ``set_epoch``.
    """

    density: float = 0.01
    value_dtype: str = "float32"
    warmup_epochs: int = 0
    warmup_factor: Optional[float] = None
    warmup_densities: Optional[Tuple[float, ...]] = None
    steps_per_epoch: Optional[int] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        require_fraction("density", self.density)
        require_choice("value_dtype", self.value_dtype, VALUE_DTYPES)
        self.schedule  # built once here, which validates the warm-up fields

    @functools.cached_property
    def schedule(self) -> DensitySchedule:
        """The density schedule these settings describe (built once per config)."""
        densities = None if self.warmup_densities is None else tuple(self.warmup_densities)
        return DensitySchedule(self.density, self.warmup_epochs, self.warmup_factor, densities,
                               self.steps_per_epoch)

    def density_at(self, epoch: float) -> float:
        return self.schedule.density(epoch)

    def density_for(self, step: int, epoch: float) -> float:
        return self.schedule.density(self.schedule.epoch_at(step, epoch))

