"""``compression=`` for the stock ``hvd.DistributedGradientTape`` (unmodified Horovod).

Horovod's TensorFlow path (``_make_allreduce_grads_fn`` in ``horovod/tensorflow/__init__.py``)
calls ``compress(grad)``, all-reduces what it returns and calls ``decompress(result, ctx)``,
one gradient after another in the order of the tape's ``sources`` (``None`` gradients
skipped), always while tracing a ``tf.function``: an eagerly executed tape runs it through a
``tf.function`` of its own. A sparse compressor launches a named allgather of the message from
``compress`` and hands Horovod a one-element placeholder; ``decompress`` rebuilds the
averaged gradient from the gathered messages. A two-stage compressor (ScaleCom,
blocksign) runs its whole exchange in ``compress`` and hands the result to ``decompress``.
Where the method allows, the tensors go in buckets, each exchanged as one tensor
(:class:`MethodCompressor`).

**Which variable a gradient belongs to.** ``compress`` gets only the gradient, and inside a
trace a gradient tensor carries nothing that names its variable (eagerly executed tapes hand
Horovod's function the gradients as anonymous arguments). Horovod's tape and its Keras
optimizers all hand the gradients to one function, ``allreduce_grads(grads, vars)`` (made by
``_make_allreduce_grads_fn``), with the variables they belong to; ``compress`` is called
beneath it with an element of ``grads`` itself. The compressor reads both lists from that
call's frame and pairs the tensor with its variable by identity: exact whatever the order,
the repeated shapes or the ``None`` gradients, on every rank alike. Without ``variables=``
it binds itself to the ``vars`` of its first call, named as they are (Keras 3's inner
``tf.Variable``s carry their Keras paths); a name that repeats (unnamed ``tf.Variable``s)
gets ``.1``, ``.2``, ... in the order of ``vars``, the same on every rank.

Called some other way (``hvd.allreduce(grad, compression=...)`` directly, no such frame),
it needs ``variables=`` and falls back on the order: within one trace the gradients come in
the order of ``variables``, so it gives each the next variable, at or after a cursor, of the
same shape and dtype (exact when shapes are unique or the order is kept).

Within one trace, the ``k``-th compression of a variable name by any compressor (a second
``tape.gradient``, or a second model whose variables have the same paths) gets its own
collective names (``occurrence`` ``k``), as TensorFlow gives Horovod's stock ops names of
their own.
"""
from __future__ import annotations

import os
import re
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import horovod.tensorflow as hvd
import tensorflow as tf
from horovod.tensorflow.compression import Compression as HorovodCompression
from horovod.tensorflow.compression import Compressor
# No public API says whether a trace is XLA-compiled; tf.function itself asks this module.
from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext

from ..core.adaptive import STATE_KEY, Adaptive
from ..core.callers import caller_frames, calling_object, values_among_callers
from ..core.bucket import Bucket
from ..core.collectives import ALLGATHER, backward_buckets
from ..core.config import keeping_yours
from ..core.controls import CompressorControls
from ..core.hosts import Hosts
from ..core.method import Method
from ..core.methods import METHODS, MethodSpec, spec_of
from ..core.one_worker import refuse_or_warn
from ..core.stats import CompressionStats
from ..core.wire import tensor_id
from .adaptive import AdaptiveBuckets
from .collectives import PREFIX, run
from .engine import DenseUpdate, Engine
from .hierarchy import BetweenHosts, find_hosts, host_average
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


def as_tf_variable(source: Any) -> Any:
    """The ``tf.Variable`` behind a Keras 3 variable; anything else as it is."""
    if isinstance(source, (tf.Variable, tf.Tensor)) or not hasattr(source, "value"):
        return source
    value = source.value
    return value if isinstance(value, tf.Variable) else source


def _identity(variable: Any) -> Any:
    """A hashable identity shared by a Keras 3 variable and the ``tf.Variable`` inside it."""
    return as_tf_variable(variable).ref()


def _unique_names(variables: Sequence[Any]) -> List[str]:
    """Each variable's name, with ``.1``, ``.2``, ... added to the later ones of a repeated name."""
    names, seen = [], {}
    for variable in variables:
        name = variable_name(variable)
        count = seen.get(name, 0)
        seen[name] = count + 1
        names.append(f"{name}.{count}" if count else name)
    return names


# Horovod's ``_make_allreduce_grads_fn`` returns ``allreduce_grads(grads, vars, ...)``; AutoGraph
# converts it into ``tf__allreduce_grads`` when a ``tf.function`` traces it.
_REDUCER = "allreduce_grads"


def _horovod_reduction(tensor: tf.Tensor) -> Optional[Tuple[Any, Sequence[Any], Sequence[Any]]]:
    """(the variable paired with ``tensor``, all the variables, all their gradients) in the
    Horovod ``allreduce_grads`` call that is compressing ``tensor`` (found among the callers'
    frames), or None when ``compress`` was called some other way."""
    for frame in caller_frames():
        if frame.f_code.co_name.endswith(_REDUCER):
            grads, variables = frame.f_locals.get("grads"), frame.f_locals.get("vars")
            index = next((i for i, g in enumerate(grads or ()) if g is tensor), None)
            if variables is not None and index is not None:
                return variables[index], variables, grads
    return None


