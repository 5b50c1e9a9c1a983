"""What compressed tensors add to a TensorFlow graph: ops, seconds of tracing, seconds of
the first run.

Horovod calls a compressor while tracing a ``tf.function``, so a model's first step waits for
every compressed tensor's exchange to be built op by op in Python (plus the function graphs
of its ``tf.cond`` and ``tf.while_loop``), and then for Grappler to optimize the result. This
times both for ``--tensors`` tensors of one shape, or for a Keras application's trainable
variables (``--keras-model ResNet50``: those the method compresses), on one worker: the
sparse methods' compress and decompress (traced once per size and shared), the two-stage
methods' whole exchange (per tensor), with Horovod's collectives replaced by what a lone
worker receives (its own message).

    .venv/bin/python -m benchmarks.trace_tf [--shape 256 64] [--tensors 1] [--repeat 5] [--methods dgc,...]
    .venv/bin/python -m benchmarks.trace_tf --keras-model ResNet50 --repeat 1 --methods dgc
        [--layout buckets] [--runs 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable, List, Sequence, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402 (the log level must be set before the import)

from horovod_dgc.core.bucket import Bucket  # noqa: E402
from horovod_dgc.core.collectives import ALLGATHER, backward_buckets  # noqa: E402
from horovod_dgc.core.methods import BY_NAME, METHODS  # noqa: E402
from horovod_dgc.tensorflow.engine import Engine  # noqa: E402
from horovod_dgc.tensorflow.twostage import TwoStageEngine  # noqa: E402

WORLD_SIZE = 1
DEFAULT_SHAPE = (256, 64)
DEFAULT_REPEAT = 5
DEFAULT_TENSORS = 1


def received(kind: str, message: tf.Tensor, name: str, root: Any = 0, chunks: Any = None) -> tf.Tensor:
    """A lone worker's result of any collective: its own message."""
    return message


Shape = Sequence[int]


def exchange(method_name: str, shapes: Sequence[Shape],
             layout: str = "tensors") -> Callable[[List[tf.Tensor]], List[tf.Tensor]]:
    """A fresh ``tf.function`` running the exchange of one gradient per shape of ``shapes``
    (those the method compresses) with a fresh engine: tensor by tensor, or in the stock
    path's buckets (``layout="buckets"``, for a method that compresses a bucket as one)."""
    method = BY_NAME[method_name].build(WORLD_SIZE)
    specs = [tf.TensorSpec(shape, tf.float32, name=f"layer{i}/kernel") for i, shape in enumerate(shapes)]
    if layout == "buckets":
        engine_class = TwoStageEngine if method.family == "two-stage" else Engine
        return _bucketed(engine_class(method, specs, WORLD_SIZE, rank=0), specs)
    if method.family == "two-stage":
        engine = TwoStageEngine(method, specs, WORLD_SIZE, rank=0)

        def one(name: str, grad: tf.Tensor) -> tf.Tensor:
            return engine.exchange(name, grad, None, received, "bench")[0]
    else:
        engine = Engine(method, specs, WORLD_SIZE, rank=0)

        def one(name: str, grad: tf.Tensor) -> tf.Tensor:
            message = engine.compress(name, grad, None)
            return engine.decompress(received(ALLGATHER, message.message, "bench"), message)

    def step(grads: List[tf.Tensor]) -> List[tf.Tensor]:
        return [one(spec.name, grad) if engine.compresses(spec) else grad
                for spec, grad in zip(specs, grads)]
    # Horovod's compressors run unconverted by AutoGraph (compression.py), and so does this.
    return tf.function(tf.autograph.experimental.do_not_convert(step))


def _bucketed(engine: Engine, specs: Sequence[tf.TensorSpec]) -> Callable[[List[tf.Tensor]], List[tf.Tensor]]:
    """:func:`exchange` in the buckets the compressors cut (``backward_buckets``)."""
    engine.method.require_bucketed()
    compressed = [spec for spec in specs if engine.compresses(spec)]
    buckets = backward_buckets([spec.name for spec in compressed], [spec.shape.num_elements() * 4 for spec in compressed])

    def exchanged(bucket: Bucket, members: List[tf.Tensor]) -> List[tf.Tensor]:
        if isinstance(engine, TwoStageEngine):
            return engine.exchange_bucket(bucket, members, [None] * len(members), received, "bench")[0]
        sent = engine.compress_bucket(bucket, members, [None] * len(members))
        return engine.decompress_bucket(received(ALLGATHER, sent.message, "bench"), sent)

    def step(grads: List[tf.Tensor]) -> List[tf.Tensor]:
        averaged = {spec.name: grad for spec, grad in zip(specs, grads)}
        for names in buckets:
            members = [averaged[name] for name in names]
            bucket = engine.bucket(f"bucket.{names[0]}", list(zip(names, members)))
            averaged.update(zip(names, exchanged(bucket, members)))
        return [averaged[spec.name] for spec in specs]
    return tf.function(tf.autograph.experimental.do_not_convert(step))


