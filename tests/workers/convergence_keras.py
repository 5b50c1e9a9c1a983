"""Keras ``model.fit`` on MNIST-1D through Horovod's Keras ``DistributedOptimizer``
(tf_keras), dense or with a horovod_dgc compressor and its warm-up callback; prints
``RESULT {json}`` on rank 0 (final test accuracy, traffic ratio of the last epoch).

The model and schedule are those of examples/pytorch_mnist1d.py: three 1-D convolutions,
global max pooling, SGD with momentum 0.9 (inside the compressor for DGC), cosine-annealed
learning rate, 32 examples per rank per step.
"""
import os

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow is imported

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from _data import NUM_CLASSES, load_mnist1d  # noqa: E402

import horovod_dgc.tensorflow as hdgc  # noqa: E402
from horovod_dgc.tensorflow.callbacks import CompressionWarmup  # noqa: E402

keras = tf.keras


def conv_net(channels: int = 64) -> keras.Model:
    return keras.Sequential([
        keras.Input((40,)), keras.layers.Reshape((40, 1)),
        keras.layers.Conv1D(channels, 5, padding="same", activation="relu"),
        keras.layers.Conv1D(channels, 3, padding="same", activation="relu"),
        keras.layers.Conv1D(channels, 3, padding="same", activation="relu"),
        keras.layers.GlobalMaxPooling1D(), keras.layers.Dense(NUM_CLASSES)])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--compression", choices=["dense", "dgc"], required=True)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--density", type=float, default=0.001)
    p.add_argument("--warmup-epochs", type=int, default=4)
    args = p.parse_args()
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras.utils.set_random_seed(0)
    train, test = load_mnist1d()
    shard = train.shard(hvd.rank(), hvd.size())
    batch_size, momentum = 32, 0.9
    steps = args.epochs * (len(shard.y) // batch_size)
    model = conv_net()
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    if args.compression == "dgc":
        compression = hdgc.Compression.dgc(variables=model.trainable_variables, density=args.density,
                                           warmup_epochs=args.warmup_epochs, momentum=momentum)
        callbacks.append(CompressionWarmup(compression))
        momentum = 0.0  # DGC's momentum correction applies it
    else:
        compression = hdgc.Compression.none
    sgd = keras.optimizers.SGD(keras.optimizers.schedules.CosineDecay(0.05, steps), momentum=momentum)
    model.compile(optimizer=hvd.DistributedOptimizer(sgd, compression=compression),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    ratio = float("nan")

    class LastEpochTraffic(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if hasattr(compression, "reset_stats"):
                compression.reset_stats()

        def on_epoch_end(self, epoch, logs=None):
            nonlocal ratio
            if hasattr(compression, "stats"):
                ratio = compression.stats().ratio

    model.fit(shard.x, shard.y, batch_size=batch_size, epochs=args.epochs, shuffle=True,
              callbacks=callbacks + [LastEpochTraffic()], verbose=0)
    weights = np.concatenate([w.reshape(-1) for w in model.get_weights()])
    for other in hvd_tf.allgather_object(weights):
        assert np.array_equal(other, weights), "ranks hold different weights"
    if hvd.rank() == 0:
        accuracy = float(np.mean(np.argmax(model.predict(test.x, verbose=0), 1) == test.y))
        print("RESULT " + json.dumps(dict(compression=args.compression, accuracy=accuracy, ratio=ratio)),
              flush=True)


if __name__ == "__main__":
    main()
