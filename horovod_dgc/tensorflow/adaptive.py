"""The adaptive switch in TensorFlow (``adaptive=`` of every compressor): each bucket's mode
is a variable that the traced step reads, choosing at run time (``tf.cond``) between the
bucket's compressed exchange and its dense step (``Engine.flush_bucket``: its gradients with
every update its memories owe, averaged by one all-reduce). The step's ops sum each bucket's
compute seconds (``tf.timestamp``) and the time spent waiting for its collectives.

The decisions are taken eagerly, between steps: ``compression.end_step()`` after each
optimizer step (the Keras callback ``CompressionWarmup`` calls it after every batch) runs
:class:`~horovod_dgc.core.adaptive.StepEnd`, the same work as in PyTorch: samples, probes of
the link, the ranks' averaged measurements, and the modes, which it assigns to the variables.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import horovod.tensorflow as hvd
import tensorflow as tf

from ..core.adaptive import DENSE, Adaptive, BucketTraffic, Decision, StepEnd, Switch
from ..core.bucket import Bucket
from ..core.collectives import ALLREDUCE
from .collectives import run
from .engine import REDUCIBLE, WAITED, _variable_maker

# A bucket's mode as its variable holds it.
_DENSE_CODE = 1


class AdaptiveBuckets:
    """One compressor's switch (:class:`~horovod_dgc.core.adaptive.Switch`), its buckets' mode
    variables, and the eager collectives of its decisions."""

    def __init__(self, compressor: Any, settings: Optional[Adaptive]) -> None:
        """``compressor``: the ``MethodCompressor`` that holds this switch."""
        self.compressor = compressor
        self.switch = Switch(settings)
        self._buckets: Dict[str, Bucket] = {}
        self._modes: Dict[str, tf.Variable] = {}
        self._step_end = StepEnd(self.switch, self)
        self._warned = False

    @property
    def labels(self) -> List[str]:
        """Every bucket traced so far."""
        return sorted(self._buckets)

    # -- in the traced step ---------------------------------------------------------------------
    def launch(self, bucket: Bucket, grads: Sequence[tf.Tensor], variables: Sequence[Any], collective: str
               ) -> Tuple[tf.Tensor, List[Callable[[], tf.Tensor]]]:
        """The compressor's ``launch_bucket``, or the bucket's dense step where its mode
        variable says dense at run time: (the step counter, per member its averaged gradient)."""
        compressor, engine = self.compressor, self.compressor.engine
        self._buckets[bucket.label] = bucket

        def compressed() -> List[tf.Tensor]:
            step, finishes = compressor.launch_bucket(bucket, grads, variables, collective)
            return [step, *[finish() for finish in finishes]]

        def dense() -> List[tf.Tensor]:
            sent = engine.flush_bucket(bucket, grads, variables)
            averaged, _ = engine.waited_for(
                lambda message: compressor.collective(ALLREDUCE, message, f"{collective}.flush"), sent.tensor)
            return [sent.step, *engine.flushed(sent, averaged)]

        results = tf.cond(tf.equal(self._variable(bucket.label), _DENSE_CODE), dense, compressed)
        return results[0], [lambda result=result: result for result in results[1:]]

    def _variable(self, label: str) -> tf.Variable:
        if label not in self._modes:
            with _variable_maker() as variable:
                self._modes[label] = variable(self._code(label), name=f"horovod_dgc/mode/{label}")
        return self._modes[label]

    def _code(self, label: str) -> int:
        return _DENSE_CODE if self.switch.mode(label) == DENSE else 0

    # -- between steps (eagerly) -------------------------------------------------------------------
    def end_step(self) -> List[Decision]:
        """After an optimizer step: the switch's samples and, at a decision step, its
        decisions (collectives: every rank calls it after the same step). A second call
        after the same step does nothing."""
        if not self.compressor.started:
            return []
        engine = self.compressor.engine
        spent = engine.take_compute_s()
        step = self._steps_taken() - 1
        if self.switch.settings is None or step < 0 or step == self._step_end.last_step:
            return []
        self._step_end.exchanged(spent.pop(WAITED, 0.0))
        decisions = self._step_end(step, {label: spent.get(b.key, 0.0) for label, b in self._buckets.items()},
                                   self._traffic)
        self.assign_modes()
        return decisions

    def restore(self, modes: Optional[dict], steps_taken: int) -> None:
        """See :meth:`~horovod_dgc.core.adaptive.StepEnd.restore`; the mode variables set."""
        self._step_end.restore(modes, steps_taken)
        self.assign_modes()

    def assign_modes(self) -> None:
        """Every mode variable set to its bucket's mode now (decided or forced)."""
        for label, variable in self._modes.items():
            variable.assign(self._code(label))

    def warn_if_never_ended(self) -> None:
        """Warn, once, where steps went past the first decision without :meth:`end_step`."""
        settings = self.switch.settings
        if (settings is None or self._warned or self._step_end.last_step >= 0 or not self.compressor.started
                or self._steps_taken() <= settings.first_decision_step + 1):
            return
        self._warned = True
        warnings.warn(f"adaptive= decides in compression.end_step(), which no step has called in "
                      f"{self._steps_taken()} steps: every bucket stays compressed; call it after each "
                      f"optimizer step (Keras: pass horovod_dgc.tensorflow.CompressionWarmup(compression) "
                      f"to fit's callbacks)", stacklevel=3)

    def _steps_taken(self) -> int:
        """The steps the buckets have taken: one member's counter each (a bucket's members step
        together), not every tensor's."""
        return self.compressor.engine.steps_of(bucket.names[0] for bucket in self._buckets.values())

    def _traffic(self) -> Dict[str, BucketTraffic]:
        engine = self.compressor.engine
        return {label: BucketTraffic(bucket.numel * REDUCIBLE.get(_dtype(bucket), _dtype(bucket)).size,
                                     engine.bucket_exchanges(bucket))
                for label, bucket in self._buckets.items()}

    # -- the collectives of core.adaptive.StepEnd ------------------------------------------------
    def size(self) -> int:
        return self.compressor.engine.world_size

    def rank(self) -> int:
        return self.compressor.engine.rank

    def mean(self, values: Sequence[float], name: str) -> List[float]:
        return [float(v) for v in self._allreduce(tf.constant(list(values), tf.float64), name).numpy()]

    def allreduce_s(self, numel: int, name: str) -> float:
        probe = tf.zeros([numel], tf.float32)
        started = time.perf_counter()
        self._allreduce(probe, name).numpy()
        return time.perf_counter() - started

    def _allreduce(self, tensor: tf.Tensor, name: str) -> tf.Tensor:
        """The average over the ranks of ``tensor``, eagerly; its bytes counted in ``stats()``."""
        self.compressor.engine.record_allreduce(tensor.shape.num_elements() * tensor.dtype.size)
        return run(ALLREDUCE, tensor, name, process_set=hvd.global_process_set)


def _dtype(bucket: Bucket) -> tf.DType:
    return tf.as_dtype(bucket.dtype)
