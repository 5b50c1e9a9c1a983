"""The TensorFlow engine's buckets against its own tensor-by-tensor path, in one process.

Two ranks are emulated (their messages concatenated as Horovod's allgather would), inside
``tf.function``, through the warm-up (the density chosen at run time). Every tensor of a
bucket must come back exactly as when it is exchanged alone: its k (its own density, the
small tensors' floor), its exact top-k, its memories, bit for bit in float32. A non-finite
gradient on one rank drops the whole bucket's step on every rank. The two-stage methods'
buckets (their collectives inside the engine) run on one worker against their own
tensor-by-tensor exchange; the Horovod jobs check them on 2 and 3 workers against the
N-worker simulation (``tests/workers/twostage_tensorflow.py``).
"""

import numpy as np
import pytest
import tensorflow as tf

from horovod_dgc.core import DGC, DGCConfig, GaussianK, GaussianKConfig, TopK, TopKConfig
from horovod_dgc.core.methods import BY_NAME
from horovod_dgc.core.selection import top_count
from horovod_dgc.tensorflow.engine import Engine
from horovod_dgc.tensorflow.twostage import TwoStageEngine
from tf_emulation import graph_function, single_worker

WORLD = 2
STEPS = 7
# A large tensor, a small one (the small density's floor), a one-element tensor and another
# large one whose size is no multiple of the segments' alignment.
SHAPES = {"conv.weight": (64, 3, 5, 5), "conv.bias": (64,), "scale": (1,), "fc.weight": (97, 31)}
SCHEDULE = dict(warmup_epochs=2, steps_per_epoch=3)
METHODS = {
    "dgc": lambda: DGC(DGCConfig(density=0.01, weight_decay=1e-4, **SCHEDULE)),
    "topk": lambda: TopK(TopKConfig(density=0.01, **SCHEDULE)),
    "gaussiank": lambda: GaussianK(GaussianKConfig(density=0.01, **SCHEDULE)),
}


def _engines(method, shapes=SHAPES, dtype=tf.float32):
    return [Engine(method, [tf.TensorSpec(shape, dtype, name) for name, shape in shapes.items()], WORLD, rank)
            for rank in range(WORLD)]


def _per_tensor_step(engines, shapes=SHAPES):
    @graph_function
    def step(grads, params):
        results = [[] for _ in engines]
        for i, name in enumerate(shapes):
            sent = [e.compress(name, g[i], p[i]) for e, g, p in zip(engines, grads, params)]
            gathered = tf.concat([m.message for m in sent], 0)
            for r, (engine, message) in enumerate(zip(engines, sent)):
                results[r].append(engine.decompress(gathered, message))
        return results
    return step


def _bucket_step(engines, shapes=SHAPES):
    # Buckets take their tensors in reverse order, as both Horovod paths cut them.
    names = list(shapes)[::-1]

    @graph_function
    def step(grads, params):
        order = [list(shapes).index(n) for n in names]
        buckets = [e.bucket("bucket.x", [(n, g[i]) for n, i in zip(names, order)]) for e, g in zip(engines, grads)]
        sent = [e.compress_bucket(b, [g[i] for i in order], [p[i] for i in order])
                for e, b, g, p in zip(engines, buckets, grads, params)]
        gathered = tf.concat([m.message for m in sent], 0)
        results = []
        for engine, message in zip(engines, sent):
            averaged = dict(zip(names, engine.decompress_bucket(gathered, message)))
            results.append([averaged[n] for n in shapes])
        return results
    return step


def _inputs(rs, shapes=SHAPES, dtype=np.float32):
    grads = [[tf.constant(rs.standard_normal(s).astype(dtype)) for s in shapes.values()] for _ in range(WORLD)]
    params = [[tf.constant(rs.standard_normal(s).astype(dtype)) for s in shapes.values()] for _ in range(WORLD)]
    return grads, params


# Top-k's bucket is DGC's without the momentum, and Gaussian-k's selection in a bucket is held
# to each tensor's in test_core_bucket.py: the slow set runs them here.
@pytest.mark.parametrize("name", [name if name == "dgc" else pytest.param(name, marks=pytest.mark.slow)
                                  for name in METHODS])
