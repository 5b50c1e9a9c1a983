"""The two-stage family (ScaleCom, blocksign) for TensorFlow: the whole exchange as graph ops.

:meth:`TwoStageEngine.exchange` runs the core's ``first``, the FIRST collective, ``second``,
the SECOND collective and ``finish`` for one tensor, and returns the averaged update; the
collectives come from the caller (``compression.py`` passes Horovod's, tests an emulation),
so this module knows nothing of Horovod. Inside a ``tf.function`` the step counter (hence
ScaleCom's leader, ``step mod N``) is a run-time value: the core writes it into the headers
and checks every received header against it.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import tensorflow as tf

from ..core.collectives import BROADCAST
from ..core.method import CompressCall
from ..core.twostage import TwoStageMethod
from .engine import Engine

# collective(kind, message, name, root) -> what this rank receives; ``root`` is the rank
# whose message a BROADCAST sends (a tensor in a graph).
Collective = Callable[[str, tf.Tensor, str, Any], tf.Tensor]


class TwoStageEngine(Engine):
    """:class:`Engine` for a :class:`~horovod_dgc.core.twostage.TwoStageMethod`."""

    method: TwoStageMethod

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

        def at_density(i: int) -> Tuple[tf.Tensor, Dict[str, tf.Tensor], tf.Tensor, tf.Tensor]:
            call = self._call(name, step_value, self._density(i, grad.shape), param, scale, grad.shape)
            with self.ops.guards() as guards:
                update, new_state, nbytes, finite = self._stages(state, flat, call, collective,
                                                                 f"{collective_name}.d{i}")
            with tf.control_dependencies(guards):
                return tf.identity(update), new_state, nbytes, tf.identity(finite)

        with tf.control_dependencies([started]):
            update, new_state, nbytes, finite = self._by_density(index, grad.shape, at_density)
        with tf.control_dependencies([self._keep_if(finite, name, state, new_state)]):
            update = update * tf.cast(scale, update.dtype)
        with tf.control_dependencies([update]):
            elapsed = tf.timestamp() - started
        density = tf.gather(tf.constant(self.densities, tf.float64), index)
        self._record([(self.method.FIRST, nbytes[0]), (self.method.SECOND, nbytes[1])],
                     numel * grad.dtype.size, elements_sent=tf.round(density * numel),
                     elements_compressed=numel, selection_time_s=elapsed)
        return tf.reshape(update, grad.shape), step

    def _stages(self, state: Dict[str, tf.Tensor], flat: tf.Tensor, call: CompressCall,
                collective: Collective, collective_name: str):
        """(update, new state, bytes handed to the FIRST and the SECOND collective, whether
        every rank's gradient was finite) of one exchange."""
        method = self.method
        root = method.root(call)
        message, state, handover = method.first(self.ops, state, flat, call)
        received = collective(method.FIRST, message, f"{collective_name}.1", root)
        second, state = method.second(self.ops, state, received, handover)
        received = collective(method.SECOND, second, f"{collective_name}.2", root)
        update, finite = method.finish(self.ops, received, handover)
        first_bytes = tf.size(message, out_type=tf.int64) * message.dtype.size
        if method.FIRST == BROADCAST:
            first_bytes = tf.where(tf.equal(tf.cast(root, tf.int64), call.rank), first_bytes, 0)
        second_bytes = tf.size(second, out_type=tf.int64) * second.dtype.size
        return update, state, tf.stack([first_bytes, second_bytes]), finite
