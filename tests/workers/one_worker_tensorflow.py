"""One worker (``horovodrun -np 1``): Horovod's TensorFlow tape and Keras optimizer trace the
compressor into the branch of their all-reduce condition that never runs on one worker. A
compressor that applies momentum (DGC) is refused while the step is traced, naming the tape
or the Keras optimizer; one that keeps a plain residual is warned of once, and the run is
exactly plain SGD (a reference loop without Horovod). On two workers (``-np 2``) nothing
warns and the compressor runs.
"""
import os

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # for the Keras optimizer; before TensorFlow

import warnings

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import tensorflow as tf

import horovod_dgc.tensorflow as hdgc

STEPS = 3
SAID = "with one worker (hvd.size() == 1)"


def batch(step: int):
    rs = np.random.RandomState(100 * step + hvd.rank())
    return rs.standard_normal((16, 32)).astype(np.float32), rs.standard_normal((16, 10)).astype(np.float32)


def tape_run(compression, variables, mode: str, horovod: bool = True):
    """The variables after the steps, and the one-worker warnings of each step."""
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(tf.nn.relu(tf.matmul(x, variables[0])), variables[1]) - y))
        if horovod:
            tape = hvd.DistributedGradientTape(tape, compression=compression)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(0.1 * g)

    run = tf.function(step) if mode == "function" else step
    said = []
    for t in range(STEPS):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(*batch(t))
        said.append([str(w.message) for w in caught if SAID in str(w.message)])
    return np.concatenate([v.numpy().ravel() for v in variables]), said


def variables():
    return [tf.Variable(tf.random.stateless_normal([32, 256], [1, 2]) * 0.1),
            tf.Variable(tf.random.stateless_normal([256, 10], [3, 4]) * 0.1)]


def expect_refusal(action, path: str) -> None:
    try:
        action()
    except ValueError as error:
        message = str(error)
        assert SAID in message and "momentum=0.9" in message and path in message, message
        return
    raise AssertionError(f"DGC under the {path} on one worker was not refused")


def keras_fit(compression) -> None:
    keras = tf.keras
    net = keras.Sequential([keras.layers.Dense(256, input_shape=(32,)), keras.layers.Dense(10)])
    net.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=compression),
                loss="mse")
    x, y = batch(0)
    net.fit(x, y, batch_size=16, epochs=1, verbose=0)


def one_worker() -> None:
    for mode in ("eager", "function"):
        expect_refusal(lambda: tape_run(hdgc.Compression.dgc(density=0.01), variables(), mode),
                       "DistributedGradientTape")
        reference, _ = tape_run(None, variables(), mode, horovod=False)
        compression = hdgc.Compression.topk(density=0.01)
        got, said = tape_run(compression, variables(), mode)
        assert len(said[0]) == 1 and "uncompressed" in said[0][0], said
        assert not any(said[1:]), f"warned again: {said}"
        assert np.array_equal(got, reference), f"{mode}: not the plain SGD run"
        assert compression.stats().steps == 0
    expect_refusal(lambda: keras_fit(hdgc.Compression.dgc(density=0.01)), "Keras DistributedOptimizer")
    print("one worker ok", flush=True)


def two_workers() -> None:
    for method in ("dgc", "topk"):
        compression = getattr(hdgc.Compression, method)(density=0.01)
        _, said = tape_run(compression, variables(), "function")
        assert not any(said), f"{method}: {said}"
        assert compression.stats().steps == STEPS
    print(f"rank {hvd.rank()} two workers ok", flush=True)


if __name__ == "__main__":
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    one_worker() if hvd.size() == 1 else two_workers()
