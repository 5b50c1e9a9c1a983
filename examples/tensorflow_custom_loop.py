"""TF2 custom training loop with Horovod and gradient compression, on a Keras 3 model.

    horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow_custom_loop.py \\
        --compression dgc --image-size 32 --steps-per-epoch 20

Synthetic ImageNet-shaped data (random images, 1000 classes) by default, or ``--data-dir``
(an ImageFolder directory: one sub-folder of JPEG/PNG files per class). Gradients go through
``horovod_dgc.tensorflow.DistributedGradientTape``, which takes the Keras 3 variables as they
are (Horovod's stock tape needs ``[v.value for v in ...]``), inside a ``tf.function``. Rank 0
shows a progress bar (loss, images/s, compression ratio) and a summary at the end.
"""
from __future__ import annotations

import argparse
import time
from typing import List, Optional

import horovod.tensorflow as hvd
import keras
import tensorflow as tf
from tqdm import tqdm

import _tf_compression
from _flags import add_adaptive_flag, add_compression_flags
import _tf_data
import horovod_dgc.tensorflow as hdgc


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _tf_data.add_training_flags(p)
    p.add_argument("--model", choices=("small", "resnet50"), default="small",
                   help="small: a 4-layer CNN; resnet50: keras.applications.ResNet50(weights=None)")
    add_compression_flags(p)
    add_adaptive_flag(p)
    return p.parse_args(argv)


def build_model(name: str, image_size: int, num_classes: int) -> keras.Model:
    if name == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=(image_size, image_size, 3),
                                           classes=num_classes, classifier_activation=None)
    layers = [keras.Input((image_size, image_size, 3))]
    for channels in (32, 64, 128):
        layers += [keras.layers.Conv2D(channels, 3, strides=2, padding="same", activation="relu")]
    layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(num_classes)]
    return keras.Sequential(layers, name="small_cnn")


def main(args: argparse.Namespace) -> None:
    hvd.init()
    keras.utils.set_random_seed(0)
    data, num_classes = _tf_data.training_data(args, hvd.rank(), hvd.size())
    model = build_model(args.model, args.image_size, num_classes)
    compression = _tf_compression.make(args, model.trainable_variables)
    optimizer = keras.optimizers.SGD(args.lr * hvd.size(), momentum=_tf_compression.optimizer_momentum(args))
    if hasattr(compression, "check_optimizer"):
        compression.check_optimizer(optimizer)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hdgc.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    # Every rank starts from rank 0's weights.
    for variable in model.variables:
        variable.assign(hvd.broadcast(variable.value, root_rank=0, name=f"init.{variable.path}"))
    started, images = time.perf_counter(), 0
    for epoch in range(args.epochs):
        if hasattr(compression, "set_epoch"):
            compression.set_epoch(epoch)
            compression.reset_stats()
        bar = tqdm(data, desc=f"epoch {epoch + 1}/{args.epochs}", disable=hvd.rank() != 0)
        epoch_started = time.perf_counter()
        for step, (x, y) in enumerate(bar):
            loss = train_step(x, y)
            if getattr(compression, "adaptive", None) is not None:
                compression.end_step()  # every rank, after every step: the switch's decisions
            images += int(x.shape[0]) * hvd.size()
            rate = (step + 1) * int(x.shape[0]) * hvd.size() / (time.perf_counter() - epoch_started)
            bar.set_postfix(loss=f"{float(loss):.3f}", img_s=f"{rate:.0f}",
                            ratio=f"{_tf_compression.ratio(compression):.0f}x", refresh=False)
    if hvd.rank() == 0:
        wall_s = time.perf_counter() - started
        params = sum(int(tf.size(v)) for v in model.trainable_variables)
        print(f"\n=== {hvd.size()} ranks, {args.epochs} epochs, {args.model} ({params} parameters), "
              f"{wall_s:.1f} s, {images / wall_s:.1f} images/s ===")
        if hasattr(compression, "stats"):
            print(f"compression {args.compression}, last epoch: {compression.stats().summary()}")
        print(f"final loss: {float(loss):.4f}", flush=True)


if __name__ == "__main__":
    main(parse_args())
