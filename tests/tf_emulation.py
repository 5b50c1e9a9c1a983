"""In-process TensorFlow helpers: an emulated collective for the two-stage engine, and
``tf.function`` as horovod_dgc's code runs inside a user's function."""
import tensorflow as tf


def single_worker(kind: str, message: tf.Tensor, name: str, root, chunks=None) -> tf.Tensor:
    """Every collective of a one-worker job hands the message back."""
    return tf.identity(message)


def graph_function(fn=None, **options):
    """``tf.function`` without autograph. A user's function reaches the engine through the
    compressor's ``compress`` and ``decompress``, which autograph does not convert, so a test
    calling the engine directly must not let autograph convert it either: that converts
    thousands of the core's functions (about 20 s per trace of DGC through warm-up) and runs
    code no user runs."""
    return tf.function(fn, autograph=False, **options)
