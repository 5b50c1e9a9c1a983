"""The two-stage family (ScaleCom, blocksign) for TensorFlow: the whole exchange as graph ops.

:meth:`TwoStageEngine.exchange` runs the core's ``first``, the FIRST collective, ``second``,
the SECOND collective and ``finish`` for one tensor, and returns the averaged update; the
collectives come from the caller (``compression.py`` passes Horovod's, tests an emulation),
so this module knows nothing of Horovod. Inside a ``tf.function`` the step counter (hence
ScaleCom's leader, ``step mod N``) is a run-time value: the core writes it into the headers
and checks every received header against it. Each stage is traced once per tensor size and
shared, as the sparse methods' compress and decompress are (``engine.py``); the collectives
between the stages stay per tensor, named after it. :meth:`TwoStageEngine.exchange_bucket`
runs a bucket's exchange as one (``first_bucket``, then the bucket as one tensor), inline.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from ..core.bucket import Bucket, Plan
from ..core.collectives import BROADCAST
from ..core.method import CompressCall
from ..core.twostage import StageHandover, TwoStageMethod
from .engine import Engine
from .ops import dtype_name

# collective(kind, message, name, root, chunks=None) -> what this rank receives; ``root`` is
# the rank whose message a BROADCAST sends (a tensor in a graph); ``chunks``: an ALLTOALL's
# elements for each destination, where they differ.
Collective = Callable[[str, tf.Tensor, str, Any], tf.Tensor]


class TwoStageEngine(Engine):
    """:class:`Engine` for a :class:`~horovod_dgc.core.twostage.TwoStageMethod`."""

    method: TwoStageMethod

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # Per shared trace of a density's stages, the handover's entries that are not tensors.
        self._handover_statics: Dict[Tuple[Any, ...], Dict[str, Any]] = {}

    def exchange(self, name: str, grad: tf.Tensor, param: Optional[Any], collective: Collective,
                 collective_name: str) -> Tuple[tf.Tensor, tf.Tensor]:
        """(averaged update shaped like ``grad``, this step's counter) for a tensor that
        :meth:`compresses`; collectives are named ``collective_name`` + stage and density."""
        started = tf.timestamp()
        flat = tf.reshape(grad, [-1])
        numel = flat.shape.num_elements()
        step = self._traced_step(name)
        index = self._density_index_at(step)
        state, scale = self._read_state(name), self._current_loss_scale()
        step_value = int(step) if tf.executing_eagerly() else step
        param = None if param is None else tf.convert_to_tensor(param)  # a value, whatever the variable

        def at_density(i: int) -> Tuple[tf.Tensor, Dict[str, tf.Tensor], tf.Tensor, tf.Tensor]:
            # Each stage's results wait for its own checks (Engine._shared_call).
            stages = _Stages(self, name, grad, i, (step_value, param, scale))
            return stages.run(state, flat, collective, f"{collective_name}.d{i}")

        with tf.control_dependencies([started]):
            update, new_state, nbytes, finite = self._by_density(index, self._densities_of(grad.shape), at_density)
        with tf.control_dependencies([self._keep_if(finite, name, state, new_state)]):
            update = update * tf.cast(scale, update.dtype)
        with tf.control_dependencies([update]):
            elapsed = tf.timestamp() - started
        density = tf.gather(tf.constant(self.densities, tf.float64), index)
        self._record([(self.method.FIRST, nbytes[0]), (self.method.SECOND, nbytes[1])],
                     numel * grad.dtype.size, elements_sent=tf.round(density * numel),
                     elements_compressed=numel, selection_time_s=elapsed)
        return tf.reshape(update, grad.shape), step

    def exchange_bucket(self, bucket: Bucket, grads: Sequence[tf.Tensor], params: Sequence[Optional[Any]],
                        collective: Collective, collective_name: str) -> Tuple[List[tf.Tensor], tf.Tensor]:
        """(each member's averaged update, shaped like it; the step counter) of the tensors
        of ``bucket`` exchanged as one (``first_bucket``, then the bucket as one tensor);
        collectives named ``collective_name`` + stage and density. A bucket's members keep or
        drop the step's memories together."""
        started = tf.timestamp()
        with tf.control_dependencies([started]):
            begun = self._bucket_step(bucket, grads, params)
        method = self.method

        def at_density(i: int) -> Tuple[tf.Tensor, Dict[str, tf.Tensor], tf.Tensor, tf.Tensor, tf.Tensor]:
            message, state, handover = method.first_bucket(self.ops, begun.state, begun.flat, begun.call(self, i))
            root = method.root(handover.call)
            received, first_s = self.waited_for(
                lambda m: collective(method.FIRST, m, f"{collective_name}.d{i}.1", root, chunks=handover.chunks),
                message)
            second, state = method.second(self.ops, state, received, handover)
            received, second_s = self.waited_for(
                lambda m: collective(method.SECOND, m, f"{collective_name}.d{i}.2", root), second)
            update, finite = method.finish(self.ops, received, handover)
            return (update, state, _stage_bytes(method, message, second, root, self.rank), finite,
                    first_s + second_s)

        with tf.control_dependencies([started]):
            update, new_state, nbytes, finite, waited = self._by_density(begun.index, begun.densities,
                                                                         self._checked(at_density))
        with tf.control_dependencies(begun.guards):
            kept = [self._keep_if(finite, name, begun.old_states[name], state)
                    for name, state in begun.member_states(self.ops, new_state).items()]
        with tf.control_dependencies(kept):
            update = update * tf.cast(begun.loss_scale, update.dtype)
        with tf.control_dependencies([update]):
            elapsed = tf.timestamp() - started
        self.spend(bucket.key, elapsed - waited)
        density = tf.gather(tf.constant([Plan.at(bucket, d).total / begun.numel for d in begun.densities],
                                        tf.float64), begun.index)
        self._record([(method.FIRST, nbytes[0]), (method.SECOND, nbytes[1])], begun.numel * begun.dtype.size,
                     elements_sent=tf.round(density * begun.numel), elements_compressed=begun.numel,
                     selection_time_s=elapsed)
        return self._members(bucket, update, begun.shapes), begun.step


def _stage_bytes(method: TwoStageMethod, first: tf.Tensor, second: tf.Tensor, root: Any, rank: int) -> tf.Tensor:
    """Bytes this rank hands to the FIRST and the SECOND collective (a BROADCAST's: the root's only)."""
    first_bytes = tf.size(first, out_type=tf.int64) * first.dtype.size
    if method.FIRST == BROADCAST:
        first_bytes = tf.where(tf.equal(tf.cast(root, tf.int64), rank), first_bytes, 0)
    return tf.stack([first_bytes, tf.size(second, out_type=tf.int64) * second.dtype.size])


class _Stages:
    """One tensor's exchange at the ``i``-th density: ``first``, ``second`` and ``finish``,
    each through the engine's function shared by the tensors of its size
    (``Engine._shared_call``), with the collectives between them.

    A stage hands the next its ``StageHandover``: the tensors in it cross the functions as
    arguments; the rest (layouts, shard lengths) is the same for every tensor sharing the
    trace, and is kept per shared trace."""

    def __init__(self, engine: TwoStageEngine, name: str, grad: tf.Tensor, i: int,
                 call_args: Tuple[Any, Any, Any]):
        self.engine, self.name, self.i, self.call_args = engine, name, i, call_args
        self.shape, self.dtype = grad.shape, grad.dtype
        self.numel, self.dtype_name = grad.shape.num_elements(), dtype_name(grad.dtype)
        key = engine._share_key(f"stages.d{i}", grad.shape, grad.dtype)
        # Executing eagerly, nothing is shared: each exchange keeps its own.
        self.statics: Dict[str, Any] = ({} if tf.executing_eagerly()
                                        else engine._handover_statics.setdefault(key, {}))

    def _call(self, step: Any, param: Any, scale: Any, traced_id: Any) -> CompressCall:
        engine = self.engine
        return engine._call(self.name, step, engine._density(self.i, self.shape), param, scale,
                            self.shape, traced_id)

    def _handover(self, data: Dict[str, tf.Tensor], call: CompressCall) -> StageHandover:
        return StageHandover(call, self.numel, self.dtype_name, {**self.statics, **data})

    def _tensors(self, handover: StageHandover) -> Dict[str, tf.Tensor]:
        """The handover's tensors; the rest goes to the statics of the shared trace."""
        tensors = {k: v for k, v in handover.data.items() if isinstance(v, tf.Tensor)}
        self.statics.update({k: v for k, v in handover.data.items() if k not in tensors})
        return tensors

    def _shared(self, stage: str, body: Callable[..., Any], *args: Any) -> Any:
        return self.engine._shared_call(f"{stage}.d{self.i}", self.name, self.shape, self.dtype, body,
                                        *args, *self.call_args)

    def run(self, state: Dict[str, tf.Tensor], flat: tf.Tensor, collective: Collective,
            collective_name: str):
        """(update, new state, bytes handed to the FIRST and the SECOND collective, whether
        every rank's gradient was finite) of one exchange."""
        ops, method = self.engine.ops, self.engine.method

        def first(state, flat, *call_args):
            message, state, handover = method.first(ops, state, flat, self._call(*call_args))
            return message, state, self._tensors(handover)

        def second(state, received, data, *call_args):
            handover = self._handover(data, self._call(*call_args))
            message, state = method.second(ops, state, received, handover)
            return message, state, self._tensors(handover)

        def finish(received, data, *call_args):
            return method.finish(ops, received, self._handover(data, self._call(*call_args)))

        root = method.root(self._call(*self.call_args, None))
        message, state, data = self._shared("first", first, state, flat)
        received = collective(method.FIRST, message, f"{collective_name}.1", root)
        second_message, state, data = self._shared("second", second, state, received, data)
        received = collective(method.SECOND, second_message, f"{collective_name}.2", root)
        update, finite = self._shared("finish", finish, received, data)
        return update, state, _stage_bytes(method, message, second_message, root, self.engine.rank), finite