def graph_nodes(graph_def: Any) -> List[Any]:
    """The ops of a graph, those of the functions it calls (tf.cond branches, loop bodies)
    included."""
    return [*graph_def.node, *(n for f in graph_def.library.function for n in f.node_def)]


def graph_ops(graph_def: Any) -> int:
    """How many ops :func:`graph_nodes` finds."""
    return len(graph_nodes(graph_def))


def trace(method_name: str, shape: Shape, tensors: int = DEFAULT_TENSORS) -> Tuple[int, float, float, float]:
    """:func:`trace_shapes` of ``tensors`` tensors of ``shape``."""
    return trace_shapes(method_name, [shape] * tensors)


def trace_shapes(method_name: str, shapes: Sequence[Shape], layout: str = "tensors",
                 runs: int = 0) -> Tuple[int, float, float, float]:
    """(ops, seconds of the trace, seconds of the first run, median seconds of ``runs`` runs
    after it (0.0 for none)) of the exchange of a gradient of each shape of ``shapes``."""
    function = exchange(method_name, shapes, layout)
    started = time.perf_counter()
    concrete = function.get_concrete_function([tf.TensorSpec(shape, tf.float32) for shape in shapes])
    traced = time.perf_counter()
    grads = [tf.random.normal(shape) for shape in shapes]

    def run() -> float:
        began = time.perf_counter()
        for result in concrete(grads):
            result.numpy()
        return time.perf_counter() - began

    first = run()
    later = statistics.median(run() for _ in range(runs)) if runs else 0.0
    return graph_ops(concrete.graph.as_graph_def()), traced - started, first, later


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs="+", default=list(DEFAULT_SHAPE),
                        help=f"the tensor's shape (default: {' '.join(map(str, DEFAULT_SHAPE))})")
    parser.add_argument("--tensors", type=int, default=DEFAULT_TENSORS,
                        help=f"tensors of that shape in the step (default: {DEFAULT_TENSORS})")
    parser.add_argument("--keras-model", default=None,
                        help="a keras.applications model (ResNet50, ...) whose trainable variables "
                             "are the tensors, instead of --shape and --tensors")
    parser.add_argument("--repeat", type=int, default=DEFAULT_REPEAT,
                        help=f"traces per method, after one warm-up (default: {DEFAULT_REPEAT})")
    parser.add_argument("--methods", default=",".join(spec.name for spec in METHODS),
                        help="comma-separated methods (default: all)")
    parser.add_argument("--layout", choices=("tensors", "buckets"), default="tensors",
                        help="tensor by tensor, or in the stock path's buckets (every method at its defaults)")
    parser.add_argument("--runs", type=int, default=0,
                        help="runs after the first, timed (median): a built step's time")
    return parser.parse_args()


def model_shapes(name: str) -> List[Shape]:
    """The shapes of a ``keras.applications`` model's trainable variables (no weights loaded)."""
    import keras
    model = getattr(keras.applications, name)(weights=None)
    return [tuple(variable.shape) for variable in model.trainable_variables]


def main() -> None:
    args = parse_args()
    if args.keras_model:
        shapes = model_shapes(args.keras_model)
        what = f"{args.keras_model}'s {len(shapes)} trainable variables ({len(set(shapes))} shapes)"
    else:
        shapes = [tuple(args.shape)] * args.tensors
        what = f"{args.tensors} float32 tensor(s) of shape {tuple(args.shape)}"
    print(f"{what}, {args.layout}, one worker, default options; TensorFlow {tf.__version__}; "
          f"{args.repeat} traces after one warm-up (one {DEFAULT_SHAPE} tensor)\n")
    print(f"{'method':<12} {'ops':>6} {'trace s':>8} {'first run s':>12} {'run s':>8}   (medians)")
    for name in args.methods.split(","):
        trace(name, DEFAULT_SHAPE)
        results = [trace_shapes(name, shapes, args.layout, args.runs) for _ in range(args.repeat)]
        traced, first_run, later = (statistics.median(r[i] for r in results) for i in (1, 2, 3))
        print(f"{name:<12} {results[-1][0]:>6} {traced:>8.3f} {first_run:>12.3f} {later:>8.3f}")

if __name__ == "__main__":
    main()
