"""ResNet-50 on ImageNet (or any ImageFolder directory) with Horovod, TensorFlow and gradient
compression: the TensorFlow twin of examples/pytorch_imagenet_resnet50.py, with its flags.

    horovodrun -np 4 -H localhost:4 python examples/tensorflow_imagenet_resnet50.py \\
        --train-dir /data/imagenet/train --val-dir /data/imagenet/val --compression dgc

The usual Horovod recipe on a Keras 3 ``keras.applications.ResNet50(weights=None)`` in a
custom loop: the learning rate scales with the number of workers and
``--batches-per-allreduce`` (gradients summed locally over that many batches, then one
exchange), warms up linearly and decays tenfold at ``--lr-decay-epochs``; DGC's sparsity
warm-up follows the epochs. After every epoch rank 0 saves the weights and the optimizer,
and every rank its own part of the compressor state (residuals and momentum: gradient not
yet sent); a new run with the same ``--checkpoint-dir`` resumes from the latest complete
epoch, on any number of workers: the compressor memories are redistributed without losing
gradient mass (their average is kept; see horovod_dgc/tensorflow/checkpoint.py).

On a CPU, ``--image-size 32 --batch-size 4 --steps-per-epoch 3`` keeps an epoch short while
the gradient stays ResNet-50's (25.6 M parameters).
"""
from __future__ import annotations

import argparse
import json
import pickle
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf
from tqdm import tqdm

import _tf_compression
import _tf_data
from _flags import MOMENTUM_IN_COMPRESSOR, imagenet_parser, parse_imagenet_args
from horovod_dgc.tensorflow.checkpoint import redistribute


def build_parser() -> argparse.ArgumentParser:
    """Every flag of the example, documented (those of the PyTorch twin)."""
    return imagenet_parser(__doc__.split("\n")[0],
                           loader_workers_help="images decoded in parallel per rank (tf.data map "
                           "calls)",
                           optimizers=("horovod",),
                           optimizer_help="horovod: Horovod's all-reduce with compression= (the "
                           "PyTorch example's fused optimizer has no TensorFlow counterpart)")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    return parse_imagenet_args(build_parser(), argv)


def learning_rate(args: argparse.Namespace, epoch: float) -> float:
    """Linear warm-up from ``base_lr`` to ``base_lr * workers * batches_per_allreduce``,
    then tenfold drops."""
    peak = args.base_lr * hvd.size() * args.batches_per_allreduce
    if epoch < args.warmup_epochs:
        return args.base_lr + (peak - args.base_lr) * epoch / args.warmup_epochs
    return peak * 0.1 ** sum(epoch >= e for e in args.lr_decay_epochs)


class Checkpoints:
    """``epoch-EEE/``: ``model.weights.h5`` and ``optimizer.npz`` (rank 0), and
    ``compressor-rankR-of-N.pkl`` (rank R's compressor part). An epoch counts as saved once
    its ``complete`` file exists: rank 0 writes it last, after every rank's part."""

    def __init__(self, folder: Path, keep: int):
        self.folder, self.keep = folder, keep

    def epoch_dir(self, epoch: int) -> Path:
        return self.folder / f"epoch-{epoch:03d}"

    def latest_epoch(self) -> int:
        done = [int(d.name.split("-")[1]) for d in self.folder.glob("epoch-*") if (d / "complete").exists()]
        return max(done, default=0)

    def save(self, epoch: int, model: keras.Model, optimizer, compression) -> None:
        folder = self.epoch_dir(epoch)
        if hvd.rank() == 0:
            folder.mkdir(parents=True, exist_ok=True)
        hvd.allreduce(tf.constant(0), name=f"checkpoint.mkdir.{epoch}")
        if hasattr(compression, "state_dict"):
            with open(folder / f"compressor-rank{hvd.rank()}-of-{hvd.size()}.pkl", "wb") as f:
                pickle.dump(compression.state_dict(), f)
        if hvd.rank() == 0:
            model.save_weights(folder / "model.weights.h5")
            np.savez(folder / "optimizer.npz", *[v.numpy() for v in optimizer.variables])
        hvd.allreduce(tf.constant(0), name=f"checkpoint.saved.{epoch}")
        if hvd.rank() == 0:
            (folder / "complete").touch()
            old = sorted(self.folder.glob("epoch-*"))[:-self.keep] if self.keep else []
            for stale in old:
                shutil.rmtree(stale)

    def load(self, epoch: int, model: keras.Model, optimizer, compression) -> None:
        folder = self.epoch_dir(epoch)
        model.load_weights(folder / "model.weights.h5")
        saved = np.load(folder / "optimizer.npz")
        for i, variable in enumerate(optimizer.variables):
            variable.assign(saved[f"arr_{i}"])
        if not hasattr(compression, "load_state_dict"):
            return
        files = sorted(folder.glob("compressor-rank*-of-*.pkl"))
        worlds = {int(f.stem.rsplit("-of-", 1)[1]) for f in files}
        if len(worlds) != 1 or len(files) != next(iter(worlds)):
            raise SystemExit(f"{folder} lacks compressor parts: found {[f.name for f in files]}, "
                             f"need one per rank of the saving run")
        saved_world = worlds.pop()
        parts = [pickle.loads((folder / f"compressor-rank{r}-of-{saved_world}.pkl").read_bytes())
                 for r in range(saved_world)]
        compression.load_state_dict(redistribute(parts, hvd.size(), hvd.rank()))


