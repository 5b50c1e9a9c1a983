"""TensorFlow 1's API under TensorFlow 2, on real ranks.

* Horovod's ``DistributedOptimizer`` around a ``tf.compat.v1.train.GradientDescentOptimizer``
  (eager ``minimize``) trains every method exactly as Horovod's ``DistributedGradientTape``
  with the same compressor and a plain update ``w -= lr * g`` written here.
* DGC (and blocksign with momentum) refuses a ``tf.compat.v1.train`` optimizer that keeps state
  of its own: ``MomentumOptimizer`` with momentum (through Horovod's optimizer, and under a tape
  whose loop holds it) and ``AdamOptimizer``; ``MomentumOptimizer(momentum=0.0)`` is SGD and is
  taken. Before, they trained with the momentum applied twice, silently.
* A reduction other than Horovod's average (``op=hvd.Sum``, ``op=hvd.Adasum``: an Adasum of equal
  placeholders looked like an average) is refused while the step is traced.
* A TensorFlow 1 graph (a ``tf.Graph`` run by a ``Session``) is refused: when the compressor is
  built in it, and when one built eagerly compresses a gradient of it. Before, the first failed
  with an ``AttributeError`` and the second with a "malformed messages" error at run time.
"""
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import horovod_dgc.tensorflow as hdgc

STEPS = 4
LR = 0.1
SHAPES = {"w": (64, 80), "b": (80,)}
METHODS = {"dgc": dict(density=0.05), "topk": dict(density=0.05), "gaussiank": dict(density=0.05),
           "scalecom": dict(density=0.05), "blocksign": dict(block_size=64)}


def variables() -> list:
    return [tf.Variable(np.full(shape, 0.5, np.float32), name=name) for name, shape in SHAPES.items()]


def inputs(step: int) -> list:
    rs = np.random.RandomState(100 * step + hvd.rank())
    return [tf.constant(rs.standard_normal(shape).astype(np.float32)) for shape in SHAPES.values()]


def loss(weights: list, xs: list) -> tf.Tensor:
    return tf.add_n([tf.reduce_sum(w * x * w) for w, x in zip(weights, xs)])


def legacy_optimizer(method: str) -> np.ndarray:
    weights = variables()
    compression = getattr(hdgc.Compression, method)(**METHODS[method])
    optimizer = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR),
                                         compression=compression)
    for step in range(STEPS):
        xs = inputs(step)
        optimizer.minimize(lambda: loss(weights, xs), var_list=weights)
    assert compression.stats().steps == STEPS, f"{method}: {compression.stats().steps} steps"
    return np.concatenate([w.numpy().ravel() for w in weights])


def tape(method: str) -> np.ndarray:
    weights = variables()
    compression = getattr(hdgc.Compression, method)(**METHODS[method])
    for step in range(STEPS):
        xs = inputs(step)
        with tf.GradientTape() as plain:
            value = loss(weights, xs)
        grads = hvd.DistributedGradientTape(plain, compression=compression).gradient(value, weights)
        for w, g in zip(weights, grads):
            w.assign_sub(LR * g)
    return np.concatenate([w.numpy().ravel() for w in weights])


def expect_refusal(label: str, words: tuple, call) -> None:
    try:
        call()
    except ValueError as error:
        missing = [w for w in words if w not in str(error)]
        assert not missing, f"{label}: the error does not name {missing}: {error}"
    else:
        raise AssertionError(f"{label} was not refused")


def minimize_once(compression, optimizer) -> None:
    weights = variables()
    xs = inputs(0)
    hvd.DistributedOptimizer(optimizer, compression=compression).minimize(
        lambda: loss(weights, xs), var_list=weights)


def step_under_a_tape(compression, optimizer, **tape_options) -> None:
    weights = variables()
    with tf.GradientTape() as plain:
        value = loss(weights, inputs(0))
    grads = hvd.DistributedGradientTape(plain, compression=compression,
                                        **tape_options).gradient(value, weights)
    optimizer.apply_gradients(zip(grads, weights))


def refusals() -> None:
    v1 = tf.compat.v1.train
    for method, options in (("dgc", {}), ("blocksign", dict(momentum=0.9))):
        expect_refusal(f"{method} with MomentumOptimizer(0.9)", ("momentum=0.9",),
                       lambda: minimize_once(getattr(hdgc.Compression, method)(**options),
                                             v1.MomentumOptimizer(LR, 0.9)))
        expect_refusal(f"{method} with AdamOptimizer", ("Adam", "keeps state of its own"),
                       lambda: minimize_once(getattr(hdgc.Compression, method)(**options),
                                             v1.AdamOptimizer(LR)))
        # DGC's advice keeps the user's Nesterov (blocksign has none to offer).
        nesterov = ("nesterov=True",) if method == "dgc" else ()
        expect_refusal(f"{method} under a tape with MomentumOptimizer(0.9, use_nesterov=True)",
                       ("momentum=0.9", *nesterov),
                       lambda: step_under_a_tape(getattr(hdgc.Compression, method)(**options),
                                                 v1.MomentumOptimizer(LR, 0.9, use_nesterov=True)))
    minimize_once(hdgc.Compression.dgc(), v1.MomentumOptimizer(LR, 0.0))
    for op, name in ((hvd.Sum, "hvd.Sum"), (hvd.Adasum, "hvd.Adasum")):
        expect_refusal(f"op={name}", (f"op={name}", "op=hvd.Average"),
                       lambda: step_under_a_tape(hdgc.Compression.topk(), v1.GradientDescentOptimizer(LR),
                                                 op=op))


def graph_sessions() -> None:
    with tf.Graph().as_default():
        expect_refusal("a compressor built in a TensorFlow 1 graph", ("TensorFlow 1 graph",),
                       lambda: hdgc.Compression.topk())
    compression = hdgc.Compression.topk()
    with tf.Graph().as_default():
        weights = [tf.compat.v1.get_variable(name, shape) for name, shape in SHAPES.items()]
        xs = [tf.compat.v1.placeholder(tf.float32, shape) for shape in SHAPES.values()]
        optimizer = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR),
                                             compression=compression)
        expect_refusal("a gradient of a TensorFlow 1 graph", ("TensorFlow 1 graph",),
                       lambda: optimizer.minimize(loss(weights, xs)))


def main() -> None:
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    for method in METHODS:
        legacy, reference = legacy_optimizer(method), tape(method)
        assert np.abs(legacy - 0.5).max() > 0.01, f"{method}: nothing moved"
        assert np.array_equal(legacy, reference), \
            f"{method}: {np.abs(legacy - reference).max()} from the tape's weights"
        everyone = hvd.allgather_object(legacy, name=f"weights.{method}")
        assert all(np.array_equal(w, legacy) for w in everyone), f"{method}: ranks differ"
        print(f"rank {hvd.rank()} {method} legacy optimizer ok", flush=True)
    refusals()
    graph_sessions()
    print(f"rank {hvd.rank()} tensorflow 1 api ok", flush=True)


if __name__ == "__main__":
    main()
