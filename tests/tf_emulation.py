"""An emulated collective for in-process TensorFlow tests of the two-stage engine."""
import tensorflow as tf


def single_worker(kind: str, message: tf.Tensor, name: str, root) -> tf.Tensor:
    """Every collective of a one-worker job hands the message back."""
    return tf.identity(message)