_OP_NAMES = {getattr(hvd, name): f"hvd.{name}" for name in ("Sum", "Adasum", "Min", "Max", "Product")
             if hasattr(hvd, name)}


def _refuse_other_reductions() -> None:
    """Our collectives average over all workers, whatever process set or op the tape or
    optimizer was given: the Horovod ``allreduce`` calling ``compress`` holds both (the
    nearest caller's frame with a ``process_set``: autograph runs a converted copy of that
    function, so no code object or name identifies it; its ``op`` is resolved by then). A
    subset of the workers, or another op, is refused rather than averaged over all: the
    placeholder check in ``decompress`` cannot see an Adasum of equal placeholders."""
    for frame in caller_frames():
        process_set = frame.f_locals.get("process_set")
        if isinstance(process_set, hvd.ProcessSet):
            if process_set is not hvd.global_process_set and process_set.size() != hvd.size():
                raise ValueError(
                    f"horovod_dgc compressors exchange among all {hvd.size()} workers; the tape "
                    f"or optimizer was given a process set of {process_set.size()}: use the "
                    f"global process set (process sets are not supported)")
            op = frame.f_locals.get("op")
            if op is not None and op != hvd.Average:
                raise ValueError(f"horovod_dgc compressors average the gradients; the tape or "
                                 f"optimizer was given op={_OP_NAMES.get(op, op)}: use op=hvd.Average")
            return


def _skipped_by_horovod() -> bool:
    """Whether ``compress`` is being traced into the branch of Horovod's all-reduce condition
    (``_allreduce_cond``, ``_grouped_allreduce_cond``; autograph's converted copies end the
    same) that never runs: Horovod takes the other one on one worker."""
    return hvd.size() == 1 and any(frame.f_code.co_name.endswith("_allreduce_cond")
                                   for frame in caller_frames())


def _refuse_accumulation_after_the_exchange(config, label: str, settings: dict) -> None:
    """A Keras 3 optimizer's ``gradient_accumulation_steps=N`` sums N exchanged results: the
    exchange runs on every micro-batch (N times the traffic per step: warned of), and a
    compressor's momentum steps N times per optimizer step (refused: momentum m per
    micro-batch is m**N per step)."""
    steps = settings.get("gradient_accumulation_steps") or 1
    if steps <= 1:
        return
    what = (f"the optimizer {label!r} accumulates gradient_accumulation_steps={steps} "
            f"micro-batches after the exchange, which then runs on every micro-batch: {steps} "
            f"times the traffic per step")
    instead = ("accumulate before the exchange (Horovod's Keras DistributedOptimizer takes "
               "backward_passes_per_step), or drop gradient_accumulation_steps")
    if config.needs_plain_optimizer:
        raise ValueError(f"{what}, and the compressor's momentum={config.momentum} would step per "
                         f"micro-batch ({config.momentum ** steps:.3g} per optimizer step); "
                         f"{instead}")
    warnings.warn(f"{what}; {instead}", stacklevel=3)


def _warn_of_clipping_a_momentum(config, label: str, settings: dict) -> None:
    """A Keras optimizer's ``clipnorm``, ``global_clipnorm`` or ``clipvalue`` clips what it
    applies: with a compressor that keeps momentum, an update carrying that momentum (7.2x the
    averaged gradient's norm for DGC at momentum 0.9: ``benchmarks/update_norms.py``), not the
    gradient it clipped without compression. Warned of, not refused (it may be meant)."""
    clipping = {key: settings[key] for key in ("clipnorm", "global_clipnorm", "clipvalue")
                if settings.get(key)}
    if clipping:
        instead = (" clip each worker's gradient before it enters the memory with clip_norm= "
                   "(DGC's local clipping)" if hasattr(config, "clip_norm") else "")
        warnings.warn(f"the optimizer {label!r} clips ({clipping}) the updates it applies, "
                      f"which carry the compressor's momentum={config.momentum} (about "
                      f"1/(1 - momentum) times a gradient's norm), so it clips far more than "
                      f"without compression;{instead or ' leave it out or set it higher'}",
                      stacklevel=3)


def _horovod_optimizer() -> Optional[Any]:
    """The Horovod ``DistributedOptimizer`` whose gradients are being compressed (the ``self``
    of a caller holding Horovod's ``_allreduce_grads``, as its tape does too: Keras', or the
    wrapper of a ``tf.compat.v1.train`` optimizer), or None (a tape)."""
    return calling_object(lambda owner: hasattr(owner, "_allreduce_grads")
                          and (hasattr(owner, "get_config") or _is_legacy(owner)))


