"""horovod_dgc's DistributedGradientTape takes a Keras 3 model's variables directly: 3 steps
of a Keras 3 model (ScaleCom eagerly, DGC inside ``tf.function``) give gradients identical to the
stock tape given ``[v.value for v in variables]``, with a compressor built without
``variables=`` (bound to the tape's sources); ranks end with identical weights.
"""
import keras
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import horovod_dgc.tensorflow as hdgc

STEPS = 3


def model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((32,)), keras.layers.Dense(256, activation="relu", name="hidden"),
                             keras.layers.Dense(10, name="logits")], name="net")


def batch(step: int):
    rs = np.random.RandomState(100 * hvd.rank() + step)
    return rs.standard_normal((16, 32)).astype(np.float32), rs.randint(0, 10, 16)


def run(method: str, mode: str) -> None:
    ours, stock = model(), model()
    ours_compression = getattr(hdgc.Compression, method)(density=0.01)
    stock_compression = getattr(hdgc.Compression, method)(variables=stock.trainable_variables, density=0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(x, y, net, compression, wrap):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, net(x))
        if wrap == "ours":
            return hdgc.DistributedGradientTape(tape, compression=compression).gradient(
                loss, net.trainable_variables)
        return hvd.DistributedGradientTape(tape, compression=compression).gradient(
            loss, [v.value for v in net.trainable_variables])

    ours_step, stock_step = (tf.function(step), tf.function(step)) if mode == "function" else (step, step)
    for t in range(STEPS):
        x, y = batch(t)
        got = ours_step(x, y, ours, ours_compression, "ours")
        want = stock_step(x, y, stock, stock_compression, "stock")
        for g, w, v, s in zip(got, want, ours.trainable_variables, stock.trainable_variables):
            assert np.array_equal(g.numpy(), w.numpy()), f"{method}/{mode} {v.path} step {t}"
            v.assign_sub(0.1 * g)
            s.assign_sub(0.1 * w)
    weights = np.concatenate([v.numpy().reshape(-1) for v in ours.trainable_variables])
    for other in hvd.allgather_object(weights, name=f"weights.{method}.{mode}"):
        assert np.array_equal(other, weights), "ranks hold different weights"
    assert ours_compression.stats().steps == STEPS
    print(f"rank {hvd.rank()} {method} {mode} keras3 tape ok", flush=True)


# The wrapping under test does not depend on the method: one family per mode (each pair of
# tapes is two traces, most of this job's minutes).
RUNS = (("scalecom", "eager"), ("dgc", "function"))

if __name__ == "__main__":
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    for method, mode in RUNS:
        run(method, mode)