def test_a_bucket_gives_each_tensor_what_it_gets_alone_through_warm_up(name):
    """Seven steps across three densities (3 steps each): every rank's averaged gradients
    and memories equal the tensor-by-tensor path's bit for bit; the bucket's count is the
    sum of its tensors' k (Gaussian-k: of what each sends alone)."""
    alone, bucketed = _engines(METHODS[name]()), _engines(METHODS[name]())
    per_tensor, bucket = _per_tensor_step(alone), _bucket_step(bucketed)
    rs = np.random.RandomState(0)
    for t in range(STEPS):
        grads, params = _inputs(rs)
        expected, got = per_tensor(grads, params), bucket(grads, params)
        for rank in range(WORLD):
            for tensor, e, g in zip(SHAPES, expected[rank], got[rank]):
                assert g.shape == SHAPES[tensor]
                np.testing.assert_array_equal(e.numpy(), g.numpy(), err_msg=f"{name} {tensor} step {t} rank {rank}")
                for key, memory in alone[rank]._states[tensor].items():
                    np.testing.assert_array_equal(memory.numpy(), bucketed[rank]._states[tensor][key].numpy(),
                                                  err_msg=f"{name} {tensor}/{key} step {t}")
        if name != "gaussiank":
            density = 0.01 ** ((min(t // 3, 2) + 1) / 3)
            ks = [top_count(max(density, alone[0].config.density_floor(s) or 0.0), int(np.prod(s)))
                  for s in SHAPES.values()]
            assert int(bucketed[0]._totals["elements_sent"].numpy()) - int(alone[0]._totals["elements_sent"].numpy()) == 0
            assert sum(np.count_nonzero(g.numpy()) for g in got[0]) <= WORLD * sum(ks)
    for rank in range(WORLD):
        a, b = alone[rank].stats(), bucketed[rank].stats()
        assert (a.steps, a.dense_bytes, a.elements_sent, a.elements_compressed) == \
               (b.steps, b.dense_bytes, b.elements_sent, b.elements_compressed)
        assert b.bytes_sent < a.bytes_sent  # one header for the bucket, not one per tensor
    assert bucket.experimental_get_tracing_count() == 1


def test_under_a_loss_scale_a_bucket_gives_each_tensor_what_it_gets_alone():
    """Gradients arrive multiplied by a loss scale of 8: the memories hold them unscaled and
    the averages go back scaled, as each tensor's alone."""
    alone, bucketed = _engines(METHODS["dgc"]()), _engines(METHODS["dgc"]())
    for engine in alone + bucketed:
        engine.use_loss_scale(lambda: tf.constant(8.0))
    per_tensor, bucket = _per_tensor_step(alone), _bucket_step(bucketed)
    rs = np.random.RandomState(3)
    for t in range(2):
        grads, params = _inputs(rs)
        expected, got = per_tensor(grads, params), bucket(grads, params)
        for e, g in zip(expected[0], got[0]):
            np.testing.assert_array_equal(e.numpy(), g.numpy(), err_msg=f"step {t}")


def test_bfloat16_tensors_bucket_alike():
    """A bucket of bfloat16 gradients (float32 memories, bfloat16 values on the wire)."""
    shapes = {"a": (40, 50), "b": (50,)}
    method = TopK(TopKConfig(density=0.05))
    alone, bucketed = _engines(method, shapes, tf.bfloat16), _engines(method, shapes, tf.bfloat16)
    per_tensor, bucket = _per_tensor_step(alone, shapes), _bucket_step(bucketed, shapes)
    rs = np.random.RandomState(1)
    for t in range(3):
        grads, params = _inputs(rs, shapes)
        grads = [[tf.cast(g, tf.bfloat16) for g in per_rank] for per_rank in grads]
        expected, got = per_tensor(grads, params), bucket(grads, params)
        for e, g in zip(expected[1], got[1]):
            assert g.dtype == tf.bfloat16
            np.testing.assert_array_equal(tf.cast(e, tf.float32).numpy(), tf.cast(g, tf.float32).numpy())


def test_a_non_finite_gradient_on_one_rank_drops_the_whole_bucket_on_every_rank():
    """Rank 1's bias holds a NaN: every tensor of the bucket comes back NaN on both ranks,
    and no memory of the bucket moves (Keras' loss scaling skips such a step)."""
    engines = _engines(DGC(DGCConfig(density=0.01)))
    bucket = _bucket_step(engines)
    rs = np.random.RandomState(2)
    grads, params = _inputs(rs)
    bucket(grads, params)
    before = [{n: {k: v.numpy() for k, v in e._states[n].items()} for n in SHAPES} for e in engines]
    grads, params = _inputs(rs)
    poisoned = grads[1][1].numpy()
    poisoned[3] = np.nan
    grads[1][1] = tf.constant(poisoned)
    got = bucket(grads, params)
    for rank, engine in enumerate(engines):
        assert all(np.isnan(g.numpy()).all() for g in got[rank])
        for n in SHAPES:
            for k, v in engine._states[n].items():
                np.testing.assert_array_equal(v.numpy(), before[rank][n][k], err_msg=f"{n}/{k}")


def test_a_bucket_refuses_gradients_of_two_dtypes():
    engine = _engines(TopK(TopKConfig(density=0.01)), {"a": (10, 10), "b": (10,)})[0]
    with pytest.raises(ValueError, match="several dtypes"):
        engine.bucket("bucket.a", [("a", tf.TensorSpec((10, 10), tf.float32)), ("b", tf.TensorSpec((10,), tf.bfloat16))])


# blocksign sends small tensors dense: min_numel=1000 gives its bucket both kernels.
TWO_STAGE = {"scalecom": dict(density=0.01), "blocksign": dict(min_numel=1000),
             "dgc-sar": dict(aggregation="sparse_allreduce")}


def _two_stage_steps(name: str, scale: float = 1.0):
    """(tensor-by-tensor step, bucket step, their engines) of a two-stage method on one
    worker, the bucket taking the compressed tensors in reverse order."""
    method_name = "dgc" if name == "dgc-sar" else name
    method = BY_NAME[method_name].build(1, **TWO_STAGE[name])
    specs = [tf.TensorSpec(shape, tf.float32, n) for n, shape in SHAPES.items()]
    alone, bucketed = TwoStageEngine(method, specs, 1, 0), TwoStageEngine(method, specs, 1, 0)
    for engine in (alone, bucketed):
        engine.use_loss_scale(lambda: tf.constant(scale))
    compressed = [n for n, spec in zip(SHAPES, specs) if alone.compresses(spec)][::-1]
    assert len(compressed) >= 2, compressed

    @graph_function
    def per_tensor(grads):
        return [alone.exchange(n, g, None, single_worker, f"x.{n}")[0] if n in compressed else g
                for n, g in zip(SHAPES, grads)]

    @graph_function
    def bucket(grads):
        by_name = dict(zip(SHAPES, grads))
        members = [by_name[n] for n in compressed]
        made = bucketed.bucket("bucket.x", list(zip(compressed, members)))
        by_name.update(zip(compressed, bucketed.exchange_bucket(made, members, [None] * len(members),
                                                                 single_worker, "b")[0]))
        return [by_name[n] for n in SHAPES]

    return per_tensor, bucket, alone, bucketed


@pytest.mark.parametrize("name", list(TWO_STAGE))
def test_a_two_stage_bucket_gives_each_tensor_what_it_gets_alone(name):
    """Four steps under a loss scale of 4: each tensor's update and memories as when it is
    exchanged alone (to float32 rounding: a bucket's sums run in another order)."""
    per_tensor, bucket, alone, bucketed = _two_stage_steps(name, scale=4.0)
    rs = np.random.RandomState(4)
    for t in range(4):
        grads = [tf.constant(rs.standard_normal(s).astype(np.float32)) for s in SHAPES.values()]
        for tensor, e, g in zip(SHAPES, per_tensor(grads), bucket(grads)):
            np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-6, atol=1e-6, err_msg=f"{name} {tensor} step {t}")
        for tensor in SHAPES:
            for key, memory in alone._states[tensor].items():
                np.testing.assert_allclose(bucketed._states[tensor][key].numpy(), memory.numpy(), rtol=1e-6,
                                           atol=1e-6, err_msg=f"{name} {tensor}/{key} step {t}")
    a, b = alone.stats(), bucketed.stats()
    assert (a.steps, a.dense_bytes, a.elements_compressed) == (b.steps, b.dense_bytes, b.elements_compressed)


def test_a_two_stage_bucket_keeps_every_memory_through_a_non_finite_step():
    _, bucket, _, bucketed = _two_stage_steps("scalecom")
    rs = np.random.RandomState(5)
    bucket([tf.constant(rs.standard_normal(s).astype(np.float32)) for s in SHAPES.values()])
    before = {n: {k: v.numpy() for k, v in bucketed._states[n].items()} for n in SHAPES}
    grads = [rs.standard_normal(s).astype(np.float32) for s in SHAPES.values()]
    grads[0][0, 0, 0, 0] = np.inf
    bucket([tf.constant(g) for g in grads])
    for n in SHAPES:
        for k, v in bucketed._states[n].items():
            np.testing.assert_array_equal(v.numpy(), before[n][k], err_msg=f"{n}/{k}")


def test_a_rank_whose_bucket_holds_another_density_is_named_in_graph_mode():
    """Rank 1 compresses at twice rank 0's density: every rank's decode fails the step with
    an error naming rank 1 and the bucket."""
    engines = [_engines(TopK(TopKConfig(density=d)))[rank] for rank, d in enumerate((0.01, 0.02))]
    rs = np.random.RandomState(6)
    grads, params = _inputs(rs)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"rank 1 sent a malformed message for tensor \W*bucket\.x#"):
        _bucket_step(engines)(grads, params)


def test_a_two_stage_bucket_message_of_another_rank_is_checked_in_graph_mode():
    """A ScaleCom bucket whose received positions message was cut short fails the step,
    naming the bucket."""
    _, _, _, bucketed = _two_stage_steps("scalecom")
    compressed = [n for n in SHAPES if bucketed.compresses(tf.TensorSpec(SHAPES[n], tf.float32))][::-1]

    def truncated(kind, message, name, root, chunks=None):
        return message[:-8] if name.endswith(".1") else message

    @graph_function
    def bucket(grads):
        by_name = dict(zip(SHAPES, grads))
        members = [by_name[n] for n in compressed]
        made = bucketed.bucket("bucket.x", list(zip(compressed, members)))
        return bucketed.exchange_bucket(made, members, [None] * len(members), truncated, "b")[0]

    rs = np.random.RandomState(7)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"bucket\.x#"):
        bucket([tf.constant(rs.standard_normal(s).astype(np.float32)) for s in SHAPES.values()])
