"""ScaleCom, blocksign and the sparse all-reduce (DGC, Top-k, Gaussian-k with
``aggregation="sparse_allreduce"``) through the stock ``hvd.DistributedGradientTape``, eagerly and
inside ``tf.function``: 6 steps of fixed per-rank gradients; every rank checks each step's
aggregated gradient against the core's in-process simulation of all the workers, and that
its memories equal the simulated worker's.

The variables include a small tensor (a bias: dense for blocksign, its own density for
ScaleCom), a one-element tensor and two kernels of one shape, the compressed ones exchanged
as one bucket. Eagerly the compressor is given ``variables=``;
inside ``tf.function`` it is given nothing and takes them from Horovod's call.
"""
import argparse

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import horovod_dgc.tensorflow as hdgc
from aggregate_tensorflow import record_collectives
from horovod_dgc.core.twostage import simulate_step
from horovod_dgc.core.method import CompressCall
from horovod_dgc.tensorflow import TFOps

STEPS = 6
SPARSE_ALLREDUCE = dict(aggregation="sparse_allreduce", density=0.01)
KINDS = {"scalecom": ("scalecom", dict(density=0.01)), "blocksign": ("blocksign", dict()),
         "blocksign64": ("blocksign", dict(block_size=64, momentum=0.9)),
         "dgc-sar": ("dgc", SPARSE_ALLREDUCE), "topk-sar": ("topk", SPARSE_ALLREDUCE),
         "gaussiank-sar": ("gaussiank", SPARSE_ALLREDUCE)}


def variables():
    shapes = {"first/kernel": (64, 300), "first/bias": (300,), "second/kernel": (64, 300), "scale": (1,)}
    return [tf.Variable(tf.zeros(shape), name=name) for name, shape in shapes.items()]


def gradients(rank: int, step: int, names) -> dict:
    rs = np.random.RandomState(1000 + 10 * rank + step)
    return {name: (rs.standard_normal(shape) * (1 + step % 3)).astype(np.float32) for name, shape in names.items()}


def run(kind: str, mode: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    model_vars = variables()
    names = {v.name.rsplit(":", 1)[0]: tuple(v.shape) for v in model_vars}
    method_name, options = KINDS[kind]
    given = model_vars if mode == "eager" else None
    compression = getattr(hdgc.Compression, method_name)(variables=given, **options)
    assert compression.method.family == "two-stage", kind
    launched = record_collectives(compression)

    def step_fn(grads):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * grads[n]) for v, n in zip(model_vars, names)])
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        return tape.gradient(loss, model_vars)

    if mode == "function":
        step_fn = tf.function(step_fn)
    method, ops = compression.method, TFOps()
    compressed = [n for n, shape in names.items() if compression.config.compresses(shape, "float32")]
    assert compressed
    states = {n: [method.init_state(ops, tf.zeros([np.prod(names[n])]), n in compressed, size) for _ in range(size)]
              for n in names}
    for step in range(STEPS):
        everyone = [gradients(r, step, names) for r in range(size)]
        got = dict(zip(names, step_fn({n: tf.constant(g) for n, g in everyone[rank].items()})))
        for name in names:
            if name in compressed:
                small = method.config.is_small(names[name])
                density = method.config.density_for(step, 0, small)
                ctxs = [CompressCall(name, r, size, step, density, small=small) for r in range(size)]
                grads = [tf.constant(g[name].reshape(-1)) for g in everyone]
                results, states[name] = simulate_step(ops, method, states[name], grads, ctxs)
                want = results[rank].numpy().reshape(names[name])
                if method_name == "scalecom":
                    assert np.array_equal(got[name].numpy() != 0, want != 0), f"{kind} {name} step {step}: indices"
            else:  # dense, after the method's own momentum if it keeps one
                ctxs = [CompressCall(name, r, size, step, 1.0) for r in range(size)]
                sent = [method.dense(ops, state, tf.constant(g[name].reshape(-1)), ctx)
                        for state, g, ctx in zip(states[name], everyone, ctxs)]
                states[name] = [state for _, state in sent]
                want = sum(update.numpy() for update, _ in sent).reshape(names[name]) / size
            np.testing.assert_allclose(got[name].numpy(), want, rtol=1e-6, atol=1e-6,
                                       err_msg=f"rank {rank} {kind}/{mode} {name} step {step}")
    for name in names:
        for key, variable in compression.engine._states[name].items():
            np.testing.assert_allclose(variable.numpy(), states[name][rank][key].numpy(), rtol=1e-5, atol=1e-5,
                                       err_msg=f"rank {rank} {kind}/{mode} {name} memory {key}")
    assert compression.stats().steps == STEPS, compression.stats()
    # The compressed tensors fit one bucket: its collectives only, none per tensor.
    assert launched and all(".bucket." in name for name in launched), (kind, launched)
    print(f"rank {rank}/{size} {kind} {mode} twostage ok", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--modes", default="eager,function")
    parser.add_argument("--eager-kinds", default=None,
                        help="the kinds of --kinds that also run eagerly (default: all)")
    args = parser.parse_args()
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    kinds = args.kinds.split(",")
    eager_kinds = kinds if args.eager_kinds is None else args.eager_kinds.split(",")
    for mode in args.modes.split(","):
        for kind in kinds:
            if mode == "function" or kind in eager_kinds:
                run(kind, mode)
