"""The TensorFlow adapter against the PyTorch one, in one process.

Parity: the same gradients (NumPy arrays fed to both frameworks) through TorchOps and TFOps
give identical messages (selected indices and values) and identical memories, step after
step, eagerly and inside ``tf.function``; so do the two engines (the TensorFlow one with its
memories in variables, the step counter read at run time and the warm-up density chosen at
run time). Bad input: bad settings fail at construction, and bad messages and non-finite
gradients fail with errors that name the rank and the tensor, in graph mode too.
"""
import dataclasses
import math

import numpy as np
import pytest
import tensorflow as tf
import torch

from benchmarks.trace_tf import graph_nodes
from horovod_dgc.core import (DGC, DGCConfig, GaussianK, GaussianKConfig, MessageError,
                              NonFiniteGradientError, CompressCall, TopK, TopKConfig, wire)
from horovod_dgc.tensorflow import Compression, TFOps
from horovod_dgc.tensorflow.compression import SparseCompressor, _outermost_graph
from horovod_dgc.core.blocksign import BlockSign, BlockSignConfig
from horovod_dgc.core.twostage import simulate_step
from horovod_dgc.core.scalecom import ScaleCom, ScaleComConfig
from horovod_dgc.core.selection import top_count
from horovod_dgc.tensorflow.engine import Engine
from horovod_dgc.tensorflow.twostage import TwoStageEngine
from tf_emulation import graph_function, single_worker as emulated_single_worker
from conftest import exchange
from horovod_dgc.torch.engine import Engine as TorchEngine
from horovod_dgc.torch.ops import TorchOps

tf_ops, torch_ops = TFOps(), TorchOps()
STEPS = 10
N = 30011  # not a multiple of any block size: the short last block is exercised

METHODS = {
    "topk": lambda: TopK(TopKConfig(density=0.01)),
    "dgc": lambda: DGC(DGCConfig(density=0.01)),
    "gaussiank": lambda: GaussianK(GaussianKConfig(density=0.01)),
    "dgc-nesterov-wd": lambda: DGC(DGCConfig(density=0.001, nesterov=True, weight_decay=1e-4)),
    "gaussiank-fp16": lambda: GaussianK(GaussianKConfig(density=0.001, value_dtype="float16")),
}


def gradients(seed: int = 0):
    rs = np.random.RandomState(seed)
    param = rs.standard_normal(N).astype(np.float32)
    grads = [(rs.standard_normal(N) * (1 + t % 3)).astype(np.float32) for t in range(STEPS)]
    return param, grads


def sent_pairs(message: np.ndarray, layout) -> tuple:
    """(header words, positions, values) of a message, as sent (positions ascending)."""
    header = message[:wire.HEADER_BYTES].view(np.int32)
    parts = wire.parts_of(torch_ops, torch.from_numpy(message), layout)
    count = int(header[wire.HEADER_FIELDS.index("count")])
    positions, values, _ = layout.decode(torch_ops, parts, torch.tensor(count), "float32")
    return header, positions[:count].numpy(), values[:count].numpy()


