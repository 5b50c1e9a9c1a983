"""Per-tensor state and the core calls for TensorFlow, without Horovod.

An :class:`Engine` turns a named gradient into either a sparse message (bytes) or a dense
tensor to all-reduce, and gathered messages back into the averaged dense gradient;
``compression.py`` puts Horovod's collectives around it. Horovod calls compressors while
tracing a ``tf.function``, where Python runs once per trace, so every per-step effect is a
TensorFlow op:

* memories, step counters and statistics are ``tf.Variable``s, all created when the engine is
  built (``tf.function`` accepts new variables only on a function's first trace), eagerly even
  when that is during the user's first trace (:func:`_variable_maker`);
* a message's header carries the step counter's value at run time, and the core checks it
  against that run-time value on arrival;
* the warm-up density is chosen at run time among the schedule's few densities
  (``tf.switch_case`` on a variable that :meth:`set_epoch` assigns), since each density has
  its own message size and a traced graph would otherwise keep the density of its trace.

A sparse tensor's compress and decompress (some 700 ops) are each traced once per size and
dtype, as a function that is not inlined, and called for every tensor of that size with the
tensor's memories, step and wire id as run-time arguments: ResNet-50's 214 variables have 28
shapes, and a step's graph grows by a call per tensor instead of a copy of the exchange.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, Iterable, Iterator, List, Optional, Sequence, Tuple

import tensorflow as tf
from tensorflow.python.ops.resource_variable_ops import ResourceVariable

from ..core.bucket import Bucket, Plan, flat_views
from ..core.collectives import ALLGATHER, ALLREDUCE, network_bytes
from ..core.method import BucketCall, CompressCall, Method
from ..core.nonfinite import settle
from ..core.state import check_loadable, state_frame
from ..core.stats import CompressionStats
from ..core.warmup import WarmupWatch
from ..core.wire import MessageLayout, register_names, tensor_id
from .ops import TFOps, dtype_name

State = Dict[str, tf.Variable]
_TOTALS = {"bytes_sent": tf.int64, "dense_bytes": tf.int64, "network_bytes": tf.float64,
           "dense_network_bytes": tf.float64, "elements_sent": tf.int64,
           "elements_compressed": tf.int64, "selection_time_s": tf.float64}


@contextlib.contextmanager
def _variable_maker() -> Iterator[Callable[..., tf.Variable]]:
    """``tf.init_scope()``, yielding how to make a non-trainable variable there.

    The engine is usually built while the user's step is first traced (Horovod calls the
    compressor there). A ``tf.Variable`` made then goes through the variable-creator scope
    ``tf.function`` holds during its first trace, which takes it for the function's own and
    traces the whole step a second time to initialize it: every model's first step twice as
    long. A ``ResourceVariable`` made eagerly bypasses that scope and is captured like any
    variable made before the step. In a TF1 graph (no eager context to lift to) and outside
    any trace, ``tf.Variable`` as usual."""
    traced = not tf.executing_eagerly()
    with tf.init_scope():
        maker = ResourceVariable if traced and tf.executing_eagerly() else tf.Variable
        yield functools.partial(maker, trainable=False)


@dataclass
class TracedMessage:
    """A compressed tensor's sparse message in a graph, and what decompress needs to rebuild
    it.

    ``layouts`` has one entry per density of the schedule; ``density_index`` says which one
    the message follows.
    """

    name: str
    message: tf.Tensor
    layouts: Tuple[MessageLayout, ...]
    density_index: tf.Tensor
    step: tf.Tensor
    shape: tf.TensorShape
    dtype: tf.DType
    old_state: Dict[str, tf.Tensor]
    new_state: Dict[str, tf.Tensor]
    loss_scale: Any = 1.0


@dataclass
class TracedBucket:
    """A bucket's sparse message in a graph, and what decompress needs to rebuild each of its
    tensors (``layouts``: one per density of the schedule, ``densities[i]`` the members'
    densities at index i)."""

    bucket: Bucket
    message: tf.Tensor
    layouts: Tuple[MessageLayout, ...]
    densities: Tuple[Tuple[float, ...], ...]
    density_index: tf.Tensor
    step: tf.Tensor
    shapes: Tuple[tf.TensorShape, ...]
    dtype: tf.DType
    old_states: Dict[str, Dict[str, tf.Tensor]]
    new_states: Dict[str, Dict[str, tf.Tensor]]
    loss_scale: Any = 1.0


@dataclass
class BucketStep:
    """A bucket's exchange as it starts (``Engine._bucket_step``): the members' step and
    memories read, each memory laid out flat as ``state_layouts`` says, and what a
    ``BucketCall`` at each density of the schedule needs."""

    bucket: Bucket
    step: tf.Tensor
    guards: List[tf.Operation]
    shapes: Tuple[tf.TensorShape, ...]
    dtype: tf.DType
    densities: Tuple[Tuple[float, ...], ...]
    index: tf.Tensor
    old_states: Dict[str, Dict[str, tf.Tensor]]
    state_layouts: Dict[str, Bucket]
    state: Dict[str, tf.Tensor]
    flat: tf.Tensor
    param: Optional[tf.Tensor]
    loss_scale: Any

    @property
    def numel(self) -> int:
        """The members' elements (no padding)."""
        return sum(s.numel for s in self.bucket.segments)

    def call(self, engine: "Engine", i: int) -> BucketCall:
        """The bucket's call at the ``i``-th density of the schedule."""
        return BucketCall(bucket=self.bucket, rank=engine.rank, world_size=engine.world_size, step=self.step,
                          densities=self.densities[i], param=self.param, loss_scale=self.loss_scale,
                          keeps_bounds=False)

    def member_states(self, ops: TFOps, flat_state: Dict[str, tf.Tensor]) -> Dict[str, Dict[str, tf.Tensor]]:
        """Each member's part of the flat memories ``flat_state``."""
        parts = {key: flat_views(ops, value, self.state_layouts[key]) for key, value in flat_state.items()}
        return {name: {key: parts[key][i] for key in parts} for i, name in enumerate(self.bucket.names)}