def _is_legacy(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a ``tf.compat.v1.train`` optimizer (or Horovod's wrapper of one)."""
    return isinstance(optimizer, tf.compat.v1.train.Optimizer)


def _keras_loss_scale_optimizer() -> Optional[Any]:
    """The tf_keras ``LossScaleOptimizer`` whose scaled gradients are being compressed (the
    ``self`` of a caller that unscales them after Horovod's optimizer has reduced them), or
    None."""
    return calling_object(lambda owner: hasattr(owner, "get_unscaled_gradients") and hasattr(owner, "loss_scale"))


def _loss_scale_optimizer_among_callers() -> Optional[Any]:
    """A Keras ``LossScaleOptimizer`` (Keras 3's or tf_keras') among the callers' variables
    (:func:`values_among_callers`), or None."""
    return next((value for value in values_among_callers()
                 if any(cls.__name__.startswith("LossScaleOptimizer") for cls in type(value).__mro__)),
                None)


_KERAS_OPTIMIZER_BASES = {"BaseOptimizer", "_BaseOptimizer", "OptimizerV2"}  # Keras 3, tf_keras


def _unwrapped(optimizer: Any) -> Any:
    """The optimizer that applies the updates: the one inside a ``LossScaleOptimizer`` or
    inside Horovod's wrapper of a ``tf.compat.v1.train`` optimizer (itself otherwise)."""
    while True:
        inner = getattr(optimizer, "inner_optimizer", None)
        if inner is None and _is_legacy(optimizer):
            inner = getattr(optimizer, "_optimizer", None)
        if inner is None:
            return optimizer
        optimizer = inner


def _optimizers_among_callers() -> List[Any]:
    """The distinct Keras and ``tf.compat.v1.train`` optimizers (a wrapper counted as the one
    it wraps) among the callers' variables (:func:`values_among_callers`)."""
    found = {id(optimizer): optimizer for optimizer in
             (_unwrapped(value) for value in values_among_callers()
              if _is_legacy(value)
              or any(cls.__name__ in _KERAS_OPTIMIZER_BASES for cls in type(value).__mro__))}
    return list(found.values())


def _optimizer_settings(optimizer: Any) -> Tuple[str, dict, bool]:
    """(a label, the settings as Keras names them, whether it is SGD) of a Keras or a
    ``tf.compat.v1.train`` optimizer (``GradientDescentOptimizer`` or ``MomentumOptimizer`` is
    SGD; the others keep moments of their own)."""
    if _is_legacy(optimizer):
        settings = {"name": optimizer.get_name()}
        if isinstance(optimizer, tf.compat.v1.train.MomentumOptimizer):
            momentum = getattr(optimizer, "_momentum", None)
            momentum = momentum() if callable(momentum) else momentum
            # Unreadable (another TensorFlow's attributes): judged as momentum kept.
            settings.update(momentum=1.0 if momentum is None else float(momentum),
                            nesterov=bool(getattr(optimizer, "_use_nesterov", False)))
        sgd = isinstance(optimizer, (tf.compat.v1.train.GradientDescentOptimizer,
                                     tf.compat.v1.train.MomentumOptimizer))
        return settings["name"], settings, sgd
    with tf.init_scope():  # get_config reads variables: eagerly, also while tracing
        settings = optimizer.get_config()
    sgd = any(base.__name__ == "SGD" for base in type(optimizer).__mro__)
    return settings.get("name", type(optimizer).__name__), settings, sgd


class _Trace:
    """One trace's walk over the variables: the cursor of the order fallback."""

    __slots__ = ("position",)

    def __init__(self) -> None:
        self.position = 0


# How often each variable name was compressed so far in a traced graph, by every compressor:
# shared, because two compressors' variables can share names (two copies of one model), and
# their collectives in flight at once need names of their own.
_NAMES_TAKEN: "weakref.WeakKeyDictionary[tf.Graph, Dict[str, int]]" = weakref.WeakKeyDictionary()


def _outermost_graph(tensor: tf.Tensor) -> Optional[tf.Graph]:
    """The outermost ``tf.function`` graph ``tensor`` belongs to (None when eager)."""
    if tf.executing_eagerly():
        return None
    graph = tensor.graph
    while hasattr(getattr(graph, "outer_graph", None), "outer_graph"):
        graph = graph.outer_graph
    return graph


def _refuse_graph_execution(graph: Optional[tf.Graph]) -> None:
    """Refuse a TensorFlow 1 graph (``tf.compat.v1.disable_eager_execution()``, or a
    ``tf.Graph`` run by a ``Session``): its stateful ops run in no guaranteed order, while
    the memories are read, updated and exchanged in program order, as eager execution and
    ``tf.function`` run them. ``graph``: the graph being built (None when eager)."""
    if graph is not None and not hasattr(graph, "outer_graph"):  # a tf.function's has one
        raise ValueError(
            "horovod_dgc's TensorFlow compressors run eagerly or inside tf.function (TensorFlow "
            "2), where stateful ops run in program order; this is a TensorFlow 1 graph "
            "(tf.compat.v1.disable_eager_execution(), or a tf.Graph run by a Session), whose "
            "ops run in no guaranteed order: train with a DistributedGradientTape or a Keras "
            "DistributedOptimizer in TensorFlow 2 (Horovod's tensorflow2 examples)")


def _refuse_xla_compilation() -> None:
    """Refuse a step compiled by XLA (``jit_compile=True`` of ``tf.function`` or Keras's
    ``compile``): the compressors' ops (the timestamps of their statistics, Horovod's
    allgather of messages) have no XLA kernels, and neither has Horovod's own all-reduce on
    CPU. Without this, XLA named an op of ours ("Timestamp") as unsupported."""
    if GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError(
            "horovod_dgc's compressors cannot run in an XLA-compiled step (jit_compile=True): "
            "their ops and Horovod's collectives have no XLA kernels; compile the training "
            "step with jit_compile=False (tf.function(..., jit_compile=False), Keras: "
            "model.compile(..., jit_compile=False))")


class DeferredUpdate:
    """Horovod's ``ctx`` between compress and decompress: how to finish the exchange."""

    __slots__ = ("finish",)

    def __init__(self, finish: Callable[[], tf.Tensor]):
        self.finish = finish


class MethodCompressor(CompressorControls, Compressor):
    """A core method as a Horovod compressor: what every horovod_dgc compressor shares.

    Args:
        method: the core method (config included).
        variables: optional: the model's variables whose gradients Horovod reduces
            (``model.trainable_variables``). They name each tensor's memory and collectives,
            and give DGC the parameters for weight decay. Without them the compressor takes
            the variables Horovod's tape or Keras optimizer reduces on its first step; give
            them to restore a checkpoint before that step, or to call ``hvd.allreduce(...,
            compression=)`` directly (then in the order the gradients are compressed).

    **Buckets.** Where the method compresses a bucket as one (``bucketed``) and Horovod's
    ``allreduce_grads`` hands the gradients over (its tape, its Keras and TensorFlow 1
    optimizers), the compressed variables are cut into buckets once, identical on every rank
    (:func:`~horovod_dgc.core.collectives.backward_buckets`), split by dtype. The first
    ``compress`` of a bucket's tensor exchanges the whole bucket, from the gradients of that
    call (every member's is known there); each member hands Horovod a placeholder, and its
    ``decompress`` takes its part of the bucket's average. Horovod traces each tensor's
    exchange in a branch of its own (``tf.cond``), and a tensor made in one branch cannot be
    used in another: the bucket's ops are built in the graph of the gradients instead, where
    every branch can read them. Memories stay per tensor (the checkpoints' layout), and a
    bucket's tensors keep or drop a step's memories together (a non-finite gradient in one
    drops the bucket's step on every rank). Outside such a call (``hvd.allreduce`` called
    directly), on one worker, and between hosts, tensors are exchanged alone.
    """

    engine_class = Engine

    def __init__(self, method: Method, variables: Optional[Iterable[Any]] = None,
                 adaptive: "bool | Adaptive" = False):
        self.method = method
        self._adaptive = AdaptiveBuckets(self, Adaptive.of(adaptive))
        if adaptive:
            method.require_bucketed()
        self.config = method.config
        self._variables: List[Tuple[str, Any]] = []
        self._names: Dict[Any, str] = {}
        self._traces: "weakref.WeakKeyDictionary[tf.Graph, _Trace]" = weakref.WeakKeyDictionary()
        self._eager_trace = _Trace()
        self._engine: Optional[Engine] = None
        self._loss_scale: Optional[Callable[[], Any]] = None
        self._first_step_seen = False
        self._optimizer_checked = False
        self._loss_scale_told = False
        self._pending_epoch: Optional[float] = None
        self._loss_scale_checked = False
        self._one_worker_told = False
        self.hosts: Optional[Hosts] = None
        self.collective: Callable[..., tf.Tensor] = run
        self._bucket_members: Optional[Dict[str, Tuple[str, ...]]] = None
        # Per graph of gradients: the exchange of each gradient whose bucket was launched, by its ref.
        self._bucketed: "weakref.WeakKeyDictionary[tf.Graph, Dict[Any, Tuple[tf.Tensor, Callable[[], tf.Tensor]]]]" = \
            weakref.WeakKeyDictionary()
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
        self._adopt(variables, names)

    def _adopt(self, variables: List[Any], names: List[str]) -> None:
        self._variables = list(zip(names, variables))
        self._names = {_identity(v): name for name, v in self._variables}

    def exchange_between_hosts(self, hosts: Hosts) -> None:
        """Average each compressed gradient densely inside the host first and run the method
        between hosts only (see :mod:`horovod_dgc.core.hosts`); only before training."""
        if self._engine is not None:
            raise ValueError("exchange_between_hosts() must come before the first step")
        self.hosts = hosts
        self.collective = BetweenHosts(hosts)

    @property
    def hierarchical(self) -> bool:
        """Whether the method runs between hosts only (:meth:`exchange_between_hosts`)."""
        return self.hosts is not None

    @property
    def bound(self) -> bool:
        """Whether the variables are known."""
        return bool(self._variables)

    @property
    def started(self) -> bool:
        """Whether the memories exist (a first step, or a checkpoint loaded, made them)."""
        return self._engine is not None

    @property
    def engine(self) -> Engine:
        """Built at first use (``hvd.init()`` must have run), variables included."""
        if self._engine is None:
            if not self._variables:
                raise self._variables_needed()
            specs = [tf.TensorSpec(v.shape, v.dtype, name) for name, v in self._variables]
            world_size, rank = ((hvd.size(), hvd.rank()) if self.hosts is None
                                else (self.hosts.count, self.hosts.index))
            self._engine = self.engine_class(self.method, specs, world_size=world_size, rank=rank)
            if self._loss_scale is not None:
                self._engine.use_loss_scale(self._loss_scale)
            if self._pending_epoch is not None:
                with tf.init_scope():  # perhaps built while the first step is traced
                    self._engine.set_epoch(self._pending_epoch)
        return self._engine

    def set_epoch(self, epoch: float) -> None:
        """Drive the warm-up schedule (see :class:`CompressorControls`). Before the compressor
        knows its variables (a Keras callback's first epoch begins before the first step
        binds them) the epoch is kept and set when the memories are built."""
        if self._engine is None and not self._variables:
            self._pending_epoch = float(epoch)
            return
        super().set_epoch(epoch)

    def _variables_needed(self) -> ValueError:
        return ValueError(f"{type(self.method).__name__} keeps a memory per variable and learns "
                          f"the variables on its first step through hvd.DistributedGradientTape "
                          f"or a Horovod Keras optimizer; before that (restoring a checkpoint), "
                          f"or with hvd.allreduce called directly, give them: Compression."
                          f"{spec_of(self.method).name}(variables=model.trainable_variables, ...)")

    def attach_loss_scale(self, scale: Any) -> None:
        """Mixed precision: gradients arrive multiplied by ``scale`` (a ``tf.Variable``, or a
        function returning the current scale: a Keras ``LossScaleOptimizer``'s
        ``dynamic_scale``); memories keep them unscaled and the averaged gradients go back
        scaled, as the loss scale optimizer expects. Through a Horovod Keras
        ``DistributedOptimizer`` inside a tf_keras ``LossScaleOptimizer`` (``model.compile``
        adds one under ``mixed_float16``) the compressor attaches that optimizer's scale
        itself on its first step. Otherwise a ``LossScaleOptimizer`` found among the first
        step's callers' variables (or the attributes of their ``self``) and not attached is
        refused; ``None`` says that no scale multiplies these gradients (that optimizer scales
        another loss)."""
        self._loss_scale_told = True
        if scale is None:
            return
        self._loss_scale = scale if callable(scale) else lambda: scale
        if self._engine is not None:
            self._engine.use_loss_scale(self._loss_scale)

    def _refuse_an_untold_loss_scale(self) -> None:
        """Raise ValueError, once, if a ``LossScaleOptimizer`` nobody attached is among the
        callers' variables: the memories would keep its scaled gradients, and every change of
        its scale would multiply what they owe, silently."""
        self._loss_scale_checked = True
        if self._loss_scale_told:
            return
        optimizer = _loss_scale_optimizer_among_callers()
        if optimizer is not None:
            raise ValueError(
                f"a {type(optimizer).__name__} scales the loss, but this compressor was not told: "
                f"its memories would keep scaled gradients and every change of scale would "
                f"multiply what they owe; call compression.attach_loss_scale(lambda: "
                f"optimizer.dynamic_scale) (Keras 3; tf_keras: optimizer.loss_scale) before the "
                f"first step, or attach_loss_scale(None) if that optimizer scales another loss")

    def state_dict(self) -> dict:
        """This rank's memories, step counters and epoch, for checkpoints (call it eagerly).
        With ``adaptive``, each bucket's mode too (under ``"adaptive"``)."""
        state = self.engine.state_dict()
        if self.adaptive is not None:
            state[STATE_KEY] = self._adaptive.switch.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved on this rank (call it eagerly). A state
        without modes (saved without ``adaptive``) starts every bucket compressed."""
        state = dict(state)
        modes = state.pop(STATE_KEY, None)
        self.engine.load_state_dict(state)
        self._adaptive.restore(modes, max(state["steps"].values(), default=0))

    # -- the adaptive switch (horovod_dgc.core.adaptive) -------------------------------------------
    def force_mode(self, mode: Optional[str], labels: Optional[Sequence[str]] = None) -> None:
        """Hold buckets in ``mode`` (``"compressed"`` or ``"dense"``; None: back to the
        adaptive decisions), from the next step; ``labels``: the buckets' collective labels
        (None: every bucket traced so far). Call it eagerly with the same arguments on every
        rank, between steps. Needs ``adaptive=`` (the traced step reads the modes only then)."""
        if self.adaptive is None:
            raise ValueError("force_mode() needs a compressor built with adaptive=True (or an "
                             "Adaptive(...)): without it the traced step has no dense branch")
        self._adaptive.switch.force(mode, list(self._adaptive.labels if labels is None else labels))
        self._adaptive.assign_modes()

    def stats(self) -> CompressionStats:
        """See :class:`~horovod_dgc.core.controls.CompressorControls`; warns once where no
        step was ended past the adaptive switch's first decision."""
        self._adaptive.warn_if_never_ended()
        return super().stats()

    def check_optimizer(self, optimizer: Any) -> None:
        """Raise ValueError if the Keras or ``tf.compat.v1.train`` ``optimizer`` applying the
        result would apply the momentum the compressor already applies (with a config that
        :attr:`~horovod_dgc.core.CompressionConfig.needs_plain_optimizer`: DGC's, blocksign's
        with momentum): any optimizer but SGD (Adam, RMSprop, ... keep moments of their own),
        or SGD with momentum, or weight decay on both sides. Called on the first step through
        a Horovod ``DistributedOptimizer`` (Keras' or TensorFlow 1's; and by the callback
        :class:`~horovod_dgc.tensorflow.callbacks.CompressionWarmup`); with a tape, on the first
        step if the callers' variables hold one optimizer (call it yourself where they hold
        several). A ``LossScaleOptimizer`` is judged by the optimizer it wraps."""
        self._optimizer_checked = True
        optimizer = _unwrapped(optimizer)
        label, settings, sgd = _optimizer_settings(optimizer)
        _refuse_accumulation_after_the_exchange(self.config, label, settings)
        if not self.config.needs_plain_optimizer:
            return
        if not sgd:
            raise ValueError(
                f"the compressor applies momentum itself ({type(self.config).__name__} momentum="
                f"{self.config.momentum}), but the optimizer {label!r} "
                f"({type(optimizer).__name__}) keeps state of its own and would apply it a "
                f"second time: use SGD without momentum, or a method that keeps a plain "
                f"residual (topk, gaussiank, scalecom), which works under any optimizer")
        _warn_of_clipping_a_momentum(self.config, label, settings)
        for key in ("momentum", "weight_decay"):
            mine, theirs = getattr(self.config, key, 0.0), settings.get(key) or 0.0
            if mine and theirs:
                keep = keeping_yours(self.config, key, {theirs}, bool(settings.get("nesterov")))
                raise ValueError(
                    f"the optimizer {label!r} has {key}={theirs} but the compressor applies "
                    f"{key}={mine} itself: give the optimizer {key}=0 (plain SGD applies the "
                    f"compressor's result){keep}")

    # -- Horovod's interface -----------------------------------------------------------------------
    def _lookup(self, tensor: tf.Tensor, graph: Optional[tf.Graph]) -> Tuple[str, Any, int]:
        """(name, variable, earlier compressions of it in this trace) of the variable whose
        gradient ``tensor`` is; ``graph``: the outermost graph it belongs to (None when eager)."""
        trace = self._eager_trace if graph is None else self._traces.setdefault(graph, _Trace())
        reduction = _horovod_reduction(tensor)
        if reduction is None:
            name, variable = self._next_by_shape(tensor, trace)
        else:
            name, variable = self._paired(*reduction)
        if graph is None:
            return name, variable, 0
        taken = _NAMES_TAKEN.setdefault(graph, {})
        occurrence = taken.get(name, 0)
        taken[name] = occurrence + 1
        return name, variable, occurrence

    def _paired(self, variable: Any, variables: Sequence[Any], grads: Sequence[Any]) -> Tuple[str, Any]:
        """(name, variable) of the variable Horovod's ``allreduce_grads`` paired with the
        tensor; binds the compressor to that call's ``variables`` if it has none yet."""
        if not self._variables:
            self._adopt(list(variables), _unique_names(variables))
        if not self._first_step_seen:
            self._first_step_seen = True
            optimizer = _horovod_optimizer()
            if optimizer is None:
                # A tape: the optimizer that applies the result, if the callers hold just one.
                found = _optimizers_among_callers()
                optimizer = found[0] if len(found) == 1 else None
            if optimizer is not None and not self._optimizer_checked:
                self.check_optimizer(optimizer)
            scaler = _keras_loss_scale_optimizer()
            if scaler is not None and not self._loss_scale_told:
                # model.compile wraps the optimizer in one under mixed_float16, unasked: its
                # gradients reach Horovod's optimizer still scaled.
                self.attach_loss_scale(lambda: scaler.loss_scale)
            self._warn_of_sparse_gradients(variables, grads)
        name = self._names.get(_identity(variable))
        if name is None:
            known = ", ".join(n for n, _ in self._variables[:3])
            raise ValueError(
                f"compress() got the gradient of {variable_name(variable)!r}, which is not among "
                f"this compressor's {len(self._variables)} variables ({known}, ...): a compressor "
                f"keeps memories for one model's variables; give each tape or optimizer its own")
        return name, variable

    def _warn_of_sparse_gradients(self, variables: Sequence[Any], grads: Sequence[Any]) -> None:
        """Horovod sends a ``tf.IndexedSlices`` gradient (an embedding's) by allgathers of its
        own, never through compress(): say which variables travel so, uncompressed."""
        sparse = [self._names.get(_identity(v), variable_name(v))
                  for v, g in zip(variables, grads) if isinstance(g, tf.IndexedSlices)]
        if sparse:
            warnings.warn(f"the sparse gradients (tf.IndexedSlices) of {sparse} bypass the "
                          f"compressor: Horovod sends them uncompressed by allgathers of its own; "
                          f"pass sparse_as_dense=True to the tape or optimizer to compress them",
                          stacklevel=2)

    def _next_by_shape(self, tensor: tf.Tensor, trace: _Trace) -> Tuple[str, Any]:
        """Without Horovod's pairing: the next variable of ``tensor``'s shape and dtype at or
        after the trace's cursor (wrapping around to the first for a second pass)."""
        if not self._variables:
            raise self._variables_needed()
        matches = [i for i, (_, v) in enumerate(self._variables)
                   if tuple(v.shape) == tuple(tensor.shape) and tf.as_dtype(v.dtype) == tensor.dtype]
        if not matches:
            raise ValueError(f"compress() got a {tensor.dtype.name} tensor of shape "
                             f"{tuple(tensor.shape)} that matches no variable in variables=")
        index = next((i for i in matches if i >= trace.position), matches[0])
        trace.position = index + 1
        return self._variables[index]

    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor: tf.Tensor):
        if Engine.passes_through(tensor):
            return tensor, None
        graph = _outermost_graph(tensor)
        _refuse_graph_execution(graph)
        _refuse_xla_compilation()
        _refuse_other_reductions()
        if not self._one_worker_told and _skipped_by_horovod():
            optimizer = _horovod_optimizer()
            path = ("DistributedGradientTape" if optimizer is None else "DistributedOptimizer"
                    if _is_legacy(optimizer) else "Keras DistributedOptimizer")
            refuse_or_warn(self.config, path, "train on two or more workers, or train a one-worker "
                                              "run without the compressor")
            self._one_worker_told = True
        name, variable, occurrence = self._lookup(tensor, graph)
        handed = tensor
        if not self._loss_scale_checked:
            self._refuse_an_untold_loss_scale()
        if not tensor.shape.is_fully_defined():
            # sparse_as_dense: Horovod makes a tf.IndexedSlices dense with rows unknown
            # until run time; the engine sizes its messages from the static shape.
            tensor = tf.ensure_shape(tensor, variable.shape)
        engine = self.engine
        if not engine.compresses(tensor):
            update = engine.dense(name, tensor, variable)
            return update.tensor, update
        collective = collective_name(name, occurrence)
        exchange = self.start_bucket(handed, name, occurrence)
        if exchange is None:
            if self.hosts is not None:
                tensor = host_average(self.hosts, tensor, collective)
            exchange = self.start_exchange(name, tensor, variable, collective)
        step, finish = exchange
        # Horovod's collectives are stateless ops to TensorFlow: Grappler would run the
        # all-reduce of a constant while optimizing the graph. The step counter is no constant.
        value = tf.where(step >= 0, _PLACEHOLDER_VALUE, 0.0)
        placeholder = tf.fill([1], value, name=f"{collective}.placeholder")
        engine.record_allreduce(placeholder.dtype.size)
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

    def _buckets_by_member(self) -> Dict[str, Tuple[str, ...]]:
        """Per compressed variable, the names of its bucket's variables (in bucket order)."""
        if self._bucket_members is None:
            engine = self.engine
            specs = [(name, tf.TensorSpec(v.shape, v.dtype)) for name, v in self._variables]
            compressed = [(name, spec) for name, spec in specs
                          if not engine.passes_through(spec) and engine.compresses(spec)]
            buckets = backward_buckets([name for name, _ in compressed],
                                    [spec.shape.num_elements() * spec.dtype.size for _, spec in compressed])
            self._bucket_members = {name: bucket for bucket in buckets for name in bucket}
        return self._bucket_members

    def start_bucket(self, tensor: tf.Tensor, name: str,
                     occurrence: int) -> Optional[Tuple[tf.Tensor, Callable[[], tf.Tensor]]]:
        """:meth:`start_exchange`'s result for a tensor exchanged in its bucket (see
        :class:`MethodCompressor`), or None where it is exchanged alone."""
        if (not self.method.bucketed or self.hierarchical or tf.executing_eagerly()
                or _skipped_by_horovod()):
            return None
        ready = self._bucketed.setdefault(tensor.graph, {})
        if tensor.ref() in ready:
            return ready.pop(tensor.ref())
        reduction = _horovod_reduction(tensor)
        members = self._buckets_by_member().get(name)
        if reduction is None or members is None:
            return None
        _, variables, grads = reduction
        present = {self._names.get(_identity(v)): (g, v) for v, g in zip(variables, grads)
                   if isinstance(g, tf.Tensor)}
        entries = [(n, *present[n]) for n in members if n in present]
        by_dtype: Dict[tf.DType, List[Tuple[str, tf.Tensor, Any]]] = {}
        for entry in entries:
            by_dtype.setdefault(entry[1].dtype, []).append(entry)
        with tensor.graph.as_default():
            for dtype, group in by_dtype.items():
                label = f"bucket.{members[0]}" + (f".{dtype.name}" if len(by_dtype) > 1 else "")
                grads = [g if g.shape.is_fully_defined() else tf.ensure_shape(g, v.shape) for _, g, v in group]
                bucket = self.engine.bucket(label, [(n, g) for (n, _, _), g in zip(group, grads)])
                launch = self.launch_bucket if self.adaptive is None else self._adaptive.launch
                step, finishes = launch(bucket, grads, [v for _, _, v in group], collective_name(bucket.key, occurrence))
                ready.update({g.ref(): (step, finish) for (_, g, _), finish in zip(group, finishes)})
        return ready.pop(tensor.ref())

    def launch_bucket(self, bucket: Bucket, grads: Sequence[tf.Tensor], variables: Sequence[Any],
                      collective: str) -> Tuple[tf.Tensor, List[Callable[[], tf.Tensor]]]:
        """Launch the exchange of ``bucket``'s gradients (in its order) under the collective
        name ``collective``: (the step counter, per member a function giving its averaged
        gradient)."""
        raise NotImplementedError


class SparseCompressor(MethodCompressor):
    """A sparse method (DGC, Top-k, Gaussian-k): one allgather of (index, value) messages
    per tensor, or per bucket; built by ``Compression.dgc()`` and friends.
    A bucket (see :class:`MethodCompressor`) is one message and one allgather; the first
    member's ``decompress`` decodes it, in the gradients' graph, for all of them."""

    def launch_bucket(self, bucket: Bucket, grads: Sequence[tf.Tensor], variables: Sequence[Any],
                      collective: str) -> Tuple[tf.Tensor, List[Callable[[], tf.Tensor]]]:
        engine = self.engine
        sent = engine.compress_bucket(bucket, grads, variables)
        gathered, _ = engine.waited_for(lambda message: self.collective(ALLGATHER, message, collective), sent.message)
        graph, decoded = tf.compat.v1.get_default_graph(), []

        def part(i: int) -> Callable[[], tf.Tensor]:
            def finish() -> tf.Tensor:
                if not decoded:
                    with graph.as_default():
                        decoded.extend(engine.decompress_bucket(gathered, sent))
                return decoded[i]
            return finish

        return sent.step, [part(i) for i in range(len(grads))]

    def start_exchange(self, name: str, tensor: tf.Tensor, variable: Any,
                       collective: str) -> Tuple[tf.Tensor, Callable[[], tf.Tensor]]:
        message = self.engine.compress(name, tensor, variable)
        gathered = self.collective(ALLGATHER, message.message, collective)
        return message.step, lambda: self.engine.decompress(gathered, message)


class TwoStageCompressor(MethodCompressor):
    """A two-stage method (ScaleCom, blocksign): the whole exchange runs in compress
    (Horovod's collectives are asynchronous ops, so tensors never wait on each other);
    built by ``Compression.scalecom()`` and ``Compression.blocksign()``."""

    engine_class = TwoStageEngine

    def start_exchange(self, name: str, tensor: tf.Tensor, variable: Any,
                       collective: str) -> Tuple[tf.Tensor, Callable[[], tf.Tensor]]:
        update, step = self.engine.exchange(name, tensor, variable, self.collective, collective)
        return step, lambda: update

    def launch_bucket(self, bucket: Bucket, grads: Sequence[tf.Tensor], variables: Sequence[Any],
                      collective: str) -> Tuple[tf.Tensor, List[Callable[[], tf.Tensor]]]:
        updates, step = self.engine.exchange_bucket(bucket, grads, variables, self.collective, collective)
        return step, [lambda update=update: update for update in updates]


COMPRESSORS = {"sparse": SparseCompressor, "two-stage": TwoStageCompressor}


# Compressors built while a tf.function traces, by (function, method, options): see _factory.
_TRACED: Dict[Tuple[str, str, str], MethodCompressor] = {}


def _refuse_elastic_jobs() -> None:
    """Elastic Horovod (``horovodrun --min-np/--host-discovery-script``, which sets
    ``HOROVOD_ELASTIC=1``) changes the number of workers at a reset, while a traced step keeps
    the number it was traced with in its message layout; and Horovod's TensorFlow ``elastic.run``
    treats a failed collective as a lost worker only when the op has one of Horovod's own
    names, so a lost worker would end ``train()`` early without an error. Refused, not
    half-supported."""
    if int(os.environ.get("HOROVOD_ELASTIC", "0")):
        raise ValueError("horovod_dgc's TensorFlow compressors do not support elastic Horovod "
                         "(HOROVOD_ELASTIC=1): a traced step keeps the number of workers it was "
                         "traced with; launch a fixed number of workers (horovodrun -np N), or "
                         "train elastically with PyTorch (horovod_dgc.torch.elastic.TorchState)")


def _factory(spec: MethodSpec) -> Callable[..., MethodCompressor]:
    def build(variables: Optional[Iterable[Any]], hierarchical: bool, adaptive: "bool | Adaptive",
              options) -> MethodCompressor:
        _refuse_elastic_jobs()
        hosts = find_hosts() if hierarchical else None
        workers = hosts.count if hosts else hvd.size() if hvd.is_initialized() else None
        method = spec.build(workers, **options)
        compressor = COMPRESSORS[method.family](method, variables, adaptive)
        if hosts is not None:
            compressor.exchange_between_hosts(hosts)
        return compressor

    def factory(variables: Optional[Iterable[Any]] = None, hierarchical: bool = False,
                adaptive: "bool | Adaptive" = False, **options) -> MethodCompressor:
        if hierarchical and adaptive:
            raise ValueError("adaptive=True is not supported with hierarchical=True yet")
        if tf.executing_eagerly():
            return build(variables, hierarchical, adaptive, options)
        _refuse_graph_execution(tf.compat.v1.get_default_graph())
        if variables is not None:
            return build(variables, hierarchical, adaptive, options)
        # Built inside a tf.function (Horovod's TensorFlow 2 example does): each trace of the
        # function would build new memories, which tf.function refuses after its first trace.
        # The traces of one function share one compressor instead.
        key = (tf.compat.v1.get_default_graph().name, spec.name,
               repr(sorted({**options, "hierarchical": hierarchical, "adaptive": adaptive}.items())))
        if key not in _TRACED:
            _TRACED[key] = build(None, hierarchical, adaptive, options)
        return _TRACED[key]

    factory.__name__ = spec.name
    factory.__doc__ = (spec.factory_doc + " ``adaptive=True`` (or an "
                       ":class:`~horovod_dgc.core.adaptive.Adaptive`): each bucket goes dense where "
                       "that is predicted faster; call ``compression.end_step()`` after every step "
                       "(docs/algorithms.md#adaptive).")
    return factory


class Compression:
    """Horovod's ``Compression`` namespace plus every method of the table
    (:mod:`horovod_dgc.core.methods`): ``Compression.dgc(...)``, ``Compression.topk(...)``, ...

    ``none`` and ``fp16`` are Horovod's own. The factories take the method's options by name
    and, optionally, ``variables=`` (see :class:`MethodCompressor`); every default lives in
    the method's config class
    (:class:`~horovod_dgc.core.DGCConfig` and friends). With DGC the momentum and weight decay
    live in the compressor: apply the result with plain SGD (no momentum, no weight decay).
    """

    none = HorovodCompression.none
    fp16 = HorovodCompression.fp16


for _spec in METHODS:
    setattr(Compression, _spec.name, staticmethod(_factory(_spec)))
