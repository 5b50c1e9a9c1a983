"""Counts the bytes handed to Horovod per step through the stock DistributedGradientTape (by
wrapping the real collectives) for dense and DGC on a Keras 3 model of over 1M parameters,
inside tf.function; rank 0 prints the figures.

The wrappers run while tracing, once per traced graph, and every step of a graph hands
Horovod the same tensors: the bytes of one trace are the bytes of one step. Eagerly, Horovod
traces the same exchange into a graph of its own, so the figures would be the same.
"""
import json
from collections import defaultdict

import keras
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import horovod_dgc.tensorflow as hdgc

traced_bytes = defaultdict(int)


def counting(collective):
    def wrapper(tensor, *args, **kwargs):
        graph = tensor.graph
        while hasattr(getattr(graph, "outer_graph", None), "outer_graph"):
            graph = graph.outer_graph
        traced_bytes[id(graph)] += tensor.shape.num_elements() * tensor.dtype.size
        return collective(tensor, *args, **kwargs)
    return wrapper


# Every collective horovod_dgc or Horovod's tape launches for gradients goes through these.
hvd.allgather = counting(hvd.allgather)
hvd._allreduce = counting(hvd._allreduce)


def model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((1024,)), keras.layers.Dense(1024, activation="relu"),
                             keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])


def bytes_per_step(mode: str, compression_name: str, steps: int = 3) -> dict:
    net = model()
    variables = net.trainable_variables
    if compression_name == "dgc":
        compression = hdgc.Compression.dgc(variables=variables, density=0.001, value_dtype="float16")
    else:
        compression = hdgc.Compression.none

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(net(x)))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, [v.value for v in variables])
        for v, g in zip(variables, grads):
            v.assign_sub(0.01 * g)

    step_fn = tf.function(step) if mode == "function" else step
    traced_bytes.clear()
    rs = np.random.RandomState(hvd.rank())
    for _ in range(steps):
        step_fn(tf.constant(rs.standard_normal((32, 1024)), tf.float32))
    result = {"bytes_per_step": max(traced_bytes.values()), "params": int(net.count_params())}
    if compression_name == "dgc":
        result["stats_bytes_per_step"] = compression.stats().bytes_sent_per_step
    return result


if __name__ == "__main__":
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    figures = {name: bytes_per_step("function", name) for name in ("dense", "dgc")}
    if hvd.rank() == 0:
        print("TRAFFIC " + json.dumps(figures), flush=True)
