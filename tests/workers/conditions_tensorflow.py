"""Training conditions on real ranks, inside ``tf.function``.

A bfloat16 Keras 3 model (variables and gradients in bfloat16): 3 steps leave the weights
finite, changed and identical on every rank. A tensor that travels dense (the 10-entry output
bias: blocksign's small tensors, and every small tensor of a sparse method built with
``small_density=None``) must receive exactly the mean of the ranks' own gradients, taken here
from a plain tape and an allgather: Horovod all-reduces no bfloat16, so that average travels
as float32 and comes back rounded to bfloat16.

Two copies of one model (the same Keras paths), each with a compressor of its own (topk,
scalecom, blocksign: every kind of exchange), stepped in one ``tf.function`` (their collectives in flight at once) must train exactly as when each is
stepped in a function of its own: Horovod's stock tape takes this, as TensorFlow names its
ops apart.

A model of float32 and bfloat16 layers has its compressed tensors exchanged in two buckets,
one per dtype, and trains to identical weights on every rank.

A Keras 3 ``LossScaleOptimizer`` whose scale the compressor was not given is refused at the
first step (the memories would keep scaled gradients); ``attach_loss_scale(None)`` is taken.
DGC under a tape whose loop holds one Keras optimizer, Adam or an SGD with momentum, is
refused at the first step (momentum applied twice). A step compiled by XLA
(``jit_compile=True``) is refused while it is traced, naming the setting: XLA has no kernels
for the compressors' ops (it failed at run time, naming a "Timestamp" op).
"""
import keras
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import horovod_dgc.tensorflow as hdgc
from aggregate_tensorflow import record_collectives

STEPS = 3
# (method, options, whether the output bias travels dense)
RUNS = [("dgc", dict(density=0.05), False), ("topk", dict(density=0.05), False),
        ("gaussiank", dict(density=0.05), False), ("scalecom", dict(density=0.05), False),
        ("blocksign", dict(), True), ("topk", dict(density=0.05, small_density=None), True)]


def model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((32,)), keras.layers.Dense(256, activation="relu", name="hidden"),
                             keras.layers.Dense(10, name="logits")], name="net")


def weights(net: keras.Model) -> np.ndarray:
    return np.concatenate([np.asarray(v.value, dtype=np.float64).ravel() for v in net.trainable_variables])


def run(method: str, options: dict, bias_dense: bool) -> None:
    label = f"bf16.{method}.{'dense' if bias_dense else 'compressed'}"
    net = model()
    assert all(v.dtype == "bfloat16" for v in net.trainable_variables), label
    compression = getattr(hdgc.Compression, method)(variables=net.trainable_variables, **options)
    sgd = keras.optimizers.SGD(0.05)

    def loss_of(x, y):
        return tf.reduce_mean(tf.square(tf.cast(net(x), tf.float32) - y))

    @tf.function
    def local_gradients(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(x, y)
        return tape.gradient(loss, net.trainable_variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(x, y)
        grads = hdgc.DistributedGradientTape(tape, compression=compression).gradient(
            loss, net.trainable_variables)
        sgd.apply_gradients(zip(grads, net.trainable_variables))
        return grads

    before = weights(net)
    for s in range(STEPS):
        rs = np.random.RandomState(100 * s + hvd.rank())
        x, y = rs.standard_normal((16, 32)).astype(np.float32), rs.standard_normal((16, 10)).astype(np.float32)
        own_bias = np.asarray(local_gradients(x, y)[-1], dtype=np.float32)
        averaged_bias = step(x, y)[-1]
        assert averaged_bias.dtype == tf.bfloat16, f"{label}: {averaged_bias.dtype}"
        if bias_dense:
            everyone = hvd.allgather_object(own_bias, name=f"{label}.{s}")
            expected = tf.cast(np.mean(everyone, axis=0), tf.bfloat16)
            assert np.array_equal(np.asarray(averaged_bias, np.float32), np.asarray(expected, np.float32)), \
                f"{label} step {s}: {averaged_bias} is not the ranks' mean {expected}"
    after = weights(net)
    assert np.isfinite(after).all(), f"{label}: weights not finite"
    assert not np.array_equal(after, before), f"{label}: no update"
    for other in hvd.allgather_object(after, name=f"{label}.weights"):
        assert np.array_equal(other, after), f"{label}: ranks hold different weights"


def twins(method: str, together: bool) -> np.ndarray:
    """The weights of two copies of one model (seeds 0 and 1) after 3 steps, stepped in one
    function (``together``) or in one each."""
    nets = [model(seed) for seed in (0, 1)]
    options = {} if method == "blocksign" else dict(density=0.05)
    compressions = [getattr(hdgc.Compression, method)(variables=net.trainable_variables, **options)
                    for net in nets]
    optimizers = [keras.optimizers.SGD(0.05) for _ in nets]

    def train(i, x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(nets[i](x) - y)) if i == 0 else tf.reduce_mean(tf.abs(nets[i](x) - y))
        grads = hdgc.DistributedGradientTape(tape, compression=compressions[i]).gradient(
            loss, nets[i].trainable_variables)
        optimizers[i].apply_gradients(zip(grads, nets[i].trainable_variables))

    both = tf.function(lambda x, y: [train(i, x, y) for i in (0, 1)])
    each = [tf.function(lambda x, y, i=i: train(i, x, y)) for i in (0, 1)]
    for s in range(STEPS):
        rs = np.random.RandomState(100 * s + hvd.rank())
        x, y = rs.standard_normal((16, 32)).astype(np.float32), rs.standard_normal((16, 10)).astype(np.float32)
        if together:
            both(x, y)
        else:
            for step in each:
                step(x, y)
    return np.concatenate([weights(net) for net in nets])


def mixed_dtypes(method: str) -> None:
    """A model whose hidden layer is float32 and whose output layer is bfloat16: its
    compressed tensors go in two buckets, one per dtype; 3 steps leave the weights finite,
    changed and identical on every rank."""
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((32,)), keras.layers.Dense(256, activation="relu", name="hidden"),
                            keras.layers.Dense(10, name="logits", dtype="bfloat16")], name="net")
    assert sorted({v.dtype for v in net.trainable_variables}) == ["bfloat16", "float32"]
    compression = getattr(hdgc.Compression, method)(density=0.05)
    launched = record_collectives(compression)
    sgd = keras.optimizers.SGD(0.05)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(net(x), tf.float32) - y))
        grads = hdgc.DistributedGradientTape(tape, compression=compression).gradient(loss, net.trainable_variables)
        sgd.apply_gradients(zip(grads, net.trainable_variables))

    before = weights(net)
    for s in range(STEPS):
        rs = np.random.RandomState(100 * s + hvd.rank())
        step(rs.standard_normal((16, 32)).astype(np.float32), rs.standard_normal((16, 10)).astype(np.float32))
    after = weights(net)
    label = f"mixed.{method}"
    assert np.isfinite(after).all() and not np.array_equal(after, before), label
    for other in hvd.allgather_object(after, name=label):
        assert np.array_equal(other, after), f"{label}: ranks hold different weights"
    stages = 1 if compression.method.family == "sparse" else 2
    assert len(launched) == 2 * stages and all(".bucket." in n for n in launched), (label, launched)
    assert any("bfloat16" in n for n in launched) and any("float32" in n for n in launched), (label, launched)