@dataclass
class EpochMetrics:
    epoch: int
    loss: float
    accuracy: float
    images_per_s: float
    compression_ratio: float
    density: float
    lr: float
    val_accuracy: Optional[float] = None


class Trainer:
    """ResNet-50, the optimizer and the compressor, and the compiled steps."""

    def __init__(self, args: argparse.Namespace, num_classes: int):
        self.args = args
        keras.utils.set_random_seed(args.seed)
        self.model = keras.applications.ResNet50(weights=None, classes=num_classes, classifier_activation=None,
                                                 input_shape=(args.image_size, args.image_size, 3))
        self.compression = _tf_compression.make(args, self.model.trainable_variables)
        inside = args.compression in MOMENTUM_IN_COMPRESSOR
        self.optimizer = keras.optimizers.SGD(
            args.base_lr, momentum=_tf_compression.optimizer_momentum(args),
            weight_decay=None if inside and args.compression == "dgc" else args.wd)
        self.optimizer.build(self.model.trainable_variables)
        if hasattr(self.compression, "check_optimizer"):
            self.compression.check_optimizer(self.optimizer)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.summed = [tf.Variable(tf.zeros_like(v.value), trainable=False) for v in self.model.trainable_variables]

    @tf.function
    def accumulate(self, x: tf.Tensor, y: tf.Tensor):
        """One local backward pass, its gradient added to the local sums; (loss, correct)."""
        with tf.GradientTape() as tape:
            logits = self.model(x, training=True)
            loss = self.loss_fn(y, logits)
        for total, grad in zip(self.summed, tape.gradient(loss, self.model.trainable_variables)):
            total.assign_add(grad)
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))
        return loss, correct

    @tf.function
    def exchange_and_apply(self):
        """Average the local sums over the ranks through the compressor, apply, reset."""
        scale = 1.0 / self.args.batches_per_allreduce
        averaged = [hvd.allreduce(total * scale, op=hvd.Average, compression=self.compression,
                                  name=f"grad.{i}") for i, total in enumerate(self.summed)]
        self.optimizer.apply_gradients(zip(averaged, self.model.trainable_variables))
        for total in self.summed:
            total.assign(tf.zeros_like(total))

    @tf.function
    def predict(self, x: tf.Tensor) -> tf.Tensor:
        return tf.argmax(self.model(x, training=False), 1)


