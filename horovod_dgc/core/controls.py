"""The user's controls that every framework's compressor offers, over its engine."""
from __future__ import annotations

from .stats import CompressionStats


class CompressorControls:
    """Mixed into each adapter's compressor; ``self.engine`` (the adapter's per-tensor
    state holder) does the work and must offer ``set_epoch``, ``density``, ``stats`` and
    ``reset_stats``."""

    def set_epoch(self, epoch: float) -> None:
        """Drive the warm-up schedule: the density of ``floor(epoch)`` applies from now on.
        Call it at the start of every epoch, with the same value on every rank."""
        self.engine.set_epoch(epoch)

    def set_step(self, step: int, steps_per_epoch: int) -> None:
        """Step-based form of :meth:`set_epoch`."""
        self.set_epoch(step / steps_per_epoch)

    @property
    def density(self) -> float:
        """Density in force now (after warm-up)."""
        return self.engine.density

    def stats(self) -> CompressionStats:
        """Bytes handed to Horovod, dense-equivalent bytes, density, compress time."""
        return self.engine.stats()

    def reset_stats(self) -> None:
        self.engine.reset_stats()
