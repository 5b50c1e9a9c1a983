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

from ..core import DGC, DGCConfig, GaussianK, GaussianKConfig, TopK, TopKConfig
from ..core.blocksign import BlockSign, BlockSignConfig
from ..core.controls import CompressorControls
from ..core.exchange import ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST
from ..core.scalecom import ScaleCom, ScaleComConfig
from ..core.wire import tensor_id
from .engine import Engine
from .twostage import TwoStageEngine

ALLGATHER_PREFIX = "horovod_dgc."
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
    base = f"{ALLGATHER_PREFIX}{safe}.{tensor_id(name) & 0xFFFFFFFF:08x}"
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


class _Pending:
    """Context between compress and decompress: how to finish the exchange."""

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

    def __init__(self, method, variables: Optional[Iterable[Any]] = None):
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
                                 f"the variables: Compression.{type(self.method).__name__.lower()}"
                                 f"(variables=model.trainable_variables, ...)")
            specs = [tf.TensorSpec(v.shape, v.dtype, name) for name, v in self._variables]
            self._engine = self.engine_class(self.method, specs, world_size=hvd.size(),
                                             rank=hvd.rank())
        return self._engine

    def state_dict(self) -> dict:
        """This rank's memories, step counters and epoch, for checkpoints (call it eagerly)."""
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved on this rank (call it eagerly)."""
        self.engine.load_state_dict(state)

    def check_optimizer(self, optimizer: Any) -> None:
        """Raise ValueError if the Keras ``optimizer`` applying the result would apply the
        momentum or weight decay the compressor already applies (DGC's). The Keras callback
        :class:`~horovod_dgc.tensorflow.callbacks.CompressionWarmup` calls it at the start
        of ``fit``; call it yourself in a custom loop."""
        settings = optimizer.get_config()
        for key in ("momentum", "weight_decay"):
            mine, theirs = getattr(self.config, key, 0.0), settings.get(key) or 0.0
            if mine and theirs:
                raise ValueError(
                    f"the optimizer {settings.get('name', type(optimizer).__name__)!r} has "
                    f"{key}={theirs} but the compressor applies {key}={mine} itself: give the "
                    f"optimizer {key}=0 (plain SGD applies DGC's result)")

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
            return engine.dense(name, tensor, variable), None
        collective = collective_name(name, occurrence)
        step, finish = self.start_exchange(name, tensor, variable, collective)
        # Horovod's collectives are stateless ops to TensorFlow: Grappler would run the
        # all-reduce of a constant while optimizing the graph. The step counter is no constant.
        value = tf.where(step >= 0, _PLACEHOLDER_VALUE, 0.0)
        placeholder = tf.fill([1], value, name=f"{collective}.placeholder")
        engine.record_placeholder(placeholder.dtype.size)
        return placeholder, _Pending(finish)

    @tf.autograph.experimental.do_not_convert
    def decompress(self, tensor: tf.Tensor, ctx: Optional[_Pending]) -> tf.Tensor:
        if ctx is None:
            return tensor
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
        outcome = self.engine.compress(name, tensor, variable)
        gathered = hvd.allgather(outcome.message, name=collective, ignore_name_scope=True)
        return outcome.step, lambda: self.engine.decompress(gathered, outcome)


class TwoStageCompressor(MethodCompressor):
    """A two-stage method (ScaleCom, blocksign): the whole exchange runs in compress
    (Horovod's collectives are asynchronous ops, so tensors never wait on each other);
    built by ``Compression.scalecom()`` and ``Compression.blocksign()``."""

    engine_class = TwoStageEngine

    def start_exchange(self, name: str, tensor: tf.Tensor, variable: Any,
                       collective: str) -> Tuple[tf.Tensor, Callable[[], tf.Tensor]]:
        update, step = self.engine.exchange(name, tensor, variable, horovod_collective, collective)
        return step, lambda: update


def horovod_collective(kind: str, message: tf.Tensor, name: str, root: Any) -> tf.Tensor:
    """Horovod's collective ``kind`` on ``message``. A broadcast whose root is known only at
    run time (ScaleCom's leader) is an allgather to which only the root contributes."""
    if kind == BROADCAST:
        mine = tf.cond(tf.equal(tf.cast(root, tf.int64), hvd.rank()),
                       lambda: message, lambda: message[:0])
        return hvd.allgather(mine, name=name, ignore_name_scope=True)
    if kind == ALLREDUCE:
        return hvd.allreduce(message, op=hvd.Average, name=name, ignore_name_scope=True)
    if kind == ALLTOALL:
        return hvd.alltoall(message, name=name, ignore_name_scope=True)
    if kind == ALLGATHER:
        return hvd.allgather(message, name=name, ignore_name_scope=True)
    raise ValueError(f"unknown collective {kind!r}")


class Compression:
    """Horovod's ``Compression`` namespace plus the sparse methods.

    ``none`` and ``fp16`` are Horovod's own. The factories take ``variables=`` (the model's
    ``trainable_variables``, in the order given to ``tape.gradient``) and the method's options
    by name; every default lives in the method's config class
    (:class:`~horovod_dgc.core.DGCConfig` and friends). With DGC the momentum and weight decay
    live in the compressor: apply the result with plain SGD (no momentum, no weight decay).
    """

    none = HorovodCompression.none
    fp16 = HorovodCompression.fp16

    @staticmethod
    def dgc(variables: Optional[Iterable[Any]] = None, **options) -> SparseCompressor:
        """Deep Gradient Compression; options: :class:`~horovod_dgc.core.DGCConfig`."""
        return SparseCompressor(DGC(DGCConfig(**options)), variables)

    @staticmethod
    def topk(variables: Optional[Iterable[Any]] = None, **options) -> SparseCompressor:
        """Exact top-k with error feedback; options: :class:`~horovod_dgc.core.TopKConfig`."""
        return SparseCompressor(TopK(TopKConfig(**options)), variables)

    @staticmethod
    def gaussiank(variables: Optional[Iterable[Any]] = None, **options) -> SparseCompressor:
        """Gaussian-k with error feedback; options: :class:`~horovod_dgc.core.GaussianKConfig`."""
        return SparseCompressor(GaussianK(GaussianKConfig(**options)), variables)

    @staticmethod
    def scalecom(variables: Optional[Iterable[Any]] = None, **options) -> TwoStageCompressor:
        """ScaleCom's cyclic local top-k, values all-reduced; options:
        :class:`~horovod_dgc.core.scalecom.ScaleComConfig`."""
        return TwoStageCompressor(ScaleCom(ScaleComConfig(**options)), variables)

    @staticmethod
    def blocksign(variables: Optional[Iterable[Any]] = None, **options) -> TwoStageCompressor:
        """Blockwise scaled 1-bit sign with worker and server error feedback; options:
        :class:`~horovod_dgc.core.blocksign.BlockSignConfig`."""
        return TwoStageCompressor(BlockSign(BlockSignConfig(**options)), variables)
