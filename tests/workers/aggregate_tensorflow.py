"""Two training steps with fixed per-rank gradients through the stock
``hvd.DistributedGradientTape``, eagerly and inside ``tf.function``; every rank checks that
its aggregated gradient equals the dense reference built from all ranks' sent values.

Each method runs with a compressor given ``variables=`` and with one given nothing (it takes
the variables from Horovod's call), its compressed tensors exchanged as one bucket (one
allgather). The Keras 3 model has a layer that gets no gradient
(Horovod skips it, the compressor must too) placed just before a layer of its shapes (pairing
by order and shape would hand that layer's gradients the unused layer's memories), kernels
and biases of one shape, and tensors that go dense. Then misuse: a rank with another density
fails with an error that names the rank and the tensor.
"""
import argparse

import keras
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import horovod_dgc.tensorflow as hdgc
from horovod_dgc.core.selection import top_count

DENSITY = 0.01
MOMENTUM = 0.9
# Horovod traces the tape's exchange into a graph in both modes, and each compressor's trace
# is most of this job's minutes: eagerly, one method (the one with two memories) suffices, and
# the compressor given ``variables=`` is compared with the one given nothing for that method
# only (finding the variables does not depend on the method); the others run given nothing.
MODES = {"eager": ("dgc",), "function": ("topk", "dgc", "gaussiank")}
NAMED_TOO = ("dgc",)


def build_model():
    """(used layers, all variables in tape order: an unused layer sits among them)."""
    keras.utils.set_random_seed(0)
    first, second, third, fourth = [keras.layers.Dense(n, name=name) for n, name in
                                    ((300, "first"), (50, "second"), (50, "third"), (50, "fourth"))]
    model = keras.Sequential([keras.Input((64,)), first, second, third, fourth], name="net")
    unused = keras.layers.Dense(50, name="unused")
    unused.build((None, 50))
    variables = [v for layer in (first, unused, third, second, fourth)
                 for v in layer.trainable_variables]
    return model, variables


def gradients(rank: int, step: int, variables) -> dict:
    rs = np.random.RandomState(1000 + 10 * rank + step)
    return {v.path: rs.standard_normal(v.shape).astype(np.float32) for v in variables
            if not v.path.startswith("unused")}


def make_step(compression, variables, mode: str):
    """One DistributedGradientTape step: gradients in ``variables`` order (None if unused)."""
    def step(grads: dict):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v.value * grads[v.path]) for v in variables
                             if v.path in grads])
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        return tape.gradient(loss, [v.value for v in variables])

    return tf.function(step) if mode == "function" else step


def accumulated(method: str, state_before, grad: np.ndarray) -> np.ndarray:
    """What the memory accumulates this step (float32 numpy rounds like TensorFlow); no
    state before the first step of a compressor that learns its variables then."""
    if state_before is None:
        return grad
    if method == "dgc":
        momentum = np.float32(MOMENTUM) * state_before["momentum"] + grad
        return state_before["velocity"] + momentum
    return state_before["residual"] + grad


def snapshot(compression, name: str, shape) -> dict:
    return {k: v.numpy().reshape(shape) for k, v in compression.engine._states[name].items()}


def memory_names(compression, variables) -> dict:
    """Keras path -> the name the compressor keeps the variable's memory under."""
    return {v.path: compression._names[v.value.ref()] for v in variables}


def record_collectives(compression) -> list:
    """The names of the collectives ``compression`` launches, as it launches them."""
    launched, launch = [], compression.collective

    def recorded(kind, message, name, *args, **options):
        launched.append(name)
        return launch(kind, message, name, *args, **options)

    compression.collective = recorded
    return launched


def exact_topk_dense(x: np.ndarray, k: int) -> np.ndarray:
    flat = x.reshape(-1)
    order = sorted(range(flat.size), key=lambda i: -abs(float(flat[i])))[:k]
    out = np.zeros_like(flat)
    out[order] = flat[order]
    return out.reshape(x.shape)