def loss_scale_not_told() -> None:
    """A Keras 3 LossScaleOptimizer in the custom-loop recipe, the compressor not given its
    scale: the memories would keep scaled gradients (every change of scale would multiply
    what they owe), so the first step is refused; attach_loss_scale(None) is taken."""
    for told in (False, True):
        net = model()
        compression = hdgc.Compression.topk(variables=net.trainable_variables, density=0.05)
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05))
        optimizer.build(net.trainable_variables)
        if told:
            compression.attach_loss_scale(None)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = optimizer.scale_loss(tf.reduce_mean(tf.square(net(x) - y)))
            grads = hdgc.DistributedGradientTape(tape, compression=compression).gradient(
                loss, net.trainable_variables)
            optimizer.apply_gradients(zip(grads, net.trainable_variables))

        x, y = np.ones((16, 32), np.float32), np.ones((16, 10), np.float32)
        if told:
            step(x, y)
            continue
        try:
            step(x, y)
        except ValueError as error:
            assert "compression.attach_loss_scale(" in str(error), str(error)
        else:
            raise AssertionError("a LossScaleOptimizer nobody attached was not refused")


def dgc_refuses_adam_under_a_tape() -> None:
    """DGC applies momentum itself: a custom loop whose one Keras optimizer is Adam (or an
    SGD with momentum) would apply momentum twice, silently; refused at the first step
    without any check_optimizer call."""
    for optimizer, needle in ((keras.optimizers.Adam(1e-3), "Adam"),
                              (keras.optimizers.SGD(0.05, momentum=0.9), "momentum=0.9")):
        net = model()
        compression = hdgc.Compression.dgc(variables=net.trainable_variables, density=0.05)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(net(x) - y))
            grads = hdgc.DistributedGradientTape(tape, compression=compression).gradient(
                loss, net.trainable_variables)
            optimizer.apply_gradients(zip(grads, net.trainable_variables))

        try:
            step(np.ones((16, 32), np.float32), np.ones((16, 10), np.float32))
        except ValueError as error:
            assert needle in str(error), str(error)
        else:
            raise AssertionError(f"DGC under {needle} was not refused")


def xla_refused() -> None:
    net = model()
    compression = hdgc.Compression.topk(variables=net.trainable_variables, density=0.05)

    @tf.function(jit_compile=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(net(x) - y))
        return hdgc.DistributedGradientTape(tape, compression=compression).gradient(
            loss, net.trainable_variables)

    try:
        step(np.ones((16, 32), np.float32), np.ones((16, 10), np.float32))
    except ValueError as error:
        assert "jit_compile=False" in str(error), str(error)
    else:
        raise AssertionError("an XLA-compiled step was not refused")


if __name__ == "__main__":
    hvd.init()
    keras.mixed_precision.set_dtype_policy("bfloat16")
    for method, options, bias_dense in RUNS:
        run(method, options, bias_dense)
    keras.mixed_precision.set_dtype_policy("float32")
    for method in ("dgc", "scalecom"):
        mixed_dtypes(method)
    loss_scale_not_told()
    dgc_refuses_adam_under_a_tape()
    xla_refused()
    # dgc's and gaussiank's exchange is topk's allgather
    for method in ("topk", "scalecom", "blocksign"):
        assert np.array_equal(twins(method, True), twins(method, False)), f"twins.{method}: stepped together differs"
    print(f"rank {hvd.rank()} tensorflow conditions ok", flush=True)
