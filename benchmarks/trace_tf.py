"""What one compressed tensor adds to a TensorFlow graph: ops, seconds of tracing, seconds
of the first run.

Horovod calls a compressor while tracing a ``tf.function``, so a model's first step waits for
every compressed tensor's exchange to be built op by op in Python (plus the function graphs
of its ``tf.cond`` and ``tf.while_loop``), and then for Grappler to optimize the result. This
times both for one tensor on one worker: the sparse methods' compress and decompress, the
two-stage methods' whole exchange, with Horovod's collectives replaced by what a lone worker
receives (its own message).

    .venv/bin/python -m benchmarks.trace_tf [--shape 256 64] [--repeat 5] [--methods dgc,...]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable, List, Sequence, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402 (the log level must be set before the import)

from horovod_dgc.core.collectives import ALLGATHER  # noqa: E402
from horovod_dgc.core.methods import BY_NAME, METHODS  # noqa: E402
from horovod_dgc.tensorflow.engine import Engine  # noqa: E402
from horovod_dgc.tensorflow.twostage import TwoStageEngine  # noqa: E402

WORLD_SIZE = 1
DEFAULT_SHAPE = (256, 64)
DEFAULT_REPEAT = 5


def received(kind: str, message: tf.Tensor, name: str, root: Any = 0) -> tf.Tensor:
    """A lone worker's result of any collective: its own message."""
    return message


def exchange(method_name: str, shape: Sequence[int]) -> Callable[[tf.Tensor], tf.Tensor]:
    """A fresh ``tf.function`` running one tensor's exchange with a fresh engine."""
    method = BY_NAME[method_name].build(WORLD_SIZE)
    spec = tf.TensorSpec(shape, tf.float32, name="layer/kernel")
    if method.family == "two-stage":
        engine = TwoStageEngine(method, [spec], WORLD_SIZE, rank=0)

        def step(grad: tf.Tensor) -> tf.Tensor:
            return engine.exchange(spec.name, grad, None, received, "bench")[0]
    else:
        engine = Engine(method, [spec], WORLD_SIZE, rank=0)

        def step(grad: tf.Tensor) -> tf.Tensor:
            message = engine.compress(spec.name, grad, None)
            return engine.decompress(received(ALLGATHER, message.message, "bench"), message)
    # Horovod's compressors run unconverted by AutoGraph (compression.py), and so does this.
    return tf.function(tf.autograph.experimental.do_not_convert(step))


def graph_nodes(graph_def: Any) -> List[Any]:
    """The ops of a graph, those of the functions it calls (tf.cond branches, loop bodies)
    included."""
    return [*graph_def.node, *(n for f in graph_def.library.function for n in f.node_def)]


def graph_ops(graph_def: Any) -> int:
    """How many ops :func:`graph_nodes` finds."""
    return len(graph_nodes(graph_def))


def trace(method_name: str, shape: Sequence[int]) -> Tuple[int, float, float]:
    """(ops, seconds of the trace, seconds of the first run) of one tensor's exchange."""
    function = exchange(method_name, shape)
    started = time.perf_counter()
    concrete = function.get_concrete_function(tf.TensorSpec(shape, tf.float32))
    traced = time.perf_counter()
    concrete(tf.random.normal(shape)).numpy()
    return graph_ops(concrete.graph.as_graph_def()), traced - started, time.perf_counter() - traced


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs="+", default=list(DEFAULT_SHAPE),
                        help=f"the tensor's shape (default: {' '.join(map(str, DEFAULT_SHAPE))})")
    parser.add_argument("--repeat", type=int, default=DEFAULT_REPEAT,
                        help=f"traces per method, after one warm-up (default: {DEFAULT_REPEAT})")
    parser.add_argument("--methods", default=",".join(spec.name for spec in METHODS),
                        help="comma-separated methods (default: all)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    print(f"one {tuple(args.shape)} float32 tensor, one worker, default options; "
          f"TensorFlow {tf.__version__}; {args.repeat} traces after one warm-up\n")
    print(f"{'method':<12} {'ops':>6} {'trace s':>8} {'first run s':>12}   (medians)")
    for name in args.methods.split(","):
        trace(name, args.shape)
        results: List[Tuple[int, float, float]] = [trace(name, args.shape) for _ in range(args.repeat)]
        traced = statistics.median(r[1] for r in results)
        first_run = statistics.median(r[2] for r in results)
        print(f"{name:<12} {results[-1][0]:>6} {traced:>8.3f} {first_run:>12.3f}")


if __name__ == "__main__":
    main()