def run(method: str, mode: str, named: bool) -> dict:
    """Two steps; checks each rank's result against the dense reference; returns them."""
    rank, size = hvd.rank(), hvd.size()
    _, variables = build_model()
    # float32 values: the sent values are then exactly the selected entries.
    compression = getattr(hdgc.Compression, method)(variables=variables if named else None,
                                                    density=DENSITY, value_dtype="float32")
    launched = record_collectives(compression)
    step_fn = make_step(compression, variables, mode)
    shapes = {v.path: tuple(v.shape) for v in variables}
    results = []
    for step in range(2):
        grads = gradients(rank, step, variables)
        before = ({path: snapshot(compression, name, shapes[path]) for path, name
                   in memory_names(compression, variables).items() if path in grads}
                  if compression.bound else {})
        got = dict(zip([v.path for v in variables], step_fn(grads)))
        names = memory_names(compression, variables)
        for name, grad in grads.items():
            compressed = compression.engine.compresses(tf.TensorSpec(shapes[name], tf.float32))
            if compressed:
                x = accumulated(method, before.get(name), grad)
                kept = snapshot(compression, names[name], shapes[name])
                mine = x - (kept["velocity"] if method == "dgc" else kept["residual"])
                if method in ("topk", "dgc"):
                    k = top_count(compression.config.density_floor(shapes[name]) or DENSITY,
                                  grad.size)
                    assert np.array_equal(mine, exact_topk_dense(x, k)), f"{name}: not the exact top-k"
            else:
                mine = grad if method != "dgc" else snapshot(compression, names[name], shapes[name])["momentum"]
            everyone = hvd.allgather_object(mine, name=f"check.{method}.{mode}.{named}.{step}.{name}")
            reference = np.zeros_like(grad)
            for sent in everyone:
                reference = reference + sent
            reference = reference * np.float32(1.0 / size)
            result = got[name].numpy()
            if compressed:
                assert np.array_equal(result, reference), f"rank {rank} {method}/{mode} {name}: not bit-exact"
            else:
                np.testing.assert_allclose(result, reference, rtol=1e-6, atol=1e-7)
        assert got["unused/kernel"] is None and got["unused/bias"] is None
        results.append({k: v.numpy() for k, v in got.items() if v is not None})
    assert compression.stats().steps == 2, compression.stats()
    # Every compressed tensor fits one bucket: one allgather a trace, none per tensor.
    assert launched and all(".bucket." in name for name in launched), launched
    return {"results": results, "names": names}


def run_named_and_unnamed(method: str, mode: str) -> None:
    """The compressor given nothing passes the reference check and names the memories by the
    Keras paths of Keras 3's inner variables; for :data:`NAMED_TOO`, the one given
    ``variables=`` passes it too, and the two agree bit for bit."""
    unnamed = run(method, mode, named=False)
    assert all(path == name for path, name in unnamed["names"].items()), unnamed["names"]
    if method in NAMED_TOO:
        named = run(method, mode, named=True)
        for mine, theirs in zip(named["results"], unnamed["results"]):
            assert mine.keys() == theirs.keys()
            for key in mine:
                assert np.array_equal(mine[key], theirs[key]), f"{method}/{mode} {key}: unnamed differs"
        assert unnamed["names"] == named["names"], unnamed["names"]
    print(f"rank {hvd.rank()}/{hvd.size()} {method} {mode} aggregate ok", flush=True)


def expect_failure(fn, *needles: str) -> None:
    """``fn`` fails the step with an assertion (graph-mode checks print quotes escaped)."""
    try:
        fn()
    except tf.errors.InvalidArgumentError as error:
        assert all(n in str(error) for n in needles), str(error)
        return
    raise AssertionError(f"no error mentioning {needles}")


def misuse() -> None:
    """Errors name the sending rank and the tensor (another density). (Another op than
    the average: tests/workers/legacy_tensorflow.py.)"""
    rank = hvd.rank()
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(64, use_bias=False, name="lonely")
    layer.build((None, 64))
    variables = layer.trainable_variables
    grads = {variables[0].path: np.ones((64, 64), np.float32)}
    other = 1 - rank
    compression = hdgc.Compression.topk(variables=variables, density=DENSITY * (1 + rank))
    expect_failure(lambda: make_step(compression, variables, "function")(grads),
                   f"rank {other} sent a malformed message for tensor", "lonely/kernel", "capacity")
    print(f"rank {rank} misuse ok", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--function-methods", default=",".join(MODES["function"]),
                        help="the methods run inside tf.function")
    parser.add_argument("--function-only", action="store_true",
                        help="skip the eager run and the misuse checks")
    args = parser.parse_args()
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    if not args.function_only:
        for method in MODES["eager"]:
            run_named_and_unnamed(method, "eager")
    for method in args.function_methods.split(","):
        run_named_and_unnamed(method, "function")
    if not args.function_only:
        misuse()
