"""Loss scaling under tf_keras ``model.fit`` with Horovod's Keras ``DistributedOptimizer``,
no ``attach_loss_scale`` call: the ``LossScaleOptimizer`` around Horovod's optimizer (which
``model.compile`` adds by itself under ``mixed_float16``) hands the compressor scaled
gradients, and the compressor must find that scale itself.

- ``float32`` policy, a dynamic ``LossScaleOptimizer`` whose scale doubles every 2 steps
  (powers of two: exact): memories and weights equal, bit for bit, those of a twin trained
  without any scale.
- ``mixed_float16`` policy (the optimizer wrapped by ``compile``), rank 1 alone overflowing
  at batch OVERFLOW: every rank halves its scale there, keeps its memories as they were,
  and ends with finite weights identical to the other ranks'.

``CompressionWarmup`` runs in every fit: its check of the optimizer judges a
``LossScaleOptimizer`` by the SGD it wraps (it refused DGC under one before). It also moves
the warm-up with fit's epochs, from ``initial_epoch`` on a resumed fit: the density sent in
each epoch follows the schedule.
"""
import os

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow is imported

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd

import horovod_dgc.tensorflow as hdgc
from horovod_dgc.tensorflow.callbacks import CompressionWarmup

keras = tf.keras
BATCHES, BATCH, OVERFLOW = 6, 16, 2
METHODS = {"topk": dict(density=0.05, min_numel=1000), "dgc": dict(density=0.05, min_numel=1000)}


def memories(compression) -> list:
    """This rank's memories in the variables' order (two fits name their layers apart)."""
    return [np.array(v) for state in compression.state_dict()["states"].values() for v in state.values()]


def weights(net) -> np.ndarray:
    return np.concatenate([v.numpy().ravel() for v in net.trainable_variables])


def net_and_data():
    """The model (seeded alike on every rank) and this rank's own batches."""
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.layers.Dense(64, activation="relu", input_shape=(32,)),
                            keras.layers.Dense(10, dtype="float32")])
    rs = np.random.RandomState(hvd.rank())
    x = rs.standard_normal((BATCHES * BATCH, 32)).astype(np.float32)
    y = rs.standard_normal((BATCHES * BATCH, 10)).astype(np.float32)
    return net, x, y


def fit(method: str, optimizer_around=None, overflow: bool = False, record=None):
    """(model, compressor) after one epoch of ``model.fit``; ``record`` (a :class:`Record`)
    watches the compressor batch by batch."""
    net, x, y = net_and_data()
    compression = getattr(hdgc.Compression, method)(**METHODS[method])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05), compression=compression)
    net.compile(optimizer=optimizer if optimizer_around is None else optimizer_around(optimizer), loss="mse")
    if overflow and hvd.rank() == 1:
        x[OVERFLOW * BATCH:(OVERFLOW + 1) * BATCH] = 1e30
    # CompressionWarmup checks the optimizer at the start: a LossScaleOptimizer by the one it wraps.
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), CompressionWarmup(compression)]
    if record is not None:
        record.compression = compression
        callbacks.append(record)
    net.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    return net, compression


def dynamic_scale_matches_the_unscaled_twin(method: str) -> None:
    def scaled(optimizer):
        return keras.mixed_precision.LossScaleOptimizer(optimizer, initial_scale=2.0 ** 10,
                                                        dynamic_growth_steps=2)
    # The twin first: a LossScaleOptimizer among its callers' variables would be refused.
    twin, twin_compression = fit(method)
    net, compression = fit(method, scaled)
    assert float(net.optimizer.loss_scale) == 2.0 ** 13, f"{method}: scale {float(net.optimizer.loss_scale)}"
    for ours, theirs in zip(memories(compression), memories(twin_compression), strict=True):
        assert np.array_equal(ours, theirs), (
            f"{method}: memories differ from the unscaled twin's (ratio "
            f"{np.abs(ours).sum() / max(np.abs(theirs).sum(), 1e-30):.4g})")
    assert np.array_equal(weights(net), weights(twin)), f"{method}: weights differ from the unscaled twin's"


class Record(keras.callbacks.Callback):
    """The loss scale and the compressor's memories after every batch."""

    def __init__(self):
        super().__init__()
        self.compression, self.scales, self.memories = None, [], []

    def on_train_batch_end(self, batch, logs=None):
        self.scales.append(float(self.model.optimizer.loss_scale))
        self.memories.append(memories(self.compression))


def overflow_on_one_rank_is_skipped_everywhere(method: str) -> None:
    record = Record()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        net, _ = fit(method, overflow=True, record=record)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert type(net.optimizer).__name__.startswith("LossScaleOptimizer"), type(net.optimizer)
    scales = record.scales
    assert scales[OVERFLOW] == scales[OVERFLOW - 1] / 2, f"{method}: scales {scales}"
    for before, after in zip(record.memories[OVERFLOW - 1], record.memories[OVERFLOW], strict=True):
        assert np.array_equal(before, after), f"{method}: the skipped step changed a memory"
    values = weights(net)
    assert np.isfinite(values).all(), f"{method}: weights not finite"
    for other in hvd_tf.allgather_object(values, name=f"overflow.{method}"):
        assert np.array_equal(other, values), f"{method}: ranks hold different weights"


class SentPerEpoch(keras.callbacks.Callback):
    """The fraction of the compressed tensors' entries the compressor sent in each epoch."""

    def __init__(self, compression):
        super().__init__()
        self.compression, self.totals, self.sent = compression, (0, 0), []

    def on_epoch_end(self, epoch, logs=None):
        stats = self.compression.stats()
        sent, compressed = stats.elements_sent - self.totals[0], stats.elements_compressed - self.totals[1]
        self.totals = (stats.elements_sent, stats.elements_compressed)
        self.sent.append(sent / compressed)


def warmup_follows_fits_epochs() -> None:
    """``CompressionWarmup`` sets the epoch at the start of each epoch of ``fit``, counted from
    ``initial_epoch``: the density sent in each epoch (the compressor's statistics) and the one
    logged follow ``rho ** ((e + 1) / (W + 1))``, from a fresh run and from one resumed at
    epoch 1. Catches a callback that never sets the epoch (every epoch would send epoch 0's
    density, 7x too many entries by the last) or that counts from 0 on resuming."""
    final, warmup_epochs = 0.05, 2
    schedule = [final ** ((e + 1) / (warmup_epochs + 1)) for e in range(warmup_epochs)] + [final]
    for initial_epoch in (0, 1):
        net, x, y = net_and_data()
        compression = hdgc.Compression.dgc(density=final, min_numel=1000, warmup_epochs=warmup_epochs)
        net.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05), compression=compression),
                    loss="mse")
        sent = SentPerEpoch(compression)
        history = net.fit(x, y, batch_size=BATCH, epochs=len(schedule), initial_epoch=initial_epoch,
                          shuffle=False, verbose=0,
                          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                     CompressionWarmup(compression), sent])
        wanted = schedule[initial_epoch:]
        # Each tensor sends ceil(density * n) entries: a few percent over the density here.
        assert np.allclose(sent.sent, wanted, rtol=0.05), (initial_epoch, sent.sent, wanted)
        assert np.allclose(history.history["density"], wanted), (initial_epoch, history.history, wanted)


if __name__ == "__main__":
    hvd.init()
    warmup_follows_fits_epochs()
    for method in METHODS:
        dynamic_scale_matches_the_unscaled_twin(method)
        overflow_on_one_rank_is_skipped_everywhere(method)
    print(f"rank {hvd.rank()} keras fit loss scale ok", flush=True)