def train_epoch(trainer: Trainer, data: tf.data.Dataset, epoch: int, steps: Optional[int]) -> EpochMetrics:
    args, compression = trainer.args, trainer.compression
    if hasattr(compression, "set_epoch"):
        compression.set_epoch(epoch)
        compression.reset_stats()
    batches = iter(data)
    bar = tqdm(total=steps, desc=f"epoch {epoch + 1}/{args.epochs}", disable=hvd.rank() != 0, leave=False)
    loss_sum = correct = seen = exchanges = 0.0
    started = time.perf_counter()
    while steps is None or exchanges < steps:
        group = [b for _, b in zip(range(args.batches_per_allreduce), batches)]
        if len(group) < args.batches_per_allreduce:
            break
        lr = learning_rate(args, epoch + (exchanges / steps if steps else 0.0))
        trainer.optimizer.learning_rate.assign(lr)
        for x, y in group:
            loss, right = trainer.accumulate(x, y)
            loss_sum, correct, seen = loss_sum + float(loss), correct + float(right), seen + int(x.shape[0])
        trainer.exchange_and_apply()
        exchanges += 1
        rate = seen * hvd.size() / (time.perf_counter() - started)
        bar.update()
        bar.set_postfix(loss=f"{loss_sum / (exchanges * args.batches_per_allreduce):.3f}",
                        acc=f"{correct / seen:.3f}", img_s=f"{rate:.1f}",
                        ratio=f"{_tf_compression.ratio(compression):.1f}x", refresh=False)
    bar.close()
    totals = hvd.allreduce(tf.constant([loss_sum, correct, seen, exchanges * args.batches_per_allreduce], tf.float64),
                           op=hvd.Sum, name=f"epoch.{epoch}").numpy()
    return EpochMetrics(epoch=epoch + 1, loss=totals[0] / max(totals[3], 1), accuracy=totals[1] / max(totals[2], 1),
                        images_per_s=totals[2] / (time.perf_counter() - started),
                        compression_ratio=_tf_compression.ratio(compression),
                        density=getattr(compression, "density", 1.0), lr=lr)


def validate(trainer: Trainer, data: tf.data.Dataset) -> float:
    correct = seen = 0.0
    for x, y in data:
        correct += float(tf.reduce_sum(tf.cast(tf.equal(trainer.predict(x), y), tf.float64)))
        seen += int(x.shape[0])
    totals = hvd.allreduce(tf.constant([correct, seen], tf.float64), op=hvd.Sum, name="validation").numpy()
    return totals[0] / max(totals[1], 1)


def main(args: argparse.Namespace) -> None:
    hvd.init()
    if args.synthetic:
        num_classes = args.num_classes
        train = _tf_data.synthetic(num_classes, args.image_size, args.batch_size,
                                   args.synthetic_images // hvd.size(), hvd.rank(), args.seed)
    else:
        train, num_classes = _tf_data.image_folder(args.train_dir, args.image_size, args.batch_size, hvd.rank(),
                                                   hvd.size(), True, args.seed, args.loader_workers)
    val = None
    if args.val_dir:
        val, _ = _tf_data.image_folder(args.val_dir, args.image_size, args.val_batch_size, hvd.rank(),
                                       hvd.size(), False, args.seed, args.loader_workers)
    trainer = Trainer(args, num_classes)
    checkpoints = Checkpoints(args.checkpoint_dir, args.keep_checkpoints)
    start = checkpoints.latest_epoch()
    if start:
        checkpoints.load(start, trainer.model, trainer.optimizer, trainer.compression)
        if hvd.rank() == 0:
            print(f"resumed from {checkpoints.epoch_dir(start)}", flush=True)
    else:
        for variable in trainer.model.variables:  # every rank starts from rank 0's weights
            variable.assign(hvd.broadcast(variable.value, root_rank=0, name=f"init.{variable.path}"))
    history: List[dict] = []
    for epoch in range(start, args.epochs):
        metrics = train_epoch(trainer, train, epoch, args.steps_per_epoch)
        if val is not None:
            metrics.val_accuracy = validate(trainer, val)
        checkpoints.save(epoch + 1, trainer.model, trainer.optimizer, trainer.compression)
        if hvd.rank() == 0:
            history.append(asdict(metrics))
            report(metrics, args)
            if args.json:
                args.json.write_text(json.dumps(dict(compression=args.compression, workers=hvd.size(),
                                                     resumed_from=start, history=history), indent=2))


def report(m: EpochMetrics, args: argparse.Namespace) -> None:
    val = "" if m.val_accuracy is None else f", val accuracy {m.val_accuracy:.4f}"
    tqdm.write(f"epoch {m.epoch}/{args.epochs}: loss {m.loss:.4f}, accuracy {m.accuracy:.4f}{val}, "
               f"{m.images_per_s:.1f} images/s, lr {m.lr:.4g}, {args.compression} density "
               f"{m.density:.4%}, traffic {m.compression_ratio:.1f}x smaller than dense")


if __name__ == "__main__":
    main(parse_args())
