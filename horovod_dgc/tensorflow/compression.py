"""``compression=`` for the stock ``hvd.DistributedGradientTape`` (unmodified Horovod).

Horovod's TensorFlow path (``_make_allreduce_grads_fn`` in ``horovod/tensorflow/__init__.py``)
calls ``compress(grad)``, all-reduces what it returns and calls ``decompress(result, ctx)``,
one gradient after another in the order of the tape's ``sources`` (``None`` gradients
skipped), always while tracing a ``tf.function``: an eagerly executed tape runs it through a
``tf.function`` of its own. A sparse compressor launches a named allgather of the message from
``compress`` and hands Horovod a one-element placeholder; ``decompress`` rebuilds the
averaged gradient from the gathered messages. A two-stage compressor (ScaleCom,
blocksign) runs its whole exchange in ``compress`` and hands the result to ``decompress``.

**Which variable a gradient belongs to.** ``compress`` gets only the gradient, and inside a
trace a gradient tensor carries nothing that names its variable (eagerly executed tapes hand
Horovod's function the gradients as anonymous arguments). What is reliable is the order:
within one trace, Horovod compresses the gradients in the order of ``sources``. So the
compressor keeps, per trace (the outermost ``tf.function`` graph being built), a cursor into
``variables`` and gives each gradient the next variable, at or after the cursor, of the same
shape and dtype. This is exact whatever the order when shapes are unique, and exact for
repeated shapes when ``variables`` lists the reduced variables in the order of ``sources``;
a variable whose gradient is ``None`` (or an ``IndexedSlices``, which Horovod gathers
itself) is skipped correctly unless the next gradient has its shape. A second pass over the
variables within one trace (a second ``tape.gradient``) starts again from the first one.
Horovod's ``groups=`` given as lists of variables reorders the gradients: not supported.
"""
from __future__ import annotations

import re
import weakref
from typing import Any, Callable, Iterable, List, Optional, Tuple

import horovod.tensorflow as hvd
import tensorflow as tf
from horovod.tensorflow.compression import Compression as HorovodCompression
from horovod.tensorflow.compression import Compressor

from ..core.collectives import ALLGATHER
from ..core.controls import CompressorControls
from ..core.method import Method
from ..core.methods import METHODS, MethodSpec, spec_of
from ..core.wire import tensor_id
from .collectives import PREFIX, run
from .engine import DenseUpdate, Engine
from .twostage import TwoStageEngine
# Each rank all-reduces 1.0: Horovod's average is 1.0 only with op=hvd.Average.
_PLACEHOLDER_VALUE = 1.0


def variable_name(variable: Any) -> str:
    """A variable's name, identical on every rank: a Keras 3 variable's path
    (``"sequential/dense/kernel"``), a ``tf.Variable``'s name without its ``":0"``."""
    return getattr(variable, "path", None) or variable.name.rsplit(":", 1)[0]


def collective_name(name: str, occurrence: int = 0) -> str:
    """The allgather's name for tensor ``name``: a valid op name, unique per tensor (the
    crc32 of the name tells apart names that differ only in replaced characters)."""
    safe = re.sub(r"[^A-Za-z0-9_.]", "_", name)
    base = f"{PREFIX}{safe}.{tensor_id(name) & 0xFFFFFFFF:08x}"
    return f"{base}.{occurrence}" if occurrence else base


class _Cursor:
    """Where one trace stands in the variables list, and how many passes it began."""

    __slots__ = ("position", "passes")

    def __init__(self) -> None:
        self.position, self.passes = 0, 0


def _outermost_graph(tensor: tf.Tensor) -> Optional[tf.Graph]:
    """The outermost ``tf.function`` graph ``tensor`` belongs to (None when eager)."""
    if tf.executing_eagerly():
        return None
    graph = tensor.graph
    while hasattr(getattr(graph, "outer_graph", None), "outer_graph"):
        graph = graph.outer_graph
    return graph


class DeferredUpdate:
    """Horovod's ``ctx`` between compress and decompress: how to finish the exchange."""

    __slots__ = ("finish",)

    def __init__(self, finish: Callable[[], tf.Tensor]):
        self.finish = finish


