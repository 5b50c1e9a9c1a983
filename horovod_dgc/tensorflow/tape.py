"""``DistributedGradientTape`` that accepts Keras 3 variables: Horovod's own, unmodified,
behind a thin proxy.

Horovod 0.28.1's tape keys gradients by ``variable.ref()``, which Keras 3 variables (not
``tf.Variable``s) lack. A Keras 3 variable holds a ``tf.Variable`` (``.value``), which is
what the tape watched when the model read it; the proxy hands Horovod those instead.
"""
from __future__ import annotations

from typing import Any, Optional

import horovod.tensorflow as hvd
import tensorflow as tf

from .compression import MethodCompressor, as_tf_variable


class DistributedGradientTape:
    """Horovod's ``hvd.DistributedGradientTape(tape, **options)``, taking Keras 3 variables
    as ``sources`` (and as local sources).

    A horovod_dgc compressor built without ``variables=`` is bound to the sources of the
    first ``gradient`` call, named by their Keras paths (``"sequential/dense/kernel"``). Every
    other attribute is the Horovod tape's.
    """

    def __init__(self, tape: tf.GradientTape, **options: Any):
        self._horovod_tape = hvd.DistributedGradientTape(tape, **options)
        self._compression = options.get("compression")

    def gradient(self, target: Any, sources: Any, output_gradients: Optional[Any] = None,
                 **options: Any) -> Any:
        if isinstance(self._compression, MethodCompressor) and not self._compression.bound:
            self._compression.bind(tf.nest.flatten(sources))
        variables = tf.nest.map_structure(as_tf_variable, sources)
        return self._horovod_tape.gradient(target, variables, output_gradients, **options)

    def register_local_source(self, source: Any) -> None:
        self._horovod_tape.register_local_source(as_tf_variable(source))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._horovod_tape, name)
