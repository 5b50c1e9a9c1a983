"""Keras ``model.fit`` with Horovod's Keras ``DistributedOptimizer`` and gradient compression.

    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_fit.py \\
        --compression dgc --image-size 32 --steps-per-epoch 20

Horovod 0.28.1's Keras integration wraps Keras 2 optimizers, so this runs on ``tf_keras``
(``TF_USE_LEGACY_KERAS=1``, set below before TensorFlow is imported); Keras 3 users train
with a custom loop (examples/tensorflow_custom_loop.py). Synthetic ImageNet-shaped data by
default, or ``--data-dir`` (an ImageFolder directory). The compressor goes to Horovod as
``compression=``; the ``CompressionWarmup`` callback moves DGC's warm-up with the epochs.
"""
from __future__ import annotations

import os

os.environ["TF_USE_LEGACY_KERAS"] = "1"

import argparse  # noqa: E402
import time  # noqa: E402
from typing import List, Optional  # noqa: E402

import horovod.tensorflow.keras as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402

import _tf_compression  # noqa: E402
from _flags import add_adaptive_flag, add_compression_flags  # noqa: E402
import _tf_data  # noqa: E402
from horovod_dgc.tensorflow.callbacks import CompressionWarmup  # noqa: E402

keras = tf.keras  # tf_keras, from TF_USE_LEGACY_KERAS


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _tf_data.add_training_flags(p)
    add_compression_flags(p)
    add_adaptive_flag(p)
    return p.parse_args(argv)


def small_cnn(image_size: int, num_classes: int) -> keras.Model:
    layers = [keras.Input((image_size, image_size, 3))]
    for channels in (32, 64, 128):
        layers.append(keras.layers.Conv2D(channels, 3, strides=2, padding="same", activation="relu"))
    layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(num_classes)]
    return keras.Sequential(layers, name="small_cnn")


class Throughput(keras.callbacks.Callback):
    """Images per second of every epoch, added to its logs."""

    def __init__(self, images_per_step: int):
        super().__init__()
        self.images_per_step, self.started, self.steps = images_per_step, 0.0, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.started, self.steps = time.perf_counter(), 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1

    def on_epoch_end(self, epoch, logs=None):
        logs["images_per_s"] = self.steps * self.images_per_step / (time.perf_counter() - self.started)


def main(args: argparse.Namespace) -> None:
    hvd.init()
    keras.utils.set_random_seed(0)
    data, num_classes = _tf_data.training_data(args, hvd.rank(), hvd.size())
    model = small_cnn(args.image_size, num_classes)
    compression = _tf_compression.make(args, model.trainable_variables)
    sgd = keras.optimizers.SGD(args.lr * hvd.size(), momentum=_tf_compression.optimizer_momentum(args))
    model.compile(optimizer=hvd.DistributedOptimizer(sgd, compression=compression),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    # (Horovod's MetricAverageCallback calls a Keras-3-only backend here: metrics are rank 0's.)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), Throughput(args.batch_size * hvd.size())]
    if hasattr(compression, "set_epoch"):
        callbacks.append(CompressionWarmup(compression))
    started = time.perf_counter()
    history = model.fit(data, epochs=args.epochs, callbacks=callbacks, verbose=1 if hvd.rank() == 0 else 0)
    if hvd.rank() == 0:
        last = {k: v[-1] for k, v in history.history.items()}
        print(f"\n=== {hvd.size()} ranks, {args.epochs} epochs, {model.count_params()} parameters, "
              f"{time.perf_counter() - started:.1f} s ===")
        if hasattr(compression, "stats"):
            print(f"compression {args.compression}, whole run: {compression.stats().summary()}")
        print(f"last epoch (rank 0's batches): loss {last['loss']:.4f}, accuracy {last['accuracy']:.4f}, "
              f"{last['images_per_s']:.1f} images/s", flush=True)


if __name__ == "__main__":
    main(parse_args())