@dataclass
class DenseUpdate:
    """A tensor that travels dense: what to all-reduce, and how to give the result back."""

    name: str
    tensor: tf.Tensor
    dtype: tf.DType
    step: tf.Tensor
    old_state: Dict[str, tf.Tensor]
    new_state: Dict[str, tf.Tensor]
    loss_scale: Any = 1.0

@dataclass
class FlushedBucket:
    """A compressed bucket's dense step in a graph (``Engine.flush_bucket``): what to
    all-reduce (averaged), and how to give the result back."""

    bucket: Bucket
    tensor: tf.Tensor
    step: tf.Tensor
    shapes: Tuple[tf.TensorShape, ...]
    dtype: tf.DType
    old_states: Dict[str, Dict[str, tf.Tensor]]
    new_states: Dict[str, Dict[str, tf.Tensor]]


# The key of Engine.spend under which the time spent waiting for exchanges is summed.
WAITED = "horovod_dgc.waited"

# Horovod's collectives take no bfloat16: such dense tensors travel as float32.
REDUCIBLE = {tf.bfloat16: tf.float32}
# A function TensorFlow keeps as one call op in the graphs that call it (and optimizes once).
_NOT_INLINED = {"_noinline": True}


class Engine:
    """Holds a method, the per-tensor memories and step counters, and the statistics.

    Args:
        method: the core method (config included).
        tensors: name, shape and dtype of every tensor the engine may see.
        world_size, rank: the number of workers and this one.
    """

    def __init__(self, method: Method, tensors: Sequence[tf.TensorSpec], world_size: int,
                 rank: int):
        self.method = method
        self.ops = TFOps()
        self.world_size = world_size
        self.rank = rank
        self.epoch = 0.0
        schedule = method.config.schedule
        self.densities = schedule.densities_in_use if schedule else (1.0,)
        self._watch = WarmupWatch(schedule)
        self._loss_scale: Optional[Callable[[], Any]] = None
        with _variable_maker() as variable:
            self._density_index = variable(self.densities.index(self.density),
                                           name="horovod_dgc/density_index")
            self._states = {spec.name: self._new_state(spec, variable) for spec in tensors}
            self._numels = {spec.name: spec.shape.num_elements() for spec in tensors}
            self._steps = {spec.name: variable(tf.constant(0, tf.int64), name=f"horovod_dgc/{spec.name}/step")
                           for spec in tensors}
            self._totals = {field: variable(tf.constant(0, dtype), name=f"horovod_dgc/{field}")
                            for field, dtype in _TOTALS.items()}
        self._steps_at_reset = 0
        # Seconds of compute per bucket (and of waiting for the exchanges, under WAITED), summed
        # by the traced steps since the last take_compute_s(): made at a bucket's first trace.
        self._compute_s: Dict[str, tf.Variable] = {}
        self._shared: Dict[Tuple[Any, ...], Callable[..., Any]] = {}
        register_names(spec.name for spec in tensors)

    @property
    def config(self):
        return self.method.config

    def _new_state(self, spec: tf.TensorSpec, variable: Callable[..., tf.Variable]) -> State:
        if self.passes_through(spec):
            return {}
        flat = tf.TensorSpec([spec.shape.num_elements()], spec.dtype)
        initial = self.method.init_state(self.ops, flat, self.compresses(spec), self.world_size)
        return {key: variable(value, name=f"horovod_dgc/{spec.name}/{key}") for key, value in initial.items()}

    # -- schedule and statistics ------------------------------------------------------------
    @property
    def density(self) -> float:
        """Density in force now (after warm-up)."""
        return self.config.density_at(self.epoch)

    def set_epoch(self, epoch: float) -> None:
        """Select the density of ``floor(epoch)`` for the steps that follow (call it eagerly)."""
        self.epoch = float(epoch)
        self._watch.epoch_set(self.epoch)
        self._density_index.assign(self.densities.index(self.density))

    def use_loss_scale(self, scale: Callable[[], Any]) -> None:
        """Read the current loss scale from ``scale()`` (a tensor in the graph) at every
        compress: memories keep unscaled gradients, results go back scaled."""
        self._loss_scale = scale

    def _current_loss_scale(self) -> Any:
        return 1.0 if self._loss_scale is None else tf.cast(self._loss_scale(), tf.float32)

    def _density_index_at(self, step: tf.Tensor) -> tf.Tensor:
        """The density index in force at a tensor's ``step``: from the step count when the
        schedule has ``steps_per_epoch``, else from the epoch last set."""
        schedule = self.config.schedule
        if schedule is None or schedule.steps_per_epoch is None:
            return self._density_index.read_value()
        table = [self.densities.index(schedule.density(e)) for e in range(schedule.warmup_epochs + 1)]
        epoch = tf.minimum(step // schedule.steps_per_epoch, schedule.warmup_epochs)
        return tf.gather(tf.constant(table, tf.int32), epoch)

    def stats(self) -> CompressionStats:
        """Totals since the last reset (call it eagerly)."""
        totals = {field: variable.numpy() for field, variable in self._totals.items()}
        values = {field: (float if dtype == tf.float64 else int)(totals[field])
                  for field, dtype in _TOTALS.items()}
        return CompressionStats(steps=max(0, self._max_step() - self._steps_at_reset), **values)

    def reset_stats(self) -> None:
        for variable in self._totals.values():
            variable.assign(tf.zeros_like(variable))
        self._steps_at_reset = self._max_step()

    def _max_step(self) -> int:
        return max((int(step.numpy()) for step in self._steps.values()), default=0)

    def _record(self, handed: Sequence[Tuple[str, Any]], dense_bytes: int, **counts: Any) -> None:
        """Count the bytes ``handed`` to collectives ((kind, bytes) pairs) and what they send
        on the network, for a gradient of ``dense_bytes`` (0: counted already)."""
        amounts = dict(counts, dense_bytes=dense_bytes,
                       bytes_sent=tf.add_n([tf.cast(n, tf.int64) for _, n in handed]),
                       network_bytes=tf.add_n([network_bytes(kind, tf.cast(n, tf.float64), self.world_size)
                                               for kind, n in handed]),
                       dense_network_bytes=network_bytes(ALLREDUCE, float(dense_bytes), self.world_size))
        for field, amount in amounts.items():
            variable = self._totals[field]
            variable.assign_add(tf.cast(amount, variable.dtype))

    def spend(self, key: str, seconds: tf.Tensor) -> tf.Operation:
        """Add ``seconds`` (a run-time duration) to what bucket ``key`` cost this step (the
        adaptive switch's input; :data:`WAITED`: the time spent waiting for exchanges)."""
        if key not in self._compute_s:
            with _variable_maker() as variable:
                self._compute_s[key] = variable(tf.constant(0.0, tf.float64), name=f"horovod_dgc/seconds/{key}")
        return self._compute_s[key].assign_add(tf.cast(seconds, tf.float64))

    def waited_for(self, exchange: Callable[[tf.Tensor], tf.Tensor], message: tf.Tensor
                   ) -> Tuple[tf.Tensor, tf.Tensor]:
        """(``exchange(message)``, the seconds from ``message`` being ready to the result),
        the wait summed under :data:`WAITED`."""
        with tf.control_dependencies([message]):
            sent = tf.timestamp()
        with tf.control_dependencies([sent]):
            received = exchange(tf.identity(message))
        with tf.control_dependencies([received]):
            waited = tf.timestamp() - sent
        with tf.control_dependencies([self.spend(WAITED, waited)]):
            return tf.identity(received), waited

    def take_compute_s(self) -> Dict[str, float]:
        """Seconds per bucket key (and under :data:`WAITED`) since the last call (call it
        eagerly)."""
        taken = {}
        for key, variable in self._compute_s.items():
            taken[key] = float(variable.numpy())
            variable.assign(0.0)
        return taken

    def steps_of(self, names: Iterable[str]) -> int:
        """The most steps any of the tensors ``names`` has taken (call it eagerly)."""
        return max((int(self._steps[name].numpy()) for name in names), default=0)

    def bucket_exchanges(self, bucket: Bucket) -> Tuple[Tuple[str, int], ...]:
        """``Method.bucket_exchanges`` of ``bucket`` at the densities of its next step."""
        step = self.steps_of(bucket.names)
        return self.method.bucket_exchanges(
            Plan.at(bucket, [self.config.density_for(step, self.epoch, s.small) for s in bucket.segments]),
            self.world_size)

    def record_allreduce(self, nbytes: int) -> None:
        """Count the bytes of an all-reduce that carries no gradient: the placeholder Horovod
        all-reduces beside a sparse message, the adaptive switch's probes and measurements."""
        self._record([(ALLREDUCE, nbytes)], 0)

    # -- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's part: memories (NumPy arrays), step counters and epoch, tagged with
        the method, its config and the world they belong to (call it eagerly)."""
        return state_frame(self.method, world_size=self.world_size, rank=self.rank, epoch=self.epoch,
                           steps={n: int(step.numpy()) for n, step in self._steps.items()},
                           states={n: {k: v.numpy().copy() for k, v in s.items()}
                                   for n, s in self._states.items()})

    def load_state_dict(self, state: dict) -> None:
        """Restore this rank's part saved by :meth:`state_dict` (call it eagerly); a state of
        another method, config, world, rank, tensor set or shape is refused whole."""
        self._check_loadable(state)
        for name, tensors in state["states"].items():
            for key, value in tensors.items():
                self._states[name][key].assign(value)
        for name, step in state["steps"].items():
            self._steps[name].assign(step)
        self.set_epoch(state["epoch"])
        self._steps_at_reset = self._max_step()

    def _check_loadable(self, state: dict) -> None:
        numels = {name: self._numels[name] for name in self._states}
        memories = {name: {key: tf.constant(value) for key, value in tensors.items()}
                    for name, tensors in state.get("states", {}).items()}
        check_loadable(self.ops, {**state, "states": memories}, self.method, numels,
                       self.world_size, self.rank,
                       "load every rank's part with horovod_dgc.tensorflow.checkpoint."
                       "redistribute(parts, world_size, rank) instead")
        if set(state["states"]) != set(self._states) or set(state["steps"]) != set(self._steps):
            raise ValueError(f"compressor state holds tensors {sorted(state['states'])[:5]}..., "
                             f"this compressor {sorted(self._states)[:5]}...: another model?")
        for name, tensors in state["states"].items():
            if set(tensors) != set(self._states[name]):
                raise ValueError(f"compressor state of tensor {name!r} holds {sorted(tensors)}, "
                                 f"expected {sorted(self._states[name])}")

    # -- which path -------------------------------------------------------------------------
    def compresses(self, tensor: Any) -> bool:
        """Whether a tensor (or ``tf.TensorSpec``) goes through the sparse path."""
        return self.config.compresses(tuple(tensor.shape.as_list()), dtype_name(tensor.dtype))

    @staticmethod
    def passes_through(tensor: Any) -> bool:
        """Zero-element and non-floating tensors are handed on untouched."""
        return tensor.shape.num_elements() == 0 or not tensor.dtype.is_floating

    def _next_step(self, name: str) -> tf.Tensor:
        return self._steps[name].assign_add(1) - 1

    def _read_state(self, name: str) -> Dict[str, tf.Tensor]:
        return {key: variable.read_value() for key, variable in self._states[name].items()}

    def _keep_if(self, finite: tf.Tensor, name: str, old: Dict[str, tf.Tensor],
                 new: Dict[str, tf.Tensor]) -> tf.Operation:
        """Keep the step's memories of tensor ``name`` only if every rank's gradient was
        finite (per tensor in TensorFlow: see docs/guide/mixed-precision.md)."""
        return tf.group([self._states[name][key].assign(tf.where(finite, new[key], old[key]))
                         for key in new])

    def _keep_members_if(self, finite: tf.Tensor, sent: Any) -> List[tf.Operation]:
        """:meth:`_keep_if` for every member of ``sent``'s bucket (a ``TracedBucket`` or a
        ``FlushedBucket``): a bucket's tensors keep or drop a step together."""
        return [self._keep_if(finite, name, sent.old_states[name], sent.new_states[name])
                for name in sent.bucket.names]

    def _call(self, name: str, step: tf.Tensor, density: float, param: Optional[Any],
              loss_scale: Any, shape: Any, traced_id: Optional[tf.Tensor] = None) -> CompressCall:
        """``shape``: the gradient's."""
        flat_param = None if param is None else tf.reshape(tf.convert_to_tensor(param), [-1])
        small = self.config.is_small(tuple(tf.TensorShape(shape).as_list()))
        return CompressCall(name=name, rank=self.rank, world_size=self.world_size, step=step,
                            density=density, param=flat_param, loss_scale=loss_scale, small=small,
                            traced_id=traced_id)

    def _traced_step(self, name: str) -> tf.Tensor:
        warning = self._watch.warning(0)
        if warning and self.rank == 0:
            warnings.warn(warning, stacklevel=4)
        return self._next_step(name)

    def _density(self, i: int, shape: Any) -> float:
        """The ``i``-th density of the schedule for a tensor of ``shape`` (small ones have a
        floor of their own)."""
        floor = self.config.density_floor(tuple(tf.TensorShape(shape).as_list()))
        return self.densities[i] if floor is None else max(self.densities[i], floor)

    def _densities_of(self, shape: Any) -> List[float]:
        """A tensor of ``shape``'s density at each index of the schedule."""
        return [self._density(i, shape) for i in range(len(self.densities))]

    def _by_density(self, index: tf.Tensor, densities: Sequence[Hashable], fn: Callable[[int], Any]) -> Any:
        """``fn(i)`` for the density index ``index`` in force at run time, where
        ``densities[i]`` is what index i means to the caller (a tensor's density, a bucket's
        tuple of its members'): one branch per distinct value (a small tensor's floor merges
        warm-up densities; each branch is a whole exchange in the traced graph)."""
        firsts = sorted({densities.index(d) for d in densities})
        if len(firsts) == 1:
            return fn(firsts[0])
        branch_of = [firsts.index(densities.index(d)) for d in densities]
        return tf.switch_case(tf.gather(tf.constant(branch_of, tf.int32), index),
                              [functools.partial(fn, i) for i in firsts])

    def _share_key(self, kind: str, shape: Any, dtype: tf.DType) -> Tuple[Any, ...]:
        """What the tensors that share ``kind``'s trace have in common (see :meth:`_shared_call`)."""
        shape = tf.TensorShape(shape)
        return (kind, shape.num_elements(), dtype, self.config.is_small(tuple(shape.as_list())),
                tuple(self._densities_of(shape)))

    def _shared_call(self, kind: str, name: str, shape: Any, dtype: tf.DType,
                     body: Callable[..., Any], *args: Any) -> Any:
        """``body(*args, traced_id)``, run for tensor ``name``: executing eagerly, directly
        (``traced_id`` None); in a graph, through the function not inlined that every tensor
        of this size, dtype and densities shares (traced for the first of them, whose
        ``body`` it keeps: a body may only depend on the tensor through its arguments)."""
        if tf.executing_eagerly():
            return body(*args, None)
        key = self._share_key(kind, shape, dtype)
        function = self._shared.get(key)
        if function is None:
            function = self._shared[key] = tf.function(self._checked(body), autograph=False,
                                                       experimental_attributes=_NOT_INLINED)
        # Not a constant: Grappler would specialize the function for each constant argument,
        # optimizing a copy of the exchange per tensor again.
        traced_id = tf.raw_ops.PlaceholderWithDefault(input=tf.constant(tensor_id(name), tf.int64), shape=[])
        return function(*args, traced_id)

    def _checked(self, body: Callable[..., Any]) -> Callable[..., Any]:
        """``body``, its results made to wait for the checks it builds (in its own graph)."""
        def checked(*args: Any) -> Any:
            with self.ops.guards() as guards:
                results = body(*args)
            with tf.control_dependencies(guards):
                return tf.nest.map_structure(tf.identity, results)

        return checked

    # -- the two paths ------------------------------------------------------------------------
    def compress(self, name: str, grad: tf.Tensor, param: Optional[Any]) -> TracedMessage:
        """Sparse message for a tensor that :meth:`compresses`."""
        started = tf.timestamp()
        flat = tf.reshape(grad, [-1])
        numel, grad_dtype = flat.shape.num_elements(), dtype_name(grad.dtype)
        layouts = tuple(self.method.layout(name, numel, grad_dtype, self._density(i, grad.shape))
                        for i in range(len(self.densities)))
        step = self._traced_step(name)
        index = self._density_index_at(step)
        state, scale = self._read_state(name), self._current_loss_scale()
        param = None if param is None else tf.convert_to_tensor(param)  # a value, whatever the variable

        def body(state: Dict[str, tf.Tensor], flat: tf.Tensor, step: tf.Tensor, index: tf.Tensor,
                 param: Optional[Any], scale: Any, traced_id: Optional[tf.Tensor]) -> Tuple[Any, ...]:
            def at_density(i: int) -> Tuple[tf.Tensor, Dict[str, tf.Tensor], tf.Tensor]:
                call = self._call(name, step, self._density(i, grad.shape), param, scale, grad.shape,
                                  traced_id)
                result = self.method.compress(self.ops, state, flat, call)
                return result.message, result.state, tf.cast(result.count, tf.int64)

            return self._by_density(index, self._densities_of(grad.shape), at_density)

        with tf.control_dependencies([started]):
            message, new_state, count = self._shared_call("compress", name, grad.shape, grad.dtype, body,
                                                          state, flat, step, index, param, scale)
        with tf.control_dependencies([message, count]):
            elapsed = tf.timestamp() - started
        nbytes = tf.gather(tf.constant([layout.nbytes for layout in layouts], tf.int64), index)
        self._record([(ALLGATHER, nbytes)], numel * grad.dtype.size, elements_sent=count,
                     elements_compressed=numel, selection_time_s=elapsed)
        return TracedMessage(name, message, layouts, index, step, grad.shape, grad.dtype, state,
                             new_state, scale)

    # -- a bucket: several tensors as one message ----------------------------------------------
    def bucket(self, label: str, members: Sequence[Tuple[str, Any]]) -> Bucket:
        """The bucket of these (name, gradient or ``tf.TensorSpec``) pairs under ``label``
        (one dtype; fully defined shapes), its key registered for error messages."""
        dtypes = {tf.as_dtype(grad.dtype) for _, grad in members}
        if len(dtypes) != 1:
            raise ValueError(f"bucket {label!r} holds gradients of several dtypes: {sorted(d.name for d in dtypes)}")
        bucket = Bucket.of(label, [(name, grad.shape.num_elements(), self.config.is_small(tuple(grad.shape.as_list())))
                                   for name, grad in members], dtype_name(dtypes.pop()))
        register_names([bucket.key])
        return bucket

    def _bucket_step(self, bucket: Bucket, grads: Sequence[tf.Tensor], params: Sequence[Optional[Any]]
                     ) -> "BucketStep":
        """What a bucket's exchange starts from: every member's step counter advanced (checked
        to agree), their memories read into the bucket's flat layout, the flat gradient."""
        steps = [self._traced_step(name) for name in bucket.names]
        step = steps[0]
        with self.ops.guards() as guards:
            self.ops.check(tf.reduce_all(tf.equal(tf.stack(steps), step)), RuntimeError(
                f"the tensors of bucket {bucket.label!r} are at different steps: a tensor of it "
                f"was also compressed alone (hvd.allreduce(..., compression=) called directly?)"))
        shapes = tuple(grad.shape for grad in grads)
        old = {name: self._read_state(name) for name in bucket.names}
        layouts = self.method.state_buckets(bucket, self.world_size)
        param = (self._flat(bucket, [tf.convert_to_tensor(p) for p in params])
                 if getattr(self.config, "weight_decay", 0.0) > 0 else None)
        return BucketStep(
            bucket=bucket, step=step, guards=guards, shapes=shapes, dtype=grads[0].dtype,
            densities=tuple(tuple(d) for d in zip(*(self._densities_of(shape) for shape in shapes))),
            index=self._density_index_at(step), old_states=old, state_layouts=layouts,
            state={key: self._flat(layout, [old[name][key] for name in bucket.names]) for key, layout in layouts.items()},
            flat=self._flat(bucket, grads), param=param, loss_scale=self._current_loss_scale())

    def compress_bucket(self, bucket: Bucket, grads: Sequence[tf.Tensor],
                        params: Sequence[Optional[Any]]) -> TracedBucket:
        """One sparse message for the tensors of ``bucket`` (their gradients in its order).
        Their memories stay per tensor (checkpoints and the per-tensor path read them as
        ever): read into the bucket's flat layout, and split back when the step is kept."""
        started = tf.timestamp()
        with tf.control_dependencies([started]):
            begun = self._bucket_step(bucket, grads, params)

        def at_density(i: int) -> Tuple[tf.Tensor, Dict[str, tf.Tensor], tf.Tensor]:
            result = self.method.compress_bucket(self.ops, begun.state, begun.flat, begun.call(self, i))
            return result.message, result.state, tf.cast(result.count, tf.int64)

        message, new_state, count = self._by_density(begun.index, begun.densities, self._checked(at_density))
        with tf.control_dependencies(begun.guards + [message, count]):
            message, elapsed = tf.identity(message), tf.timestamp() - started
        self.spend(bucket.key, elapsed)
        layouts = tuple(self.method.bucket_layout(bucket, Plan.at(bucket, d)) for d in begun.densities)
        nbytes = tf.gather(tf.constant([layout.nbytes for layout in layouts], tf.int64), begun.index)
        self._record([(ALLGATHER, nbytes)], begun.numel * begun.dtype.size, elements_sent=count,
                     elements_compressed=begun.numel, selection_time_s=elapsed)
        return TracedBucket(bucket, message, layouts, begun.densities, begun.index, begun.step, begun.shapes,
                            begun.dtype, begun.old_states, begun.member_states(self.ops, new_state), begun.loss_scale)

    @staticmethod
    def _flat(layout: Bucket, tensors: Sequence[tf.Tensor]) -> tf.Tensor:
        """``tensors`` laid out as the segments of ``layout``: one flat tensor, zero padding."""
        return tf.concat([tf.pad(tf.reshape(t, [-1]), [[0, s.span - s.numel]])
                          for t, s in zip(tensors, layout.segments)], 0)

    def decompress_bucket(self, gathered: tf.Tensor, sent: TracedBucket) -> List[tf.Tensor]:
        """Each member's averaged gradient, from the allgather of every rank's message for
        ``sent``; each member's memories of this step are kept only if no rank flagged the
        bucket (its tensors are kept or dropped together)."""
        bucket = sent.bucket
        with tf.control_dependencies([gathered]):
            started = tf.timestamp()

        def decode(i: int) -> Tuple[tf.Tensor, tf.Tensor]:
            with self.ops.guards() as guards:
                flats, finite = self.method.decompress(self.ops, gathered, [sent.layouts[i]], self.world_size,
                                                       sent.step, [dtype_name(sent.dtype)])
            with tf.control_dependencies(guards):
                return tf.identity(flats[0]), tf.identity(finite)

        with tf.control_dependencies([started]):
            flat, finite = self._by_density(sent.density_index, sent.densities, decode)
        kept = self._keep_members_if(finite, sent)
        with tf.control_dependencies(kept):
            flat = flat * tf.cast(sent.loss_scale, flat.dtype)
        with tf.control_dependencies([flat]):
            self.spend(bucket.key, tf.timestamp() - started)
        return self._members(bucket, flat, sent.shapes)

    def flush_bucket(self, bucket: Bucket, grads: Sequence[tf.Tensor],
                     params: Sequence[Optional[Any]]) -> FlushedBucket:
        """A compressed bucket's dense step (``Method.flush_bucket``: its gradients with every
        update its memories owe): what to all-reduce (averaged), flat; give the result to
        :meth:`flushed`."""
        started = tf.timestamp()
        with tf.control_dependencies([started]):
            begun = self._bucket_step(bucket, grads, params)
        wire = REDUCIBLE.get(begun.dtype, begun.dtype)
        # A flush reads no density: the call at the schedule's first one.
        with self.ops.guards() as guards:
            update, state = self.method.flush_bucket(self.ops, begun.state, begun.flat, begun.call(self, 0),
                                                     dtype_name(wire))
        with tf.control_dependencies(begun.guards + guards):
            update = tf.identity(update)
        self._record([(ALLREDUCE, update.shape.num_elements() * wire.size)], begun.numel * begun.dtype.size)
        with tf.control_dependencies([update]):
            self.spend(bucket.key, tf.timestamp() - started)
        return FlushedBucket(bucket, update, begun.step, begun.shapes, begun.dtype, begun.old_states,
                             begun.member_states(self.ops, state))

    def flushed(self, sent: FlushedBucket, averaged: tf.Tensor) -> List[tf.Tensor]:
        """A flushed bucket's averaged gradients, one per member shaped like it, in the
        gradients' dtype; the members' memories of this step are kept only if the average is
        finite (every rank's gradient was)."""
        bucket = sent.bucket
        finite = settle(self.ops, self.config.nonfinite, self.ops.is_finite(self.ops.sum(averaged)),
                        [], lambda: f"bucket {bucket.label!r} on some rank", sent.step)
        kept = self._keep_members_if(finite, sent)
        with tf.control_dependencies(kept):
            flat = tf.cast(tf.identity(averaged), sent.dtype)
        return self._members(bucket, flat, sent.shapes)

    def _members(self, bucket: Bucket, flat: tf.Tensor, shapes: Sequence[tf.TensorShape]) -> List[tf.Tensor]:
        """Each member's part of ``flat`` (laid out as ``bucket``), shaped by ``shapes``."""
        return [tf.reshape(part, shape) for part, shape in zip(flat_views(self.ops, flat, bucket), shapes)]

    def dense(self, name: str, grad: tf.Tensor, param: Optional[Any]) -> DenseUpdate:
        """What to all-reduce for a tensor that does not compress (float32 for a bfloat16
        gradient); give the result to :meth:`dense_received`."""
        flat = tf.reshape(grad, [-1])
        step = self._next_step(name)
        old, scale = self._read_state(name), self._current_loss_scale()
        update, state = self.method.dense(self.ops, old, flat,
                                          self._call(name, step, self.density, param, scale, grad.shape))
        reducible = REDUCIBLE.get(grad.dtype, grad.dtype)
        update = tf.cast(update, reducible) * tf.cast(scale, reducible)
        nbytes = flat.shape.num_elements() * update.dtype.size
        self._record([(ALLREDUCE, nbytes)], flat.shape.num_elements() * grad.dtype.size)
        return DenseUpdate(name, tf.reshape(update, grad.shape), grad.dtype, step, old, state, scale)

    def dense_received(self, sent: DenseUpdate, averaged: tf.Tensor) -> tf.Tensor:
        """The all-reduced ``sent.tensor`` in the gradient's dtype; the tensor's memories of
        this step are kept only if the result is finite."""
        finite = settle(self.ops, self.config.nonfinite, self.ops.is_finite(self.ops.sum(averaged)),
                        [], lambda: f"tensor {sent.name!r} on some rank", sent.step)
        with tf.control_dependencies([self._keep_if(finite, sent.name, sent.old_state, sent.new_state)]):
            return tf.cast(tf.identity(averaged), sent.dtype)

    def decompress(self, gathered: tf.Tensor, message: TracedMessage) -> tf.Tensor:
        """Averaged dense gradient of ``message``'s tensor from the allgather of every rank's
        message; the core checks every header against the run-time step."""
        def body(gathered: tf.Tensor, step: tf.Tensor, index: tf.Tensor,
                 traced_id: Optional[tf.Tensor]) -> Tuple[tf.Tensor, tf.Tensor]:
            def decode(i: int) -> Tuple[tf.Tensor, tf.Tensor]:
                with self.ops.guards() as guards:
                    flats, finite = self.method.decompress(self.ops, gathered, [message.layouts[i]],
                                                           self.world_size, step,
                                                           [dtype_name(message.dtype)], traced_id=traced_id)
                with tf.control_dependencies(guards):
                    return tf.identity(flats[0]), tf.identity(finite)

            return self._by_density(index, self._densities_of(message.shape), decode)

        flat, finite = self._shared_call("decompress", message.name, message.shape, message.dtype, body,
                                         gathered, message.step, message.density_index)
        kept = self._keep_if(finite, message.name, message.old_state, message.new_state)
        with tf.control_dependencies([kept]):
            flat = flat * tf.cast(message.loss_scale, flat.dtype)
        return tf.reshape(flat, message.shape)
