"""TensorFlow traces a sparse tensor's compress and decompress, and a two-stage tensor's stages,
once per size and calls them for every tensor of that size (``tensorflow/engine.py``,
``twostage.py``). Each tensor must still get its own selection, memory, header and errors:
checked here on one worker against a naive top-k with error feedback, the two-stage methods
against the same exchanges executed eagerly (nothing shared), and with messages handed to the
wrong tensor."""
from typing import Dict, List

import numpy as np
import pytest
import tensorflow as tf

from horovod_dgc.core import DGC, DGCConfig, TopK, TopKConfig
from horovod_dgc.core.blocksign import BlockSign, BlockSignConfig
from horovod_dgc.core.scalecom import ScaleCom, ScaleComConfig
from horovod_dgc.core.twostage import TwoStageMethod
from horovod_dgc.tensorflow.engine import Engine
from horovod_dgc.tensorflow.twostage import TwoStageEngine
from tf_emulation import graph_function, single_worker

# a, b and c have one size (c another shape of it); d is small (1-D, under min_numel).
SHAPES = {"a": (80, 64), "b": (80, 64), "c": (64, 80), "d": (100,)}
DENSITY = 0.02
# Entries sent: ceil(0.02 * 5120) for a, b, c; d at the small tensors' density, 0.05 * 100.
SENT = {"a": 103, "b": 103, "c": 103, "d": 5}
STEPS = 3


def naive_top_k(residual: np.ndarray, grad: np.ndarray, k: int):
    """(what one worker sends, the residual it keeps): the k largest of residual + grad, sent
    as float16 (the default value format), the rounding kept in the residual."""
    accumulated = residual + grad
    largest = np.argsort(-np.abs(accumulated), kind="stable")[:k]
    sent = np.zeros_like(accumulated)
    sent[largest] = accumulated[largest].astype(np.float16)
    return sent, accumulated - sent


def _engine(nonfinite: str = "skip") -> Engine:
    method = TopK(TopKConfig(density=DENSITY, value_dtype="float16", nonfinite=nonfinite))
    return Engine(method, [tf.TensorSpec(shape, tf.float32, name) for name, shape in SHAPES.items()],
                  world_size=1, rank=0)


def _counting_traces(engine: Engine, kinds=("compress", "decompress")) -> Dict[str, List[int]]:
    """How often the engine's method runs each of ``kinds`` while being traced."""
    counts: Dict[str, List[int]] = {kind: [] for kind in kinds}
    for kind, calls in counts.items():
        original = getattr(engine.method, kind)

        def counted(*args, _original=original, _calls=calls, **kwargs):
            _calls.append(1)
            return _original(*args, **kwargs)

        setattr(engine.method, kind, counted)
    return counts


def _check_against_eager(names, traced, engine: Engine, eager, unshared: Engine, t: int) -> None:
    """The results of a traced step of ``engine`` (``traced``) equal those of the same exchange
    executed eagerly by ``unshared`` (``eager``) at step ``t``, and the memories they leave,
    tensor by tensor of ``names``."""
    for name, got, want in zip(names, traced, eager):
        np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=f"{name}, step {t}")
        for key, memory in unshared._states[name].items():
            np.testing.assert_array_equal(engine._states[name][key].numpy(), memory.numpy(),
                                          err_msg=f"{name} {key}, step {t}")


def test_tensors_of_one_size_share_one_trace_and_keep_their_own_selection_and_memory():
    engine = _engine()
    traces = _counting_traces(engine)

    @graph_function
    def step(grads):
        results = []
        for name, grad in zip(SHAPES, grads):
            message = engine.compress(name, grad, None)
            results.append(engine.decompress(message.message, message))
        return results

    rs = np.random.RandomState(5)
    residuals = {name: np.zeros(np.prod(shape), np.float32) for name, shape in SHAPES.items()}
    for t in range(STEPS):
        grads = {name: rs.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
        results = step([tf.constant(g) for g in grads.values()])
        for (name, grad), result in zip(grads.items(), results):
            sent, residuals[name] = naive_top_k(residuals[name], grad.reshape(-1), SENT[name])
            np.testing.assert_array_equal(result.numpy().reshape(-1), sent, err_msg=f"{name}, step {t}")
            np.testing.assert_array_equal(engine._states[name]["residual"].numpy(), residuals[name],
                                          err_msg=f"{name}, step {t}")
    assert step.experimental_get_tracing_count() == 1
    assert (len(traces["compress"]), len(traces["decompress"])) == (2, 2)  # a, b, c's size; d's


def test_a_small_and_a_large_tensor_of_one_size_and_density_keep_traces_of_their_own():
    """At equal densities only smallness tells a 1-D tensor (small: DGC keeps its momentum
    unmasked) from a 2-D one of the same size (masked): sharing one trace would give one of
    them the other's memory. Both must step as when executed eagerly (nothing shared)."""
    shapes = {"kernel": (64, 64), "bias": (4096,)}

    def engine() -> Engine:
        method = DGC(DGCConfig(density=0.05, small_density=0.05))
        return Engine(method, [tf.TensorSpec(shape, tf.float32, name) for name, shape in shapes.items()],
                      world_size=1, rank=0)

    def exchange(engine: Engine, grads):
        messages = [engine.compress(name, grad, None) for name, grad in zip(shapes, grads)]
        return [engine.decompress(message.message, message) for message in messages]

    shared, eager = engine(), engine()
    traces = _counting_traces(shared, ("compress",))
    step = graph_function(lambda grads: exchange(shared, grads))
    rs = np.random.RandomState(7)
    for t in range(STEPS):
        grads = [tf.constant(rs.standard_normal(shape).astype(np.float32)) for shape in shapes.values()]
        _check_against_eager(shapes, step(grads), shared, exchange(eager, grads), eager, t)
    assert len(traces["compress"]) == 2


def _handed_over(engine: Engine, corrupt):
    """A traced step of a and b in which b's decompress gets ``corrupt(a's message, b's
    message)`` instead of b's own message."""
    @graph_function
    def step(grads):
        a, b = (engine.compress(name, grad, None) for name, grad in zip("ab", grads))
        engine.decompress(a.message, a)
        return engine.decompress(corrupt(a.message, b.message), b)

    return step


def _grads():
    return [tf.random.stateless_normal(SHAPES[name], seed=[1, i]) for i, name in enumerate("ab")]


@pytest.mark.parametrize("corrupt,match", [
    (lambda a, b: a, r"rank 0 sent a malformed message for tensor \W*b\W*: tensor id is -?\d+ \(\W*a\W*\), "
                     r"expected -?\d+"),
    (lambda a, b: tf.concat([b[:1] ^ 0xFF, b[1:]], 0), r"tensor \W*b\W*: magic is")],
    ids=["a's message", "corrupted magic"])
def test_a_message_in_a_shared_trace_is_checked_against_its_own_tensor_and_named(corrupt, match):
    with pytest.raises(tf.errors.InvalidArgumentError, match="MessageError: .*" + match):
        _handed_over(_engine(), corrupt)(_grads())


def test_a_non_finite_gradient_in_a_shared_trace_is_named_by_its_own_tensor():
    engine = _engine(nonfinite="raise")
    step = _handed_over(engine, lambda a, b: b)
    finite, poisoned = _grads()
    poisoned = tf.tensor_scatter_nd_update(poisoned, [[3, 4]], [float("nan")])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"NonFiniteGradientError: gradient of tensor \W*b\W* on rank 0"):
        step([finite, poisoned])


