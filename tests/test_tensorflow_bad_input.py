"""TensorFlow: bad settings of the two-stage methods fail at construction, an optimizer that
would apply DGC's momentum twice is refused, and compressor state survives a save/load round
trip while a state of another method, tensor set or shape is refused."""
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from horovod_dgc.core import DGC, DGCConfig, TopK, TopKConfig
from horovod_dgc.core.blocksign import BlockSign, BlockSignConfig
from horovod_dgc.core.scalecom import ScaleCom, ScaleComConfig
from horovod_dgc.tensorflow import Compression
from horovod_dgc.tensorflow.callbacks import CompressionWarmup
from horovod_dgc.tensorflow.engine import Engine
from horovod_dgc.tensorflow.twostage import TwoStageEngine
from tf_emulation import graph_function, single_worker as emulated_single_worker


@pytest.mark.parametrize("factory,options,field", [
    (Compression.scalecom, dict(density=0.0), "density"),
    (Compression.scalecom, dict(beta=0.0), "beta"),
    (Compression.scalecom, dict(leader_selection="random"), "leader_selection"),
    (Compression.scalecom, dict(chunks=0), "chunks"),
    (Compression.blocksign, dict(block_size=0), "block_size"),
    (Compression.blocksign, dict(momentum=1.0), "momentum"),
    (Compression.blocksign, dict(nonfinite="ignore"), "nonfinite")])
def test_bad_two_stage_settings_raise_value_error_at_construction(factory, options, field):
    with pytest.raises(ValueError, match=field):
        factory(**options)


def test_force_mode_needs_adaptive_and_a_step_end_before_any_step_does_nothing():
    """(The refusals at construction: tests/test_adaptive.py, for both frameworks.)"""
    plain = Compression.topk(adaptive=False)
    assert plain.adaptive is None and plain.end_step() == []
    with pytest.raises(ValueError, match="needs a compressor built with adaptive"):
        plain.force_mode("dense")


def test_unknown_two_stage_option_is_a_type_error():
    with pytest.raises(TypeError):
        Compression.blocksign(density=0.01)


@pytest.mark.parametrize("optimizer,refused", [
    (keras.optimizers.SGD(0.1, momentum=0.9), "momentum=0.9"),
    (keras.optimizers.SGD(0.1, weight_decay=1e-4), None),
    (keras.optimizers.SGD(0.1), None)])
def test_optimizer_with_momentum_is_refused_with_dgc(optimizer, refused):
    compression = Compression.dgc(momentum=0.9)
    if refused:
        with pytest.raises(ValueError, match=refused):
            compression.check_optimizer(optimizer)
    else:
        compression.check_optimizer(optimizer)
    Compression.topk().check_optimizer(optimizer)  # no momentum of its own: anything goes


def test_dgc_weight_decay_with_optimizer_weight_decay_is_refused():
    with pytest.raises(ValueError, match="weight_decay"):
        Compression.dgc(weight_decay=1e-4).check_optimizer(keras.optimizers.SGD(0.1, weight_decay=1e-4))


def test_warmup_callback_needs_a_horovod_dgc_compressor_and_checks_the_optimizer():
    with pytest.raises(TypeError, match="horovod_dgc compressor"):
        CompressionWarmup(Compression.fp16)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    callback = CompressionWarmup(Compression.dgc(density=0.01, warmup_epochs=2))
    callback.set_model(model)
    with pytest.raises(ValueError, match="momentum"):
        callback.on_train_begin()


def test_warmup_callback_moves_the_density_along_the_schedule_at_each_epoch():
    """DGC's exponential warm-up over 4 epochs down to 0.001 (docs/algorithms.md#warm-up:
    ``c^(e+1)``, ``c = 0.001^(1/5)``, then 0.001), read from the compressor and from each
    epoch's logs."""
    import horovod.tensorflow as hvd
    hvd.init()  # one worker: the compressor's engine is built for hvd.size()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    compressor = Compression.dgc(density=0.001, warmup_epochs=4, variables=model.trainable_variables)
    callback = CompressionWarmup(compressor)
    seen = []
    for epoch in range(6):
        callback.on_epoch_begin(epoch)
        logs = {}
        callback.on_epoch_end(epoch, logs)
        seen.append((compressor.density, logs["density"]))
    want = [0.001 ** ((e + 1) / 5) for e in range(5)] + [0.001]
    assert [d for d, _ in seen] == pytest.approx(want) and [d for _, d in seen] == pytest.approx(want)


# -- state_dict / load_state_dict ------------------------------------------------------------
SHAPES = {"fc/kernel": (64, 100), "fc/bias": (100,)}
METHODS = {"dgc": lambda: DGC(DGCConfig(density=0.01, warmup_epochs=2)),
           "topk": lambda: TopK(TopKConfig(density=0.01)),
           "scalecom": lambda: ScaleCom(ScaleComConfig(density=0.01)),
           "blocksign": lambda: BlockSign(BlockSignConfig(block_size=64, momentum=0.9))}


def _engine(name: str, shapes=SHAPES):
    method = METHODS[name]()
    specs = [tf.TensorSpec(shape, tf.float32, tensor) for tensor, shape in shapes.items()]
    engine_class = TwoStageEngine if name in ("scalecom", "blocksign") else Engine
    return engine_class(method, specs, world_size=1, rank=0)