def assert_same_message(torch_message: np.ndarray, tf_message: np.ndarray, layout) -> None:
    for a, b in zip(sent_pairs(torch_message, layout), sent_pairs(tf_message, layout)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("name", list(METHODS))
def test_core_methods_give_identical_messages_and_memories_for_10_steps(name, mode):
    method = METHODS[name]()
    param, grads = gradients()
    torch_state = method.init_state(torch_ops, torch.zeros(N), True, 1)
    tf_state = method.init_state(tf_ops, tf.zeros([N]), True, 1)

    def tf_compress(state, grad, step, p):
        result = method.compress(tf_ops, state, grad, CompressCall("w", 0, 1, step, method.config.density, p))
        return result.message, result.state

    if mode == "function":
        tf_compress = graph_function(tf_compress)
    for t, grad in enumerate(grads):
        ctx = CompressCall("w", 0, 1, t, method.config.density, torch.from_numpy(param))
        expected = method.compress(torch_ops, torch_state, torch.from_numpy(grad), ctx)
        # In a graph the step is a tensor, as the engine's counter is.
        step = tf.constant(t, tf.int64) if mode == "function" else t
        message, tf_state = tf_compress(tf_state, tf.constant(grad), step, tf.constant(param))
        assert_same_message(expected.message.numpy(), message.numpy(), expected.layout)
        for key, value in expected.state.items():
            np.testing.assert_array_equal(value.numpy(), tf_state[key].numpy(), err_msg=f"{key} at step {t}")
        torch_state = expected.state
    if mode == "function":
        assert tf_compress.experimental_get_tracing_count() == 1


def test_dgc_with_clipping_agrees_to_rounding():
    """The norm is a dot product, summed in another order by each framework."""
    method = DGC(DGCConfig(density=0.01, clip_norm=5.0, value_dtype="float32"))
    param, grads = gradients()
    torch_state = method.init_state(torch_ops, torch.zeros(N), True, 1)
    tf_state = method.init_state(tf_ops, tf.zeros([N]), True, 1)
    for t, grad in enumerate(grads):
        torch_state = method.compress(torch_ops, torch_state, torch.from_numpy(grad),
                                      CompressCall("w", 0, 4, t, 0.01)).state
        tf_state = method.compress(tf_ops, tf_state, tf.constant(grad),
                                   CompressCall("w", 0, 4, t, 0.01)).state
    for key, value in torch_state.items():
        np.testing.assert_allclose(value.numpy(), tf_state[key].numpy(), rtol=1e-5, atol=1e-6)


WARM_UP = {"topk": TopK(TopKConfig(density=0.01, warmup_epochs=2)),
           "dgc": DGC(DGCConfig(density=0.01, warmup_epochs=2)),
           "gaussiank": GaussianK(GaussianKConfig(density=0.01, warmup_epochs=2))}


def _case_branches(graph) -> list:
    """The number of branches of every ``tf.switch_case`` of a traced graph."""
    return sorted(len(n.attr["branches"].list.func) for n in graph_nodes(graph.as_graph_def())
                  if n.op in ("Case", "StatelessCase"))


@pytest.mark.parametrize("driven_by", ["set_epoch", "steps_per_epoch"])
@pytest.mark.parametrize("name", list(WARM_UP))
def test_engines_agree_in_tf_function_through_warm_up(name, driven_by):
    """The TensorFlow engine (variables, run-time step and density) against PyTorch's; the
    warm-up switches density every 3 steps without retracing, told by ``set_epoch`` or
    counting the steps itself (``steps_per_epoch=3``, the epoch then computed in the graph).
    ``w`` sends the k of the paper's schedule, ``0.01 ** ((e + 1) / 3)`` in epochs 0 and 1,
    then 0.01. ``b`` is small: its floor (0.05) merges the last two of the densities 0.215,
    0.046, 0.01, so its exchange has two branches in the graph, not three."""
    method = WARM_UP[name]
    if driven_by == "steps_per_epoch":
        method = type(method)(dataclasses.replace(method.config, steps_per_epoch=3))
    shapes = {"w": (311, 97), "b": (97,)}
    torch_engine = TorchEngine(method, world_size=1, rank=0)
    tf_engine = Engine(method, [tf.TensorSpec(shape, tf.float32, n) for n, shape in shapes.items()],
                       world_size=1, rank=0)

    @graph_function
    def tf_step(grads):
        updates = []
        for tensor, grad in zip(shapes, grads):
            outcome = tf_engine.compress(tensor, grad, None)
            updates.append(tf_engine.decompress(outcome.message, outcome))
        return updates

    rs = np.random.RandomState(1)
    for t in range(STEPS):
        if driven_by == "set_epoch":
            torch_engine.epoch = t // 3
            tf_engine.set_epoch(t // 3)
        grads = [rs.standard_normal(shape).astype(np.float32) for shape in shapes.values()]
        updates = tf_step([tf.constant(g) for g in grads])
        if name != "gaussiank":  # its count follows its threshold, not k
            density = 0.01 ** ((t // 3 + 1) / 3) if t // 3 < 2 else 0.01
            assert np.count_nonzero(updates[0].numpy()) == math.ceil(density * 311 * 97), t
        for tensor, grad, update in zip(shapes, grads, updates):
            outcome = torch_engine.compress(tensor, torch.from_numpy(grad.copy()), None)  # consumed
            expected = torch_engine.decompress(outcome.message, [outcome])[0].numpy()
            np.testing.assert_array_equal(expected, update.numpy(), err_msg=f"{tensor}, step {t}")
            for key, value in torch_engine._states[tensor].items():
                np.testing.assert_array_equal(value.numpy(), tf_engine._states[tensor][key].numpy().reshape(-1))
    assert tf_step.experimental_get_tracing_count() == 1
    assert _case_branches(tf_step.get_concrete_function(
        [tf.TensorSpec(shape, tf.float32) for shape in shapes.values()]).graph) == [2, 2, 3, 3]
    a, b = torch_engine.stats(), tf_engine.stats()
    assert (a.steps, a.bytes_sent, a.dense_bytes, a.elements_sent, a.elements_compressed) == \
           (b.steps, b.bytes_sent, b.dense_bytes, b.elements_sent, b.elements_compressed)
    assert b.selection_time_s > 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_gradients_agree_with_torch(dtype):
    """Memories in float32, values on the wire in the gradient's own 16-bit format."""
    method = TopK(TopKConfig(density=0.01, value_dtype="float16"))
    torch_engine = TorchEngine(method, world_size=1, rank=0)
    tf_engine = Engine(method, [tf.TensorSpec((32, 64), dtype, "w")], world_size=1, rank=0)

    @graph_function
    def tf_step(grad):
        outcome = tf_engine.compress("w", grad, None)
        return tf_engine.decompress(outcome.message, outcome)

    # Distinct magnitudes, exact in both 16-bit formats: no ties for top-k to break differently.
    magnitudes = np.ldexp(1.0 + np.arange(128) / 128.0, np.arange(-8, 8)[:, None]).reshape(-1)
    rs = np.random.RandomState(4)
    for _ in range(3):
        values = rs.permutation(magnitudes) * rs.choice([-1.0, 1.0], magnitudes.size)
        grad = torch.from_numpy(values.reshape(32, 64).astype(np.float32)).to(getattr(torch, dtype))
        outcome = torch_engine.compress("w", grad, None)
        expected = torch_engine.decompress(outcome.message, [outcome])[0].float().numpy()
        got = tf_step(tf.cast(tf.constant(grad.float().numpy()), dtype))
        assert got.dtype == dtype
        np.testing.assert_array_equal(expected, tf.cast(got, tf.float32).numpy())
    np.testing.assert_array_equal(torch_engine._states["w"]["residual"].numpy(),
                                  tf_engine._states["w"]["residual"].numpy().reshape(-1))


# -- TFOps pieces against TorchOps ----------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32", "int64"])
def test_bytes_are_bit_exact_both_ways(dtype):
    values = torch.randn(37).mul(1000).to(getattr(torch, dtype))
    expected = torch_ops.to_bytes(values).numpy()
    tf_values = tf_ops.from_bytes(tf.constant(expected), dtype)
    np.testing.assert_array_equal(tf_ops.to_bytes(tf_values).numpy(), expected)
    assert tf_ops.dtype(tf_values) == dtype


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_block_pieces_match_torch_with_nan_padding(mode):
    x = np.random.RandomState(2).standard_normal(1003).astype(np.float32)
    blocks = np.array([0, 31, 125], np.int64)  # 125 is the short last block of 8

    def pieces(x, blocks):
        return tf_ops.block_abs_max(x, 8), tf_ops.gather_blocks(x, blocks, 8)

    fn = graph_function(pieces) if mode == "function" else pieces
    maxima, gathered = fn(tf.constant(x), tf.constant(blocks))
    np.testing.assert_array_equal(maxima.numpy(), torch_ops.block_abs_max(torch.from_numpy(x), 8).numpy())
    np.testing.assert_array_equal(gathered.numpy(), torch_ops.gather_blocks(
        torch.from_numpy(x), torch.from_numpy(blocks), 8).numpy())
    assert np.isnan(gathered.numpy()[-5:]).all()


def test_strided_sample_with_run_time_offset_has_static_length():
    @graph_function
    def sample(x, offset):
        s = tf_ops.strided_sample(x, offset, 7)
        assert s.shape == [100 // 7]
        return s

    x = tf.range(100.0)
    np.testing.assert_array_equal(sample(x, tf.constant(3, tf.int64)).numpy(), np.arange(3, 100, 7)[:14])


# -- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("factory", [Compression.dgc, Compression.topk, Compression.gaussiank])
@pytest.mark.parametrize("options,field", [(dict(density=0.0), "density"), (dict(density=1.5), "density"),
                                           (dict(value_dtype="int4"), "value_dtype"),
                                           (dict(nonfinite="ignore"), "nonfinite"),
                                           (dict(warmup_epochs=-1), "warmup_epochs")])
def test_bad_settings_raise_value_error_at_construction(factory, options, field):
    with pytest.raises(ValueError, match=field):
        factory(**options)


def test_bad_dgc_setting_and_unknown_option():
    with pytest.raises(ValueError, match="momentum"):
        Compression.dgc(momentum=1.0)
    with pytest.raises(TypeError):
        Compression.topk(momentum=0.9)


def test_variables_must_be_named_once_and_known():
    with pytest.raises(ValueError, match="duplicate"):
        Compression.topk(variables=[tf.Variable(tf.zeros([2, 2]), name="w"),
                                    tf.Variable(tf.zeros([2]), name="w")])
    with pytest.raises(ValueError, match="empty"):
        Compression.topk(variables=[])
    with pytest.raises(ValueError, match="variables="):
        Compression.topk().engine


@pytest.mark.parametrize("tensor", [tf.zeros([0]), tf.range(10), tf.ones([3, 3], tf.int32)])
def test_zero_element_and_integer_tensors_pass_through_untouched(tensor):
    out, ctx = Compression.dgc().compress(tensor)
    assert out is tensor and ctx is None


def _engines(world_size=3, density=0.01, name="fc.weight", nonfinite="skip"):
    method = DGC(DGCConfig(density=density, nonfinite=nonfinite))
    return [Engine(method, [tf.TensorSpec([50, 100], tf.float32, name)], world_size, rank)
            for rank in range(world_size)]


def _messages(engines, name="fc.weight"):
    grad = tf.constant(np.random.RandomState(3).standard_normal([50, 100]).astype(np.float32))
    outcomes = [engine.compress(name, grad, None) for engine in engines]
    return outcomes, [outcome.message.numpy() for outcome in outcomes]


def _set_word(message: np.ndarray, field: str, value: int) -> np.ndarray:
    message = message.copy()
    message[:wire.HEADER_WORDS * 4].view(np.int32)[wire.HEADER_FIELDS.index(field)] = value
    return message


def _corrupt(case: str):
    """(gathered bytes as rank 0 receives them, rank 0's outcome) for a malformed case."""
    engines = _engines()
    outcomes, parts = _messages(engines)
    if case == "magic":
        parts[2] = parts[2].copy()
        parts[2][0] ^= 0xFF
    elif case == "other tensor":
        parts[1] = _messages(_engines(name="fc.bias"), "fc.bias")[1][1]
    elif case == "sender":
        parts[1] = parts[0]
    elif case == "step":
        parts[1] = _messages([engines[1]])[1][0]
    elif case == "truncated":
        parts[2] = parts[2][:-8]
    elif case == "density":
        parts[1] = _messages(_engines(density=0.02))[1][1]
    elif case == "count":
        parts[0] = _set_word(parts[0], "count", outcomes[0].layouts[0].capacity + 1)
    return engines[0], np.concatenate(parts), outcomes[0]


MALFORMED = {"magic": r"rank 2 .*fc\.weight.*magic",
             "other tensor": r"rank 1 .*fc\.weight.*tensor id",
             "sender": r"rank 1 .*sender rank is 0",
             "step": r"rank 1 .*fc\.weight.*step is 1, expected 0",
             "truncated": r"received \d+ bytes for tensor\(s\) .*fc.weight.*, expected \d+",
             "density": r"rank 1 .*fc\.weight.*capacity is 100, expected 50",
             "count": r"rank 0 .*fc\.weight.*count"}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_message_is_refused_eagerly_with_rank_and_tensor(case):
    engine, gathered, outcome = _corrupt(case)
    with pytest.raises(MessageError, match=MALFORMED[case]):
        engine.decompress(tf.constant(gathered), outcome)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_message_is_refused_in_graph_mode_with_rank_and_tensor(case):
    engine, gathered, outcome = _corrupt(case)
    decompress = graph_function(lambda data: engine.decompress(data, outcome),
                             input_signature=[tf.TensorSpec([None], tf.uint8)])
    with pytest.raises(tf.errors.InvalidArgumentError, match="MessageError: .*" + MALFORMED[case]):
        decompress(tf.constant(gathered))


def _exchange_with_a_nan_on_rank_1(nonfinite: str, graph: bool):
    """Both ranks' engines exchange one step in which rank 1's gradient holds a NaN; returns
    (rank 0's averaged gradient, the engines)."""
    engines = _engines(world_size=2, nonfinite=nonfinite)
    good = np.ones([50, 100], np.float32)
    bad = good.copy()
    bad[0, 7] = np.nan

    def step(grads):
        messages = [e.compress("fc.weight", g, None) for e, g in zip(engines, grads)]
        gathered = tf.concat([m.message for m in messages], 0)
        return [e.decompress(gathered, m) for e, m in zip(engines, messages)][0]

    step = graph_function(step) if graph else step
    return step([tf.constant(good), tf.constant(bad)]), engines


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_non_finite_gradient_on_one_rank_reaches_every_rank_and_keeps_every_memory(graph):
    averaged, engines = _exchange_with_a_nan_on_rank_1("skip", graph)
    assert np.isnan(averaged.numpy()).all()
    for engine in engines:
        assert not any(np.any(v.numpy()) for v in engine._states["fc.weight"].values())


def test_non_finite_gradient_raises_naming_tensor_and_rank_in_graph_mode():
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"NonFiniteGradientError: gradient of tensor .*fc\.weight.* on rank 1"):
        _exchange_with_a_nan_on_rank_1("raise", True)
    with pytest.raises(NonFiniteGradientError, match=r"fc.weight.* on rank 1"):
        _exchange_with_a_nan_on_rank_1("raise", False)


def test_skipped_non_finite_gradient_leaves_memory_and_passes_nan_on():
    method = TopK(TopKConfig(density=0.01, nonfinite="skip"))
    engine = Engine(method, [tf.TensorSpec([50, 100], tf.float32, "w")], 1, 0)

    @graph_function
    def step(grad):
        outcome = engine.compress("w", grad, None)
        return engine.decompress(outcome.message, outcome)

    assert np.isnan(step(tf.fill([50, 100], float("inf"))).numpy()).all()
    assert not np.any(engine._states["w"]["residual"].numpy())


# -- gradient -> variable ----------------------------------------------------------------------
def test_gradients_map_to_variables_by_order_and_shape_within_each_trace():
    variables = [tf.Variable(tf.zeros(shape), name=name) for name, shape in
                 [("a", [4, 4]), ("unused", [3, 5]), ("b", [4, 4]), ("c", [5]), ("d", [4, 4])]]
    compression = SparseCompressor(TopK(), variables)
    seen = []

    @graph_function
    def trace(grads):
        for grad in grads:
            seen.append(compression._lookup(grad, _outermost_graph(grad))[0::2])
        return grads

    # No gradient for "unused"; then a second pass in the same trace; then a new trace.
    shapes = [[4, 4], [4, 4], [5], [4, 4], [4, 4], [4, 4]]
    trace([tf.zeros(s) for s in shapes])
    assert seen == [("a", 0), ("b", 0), ("c", 0), ("d", 0), ("a", 1), ("b", 1)]
    seen.clear()
    trace([tf.zeros(s) for s in shapes[:3]])
    assert seen == [("a", 0), ("b", 0), ("c", 0)]
    with pytest.raises(ValueError, match="matches no variable"):
        graph_function(lambda: compression._lookup(tf.zeros([9]), tf.compat.v1.get_default_graph()))()


# -- the operations of the two-stage methods --------------------------------------------------
def test_sign_packing_and_block_operations_match_torch():
    x = np.random.default_rng(5).standard_normal(1000).astype(np.float32)
    x[::7] = 0.0  # sign(0) is +1 in both
    packed_torch = torch_ops.pack_signs(torch.from_numpy(x))
    packed_tf = tf_ops.pack_signs(tf.constant(x))
    np.testing.assert_array_equal(packed_torch.numpy(), packed_tf.numpy())
    np.testing.assert_array_equal(torch_ops.unpack_signs(packed_torch, "float32").numpy(),
                                  tf_ops.unpack_signs(packed_tf, "float32").numpy())
    for block in (7, 64, 1000):
        sums_torch = torch_ops.block_abs_sum(torch.from_numpy(x), block)
        np.testing.assert_array_equal(sums_torch.numpy(), tf_ops.block_abs_sum(tf.constant(x), block).numpy())
        np.testing.assert_array_equal(torch_ops.repeat_blocks(sums_torch, block, 1000).numpy(),
                                      tf_ops.repeat_blocks(tf.constant(sums_torch.numpy()), block, 1000).numpy())


# -- the two-stage methods ---------------------------------------------------------------------
TWO_STAGE = {
    "scalecom": lambda: ScaleCom(ScaleComConfig(density=0.01)),
    "scalecom-chunked-lowpass": lambda: ScaleCom(ScaleComConfig(density=0.01, beta=0.5,
                                                                leader_selection="chunked")),
    "blocksign": lambda: BlockSign(BlockSignConfig()),
    "blocksign64-momentum": lambda: BlockSign(BlockSignConfig(block_size=64, momentum=0.9)),
}


def _two_stage_steps(ops, method, grads, to_tensor, simulate) -> list:
    """Each step's (FIRST messages, results, states) of 2 simulated workers, as arrays."""
    states = [method.init_state(ops, to_tensor(np.zeros(N, np.float32)), True, 2) for _ in range(2)]
    history = []
    for t in range(STEPS):
        ctxs = [CompressCall("w", r, 2, t, method.config.density_at(0)) for r in range(2)]
        worker_grads = [to_tensor(grads[t]), to_tensor(grads[(t + 3) % STEPS])]
        firsts, results, states = simulate(method, states, worker_grads, ctxs)
        history.append(([m.numpy() for m in firsts], [r.numpy() for r in results],
                        [{k: v.numpy().copy() for k, v in s.items()} for s in states]))
    return history


def _simulate_recording(ops):
    """simulate_step that also returns each worker's FIRST message (its selection)."""
    def simulate(method, states, grads, ctxs):
        copies = [{k: ops.copy(v) for k, v in s.items()} for s in states]  # first() may update in place
        firsts = [method.first(ops, s, g, c)[0] for s, g, c in zip(copies, grads, ctxs)]
        results, states = simulate_step(ops, method, states, grads, ctxs)
        return firsts, results, states
    return simulate


@pytest.mark.parametrize("name", list(TWO_STAGE))
def test_two_stage_methods_give_identical_selections_and_memories_for_10_steps(name):
    """Two workers simulated eagerly in each framework (the engine test below covers
    graph mode): identical messages, results and memories. ScaleCom: identical leader
    indices, values and memories. Blocksign: identical packed signs, block scales and
    residuals (block sums accumulate in float64, see TensorOps.block_abs_sum)."""
    method = TWO_STAGE[name]()
    _, grads = gradients()
    tf_simulate = _simulate_recording(tf_ops)
    expected = _two_stage_steps(torch_ops, method, grads, torch.from_numpy, _simulate_recording(torch_ops))
    got = _two_stage_steps(tf_ops, method, grads, tf.constant, tf_simulate)
    leader_indices = isinstance(method, ScaleCom)

    for t, ((firsts_a, results_a, states_a), (firsts_b, results_b, states_b)) in enumerate(zip(expected, got)):
        layout = method.index_layout("w", N, method.config.density) if leader_indices else method.layout("w", N, 2)
        for a, b in zip(firsts_a, firsts_b):
            # ScaleCom: the leader's indices as a set (top-k's order is each framework's own);
            # blocksign: the packed signs of the first shard.
            (header_a, (part_a, *_)), (header_b, (part_b, *_)) = [
                (m[:wire.HEADER_BYTES].view(np.int32),
                 wire.parts_of(torch_ops, torch.from_numpy(m[:layout.nbytes]), layout)) for m in (a, b)]
            np.testing.assert_array_equal(header_a, header_b)
            np.testing.assert_array_equal(np.sort(part_a.numpy()) if leader_indices else part_a.numpy(),
                                          np.sort(part_b.numpy()) if leader_indices else part_b.numpy(),
                                          err_msg=f"selection at step {t}")
        for a, b in zip(results_a, results_b):
            np.testing.assert_array_equal(a, b, err_msg=f"result at step {t}")
        for a, b in zip(states_a, states_b):
            for key in a:
                np.testing.assert_array_equal(a[key], b[key], err_msg=f"{key} at step {t}")


@pytest.mark.parametrize("name", list(TWO_STAGE))
def test_two_stage_engine_in_tf_function_matches_the_torch_simulation(name):
    """The TensorFlow engine (memories in variables, run-time step and leader, headers
    checked against them) for one worker, in one trace, against the core on PyTorch."""
    method = TWO_STAGE[name]()
    shape = (311, 97)
    engine = TwoStageEngine(method, [tf.TensorSpec(shape, tf.float32, "w")], world_size=1, rank=0)

    @graph_function
    def tf_step(grad):
        return engine.exchange("w", grad, None, emulated_single_worker, "w")[0]

    states = [method.init_state(torch_ops, torch.zeros(311 * 97), True, 1)]
    rs = np.random.RandomState(1)
    for t in range(STEPS):
        grad = rs.standard_normal(shape).astype(np.float32)
        results, states = simulate_step(torch_ops, method, states, [torch.from_numpy(grad).reshape(-1)],
                                        [CompressCall("w", 0, 1, t, method.config.density_at(0))])
        got = tf_step(tf.constant(grad)).numpy().reshape(-1)
        np.testing.assert_array_equal(results[0].numpy(), got, err_msg=f"step {t}")
        for key, value in states[0].items():
            np.testing.assert_array_equal(value.numpy(), engine._states["w"][key].numpy())
    assert tf_step.experimental_get_tracing_count() == 1
    assert engine.stats().steps == STEPS


@pytest.mark.parametrize("name", list(TWO_STAGE))
def test_two_stage_engine_under_a_loss_scale_matches_its_unscaled_twin_times_the_scale(name):
    """Gradients times a changing power-of-two loss scale: the update comes back times the
    scale and the memories stay those of a twin engine given the unscaled gradients (exact:
    a power of two scales without rounding). Catches a two-stage result left unscaled and
    memories kept scaled."""
    shape, scales = (311, 97), [1024.0, 512.0, 2048.0]
    scaled, twin = (TwoStageEngine(TWO_STAGE[name](), [tf.TensorSpec(shape, tf.float32, "w")], 1, 0)
                    for _ in range(2))
    scale = tf.Variable(1.0)
    scaled.use_loss_scale(lambda: scale)
    rs = np.random.RandomState(5)
    for t, current in enumerate(scales):
        grad = rs.standard_normal(shape).astype(np.float32)
        scale.assign(current)
        got = scaled.exchange("w", tf.constant(grad * np.float32(current)), None, emulated_single_worker, "w")[0]
        want = twin.exchange("w", tf.constant(grad), None, emulated_single_worker, "w")[0]
        np.testing.assert_array_equal(got.numpy(), want.numpy() * np.float32(current), err_msg=f"step {t}")
        for key, value in twin._states["w"].items():
            np.testing.assert_array_equal(scaled._states["w"][key].numpy(), value.numpy(), err_msg=f"{key} step {t}")


def _memories(states):
    return {key: value.numpy().copy() for key, value in states.items()}


def test_a_dense_tensors_memory_is_kept_through_a_non_finite_step():
    """DGC's momentum of a small tensor sent dense: a finite step changes it, an infinite
    gradient then comes back non-finite and leaves it as it was. Catches the dense tensor's
    memories kept whatever the result."""
    engine = Engine(DGC(DGCConfig(density=0.01, small_density=None)), [tf.TensorSpec([10], tf.float32, "bias")], 1, 0)
    for grad in (np.ones(10, np.float32), np.full(10, np.inf, np.float32)):
        before = _memories(engine._states["bias"])
        sent = engine.dense("bias", tf.constant(grad), None)
        got = engine.dense_received(sent, sent.tensor).numpy()
    assert not np.isfinite(got).all()
    assert any(np.any(v) for v in before.values()), "the finite step left no memory"
    for key, value in before.items():
        np.testing.assert_array_equal(engine._states["bias"][key].numpy(), value, err_msg=key)


@pytest.mark.parametrize("name", list(TWO_STAGE))
def test_a_two_stage_memory_is_kept_through_a_non_finite_step(name):
    """As the dense tensor's, for ScaleCom's and blocksign's memories. Catches them kept
    whatever the result."""
    engine = TwoStageEngine(TWO_STAGE[name](), [tf.TensorSpec((311, 97), tf.float32, "w")], 1, 0)
    rs = np.random.RandomState(9)
    engine.exchange("w", tf.constant(rs.standard_normal((311, 97)).astype(np.float32)), None,
                    emulated_single_worker, "w")
    before = _memories(engine._states["w"])
    grad = rs.standard_normal((311, 97)).astype(np.float32)
    grad[7, 3] = np.nan
    got = engine.exchange("w", tf.constant(grad), None, emulated_single_worker, "w")[0].numpy()
    assert not np.isfinite(got).all()
    assert any(np.any(v) for v in before.values()), "the finite step left no memory"
    for key, value in before.items():
        np.testing.assert_array_equal(engine._states["w"][key].numpy(), value, err_msg=key)


def _tampered(field: str, value: int):
    """An emulated one-worker collective that rewrites a header word of the FIRST stage."""
    def collective(kind, message, name, root):
        if not name.endswith(".1"):
            return tf.identity(message)
        words = tf.bitcast(tf.reshape(message[:wire.HEADER_WORDS * 4], [-1, 4]), tf.int32)
        words = tf.tensor_scatter_nd_update(words, [[wire.HEADER_FIELDS.index(field)]], [value])
        return tf.concat([tf.reshape(tf.bitcast(words, tf.uint8), [-1]), message[wire.HEADER_WORDS * 4:]], 0)
    return collective


@pytest.mark.parametrize("name,field,value,match", [("scalecom", "step", 7, "step is 7, expected 0"),
                                                    ("scalecom", "sender rank", 3, "sender rank is 3"),
                                                    ("blocksign", "tensor id", 5, "tensor id is 5")])
def test_two_stage_malformed_message_is_refused_in_graph_mode_with_rank_and_tensor(name, field, value, match):
    engine = TwoStageEngine(TWO_STAGE[name](), [tf.TensorSpec([50, 100], tf.float32, "fc.weight")], 1, 0)
    step = graph_function(lambda g: engine.exchange("fc.weight", g, None, _tampered(field, value), "x")[0])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"rank 0 .*fc\.weight.*" + match):
        step(tf.ones([50, 100]))


def test_under_a_loss_scale_memories_stay_unscaled_and_the_update_goes_back_scaled():
    """Keras mixed precision: gradients arrive times the loss scale, which changes between
    steps; a naive top-k with error feedback on the unscaled gradients is the reference."""
    shape, density, scales = (50, 100), 0.01, [1024.0, 512.0, 512.0, 2048.0]
    method = TopK(TopKConfig(density=density, value_dtype="float32"))
    engine = Engine(method, [tf.TensorSpec(shape, tf.float32, "w")], world_size=1, rank=0)
    scale = tf.Variable(1.0)
    engine.use_loss_scale(lambda: scale)
    k = top_count(density, int(np.prod(shape)))
    residual = np.zeros(int(np.prod(shape)), np.float32)
    rs = np.random.RandomState(7)
    for step, current in enumerate(scales):
        grad = rs.standard_normal(shape).astype(np.float32)
        scale.assign(current)
        outcome = engine.compress("w", tf.constant(grad * np.float32(current)), None)
        got = engine.decompress(outcome.message, outcome).numpy().reshape(-1)
        x = residual + grad.reshape(-1)
        chosen = np.argsort(-np.abs(x), kind="stable")[:k]
        want = np.zeros_like(x)
        want[chosen] = x[chosen]
        residual = x - want
        np.testing.assert_allclose(got, want * current, rtol=1e-6, err_msg=f"step {step}")
        np.testing.assert_allclose(np.asarray(engine.state_dict()["states"]["w"]["residual"]).reshape(-1),
                                   residual, rtol=1e-5, atol=1e-6, err_msg=f"step {step}")


def test_under_a_loss_scale_a_tensor_that_travels_dense_goes_back_scaled():
    """A small tensor sent dense (``small_density=None``) under a changing loss scale: the
    average comes back times the scale, as the sparse tensors' do. Catches the dense result
    left unscaled."""
    method = TopK(TopKConfig(density=0.01, small_density=None))
    engine = Engine(method, [tf.TensorSpec([10], tf.float32, "bias")], world_size=1, rank=0)
    scale = tf.Variable(1.0)
    engine.use_loss_scale(lambda: scale)
    rs = np.random.RandomState(3)
    for step, current in enumerate([1024.0, 512.0, 2048.0]):
        grad = rs.standard_normal(10).astype(np.float32)
        scale.assign(current)
        assert not engine.compresses(tf.TensorSpec([10], tf.float32))
        sent = engine.dense("bias", tf.constant(grad * np.float32(current)), None)
        got = engine.dense_received(sent, sent.tensor).numpy()  # one worker: the all-reduce is itself
        np.testing.assert_allclose(got, grad * np.float32(current), rtol=1e-6, err_msg=f"step {step}")


FLOAT64_METHODS = {"dgc": METHODS["dgc"], "gaussiank": METHODS["gaussiank"],
                   "dgc-sparse-allreduce": lambda: DGC(DGCConfig(density=0.01, aggregation="sparse_allreduce")),
                   **TWO_STAGE}


@pytest.mark.parametrize("name", list(FLOAT64_METHODS))
def test_float64_gradients_agree_with_torch(name):
    """A float64 model in a tf.function: the same updates as the PyTorch engine's, bit for
    bit, in float64. Catches float64 bytes cut into the wire's float32 parts (blocksign's
    scales were: updates of 4e19, and a negative shape with blocks)."""
    method = FLOAT64_METHODS[name]()
    shape = (64, 64)
    spec = [tf.TensorSpec(shape, tf.float64, "w")]
    torch_engine = TorchEngine(method, world_size=1, rank=0)
    if method.family == "sparse":
        engine = Engine(method, spec, world_size=1, rank=0)

        def tf_step(grad):
            outcome = engine.compress("w", grad, None)
            return engine.decompress(outcome.message, outcome)
    else:
        engine = TwoStageEngine(method, spec, world_size=1, rank=0)

        def tf_step(grad):
            return engine.exchange("w", grad, None, emulated_single_worker, "w")[0]
    tf_step = graph_function(tf_step)
    rs = np.random.RandomState(7)
    for t in range(3):
        grad = rs.standard_normal(shape)
        expected = exchange(torch_engine, torch.from_numpy(grad))
        got = tf_step(tf.constant(grad))
        assert got.dtype == tf.float64 and expected.dtype == torch.float64
        np.testing.assert_array_equal(expected.numpy(), got.numpy().reshape(shape), err_msg=f"step {t}")


def test_a_bucket_selects_each_segment_as_alone_inside_tf_function():
    """Both bucket selections through TFOps in a graph (where the plan's tables are made for
    that graph) against the plain references of each segment alone."""
    from horovod_dgc.core.bucket import Bucket, GaussianPlan, Plan, select_gaussian, select_segments
    from test_core_bucket import naive_gaussian, naive_top
    bucket = Bucket.of("b", [("a", 5000, False), ("b", 7, True), ("c", 20000, False), ("d", 65, True)], "float32")
    plan = Plan.at(bucket, [0.01, 0.3, 0.001, 0.05])
    x = np.zeros(bucket.numel, np.float32)
    rng = np.random.default_rng(0)
    for s in bucket.segments:
        x[s.offset:s.end] = rng.standard_normal(s.numel) * np.exp(rng.standard_normal(s.numel))
    top = tf.function(lambda v: select_segments(tf_ops, v, plan))(tf.constant(x)).numpy().tolist()
    gaussian = tf.function(lambda v: select_gaussian(tf_ops, v, GaussianPlan.of(plan)))(tf.constant(x))
    want_top, want_gaussian = [], []
    for s, k in zip(bucket.segments, plan.ks):
        values = torch.from_numpy(x[s.offset:s.end])
        want_top += [s.offset + i for i in naive_top(values, k)]
        want_gaussian += [s.offset + i for i in naive_gaussian(values.tolist(), k)[0]]
    assert top == want_top
    assert gaussian.numpy().tolist() == want_gaussian
