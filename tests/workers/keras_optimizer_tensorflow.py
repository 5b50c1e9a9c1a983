"""Every method through Horovod's Keras ``DistributedOptimizer`` (tf_keras, ``model.fit``),
with a compressor given nothing: every rank ends with the same weights, and the compressor
keeps its memories under the variables' names; for DGC a compressor given ``variables=``
ends with the same weights bit for bit. DGC under an SGD with momentum of its own is refused
on the first step.

The model has a layer that gets no gradient, placed just before a layer of the same shapes
(pairing gradients by order and shape would give that layer the unused one's memories).
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
# The kernels (1,600 and 2,560 elements) are compressed, the biases go dense.
METHODS = {"dgc": dict(density=0.01), "topk": dict(density=0.01), "gaussiank": dict(density=0.01),
           "scalecom": dict(density=0.01), "blocksign": dict(block_size=64)}
METHODS = {name: {**options, "min_numel": 1000} for name, options in METHODS.items()}
# Each fit is a trace of its own (most of this job's minutes), and finding the variables does
# not depend on the method: one method also trains with a compressor given ``variables=``.
NAMED_TOO = ("dgc",)


class Net(keras.Model):
    """in -> 40 -> 40 -> 40 -> 3; ``spare`` (40 -> 40) is built but never called."""

    def __init__(self):
        super().__init__()
        self.wide = keras.layers.Dense(40, activation="relu", name="wide")
        self.spare = keras.layers.Dense(40, name="spare")
        self.middle = keras.layers.Dense(40, activation="relu", name="middle")
        self.late = keras.layers.Dense(40, activation="relu", name="late")
        self.out = keras.layers.Dense(3, name="out")

    def call(self, x):
        return self.out(self.late(self.middle(self.wide(x))))


def train(method: str, named: bool, momentum: float = 0.0) -> tuple:
    keras.utils.set_random_seed(0)
    net = Net()
    net.build((None, 64))
    net.spare.build((None, 40))
    order = [v.name for v in net.trainable_variables]
    assert order.index("kernel:0") + 2 == order.index("middle/kernel:0"), order  # spare, middle
    compression = getattr(hdgc.Compression, method)(
        variables=net.trainable_variables if named else None, **METHODS[method])
    sgd = keras.optimizers.SGD(0.1, momentum=momentum)
    net.compile(optimizer=hvd.DistributedOptimizer(sgd, compression=compression),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rs = np.random.RandomState(hvd.rank())
    x, y = rs.standard_normal((96, 64)).astype(np.float32), rs.randint(0, 3, 96)
    net.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    weights = np.concatenate([v.numpy().reshape(-1) for v in net.trainable_variables])
    return weights, compression


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", default=",".join(METHODS))
    methods = parser.parse_args().methods.split(",")
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    for method in methods:
        unnamed, compression = train(method, named=False)
        if method in NAMED_TOO:
            named, _ = train(method, named=True)
            assert np.array_equal(named, unnamed), f"{method}: unnamed compressor trains differently"
        everyone = hvd_tf.allgather_object(unnamed, name=f"weights.{method}")
        assert all(np.array_equal(w, unnamed) for w in everyone), f"{method}: ranks differ"
        stats = compression.stats()
        assert stats.steps == 3 and stats.bytes_sent < stats.dense_bytes, (method, stats)
        spare = compression.engine._states["kernel"]  # built outside a name scope
        assert not any(np.any(v.numpy()) for v in spare.values()), f"{method}: spare got a memory"
        print(f"rank {hvd.rank()}/{hvd.size()} {method} keras unnamed ok", flush=True)
    try:
        train("dgc", named=False, momentum=0.9)
    except ValueError as error:
        assert "compressor applies momentum" in str(error), error
        print(f"rank {hvd.rank()} double momentum refused", flush=True)


if __name__ == "__main__":
    main()
