"""Which variable a gradient belongs to, through the stock ``hvd.DistributedGradientTape`` in
one process (size 1: Horovod still traces the compressed branch, so the pairing, the names
and the collectives can be read from the traced graph).

The plausible bugs: pairing by order and shape (a gradient after a ``None`` one takes the
``None`` variable's memory), names that collide when variables share one, a compressor
silently serving a second model, and a compressor built inside a ``tf.function`` rebuilt on
every trace (tf.function refuses variables created after its first trace).
"""
import horovod.tensorflow as hvd
import pytest
import tensorflow as tf

from horovod_dgc.tensorflow import Compression
from horovod_dgc.tensorflow.compression import collective_name

# In one process Horovod traces the compressed branch but never runs it, and says so: with a
# warning (DGC refuses outright unless it applies no momentum, hence momentum=0.0 below).
pytestmark = pytest.mark.filterwarnings("ignore:with one worker")


@pytest.fixture(scope="module", autouse=True)
def horovod():
    # Not at import: a module collected after this one that loads torch's libraries (as
    # test_codecs.py does) leaves an import-time hvd.init() uninitialized.
    hvd.init()


def trace_step(compression, variables, used):
    """The graph of one tape step whose loss reads only ``used`` of ``variables``."""
    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * v) for v in used])
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        return tape.gradient(loss, variables)

    return step.get_concrete_function().graph


def test_a_gradient_after_a_none_one_of_its_shape_gets_its_own_variable():
    # Three variables of one name and shape; the middle one gets no gradient.
    first, unused, last = [tf.Variable(tf.ones([50, 40]), name="w") for _ in range(3)]
    compression = Compression.topk(density=0.01)
    graph = trace_step(compression, [first, unused, last], used=[first, last])
    assert [name for name, _ in compression._variables] == ["w", "w.1", "w.2"]
    ops = " ".join(op.name for g in [graph, *[f.graph for f in graph._functions.values()]]
                   for op in g.get_operations())
    assert collective_name("w.2") in ops and collective_name("w") in ops, ops
    assert collective_name("w.1") not in ops


def test_a_second_model_on_one_compressor_is_refused_naming_the_variable():
    compression = Compression.dgc(density=0.01, momentum=0.0)
    mine = tf.Variable(tf.ones([50, 40]), name="mine")
    trace_step(compression, [mine], used=[mine])
    theirs = tf.Variable(tf.ones([50, 40]), name="theirs")
    with pytest.raises(ValueError, match="'theirs'.*give each tape or optimizer its own"):
        trace_step(compression, [theirs], used=[theirs])


def test_a_compressor_built_inside_a_tf_function_is_built_once_per_function():
    built = []

    def build(x):
        built.append(Compression.topk(density=0.01))
        return x

    first, second = tf.function(build), tf.function(lambda x: build(x))
    first(tf.constant(1.0))
    first(tf.constant([1.0, 2.0]))  # a second trace
    second(tf.constant(1.0))
    assert built[0] is built[1] and built[2] is not built[0]
    assert Compression.topk(density=0.01) is not Compression.topk(density=0.01)  # eagerly: new


def test_autograph_converts_none_of_horovod_dgc_in_a_users_function(monkeypatch):
    """A user's ``tf.function`` (autograph on) reaches the compressor through Horovod's tape:
    autograph must stop at ``compress``/``decompress``, or every trace converts thousands of
    the core's functions (tens of seconds per tensor with warm-up) and runs converted code
    nobody tested."""
    from tensorflow.python.autograph.impl import api

    converted = []
    convert = api._convert_actual

    def counting(entity, program_ctx):
        converted.append(getattr(entity, "__module__", "") or "")
        return convert(entity, program_ctx)

    monkeypatch.setattr(api, "_convert_actual", counting)
    weight = tf.Variable(tf.ones([50, 40]), name="weight")
    trace_step(Compression.dgc(density=0.01, momentum=0.0), [weight], used=[weight])
    assert converted, "autograph converted nothing: the probe no longer sees conversions"
    ours = [module for module in converted if module.startswith("horovod_dgc")]
    assert not ours, ours


@pytest.mark.parametrize("given", [True, False], ids=["variables-given", "variables-learned"])
def test_the_first_step_is_traced_once_though_the_memories_are_made_in_it(given):
    """The memories are made while Horovod's tape first traces the step. Made through
    ``tf.Variable`` there, ``tf.function`` takes them for its own and traces the whole step a
    second time (every model's first step twice as long); they must be captured instead."""
    weight = tf.Variable(tf.ones([50, 40]), name="weight")
    compression = Compression.topk(density=0.01, **({"variables": [weight]} if given else {}))
    traces = []

    @tf.function
    def step():
        traces.append(1)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(weight * weight)
        return hvd.DistributedGradientTape(tape, compression=compression).gradient(loss, [weight])

    for _ in range(3):
        step()
    assert len(traces) == 1
    assert compression.engine._states["weight"]["residual"].shape == [2000]
