"""The adaptive switch in real Horovod TensorFlow jobs (``adaptive=`` of every compressor).

Forced switches, through the stock ``hvd.DistributedGradientTape`` inside ``tf.function``:
every method (each with a memory whose conservation law is a plain sum), 30 steps of fixed
per-rank gradients applied as plain SGD, every bucket forced dense for steps 10-19 and
compressed again after. The memories are empty after each dense step, every rank ends with
the same parameters, and no gradient mass is lost: the parameters moved by exactly ``lr``
times (every mean gradient minus what the memories still owe, averaged over the ranks).

Decisions: dgc with the link given by hand (slow: every bucket stays compressed; fast: every
bucket goes dense) and probed, through the tape with ``end_step()`` after each step and
through Keras's ``DistributedOptimizer`` with ``model.fit`` and the ``CompressionWarmup``
callback: every rank takes the same decisions, to the digit. A checkpoint of dense modes
restored into a new compressor runs its first step dense; a compressor whose steps are never
ended warns at ``stats()``.
"""
import os
import warnings

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow is imported (Horovod's Keras)

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras

import horovod_dgc.tensorflow as hdgc
from horovod_dgc.core.adaptive import COMPRESSED, DENSE, Adaptive
from horovod_dgc.tensorflow.callbacks import CompressionWarmup

STEPS, LR = 30, 0.1
DENSE_STEPS = range(10, 20)
SHAPES = {"first/kernel": (64, 300), "first/bias": (300,), "second/kernel": (300, 50)}
PLAIN = {"topk": ("topk", {}), "gaussiank": ("gaussiank", {}), "dgc": ("dgc", {"momentum": 0.0}),
         "dgc-sar": ("dgc", {"momentum": 0.0, "aggregation": "sparse_allreduce"}),
         "scalecom": ("scalecom", {"beta": 1.0}), "blocksign": ("blocksign", {"momentum": 0.0})}
# Decided only where forced: the first decision lies past the run.
NEVER = Adaptive(first_decision_step=10_000)
EVERY = dict(recheck_steps=5, first_decision_step=4, sample_steps=2)


def gradient(rank: int, step: int, name: str) -> np.ndarray:
    rs = np.random.RandomState(10_000 * rank + 100 * step + len(name))
    return rs.standard_normal(SHAPES[name]).astype(np.float32)


def make_variables() -> dict:
    return {name: tf.Variable(tf.zeros(shape), name=name) for name, shape in SHAPES.items()}


def tape_run(compression, steps: int, before_step=lambda step: None, end_steps: bool = True,
             variables: dict = None) -> dict:
    """``steps`` of plain SGD through the stock tape inside ``tf.function``, ``end_step()``
    after each (unless not ``end_steps``); the variables by name."""
    variables = variables or make_variables()

    @tf.function
    def step_fn(grads):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * grads[n]) for n, v in variables.items()])
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        for v, g in zip(variables.values(), tape.gradient(loss, list(variables.values()))):
            v.assign_sub(LR * g)

    for step in range(steps):
        before_step(step)
        step_fn({n: tf.constant(gradient(hvd.rank(), step, n)) for n in SHAPES})
        if end_steps:
            compression.end_step()
    return variables


def pending_empty(compression) -> bool:
    states, key = compression.state_dict()["states"], compression.method.pending_memory
    return all(not states[n][key].any() for n in SHAPES if compression.engine.compresses(tf.zeros(SHAPES[n])))


def owed(compression, name: str) -> np.ndarray:
    """What the memories of every rank still owe tensor ``name``'s average (float64, flat)."""
    method, numel = compression.method, int(np.prod(SHAPES[name]))
    memories = compression.state_dict()["states"][name]
    pending = hvd.allreduce(tf.constant(memories[method.pending_memory], tf.float64), op=hvd.Average,
                            name=f"owed.{name}").numpy()
    for key in method.state_layout(True).sharded:
        pending = pending + hvd.allgather(tf.constant(memories[key], tf.float64), name=f"shards.{name}").numpy()[:numel]
    return pending


