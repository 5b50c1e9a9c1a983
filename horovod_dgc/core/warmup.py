"""Warm-up sparsity: the density ramps down exponentially over the first epochs (DGC 3.4),
and a watch that says so when the schedule is never advanced."""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Optional, Tuple

from .validation import require_fraction, require_non_negative_int, require_positive_int

# A schedule still at epoch 0 after this many steps of one tensor was most likely never
# advanced (set_epoch() forgotten); the watch warns once.
WARMUP_STALL_STEPS = 10_000


@dataclass(frozen=True)
class DensitySchedule:
    """Density per epoch: ``c ** (epoch + 1)`` for the first ``warmup_epochs`` epochs (W),
    then ``final_density`` (rho), with ``c = rho ** (1 / (W + 1))``, so that the densities
    fall by one factor per epoch and reach rho one epoch after the warm-up.

    With the paper's ``rho = 0.001`` and W = 4 the densities are 25.1%, 6.3%, 1.58%, 0.40%,
    then 0.1% (the paper: 25%, 6.25%, 1.5625%, 0.39%). ``factor`` replaces ``c`` and
    ``densities`` (one per warm-up epoch) the formula, when given; no density goes below rho.

    ``steps_per_epoch``: when given, the epoch is the compressor's own step count divided by
    it, and nothing needs to call ``set_epoch``.
    """

    final_density: float
    warmup_epochs: int = 0
    factor: Optional[float] = None
    densities: Optional[Tuple[float, ...]] = None
    steps_per_epoch: Optional[int] = None

    def __post_init__(self) -> None:
        require_fraction("density", self.final_density)
        if self.factor is not None:
            require_fraction("warmup_factor", self.factor)
        require_non_negative_int("warmup_epochs", self.warmup_epochs)
        if self.steps_per_epoch is not None:
            require_positive_int("steps_per_epoch", self.steps_per_epoch)
        if self.densities is not None:
            for d in self.densities:
                require_fraction("warmup_densities entry", d)
            if len(self.densities) != self.warmup_epochs:
                raise ValueError(f"warmup_densities has {len(self.densities)} entries for "
                                 f"{self.warmup_epochs} warm-up epochs")

    @property
    def ratio(self) -> float:
        """The factor between successive warm-up densities."""
        if self.factor is not None:
            return self.factor
        return self.final_density ** (1.0 / (self.warmup_epochs + 1))

    def density(self, epoch: float) -> float:
        """The density in force during ``epoch`` (0-based; fractions count as started)."""
        e = max(math.floor(epoch), 0)
        if e >= self.warmup_epochs:
            return self.final_density
        if self.densities is not None:
            return max(self.densities[e], self.final_density)
        return max(self.ratio ** (e + 1), self.final_density)

    @property
    def densities_in_use(self) -> Tuple[float, ...]:
        """Every density the schedule takes, largest first."""
        return tuple(sorted({self.density(e) for e in range(self.warmup_epochs + 1)}, reverse=True))

    def epoch_at(self, step: int, epoch: float) -> float:
        """The epoch a tensor's ``step`` falls in: from the step count when
        ``steps_per_epoch`` is given, else the ``epoch`` last set."""
        if self.steps_per_epoch is None:
            return epoch
        return step / self.steps_per_epoch


class WarmupWatch:
    """Warns once when a warm-up schedule that follows ``set_epoch`` is never advanced: the
    density would stay at epoch 0's for the whole run, silently."""

    def __init__(self, schedule: Optional[DensitySchedule]):
        self._armed = (schedule is not None and schedule.warmup_epochs > 0
                       and schedule.steps_per_epoch is None)
        self._schedule = schedule
        self._set = False
        self._advanced = False
        self._lock = threading.Lock()

    def epoch_set(self, epoch: float) -> None:
        with self._lock:
            self._set = True
            self._advanced = self._advanced or epoch >= 1

    def warning(self, step: int) -> Optional[str]:
        """The warning to give at a tensor's ``step`` (at most once), or None."""
        with self._lock:
            if not self._armed:
                return None
            if step == 0 and not self._set:
                reason = "set_epoch() was not called before the first step"
            elif step >= WARMUP_STALL_STEPS and not self._advanced:
                reason = f"the epoch is still 0 after {step} steps"
            else:
                return None
            self._armed = False
        return (f"horovod_dgc: warm-up sparsity follows set_epoch(), but {reason}: the density "
                f"stays at {self._schedule.density(0):.4g} (epoch 0's of "
                f"{self._schedule.warmup_epochs} warm-up epochs) until compression.set_epoch(epoch) "
                f"is called at the start of every epoch, or the compressor is built with "
                f"steps_per_epoch= to advance by itself")
