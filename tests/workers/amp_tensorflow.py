"""TensorFlow loss scaling end to end: a Keras 3 model, a Keras ``LossScaleOptimizer`` and
``horovod_dgc.tensorflow.DistributedGradientTape``, with the scale attached
(``compression.attach_loss_scale``), under the ``float32`` and the ``mixed_float16`` policy.
At step OVERFLOW rank 1 alone overflows: every rank must skip that step and halve its scale,
keep every memory as it was (every tensor's exchange saw the NaN) and keep weights identical
to the other ranks'. Under ``float32``, where a power-of-two scale is exact, the memories
must also hold unscaled gradients while the scale doubles every 2 good steps, and the
averaged gradients go back scaled: memories and weights equal to those of a twin model
trained in lockstep on the same batches with no scale at all.
"""
import argparse

import keras
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import horovod_dgc.tensorflow as hdgc

STEPS, OVERFLOW = 6, 3


def build(method: str, scaled: bool):
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((32,)), keras.layers.Dense(256, activation="relu", name="hidden"),
                            keras.layers.Dense(10, name="logits", dtype="float32")], name="net")
    options = dict(density=0.05) if method != "blocksign" else dict(momentum=0.5)
    # variables=: the memories are read before the first step
    compression = getattr(hdgc.Compression, method)(variables=net.trainable_variables, **options)
    sgd = keras.optimizers.SGD(0.05)
    if not scaled:
        sgd.build(net.trainable_variables)
        compression.attach_loss_scale(None)  # the scaled model's optimizer is not this one's
        return net, compression, sgd
    optimizer = keras.optimizers.LossScaleOptimizer(sgd, initial_scale=2.0 ** 10, dynamic_growth_steps=2)
    optimizer.build(net.trainable_variables)
    compression.attach_loss_scale(lambda: optimizer.dynamic_scale)
    return net, compression, optimizer


def memories(compression) -> dict:
    return {f"{n}.{k}": v for n, s in compression.state_dict()["states"].items() for k, v in s.items()}


def run(method: str, policy: str) -> None:
    keras.mixed_precision.set_dtype_policy(policy)
    rank = hvd.rank()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    net, compression, optimizer = build(method, scaled=True)
    twin, twin_compression, twin_sgd = build(method, scaled=False)  # scale 1, no overflow

    def gradients(model, comp, loss_scale, overflow):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x)) * loss_scale
            if overflow:
                loss = loss * float("inf")
        return hdgc.DistributedGradientTape(tape, compression=comp).gradient(loss, model.trainable_variables)

    for step in range(STEPS):
        rs = np.random.RandomState(100 * step + rank)
        x, y = rs.standard_normal((32, 32)).astype(np.float32), rs.randint(0, 10, 32)
        weights = [v.numpy().copy() for v in net.trainable_variables]
        kept, scale = memories(compression), float(optimizer.dynamic_scale.numpy())
        overflow = rank == 1 and step == OVERFLOW
        optimizer.apply(gradients(net, compression, optimizer.dynamic_scale, overflow),
                        net.trainable_variables)
        moved = any(not np.array_equal(v.numpy(), w) for v, w in zip(net.trainable_variables, weights))
        if step == OVERFLOW:
            assert float(optimizer.dynamic_scale.numpy()) == scale * 0.5, f"{method}: no back-off"
            assert not moved, f"{method}: a skipped step changed the weights"
            after = memories(compression)
            for name, value in kept.items():
                assert np.array_equal(after[name], value), f"{method}: the skipped step changed {name}"
            # The twin's exchange sees the step too (its step count picks ScaleCom's leader).
            gradients(twin, twin_compression, 1.0, overflow)
            continue
        assert moved, f"{method}: step {step} did not train"
        if policy != "float32":
            continue
        twin_sgd.apply(gradients(twin, twin_compression, 1.0, False), twin.trainable_variables)
        want = memories(twin_compression)
        for name, value in memories(compression).items():
            np.testing.assert_allclose(value, want[name], rtol=1e-6, atol=1e-9,
                                       err_msg=f"{method} step {step} (scale {scale}): {name}")
        for v, w in zip(net.trainable_variables, twin.trainable_variables):
            np.testing.assert_allclose(v.numpy(), w.numpy(), rtol=1e-6, atol=1e-9,
                                       err_msg=f"{method} step {step} (scale {scale}): {v.path}")
    final = np.concatenate([v.numpy().reshape(-1) for v in net.trainable_variables])
    for other in hvd.allgather_object(final, name=f"amp.weights.{method}.{policy}"):
        assert np.array_equal(other, final), f"{method}: ranks hold different weights"
    print(f"rank {rank} {method} {policy} tf amp ok", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", default="dgc")
    args = parser.parse_args()
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    for policy in ("float32", "mixed_float16"):
        for method in args.methods.split(","):
            run(method, policy)
