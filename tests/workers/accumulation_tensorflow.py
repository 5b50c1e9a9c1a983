"""Gradient accumulation through Horovod's Keras ``DistributedOptimizer``
(``backward_passes_per_step=2``, tf_keras, ``model.fit``): the model's loss is ``sum(w * x)``,
so a batch of one sample x has gradient x exactly. Eight samples a rank with two passes a step
give the weights that four samples ``x[2i] + x[2i+1]`` give with one pass a step, and the
compressor counts four steps. Catches a compressor run on every pass (Horovod's aggregation
puts the all-reduce inside a ``tf.cond``), a step counted per pass, or a pass's gradient lost.
Keras' ``steps_per_execution=4`` (four steps in one run of the traced function) trains as one
step per run does: catches state advanced once per trace or per run instead of per step.
"""
import argparse
import os

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow is imported

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd

import horovod_dgc.tensorflow as hdgc

keras = tf.keras
SAMPLES = 8  # per rank; two passes a step
KERNEL, BIAS = (64, 40), (40,)  # 2,560 elements compressed, 40 dense
METHODS = {"dgc": dict(density=0.01), "topk": dict(density=0.01), "gaussiank": dict(density=0.01),
           "scalecom": dict(density=0.01), "blocksign": dict(block_size=64)}
METHODS = {name: {**options, "min_numel": 1000} for name, options in METHODS.items()}


class Injected(keras.Model):
    """Loss ``sum(kernel * x[:2560]) + sum(bias * x[2560:])`` per sample."""

    def __init__(self):
        super().__init__()
        init = keras.initializers.RandomNormal(seed=0)
        self.kernel = self.add_weight(name="kernel", shape=KERNEL, initializer=init)
        self.bias = self.add_weight(name="bias", shape=BIAS, initializer=init)

    def call(self, x):
        split = int(np.prod(KERNEL))
        kernel = tf.reduce_sum(tf.reshape(x[:, :split], (-1,) + KERNEL) * self.kernel, axis=[1, 2])
        return kernel + tf.reduce_sum(x[:, split:] * self.bias, axis=1)


def train(method: str, passes: int, samples: np.ndarray, steps_per_execution: int = 1) -> tuple:
    keras.utils.set_random_seed(0)
    net = Injected()
    compression = getattr(hdgc.Compression, method)(**METHODS[method])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=compression,
                                         backward_passes_per_step=passes)
    net.compile(optimizer=optimizer, loss=lambda _, loss: loss, steps_per_execution=steps_per_execution)
    net.fit(samples, np.zeros(len(samples), np.float32), batch_size=1, epochs=1, shuffle=False, verbose=0)
    return np.concatenate([v.numpy().reshape(-1) for v in net.trainable_variables]), compression


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", default=",".join(METHODS))
    methods = parser.parse_args().methods.split(",")
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    rs = np.random.RandomState(hvd.rank())
    samples = rs.standard_normal((SAMPLES, int(np.prod(KERNEL)) + BIAS[0])).astype(np.float32)
    summed = samples[0::2] + samples[1::2]
    for method in methods:
        accumulated, compression = train(method, 2, samples)
        reference, _ = train(method, 1, summed)
        steps = compression.stats().steps
        assert steps == SAMPLES // 2, f"{method}: the compressor counted {steps} steps"
        keras.utils.set_random_seed(0)
        initial = np.concatenate([v.numpy().reshape(-1) for v in Injected().trainable_variables])
        assert float(np.abs(reference - initial).max()) > 0.01, f"{method}: nothing moved"
        difference = float(np.abs(accumulated - reference).max())
        assert difference <= 1e-6, f"{method}: accumulation differs by {difference}"
        # Four steps in one execution of the traced function: the same weights as one each.
        together, compression = train(method, 1, samples, steps_per_execution=4)
        one_by_one, _ = train(method, 1, samples)
        assert compression.stats().steps == SAMPLES, f"{method}: {compression.stats().steps} steps together"
        assert np.array_equal(together, one_by_one), f"{method}: steps_per_execution=4 differs"
        everyone = hvd_tf.allgather_object(accumulated, name=f"weights.{method}")
        assert all(np.array_equal(w, accumulated) for w in everyone), f"{method}: ranks differ"
        print(f"rank {hvd.rank()}/{hvd.size()} {method} keras accumulation ok ({difference:.1e})", flush=True)


if __name__ == "__main__":
    main()
