"""Keras callback driving a compressor's warm-up schedule (and its adaptive switch) from
``model.fit``.

It subclasses ``tf.keras.callbacks.Callback``: tf_keras's when ``TF_USE_LEGACY_KERAS=1`` was
set before TensorFlow was imported (Horovod's Keras ``DistributedOptimizer``), Keras 3's
otherwise.
"""
from __future__ import annotations

from typing import Optional

import tensorflow as tf

from ..core.controls import CompressorControls


class CompressionWarmup(tf.keras.callbacks.Callback):
    """Tells ``compressor`` the epoch at the start of every epoch (``epoch`` -> density of
    the warm-up schedule), and adds the density in force to the epoch's logs. At the start
    of ``fit`` it refuses an optimizer that would apply momentum twice (DGC applies it).
    With ``adaptive=``, it ends the compressor's step after every batch
    (``compressor.end_step()``: the switch's samples and decisions); with
    ``steps_per_execution`` above 1, after every execution.

    ``fit`` numbers epochs from its ``initial_epoch``, so a resumed run continues the
    schedule where it stood.

    Args:
        compressor: a horovod_dgc compressor (``Compression.dgc(...)`` and friends).
    """

    def __init__(self, compressor: CompressorControls):
        super().__init__()
        if not isinstance(compressor, CompressorControls):
            raise TypeError(f"CompressionWarmup needs a horovod_dgc compressor, got "
                            f"{type(compressor).__name__}")
        self.compressor = compressor

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        check_optimizer = getattr(self.compressor, "check_optimizer", None)
        if check_optimizer is not None and self.model is not None:
            check_optimizer(self.model.optimizer)

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.compressor.set_epoch(epoch)

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if self.compressor.adaptive is not None:
            self.compressor.end_step()

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if logs is not None:
            logs["density"] = self.compressor.density