def _stepper(engine):
    """A tf.function running one step of every tensor; returns the updates."""
    @graph_function
    def step(grads):
        updates = []
        for tensor, grad in zip(SHAPES, grads):
            if not engine.compresses(grad):
                sent = engine.dense(tensor, grad, None)
                updates.append(engine.dense_received(sent, sent.tensor))
            elif isinstance(engine, TwoStageEngine):
                updates.append(engine.exchange(tensor, grad, None, emulated_single_worker, tensor)[0])
            else:
                outcome = engine.compress(tensor, grad, None)
                updates.append(engine.decompress(outcome.message, outcome))
        return updates
    return step


def _grads(seed: int):
    rs = np.random.RandomState(seed)
    return [tf.constant(rs.standard_normal(shape).astype(np.float32)) for shape in SHAPES.values()]


@pytest.mark.parametrize("name", list(METHODS))
def test_state_round_trip_restores_identical_state_and_continues_identically(name):
    saved = _engine(name)
    step = _stepper(saved)
    saved.set_epoch(1)
    for t in range(3):
        step(_grads(t))
    state = saved.state_dict()
    restored = _engine(name)
    restored.load_state_dict(state)
    again = restored.state_dict()
    assert again["steps"] == state["steps"] and again["epoch"] == state["epoch"] == 1.0
    assert any(np.any(v) for v in state["states"]["fc/kernel"].values()), "nothing was saved"
    for tensor, tensors in state["states"].items():
        for key, value in tensors.items():
            np.testing.assert_array_equal(value, again["states"][tensor][key])
    for a, b in zip(step(_grads(9)), _stepper(restored)(_grads(9))):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_state_of_another_method_config_tensor_set_or_shape_is_refused():
    state = _engine("topk").state_dict()
    with pytest.raises(ValueError, match="from method TopK"):
        _engine("dgc").load_state_dict(state)
    other_config = _engine("topk")
    other_config.method = TopK(TopKConfig(density=0.02))
    with pytest.raises(ValueError, match="another config.*density"):
        other_config.load_state_dict(state)
    with pytest.raises(ValueError, match="another model"):
        _engine("topk", {"fc/kernel": (64, 100)}).load_state_dict(state)
    with pytest.raises(ValueError, match="6399 elements"):
        _engine("topk", {"fc/kernel": (64, 101), "fc/bias": (100,)}).load_state_dict(
            {**state, "states": {**state["states"], "fc/kernel": {"residual": np.zeros(64 * 100 - 1)}}})
    with pytest.raises(ValueError, match="not a horovod_dgc compressor state"):
        _engine("topk").load_state_dict({"states": {}})


@pytest.mark.parametrize("factory", [Compression.dgc, Compression.scalecom, Compression.blocksign])
def test_elastic_horovod_is_refused_at_construction(factory, monkeypatch):
    """Under elastic Horovod a reset changes the number of workers that a traced step's layout
    keeps, and Horovod's TensorFlow elastic.run swallowed the failure of our collectives (train()
    returned early, without an error): refused before training starts."""
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    with pytest.raises(ValueError, match="do not support elastic Horovod"):
        factory()
    monkeypatch.setenv("HOROVOD_ELASTIC", "0")
    factory()


def test_a_refused_keras_momentum_says_how_to_keep_its_value_and_nesterov_flag():
    """Keras' SGD takes nesterov=True without momentum: moving the momentum alone would
    silently turn Nesterov's into heavy-ball momentum at DGC's default value."""
    sgd = keras.optimizers.SGD(0.1, momentum=0.95, nesterov=True)
    with pytest.raises(ValueError, match="and the compressor momentum=0.95, nesterov=True to keep yours"):
        Compression.dgc().check_optimizer(sgd)


@pytest.mark.parametrize("clipping", [dict(clipnorm=1.0), dict(global_clipnorm=1.0), dict(clipvalue=0.5)])
def test_a_keras_optimizer_clipping_dgcs_momentum_is_warned_of(clipping):
    """The Keras optimizer clips the update it applies, which carries DGC's momentum: warned,
    pointing to DGC's own clip_norm; without clipping, no warning."""
    with pytest.warns(UserWarning, match="carry the compressor's momentum=0.9.*clip_norm="):
        Compression.dgc().check_optimizer(keras.optimizers.SGD(0.1, **clipping))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Compression.dgc().check_optimizer(keras.optimizers.SGD(0.1))
        Compression.topk().check_optimizer(keras.optimizers.SGD(0.1, **clipping))


def test_keras_gradient_accumulation_after_the_exchange_is_refused_or_warned_of():
    """gradient_accumulation_steps=4 sums four exchanged results: DGC's momentum would step
    per micro-batch (refused, with 0.9**4); a plain residual only pays 4x the traffic (warned)."""
    sgd = keras.optimizers.SGD(0.1, gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=4.*\(0.656 per optimizer step\)"):
        Compression.dgc().check_optimizer(sgd)
    with pytest.warns(UserWarning, match="4 times the traffic per step"):
        Compression.topk().check_optimizer(sgd)
