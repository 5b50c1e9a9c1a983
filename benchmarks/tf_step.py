"""What one TensorFlow training step's exchange costs with compression against Horovod's dense
all-reduce, on one host's loopback (``make bench-tf-step``): where compression cannot save
network time, its whole cost shows.

Run by every worker (``horovodrun -np 2 -H localhost:2 --gloo python -m
benchmarks.tf_step``), one thread each. The variables are Keras' ResNet-50's 214 (the
``keras.applications`` model, 1,000 classes, not built with weights); each step's loss is
``sum(v * g)`` over the variables for fixed ``randn`` tensors ``g``, so the tape's gradients
are ``g`` at the cost of one multiply (no forward or backward pass of the network), reduced
through ``horovod_dgc.tensorflow.DistributedGradientTape`` and applied by plain SGD (lr 0:
the variables stay as they are), inside ``tf.function``. For ``dense`` the tape's compression
is Horovod's ``Compression.none``; for a method, its compressor at its defaults.

Rounds interleave the methods (one step of each per round, the order reversed every other
round) after one untimed step each (the trace); each step is timed on every rank after a
barrier, and a step counts for its slowest rank. Rank 0 prints the median milliseconds per step
and the ratio to ``dense`` of the same run::

    python -m benchmarks.tf_step [--methods dgc scalecom ...] [--steps 10]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable, Dict, List, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import horovod.tensorflow as hvd  # noqa: E402 (the log level must be set before the import)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod_dgc.tensorflow as hdgc  # noqa: E402
from horovod_dgc.core.methods import METHODS  # noqa: E402


def step_of(compression, model: keras.Model) -> Callable[[List[tf.Tensor]], None]:
    """One exchange and update of ``model``'s variables with gradients ``grads`` (their order)."""
    variables, sgd = model.trainable_variables, keras.optimizers.SGD(0.0)

    @tf.function
    def step(grads: List[tf.Tensor]) -> None:
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v.value * g) for v, g in zip(variables, grads)])
        tape = hdgc.DistributedGradientTape(tape, compression=compression)
        sgd.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return step


def timed(step: Callable[[List[tf.Tensor]], None], grads: List[tf.Tensor]) -> float:
    """Seconds of one step on this rank, started after a barrier."""
    hvd.allreduce(tf.zeros(1), name="tf_step.barrier")
    started = time.perf_counter()
    step(grads)
    return time.perf_counter() - started


def measure(methods: Sequence[str], steps: int) -> Dict[str, List[float]]:
    """Per run (``dense`` and each method), the seconds of each timed step on the slowest rank."""
    model = keras.applications.ResNet50(weights=None)
    rs = np.random.RandomState(hvd.rank())
    grads = [tf.constant(rs.standard_normal(v.shape).astype(np.float32)) for v in model.trainable_variables]
    runs = {"dense": step_of(hvd.Compression.none, model)}
    runs.update({m: step_of(getattr(hdgc.Compression, m)(), model) for m in methods})
    for step in runs.values():
        step(grads)
    seconds: Dict[str, List[float]] = {name: [] for name in runs}
    for round_ in range(steps):
        for name in (list(runs) if round_ % 2 == 0 else list(runs)[::-1]):
            seconds[name].append(timed(runs[name], grads))
    everyone = hvd.allgather_object(seconds, name="tf_step.seconds")
    return {name: [max(rank[name][i] for rank in everyone) for i in range(steps)] for name in runs}


def main(argv: Sequence[str] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["dgc", "scalecom"],
                   choices=[spec.name for spec in METHODS])
    p.add_argument("--steps", type=int, default=10, help="timed steps per run, interleaved")
    args = p.parse_args(argv)
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    seconds = measure(args.methods, args.steps)
    if hvd.rank() == 0:
        dense = statistics.median(seconds["dense"])
        print(f"{hvd.size()} workers, Keras ResNet-50's 214 variables, {args.steps} steps each, "
              f"TensorFlow {tf.__version__}")
        print(f"{'run':<12} {'ms/step':>9} {'x dense':>8}")
        for name, values in seconds.items():
            median = statistics.median(values)
            print(f"{name:<12} {1000 * median:>9.1f} {median / dense:>8.2f}")


if __name__ == "__main__":
    main()
