"""The user's controls that every framework's compressor offers, over its engine."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from .adaptive import Adaptive, Decision
from .stats import CompressionStats


class CompressorControls:
    """Mixed into each adapter's compressor; ``self.engine`` (the adapter's per-tensor
    state holder) does the work and must offer ``set_epoch``, ``density``, ``stats`` and
    ``reset_stats``; ``self._adaptive`` holds the adaptive switch (``switch``, ``labels``,
    ``end_step()``)."""

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
        """Bytes handed to Horovod, dense-equivalent bytes, density, compress time; with
        ``adaptive``, each bucket's mode and why (``buckets``)."""
        return dataclasses.replace(self.engine.stats(), buckets=self._adaptive.switch.lines())

    def reset_stats(self) -> None:
        self.engine.reset_stats()

    # -- the adaptive switch (horovod_dgc.core.adaptive) -------------------------------------------
    @property
    def adaptive(self) -> Optional[Adaptive]:
        """The adaptive switch's settings (None: every bucket always compressed)."""
        return self._adaptive.switch.settings

    def end_step(self) -> List[Decision]:
        """After every exchange of an optimizer step: the adaptive switch's bookkeeping, and
        its decision at a decision step (collectives: every rank calls it after the same
        step). PyTorch's optimizers and the DDP hook call it; in TensorFlow call it eagerly
        after every step (the Keras callback
        :class:`~horovod_dgc.tensorflow.callbacks.CompressionWarmup` does). Returns the
        decisions taken (none on other steps)."""
        return self._adaptive.end_step()

    def bucket_modes(self) -> Dict[str, str]:
        """Each bucket's mode for its next exchange (``"compressed"`` or ``"dense"``), by
        label, for every bucket exchanged so far."""
        return {label: self._adaptive.switch.mode(label) for label in self._adaptive.labels}
