"""Sparse gradients (an ``Embedding``'s ``tf.IndexedSlices``) on real ranks, through our
``DistributedGradientTape`` (eager) and Horovod's Keras ``DistributedOptimizer``
(``model.fit``, a graph). With ``sparse_as_dense=True`` Horovod hands compress() a dense
tensor whose rows are unknown until run time (it used to fail in the engine: "unsupported
operand type(s) for *: 'int' and 'NoneType'"): the embedding is now compressed, so its memory
holds what was not sent. Without it, Horovod sends the embedding uncompressed by allgathers
of its own, and the compressor warns, naming it. Every rank ends with the same weights.
"""
import os
import warnings

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow is imported

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd

import horovod_dgc.tensorflow as hdgc

keras = tf.keras
VOCABULARY, WIDTH, TOKENS, STEPS, BATCH = 1000, 16, 4, 4, 8
EMBEDDING = "embedding/embeddings"


def model() -> keras.Model:
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.layers.Embedding(VOCABULARY, WIDTH, input_length=TOKENS, name="embedding"),
                            keras.layers.Flatten(), keras.layers.Dense(3)])
    net.build((None, TOKENS))
    return net


def train(path: str, sparse_as_dense: bool) -> tuple:
    net = model()
    compression = hdgc.Compression.dgc(density=0.01, min_numel=1000)
    rs = np.random.RandomState(hvd.rank())
    x, y = rs.randint(0, VOCABULARY, (STEPS * BATCH, TOKENS)), rs.randint(0, 3, STEPS * BATCH)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if path == "keras":
            net.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=compression,
                                                           sparse_as_dense=sparse_as_dense), loss=loss)
            net.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
        else:
            sgd = keras.optimizers.SGD(0.1)
            for step in range(STEPS):
                batch = slice(step * BATCH, (step + 1) * BATCH)
                with tf.GradientTape() as tape:
                    value = loss(y[batch], net(x[batch]))
                tape = hdgc.DistributedGradientTape(tape, compression=compression, sparse_as_dense=sparse_as_dense)
                sgd.apply_gradients(zip(tape.gradient(value, net.trainable_variables), net.trainable_variables))
    said = [str(w.message) for w in caught if "bypass the compressor" in str(w.message)]
    weights = np.concatenate([v.numpy().reshape(-1) for v in net.trainable_variables])
    return weights, compression, said


def main() -> None:
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    for path in ("tape", "keras"):
        for sparse_as_dense in (True, False):
            weights, compression, said = train(path, sparse_as_dense)
            label = f"{path} sparse_as_dense={sparse_as_dense}"
            everyone = hvd_tf.allgather_object(weights, name=f"weights.{path}.{sparse_as_dense}")
            assert all(np.array_equal(w, weights) for w in everyone), f"{label}: ranks differ"
            assert compression.stats().steps == STEPS, (label, compression.stats())
            memory = compression.engine._states[EMBEDDING]
            kept = any(np.any(v.numpy()) for v in memory.values())
            if sparse_as_dense:
                assert kept and not said, f"{label}: the embedding was not compressed ({said})"
            else:
                assert not kept, f"{label}: the embedding has a memory but was never compressed"
                assert len(said) == 1 and repr(EMBEDDING) in said[0], f"{label}: {said}"
            print(f"rank {hvd.rank()} {label} sparse ok", flush=True)


if __name__ == "__main__":
    main()
