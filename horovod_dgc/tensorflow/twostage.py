"""The two-stage methods (ScaleCom, blocksign) for TensorFlow: the whole exchange as graph ops.

:meth:`TwoStageEngine.exchange` runs the core's ``first``, the FIRST collective, ``second``,
the SECOND collective and ``finish`` for one tensor, and returns the averaged update; the
collectives come from the caller (``compression.py`` passes Horovod's, tests an emulation),
so this module knows nothing of Horovod.

**The step in a graph.** Inside a ``tf.function`` the step counter (hence ScaleCom's leader,
``step mod N``) is known only at run time, while the core checks every received header
against a step and a sender known when it builds the check. So ``first`` gets the run-time
step (it writes it into its headers and samples with it); on arrival the engine compares
the step and sender words of every received header with their run-time values (on a
difference, the core's own check runs with the run-time values and names the rank), then
rewrites those words to what the core expects at step 0, and runs ``second`` and ``finish``
with step 0. The SECOND stage's headers then carry step 0: its collectives are named per
tensor, so a FIRST stage whose steps agreed pairs with the matching SECOND stage.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

import tensorflow as tf

from ..core.blocksign import BlockSign, shard_length
from ..core.exchange import ALLGATHER, BROADCAST, Pending, TwoStageMethod
from ..core.sparse import StepContext, state_dtype
from ..core.wire import HEADER_FIELDS, HEADER_WORDS
from .engine import Engine, State, _fit, _ops
from .ops import DTYPES, checked_call, dtype_name

# collective(kind, message, name, root) -> what this rank receives; ``root`` is the rank
# whose message a BROADCAST sends (a tensor in a graph).
Collective = Callable[[str, tf.Tensor, str, Any], tf.Tensor]
_RANK_WORD = HEADER_FIELDS.index("sender rank")
_STEP_WORD = HEADER_FIELDS.index("step")
_INT31 = 2 ** 31


def emulated_single_worker(kind: str, message: tf.Tensor, name: str, root: Any) -> tf.Tensor:
    """Every collective of a one-worker job hands the message back (in-process tests)."""
    return tf.identity(message)


class TwoStageEngine(Engine):
    """:class:`Engine` for a :class:`~horovod_dgc.core.exchange.TwoStageMethod`."""

    method: TwoStageMethod

    def _new_state(self, spec: tf.TensorSpec) -> State:
        state = super()._new_state(spec)
        if isinstance(self.method, BlockSign) and self.compresses(spec):
            # The server's residual for this rank's shard, which the core creates at its
            # first use: a variable must exist before the first trace.
            shard = shard_length(spec.shape.num_elements(), self.world_size, self.config.block_size)
            dtype = DTYPES[state_dtype(dtype_name(spec.dtype))]
            state["server"] = tf.Variable(tf.zeros([shard], dtype), trainable=False,
                                          name=f"horovod_dgc/{spec.name}/server")
        return state

    def exchange(self, name: str, grad: tf.Tensor, param: Optional[Any], collective: Collective,
                 collective_name: str) -> Tuple[tf.Tensor, tf.Tensor]:
        """(averaged update shaped like ``grad``, this step's counter) for a tensor that
        :meth:`compresses`; collectives are named ``collective_name`` + stage and density."""
        started = tf.timestamp()
        flat = tf.reshape(grad, [-1])
        numel = flat.shape.num_elements()
        index = self._density_index.read_value()
        step = self._next_step(name)
        state = self._read_state(name)
        step_value = int(step) if tf.executing_eagerly() else step

        def at_density(i: int) -> Tuple[tf.Tensor, Dict[str, tf.Tensor], tf.Tensor]:
            ctx = self._context(name, step_value, self.densities[i], param)
            with self.ops.guards() as guards:
                update, new_state, nbytes = self._stages(state, flat, ctx, collective,
                                                         f"{collective_name}.d{i}")
            with tf.control_dependencies(guards):
                return tf.identity(update), new_state, nbytes

        with tf.control_dependencies([started]):
            update, new_state, nbytes = self._by_density(index, at_density)
        self._assign_state(name, new_state)
        with tf.control_dependencies([update]):
            elapsed = tf.timestamp() - started
        density = tf.gather(tf.constant(self.densities, tf.float64), index)
        self._record(bytes_sent=nbytes, dense_bytes=numel * grad.dtype.size,
                     elements_sent=tf.round(density * numel), elements_compressed=numel,
                     selection_time_s=elapsed)
        return tf.reshape(update, grad.shape), step

    def _stages(self, state: Dict[str, tf.Tensor], flat: tf.Tensor, ctx: StepContext,
                collective: Collective, collective_name: str):
        """(update, new state, bytes handed to the collectives) of one exchange."""
        method = self.method
        root = method.root(ctx)
        message, state, pending = method.first(self.ops, state, flat, ctx)
        received = self._received(collective(method.FIRST, message, f"{collective_name}.1", root),
                                  method.FIRST, message)
        received, pending = self._arrived(received, method.FIRST, pending, root)
        second, state = method.second(self.ops, state, received, pending)
        received = self._received(collective(method.SECOND, second, f"{collective_name}.2", root),
                                  method.SECOND, second)
        update = method.finish(self.ops, received, pending)
        first_bytes = tf.size(message, out_type=tf.int64) * message.dtype.size
        if method.FIRST == BROADCAST:
            first_bytes = tf.where(tf.equal(tf.cast(root, tf.int64), ctx.rank), first_bytes, 0)
        second_bytes = tf.size(second, out_type=tf.int64) * second.dtype.size
        return update, state, first_bytes + second_bytes

    def _received(self, received: tf.Tensor, kind: str, sent: tf.Tensor) -> tf.Tensor:
        """What a collective delivered, with its static length; a length other than the one
        this rank's settings give fails the step with both lengths."""
        expected = sent.shape.num_elements() * (self.world_size if kind == ALLGATHER else 1)
        with self.ops.guards() as guards:
            self.ops.check(tf.equal(tf.size(received), expected), ValueError(
                f"a {kind} of horovod_dgc delivered a message of another length than the "
                f"{expected} elements expected on rank {self.rank}: do all ranks use the same "
                f"settings and variables?"))
        with tf.control_dependencies(guards):
            return _fit(received, expected)

    def _arrived(self, received: tf.Tensor, kind: str, pending: Pending,
                 root: Any) -> Tuple[tf.Tensor, Pending]:
        """Stage-1 messages checked against the run-time step and senders, rewritten for
        the core's checks at step 0 (see the module's docstring); eagerly, as they are."""
        ctx = pending.ctx
        if isinstance(ctx.step, int):
            return received, pending
        rows = 1 if kind == BROADCAST else self.world_size
        data = tf.reshape(received, [rows, -1])
        headers = tf.bitcast(tf.reshape(data[:, :HEADER_WORDS * 4], [rows, HEADER_WORDS, 4]), tf.int32)
        senders = tf.cast(tf.reshape(root, [1]) if kind == BROADCAST else tf.range(rows), tf.int32)
        step = tf.cast(ctx.step % _INT31, tf.int32)
        agree = tf.logical_and(tf.reduce_all(tf.equal(headers[:, _STEP_WORD], step)),
                               tf.reduce_all(tf.equal(headers[:, _RANK_WORD], senders)))
        layout = pending.data["layout"]
        checked = tf.cond(agree, lambda: tf.constant(True),
                          lambda: _check_headers(headers, layout, senders, ctx.step))
        core_pending = dataclasses.replace(pending, ctx=dataclasses.replace(ctx, step=0))
        core_senders = (tf.fill([rows], self.method.root(core_pending.ctx)) if kind == BROADCAST
                        else tf.range(rows))
        core_words = tf.stack([core_senders, tf.zeros([rows], tf.int32)], 1)
        core_bytes = tf.reshape(tf.bitcast(core_words, tf.uint8), [rows, 8])
        data = tf.concat([data[:, :_RANK_WORD * 4], core_bytes, data[:, (_STEP_WORD + 1) * 4:]], 1)
        with tf.control_dependencies([checked]):
            return tf.reshape(data, [-1]), core_pending


def _check_headers(headers: tf.Tensor, layout, senders: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
    """The core's header check with the run-time step and senders (raises, naming the rank)."""
    def check(words: tf.Tensor, sender_ranks: tf.Tensor, step_value: tf.Tensor) -> None:
        for header, sender in zip(words.numpy().tolist(), sender_ranks.numpy().tolist()):
            layout.check(header, sender, int(step_value))

    with tf.control_dependencies(_ops(checked_call(check, [headers, senders, step]))):
        return tf.constant(True)