def forced_switches(kind: str) -> None:
    method, options = PLAIN[kind]
    compression = getattr(hdgc.Compression, method)(adaptive=NEVER, **options)
    seen_dense = []

    def before_step(step: int) -> None:
        if step in (DENSE_STEPS.start, DENSE_STEPS.stop):
            compression.force_mode(DENSE if step == DENSE_STEPS.start else None)
        if step - 1 in DENSE_STEPS:  # the step before was dense: it sent every float32 memory
            seen_dense.append(pending_empty(compression))

    variables = tape_run(compression, STEPS, before_step)
    assert seen_dense and all(seen_dense), (kind, seen_dense)
    assert set(compression.bucket_modes().values()) == {COMPRESSED}, compression.bucket_modes()
    flat = tf.concat([tf.reshape(v, [-1]) for v in variables.values()], 0)
    assert np.array_equal(hvd.broadcast(flat, 0, name=f"params.{kind}").numpy(), flat.numpy()), f"{kind}: ranks differ"
    for name, variable in variables.items():
        mean_grads = sum(gradient(r, t, name).astype(np.float64) for r in range(hvd.size())
                         for t in range(STEPS)) / hvd.size()
        compressed = compression.engine.compresses(variable)
        owes = owed(compression, name).reshape(SHAPES[name]) if compressed else 0.0
        want = -LR * (mean_grads - owes)
        error = np.linalg.norm(variable.numpy().astype(np.float64) - want) / np.linalg.norm(LR * mean_grads)
        assert error < 1e-5, f"{kind} {name}: {error}"
    print(f"rank {hvd.rank()} {kind} tf forced switches ok", flush=True)


def agreed_modes(compression, label: str) -> list:
    """The modes of the decision lines, checked identical on every rank."""
    lines = compression.stats().buckets
    assert lines and all(line.startswith("bucket.") for line in lines), lines
    assert hvd.broadcast_object(lines, 0, name=f"lines.{label}") == lines, (hvd.rank(), lines)
    return [line.split(": ")[1].split(",")[0] for line in lines]


def tape_decisions() -> None:
    for label, settings, want in (("slow", Adaptive(link_bytes_per_s=1e3, **EVERY), {COMPRESSED}),
                                  ("fast", Adaptive(link_bytes_per_s=1e15, **EVERY), {DENSE}),
                                  ("probed", Adaptive(**EVERY), None)):
        compression = hdgc.Compression.dgc(adaptive=settings)
        variables = tape_run(compression, 12)
        modes = agreed_modes(compression, f"tape.{label}")
        assert want is None or set(modes) == want, (label, modes)
        # The step's ops timed each bucket's compute: what a compressed step costs on a free link.
        compressed_ms = [float(line.split("(predicted ")[1].split(" ms")[0]) for line in compression.stats().buckets]
        assert label != "fast" or min(compressed_ms) > 0, compression.stats().buckets
        flat = tf.concat([tf.reshape(v, [-1]) for v in variables.values()], 0)
        assert np.array_equal(hvd.broadcast(flat, 0, name=f"params.tape.{label}").numpy(), flat.numpy())
        if label == "fast":
            restored_run_dense(compression.state_dict())
    forgotten = hdgc.Compression.dgc(adaptive=Adaptive(**EVERY))
    tape_run(forgotten, 8, end_steps=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not forgotten.stats().buckets
    assert any("end_step()" in str(w.message) for w in caught), [str(w.message) for w in caught]
    print(f"rank {hvd.rank()} tape decisions agree", flush=True)


def restored_run_dense(state: dict) -> None:
    """A compressor restored from a checkpoint of dense modes runs its first step dense."""
    variables = make_variables()
    restored = hdgc.Compression.dgc(variables=list(variables.values()), adaptive=Adaptive(**EVERY))
    restored.load_state_dict(state)
    tape_run(restored, 1, variables=variables)
    assert set(restored.bucket_modes().values()) == {DENSE} and pending_empty(restored), restored.bucket_modes()


def keras_decisions() -> None:
    """model.fit with the callback ending each step: a fast link sends every bucket dense."""
    keras = tf.keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(300, activation="relu", input_shape=(64,)),
                              keras.layers.Dense(50)])
    compression = hdgc.Compression.dgc(adaptive=Adaptive(link_bytes_per_s=1e15, **EVERY))
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.01), compression=compression),
                  loss=keras.losses.MeanSquaredError())
    rs = np.random.RandomState(hvd.rank())
    x, y = rs.standard_normal((96, 64)).astype(np.float32), rs.standard_normal((96, 50)).astype(np.float32)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[CompressionWarmup(compression)])
    assert set(agreed_modes(compression, "keras")) == {DENSE}, compression.stats().buckets
    flat = tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)
    assert np.array_equal(hvd.broadcast(flat, 0, name="params.keras").numpy(), flat.numpy())
    print(f"rank {hvd.rank()} keras decisions agree", flush=True)


if __name__ == "__main__":
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    for kind in PLAIN:
        forced_switches(kind)
    tape_decisions()
    keras_decisions()
