"""ImageNet-shaped data for the TensorFlow examples, as ``tf.data`` pipelines: random images
(the default), or an ImageFolder-style directory (one sub-folder of JPEG/PNG files per class)
decoded by TensorFlow itself. Each rank reads its own shard."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Tuple

import tensorflow as tf

# ImageNet's per-channel mean and standard deviation (RGB, pixel values in [0, 1]).
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
AUTOTUNE = tf.data.AUTOTUNE


def synthetic(num_classes: int, image_size: int, batch_size: int, images: int, rank: int,
              seed: int = 0) -> tf.data.Dataset:
    """``images // batch_size`` batches of normal noise and uniform labels (different per rank)."""
    generator = tf.random.Generator.from_seed(seed * 1009 + rank)
    x = generator.normal([batch_size, image_size, image_size, 3])
    y = generator.uniform([batch_size], 0, num_classes, tf.int64)
    # One batch repeated: the point is the gradient's size and the exchange, not the data.
    return tf.data.Dataset.from_tensors((x, y)).repeat(max(1, images // batch_size))


def image_folder(root: Path, image_size: int, batch_size: int, rank: int, size: int,
                 train: bool, seed: int = 0, parallel_calls: int = AUTOTUNE) -> Tuple[tf.data.Dataset, int]:
    """(batches of this rank's shard of ``root``, number of classes). Shorter side resized
    to ``image_size``, centre crop, normalised; training shuffles and flips."""
    root = Path(root)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not classes:
        raise ValueError(f"{root} is not an ImageFolder directory (no class sub-folders)")
    files, labels = [], []
    for label, name in enumerate(classes):
        found = sorted(str(f) for f in (root / name).iterdir()
                       if f.suffix.lower() in (".jpg", ".jpeg", ".png"))
        files += found
        labels += [label] * len(found)
    if len(files) < size:
        raise ValueError(f"{root} holds {len(files)} images, fewer than the {size} ranks")
    data = tf.data.Dataset.from_tensor_slices((files, labels)).shard(size, rank)
    if train:
        data = data.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)

    def load(path: tf.Tensor, label: tf.Tensor):
        image = tf.io.decode_image(tf.io.read_file(path), channels=3, expand_animations=False)
        image = tf.cast(image, tf.float32) / 255.0
        shape = tf.cast(tf.shape(image)[:2], tf.float32)
        scaled = tf.cast(tf.math.ceil(shape * image_size / tf.reduce_min(shape)), tf.int32)
        image = tf.image.resize_with_crop_or_pad(tf.image.resize(image, scaled), image_size, image_size)
        if train:
            image = tf.image.random_flip_left_right(image, seed=seed)
        return (image - MEAN) / STD, tf.cast(label, tf.int64)

    batches = data.map(load, num_parallel_calls=parallel_calls).batch(batch_size, drop_remainder=train)
    return batches.prefetch(AUTOTUNE), len(classes)


def add_training_flags(p: argparse.ArgumentParser) -> None:
    """The data and training flags of the small TensorFlow examples (custom loop, Keras fit)."""
    p.add_argument("--data-dir", type=Path, help="ImageFolder directory (default: synthetic data)")
    p.add_argument("--image-size", type=int, default=64, help="side of the input images, pixels")
    p.add_argument("--num-classes", type=int, default=1000, help="classes of the synthetic data")
    p.add_argument("--epochs", type=int, default=2, help="epochs to train")
    p.add_argument("--steps-per-epoch", type=int, default=20, help="steps per epoch (synthetic data)")
    p.add_argument("--batch-size", type=int, default=16, help="images per step, per rank")
    p.add_argument("--lr", type=float, default=0.01,
                   help="learning rate per worker (scaled by their number)")
    p.add_argument("--momentum", type=float, default=0.9,
                   help="SGD momentum (inside the compressor for dgc and blocksign)")


def training_data(args: argparse.Namespace, rank: int, size: int) -> Tuple[tf.data.Dataset, int]:
    """(this rank's training batches, number of classes) for the flags above."""
    if args.data_dir:
        return image_folder(args.data_dir, args.image_size, args.batch_size, rank, size, train=True)
    return (synthetic(args.num_classes, args.image_size, args.batch_size,
                      args.steps_per_epoch * args.batch_size, rank), args.num_classes)
