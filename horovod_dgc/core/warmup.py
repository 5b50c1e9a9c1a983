"""Warm-up sparsity: the density ramps down exponentially over the first epochs (DGC 3.4)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from .validation import require_fraction, require_non_negative_int


@dataclass(frozen=True)
class DensitySchedule:
    """Density per epoch: ``max(factor ** (epoch + 1), final_density)`` for the first
    ``warmup_epochs`` epochs, then ``final_density``.

    With the paper's ``factor=0.25``, ``final_density=0.001`` and 4 warm-up epochs the
    densities are 25%, 6.25%, 1.5625%, 0.39%, then 0.1%. ``densities`` (one per warm-up
    epoch) replaces the formula when given.
    """

    final_density: float
    warmup_epochs: int = 0
    factor: float = 0.25
    densities: Optional[Tuple[float, ...]] = None

    def __post_init__(self) -> None:
        require_fraction("density", self.final_density)
        require_fraction("warmup_factor", self.factor)
        require_non_negative_int("warmup_epochs", self.warmup_epochs)
        if self.densities is not None:
            for d in self.densities:
                require_fraction("warmup_densities entry", d)
            if len(self.densities) != self.warmup_epochs:
                raise ValueError(f"warmup_densities has {len(self.densities)} entries for "
                                 f"{self.warmup_epochs} warm-up epochs")

    def density(self, epoch: float) -> float:
        """The density in force during ``epoch`` (0-based; fractions count as started)."""
        e = math.floor(epoch)
        if e >= self.warmup_epochs:
            return self.final_density
        if self.densities is not None:
            return max(self.densities[max(e, 0)], self.final_density)
        return max(self.factor ** (max(e, 0) + 1), self.final_density)