TWO_STAGE = {"scalecom": lambda: ScaleCom(ScaleComConfig(density=DENSITY)),
             "blocksign": lambda: BlockSign(BlockSignConfig())}


def _two_stage_engine(method: TwoStageMethod, collective=single_worker):
    """(an engine of ``method``, an exchange of the gradients of the tensors of SHAPES it
    compresses)."""
    specs = [tf.TensorSpec(shape, tf.float32, name) for name, shape in SHAPES.items()]
    engine = TwoStageEngine(method, specs, world_size=1, rank=0)

    def exchange(grads):
        return [engine.exchange(spec.name, grad, None, collective, spec.name)[0] if engine.compresses(spec)
                else grad for spec, grad in zip(specs, grads)]

    return engine, exchange


@pytest.mark.parametrize("method", list(TWO_STAGE))
def test_two_stage_tensors_of_one_size_share_each_stage_and_match_the_unshared_exchange(method):
    engine, exchange = _two_stage_engine(TWO_STAGE[method]())
    traces = _counting_traces(engine, ("first", "second", "finish"))
    unshared, eager_exchange = _two_stage_engine(TWO_STAGE[method]())
    step = graph_function(exchange)
    rs = np.random.RandomState(6)
    for t in range(STEPS):
        grads = [tf.constant(rs.standard_normal(shape).astype(np.float32)) for shape in SHAPES.values()]
        _check_against_eager(SHAPES, step(grads), engine, eager_exchange(grads), unshared, t)
    sizes = len({np.prod(shape) for name, shape in SHAPES.items()
                 if engine.compresses(tf.TensorSpec(shape, tf.float32))})  # blocksign leaves d dense
    assert {kind: len(calls) for kind, calls in traces.items()} == {"first": sizes, "second": sizes,
                                                                     "finish": sizes}


def test_each_warm_up_density_has_its_own_two_stage_traces_and_matches_the_eager_exchange():
    """ScaleCom through its warm-up in one traced function (the density index switches at run
    time, without retracing): each density's stages are traced apart. Stages shared across
    densities would run every step at the first one, silently."""
    config = ScaleComConfig(density=DENSITY, warmup_epochs=1)  # densities 0.141, then 0.02
    engine, exchange = _two_stage_engine(ScaleCom(config))
    unshared, eager_exchange = _two_stage_engine(ScaleCom(config))
    step = graph_function(exchange)
    rs = np.random.RandomState(8)
    for t in range(4):
        for each in (engine, unshared):
            each.set_epoch(t // 2)
        grads = [tf.constant(rs.standard_normal(shape).astype(np.float32)) for shape in SHAPES.values()]
        _check_against_eager(SHAPES, step(grads), engine, eager_exchange(grads), unshared, t)
    assert step.experimental_get_tracing_count() == 1


def test_a_two_stage_message_handed_to_another_tensor_is_refused_naming_both():
    """b's first stage receives a's message of the same size."""
    sent = {}

    def swapping(kind, message, name, root):
        if name.endswith(".1"):
            sent.setdefault("a", message)
            return tf.identity(sent["a"])
        return tf.identity(message)

    _, exchange = _two_stage_engine(TWO_STAGE["scalecom"](), swapping)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"MessageError: .*tensor \W*b\W*: tensor id is -?\d+ \(\W*a\W*\)"):
        graph_function(exchange)([tf.ones(shape) for shape in SHAPES.values()])