class MethodCompressor(CompressorControls, Compressor):
    """A core method as a Horovod compressor: what every horovod_dgc compressor shares.

    Args:
        method: the core method (config included).
        variables: the model's variables whose gradients Horovod reduces, in the order of the
            tape's ``sources`` (``model.trainable_variables``). They name each tensor's
            memory and collectives, and give DGC the parameters for weight decay.
    """

    engine_class = Engine

    def __init__(self, method: Method, variables: Optional[Iterable[Any]] = None):
        self.method = method
        self.config = method.config
        self._variables: List[Tuple[str, Any]] = []
        self._cursors: "weakref.WeakKeyDictionary[tf.Graph, _Cursor]" = weakref.WeakKeyDictionary()
        self._eager_cursor = _Cursor()
        self._engine: Optional[Engine] = None
        if variables is not None:
            self.bind(variables)

    # -- set-up ------------------------------------------------------------------------------
    def bind(self, variables: Iterable[Any]) -> None:
        """Key the per-tensor memories by these variables' names."""
        variables = list(variables)
        if not variables:
            raise ValueError("variables is empty (a Keras model not built yet?)")
        names = [variable_name(v) for v in variables]
        duplicates = sorted(n for n in set(names) if names.count(n) > 1)
        if duplicates:
            raise ValueError(f"variables holds duplicate names: {duplicates} (name your "
                             f"tf.Variables, or pass Keras variables)")
        self._variables = list(zip(names, variables))

    @property
    def bound(self) -> bool:
        """Whether the variables are known."""
        return bool(self._variables)

    @property
    def engine(self) -> Engine:
        """Built at first use (``hvd.init()`` must have run), variables included."""
        if self._engine is None:
            if not self._variables:
                raise ValueError(f"{type(self.method).__name__} keeps a memory per tensor and needs "
                                 f"the variables: Compression.{spec_of(self.method).name}"
                                 f"(variables=model.trainable_variables, ...)")
            specs = [tf.TensorSpec(v.shape, v.dtype, name) for name, v in self._variables]
            self._engine = self.engine_class(self.method, specs, world_size=hvd.size(),
                                             rank=hvd.rank())
        return self._engine

    def attach_loss_scale(self, scale: Any) -> None:
        """Mixed precision: gradients arrive multiplied by ``scale`` (a ``tf.Variable``, or a
        function returning the current scale: a Keras ``LossScaleOptimizer``'s
        ``dynamic_scale``); memories keep them unscaled and the averaged gradients go back
        scaled, as the loss scale optimizer expects."""
        self.engine.use_loss_scale(scale if callable(scale) else lambda: scale)

    def state_dict(self) -> dict:
        """This rank's memories, step counters and epoch, for checkpoints (call it eagerly)."""
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved on this rank (call it eagerly)."""
        self.engine.load_state_dict(state)

    def check_optimizer(self, optimizer: Any) -> None:
        """Raise ValueError if the Keras ``optimizer`` applying the result would apply the
        momentum the compressor already applies (with a config that
        :attr:`~horovod_dgc.core.CompressionConfig.needs_plain_optimizer`: DGC's, blocksign's
        with momentum): any optimizer but SGD (Adam, RMSprop, ... keep moments of their own),
        or SGD with momentum, or weight decay on both sides. The Keras callback
        :class:`~horovod_dgc.tensorflow.callbacks.CompressionWarmup` calls it at the start of
        ``fit``; call it yourself in a custom loop."""
        if not self.config.needs_plain_optimizer:
            return
        settings = optimizer.get_config()
        label = settings.get("name", type(optimizer).__name__)
        if not any(base.__name__ == "SGD" for base in type(optimizer).__mro__):
            raise ValueError(
                f"the compressor applies momentum itself ({type(self.config).__name__} momentum="
                f"{self.config.momentum}), but the optimizer {label!r} "
                f"({type(optimizer).__name__}) keeps state of its own and would apply it a "
                f"second time: use SGD without momentum, or a method that keeps a plain "
                f"residual (topk, gaussiank, scalecom), which works under any optimizer")
        for key in ("momentum", "weight_decay"):
            mine, theirs = getattr(self.config, key, 0.0), settings.get(key) or 0.0
            if mine and theirs:
                raise ValueError(
                    f"the optimizer {label!r} has {key}={theirs} but the compressor applies "
                    f"{key}={mine} itself: give the optimizer {key}=0 (plain SGD applies the "
                    f"compressor's result)")

    # -- Horovod's interface -----------------------------------------------------------------------
    def _lookup(self, tensor: tf.Tensor) -> Tuple[str, Any, int]:
        """(name, variable, pass within this trace) of the variable ``tensor`` is the gradient of."""
        graph = _outermost_graph(tensor)
        cursor = self._eager_cursor if graph is None else self._cursors.setdefault(graph, _Cursor())
        matches = [i for i, (_, v) in enumerate(self._variables)
                   if tuple(v.shape) == tuple(tensor.shape) and tf.as_dtype(v.dtype) == tensor.dtype]
        if not matches:
            raise ValueError(f"compress() got a {tensor.dtype.name} tensor of shape "
                             f"{tuple(tensor.shape)} that matches no variable in variables=")
        ahead = [i for i in matches if i >= cursor.position]
        if not ahead:
            cursor.passes += 1
        index = ahead[0] if ahead else matches[0]
        cursor.position = index + 1
        name, variable = self._variables[index]
        return name, variable, 0 if graph is None else cursor.passes

    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor: tf.Tensor):
        if Engine.passes_through(tensor):
            return tensor, None
        engine = self.engine
        name, variable, occurrence = self._lookup(tensor)
        if not engine.compresses(tensor):
            update = engine.dense(name, tensor, variable)
            return update.tensor, update
        collective = collective_name(name, occurrence)
        step, finish = self.start_exchange(name, tensor, variable, collective)
        # Horovod's collectives are stateless ops to TensorFlow: Grappler would run the
        # all-reduce of a constant while optimizing the graph. The step counter is no constant.
        value = tf.where(step >= 0, _PLACEHOLDER_VALUE, 0.0)
        placeholder = tf.fill([1], value, name=f"{collective}.placeholder")
        engine.record_placeholder(placeholder.dtype.size)
        return placeholder, DeferredUpdate(finish)

    @tf.autograph.experimental.do_not_convert
    def decompress(self, tensor: tf.Tensor, ctx: Optional[Any]) -> tf.Tensor:
        if ctx is None:
            return tensor
        if isinstance(ctx, DenseUpdate):
            return self.engine.dense_received(ctx, tensor)
        ops = self.engine.ops
        with ops.guards() as guards:
            ops.check(tf.abs(tensor[0] - _PLACEHOLDER_VALUE) < 1e-3, ValueError(
                "horovod_dgc compressors average the gradients: use op=hvd.Average"))
        with tf.control_dependencies(guards):
            return tf.identity(ctx.finish())

    def start_exchange(self, name: str, tensor: tf.Tensor, variable: Any,
                       collective: str) -> Tuple[tf.Tensor, Callable[[], tf.Tensor]]:
        """Launch the exchange of a compressed tensor under the collective name ``collective``:
        (its step counter, a function giving the averaged gradient)."""
        raise NotImplementedError


class SparseCompressor(MethodCompressor):
    """A sparse method (DGC, Top-k, Gaussian-k): one allgather of (index, value) messages
    per tensor; built by ``Compression.dgc()`` and friends."""

    def start_exchange(self, name: str, tensor: tf.Tensor, variable: Any,
                       collective: str) -> Tuple[tf.Tensor, Callable[[], tf.Tensor]]:
        message = self.engine.compress(name, tensor, variable)
        gathered = run(ALLGATHER, message.message, collective)
        return message.step, lambda: self.engine.decompress(gathered, message)


class TwoStageCompressor(MethodCompressor):
    """A two-stage method (ScaleCom, blocksign): the whole exchange runs in compress
    (Horovod's collectives are asynchronous ops, so tensors never wait on each other);
    built by ``Compression.scalecom()`` and ``Compression.blocksign()``."""

    engine_class = TwoStageEngine

    def start_exchange(self, name: str, tensor: tf.Tensor, variable: Any,
                       collective: str) -> Tuple[tf.Tensor, Callable[[], tf.Tensor]]:
        update, step = self.engine.exchange(name, tensor, variable, run, collective)
        return step, lambda: update


COMPRESSORS = {"sparse": SparseCompressor, "two-stage": TwoStageCompressor}


def _factory(spec: MethodSpec) -> Callable[..., MethodCompressor]:
    def factory(variables: Optional[Iterable[Any]] = None, **options) -> MethodCompressor:
        return COMPRESSORS[spec.family](spec.build(**options), variables)

    factory.__name__ = spec.name
    factory.__doc__ = (f"{spec.summary[0].upper()}{spec.summary[1:]}; options: "
                       f":class:`~{spec.config.__module__}.{spec.config.__name__}`.")
    return factory


class Compression:
    """Horovod's ``Compression`` namespace plus every method of the table
    (:mod:`horovod_dgc.core.methods`): ``Compression.dgc(...)``, ``Compression.topk(...)``, ...

    ``none`` and ``fp16`` are Horovod's own. The factories take ``variables=`` (the model's
    ``trainable_variables``, in the order given to ``tape.gradient``) and the method's options
    by name; every default lives in the method's config class
    (:class:`~horovod_dgc.core.DGCConfig` and friends). With DGC the momentum and weight decay
    live in the compressor: apply the result with plain SGD (no momentum, no weight decay).
    """

    none = HorovodCompression.none
    fp16 = HorovodCompression.fp16


for _spec in METHODS:
    setattr(Compression, _spec.name, staticmethod(_factory(_spec)))
