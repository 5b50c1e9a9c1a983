"""``hierarchical=True`` on 2 hosts x 2 workers (``horovodrun -H localhost:2,127.0.0.1:2``)
through the stock ``hvd.DistributedGradientTape`` inside ``tf.function``: 4 steps of per-rank
gradients; every rank checks each step's averaged gradient, and its memories, against:

* topk: a naive reference written here: each host averages its workers' gradients, adds its
  residual, keeps the exact top-k by magnitude (a sort); the update is the mean over hosts;
* scalecom and dgc with the sparse all-reduce (broadcast, all-reduce, alltoall and
  allgather between hosts): the core's in-process simulation of as many workers as hosts,
  fed the host averages.
* blocksign-bf16: blocksign on bfloat16 variables. A host's average is taken in float32 and
  rounded back to bfloat16 before the method sees it, so the simulation is fed those rounded
  averages; the gradient comes back in bfloat16, within one unit of its last place. Not
  topk: bfloat16 gradients tie in magnitude, and top-k may break a tie either way.
"""
import argparse

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import horovod_dgc.tensorflow as hdgc
from horovod_dgc.core.method import CompressCall
from horovod_dgc.core.selection import top_count
from horovod_dgc.core.twostage import simulate_step
from horovod_dgc.tensorflow import TFOps

STEPS = 4
DENSITY = 0.01
HOSTS = [[0, 1], [2, 3]]
KINDS = {"topk": ("topk", dict(density=DENSITY, value_dtype="float32")),
         "scalecom": ("scalecom", dict(density=DENSITY)),
         "dgc-sar": ("dgc", dict(aggregation="sparse_allreduce", density=DENSITY)),
         "blocksign-bf16": ("blocksign", dict(block_size=64))}
SHAPES = {"first/kernel": (64, 300), "second/kernel": (64, 300)}


def as_dtype(values: np.ndarray, dtype: tf.DType) -> np.ndarray:
    """``values`` rounded to ``dtype`` (round to nearest even, as TensorFlow's cast), in float32."""
    return tf.cast(tf.cast(values, dtype), tf.float32).numpy()


def gradients(rank: int, step: int, dtype: tf.DType = tf.float32) -> dict:
    """Rank ``rank``'s gradients of step ``step``, exactly representable in ``dtype``."""
    rs = np.random.RandomState(1000 + 10 * rank + step)
    return {n: as_dtype(rs.standard_normal(shape).astype(np.float32), dtype) for n, shape in SHAPES.items()}


def host_averages(step: int, dtype: tf.DType = tf.float32):
    """Each host's average in float32, rounded to ``dtype`` as the in-host all-reduce's is."""
    everyone = [gradients(r, step, dtype) for r in range(4)]
    return [{n: as_dtype(sum(everyone[r][n] for r in ranks) / len(ranks), dtype) for n in SHAPES}
            for ranks in HOSTS]


class NaiveTopK:
    """Each host: residual + host average, keep the exact top-k by magnitude (a sort)."""

    def __init__(self, config):
        self.config = config
        self.residuals = [{n: np.zeros(int(np.prod(s)), np.float32) for n, s in SHAPES.items()}
                          for _ in HOSTS]

    def step(self, name: str, step: int, averages) -> np.ndarray:
        k = top_count(self.config.density_for(step, 0, False), int(np.prod(SHAPES[name])))
        update = np.zeros(int(np.prod(SHAPES[name])), np.float32)
        for h, average in enumerate(averages):
            acc = self.residuals[h][name] + average[name].reshape(-1)
            order = sorted(range(acc.size), key=lambda i: -abs(float(acc[i])))[:k]
            kept = np.zeros_like(acc)
            kept[order] = acc[order]
            self.residuals[h][name] = acc - kept
            update += kept
        return update / len(averages)

    def memory(self, name: str, host: int) -> dict:
        return {"residual": self.residuals[host][name]}


class Simulation:
    """The core's simulation of as many workers as hosts, fed the host averages."""

    def __init__(self, method):
        self.method, self.ops = method, TFOps()
        self.states = {n: [method.init_state(self.ops, tf.zeros([int(np.prod(s))]), True, len(HOSTS))
                           for _ in HOSTS] for n, s in SHAPES.items()}

    def step(self, name: str, step: int, averages) -> np.ndarray:
        density = self.method.config.density_for(step, 0, False)
        calls = [CompressCall(name, h, len(HOSTS), step, density) for h in range(len(HOSTS))]
        grads = [tf.constant(a[name].reshape(-1)) for a in averages]
        results, self.states[name] = simulate_step(self.ops, self.method, self.states[name],
                                                   grads, calls)
        return results[0].numpy()

    def memory(self, name: str, host: int) -> dict:
        return {k: v.numpy() for k, v in self.states[name][host].items()}


def run(kind: str) -> None:
    rank = hvd.rank()
    host = rank // 2
    dtype = tf.bfloat16 if kind.endswith("-bf16") else tf.float32
    model_vars = [tf.Variable(tf.zeros(shape, dtype), name=name) for name, shape in SHAPES.items()]
    method_name, options = KINDS[kind]
    compression = getattr(hdgc.Compression, method_name)(hierarchical=True, **options)

    @tf.function
    def step_fn(grads):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * grads[n]) for v, n in zip(model_vars, SHAPES)])
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        return tape.gradient(loss, model_vars)

    reference = NaiveTopK(compression.config) if kind == "topk" else Simulation(compression.method)
    for step in range(STEPS):
        mine = {n: tf.constant(g, dtype) for n, g in gradients(rank, step, dtype).items()}
        got = dict(zip(SHAPES, step_fn(mine)))
        averages = host_averages(step, dtype)
        for name, shape in SHAPES.items():
            assert got[name].dtype == dtype, (kind, name, got[name].dtype)
            want = as_dtype(reference.step(name, step, averages).reshape(shape), dtype)
            # bfloat16: float32 sums that differ in their last bit may round to neighbours.
            np.testing.assert_allclose(tf.cast(got[name], tf.float32).numpy(), want, atol=1e-6,
                                       rtol=2 ** -7 if dtype == tf.bfloat16 else 1e-5,
                                       err_msg=f"rank {rank} {kind} {name} step {step}")
    assert compression.engine.world_size == len(HOSTS), compression.engine.world_size
    for name in SHAPES:
        for key, want in reference.memory(name, host).items():
            got = compression.engine._states[name][key].numpy().reshape(-1)
            np.testing.assert_allclose(got, want.reshape(-1), rtol=1e-5, atol=1e-5,
                                       err_msg=f"rank {rank} {kind} {name} memory {key}")
    print(f"rank {rank}/4 {kind} hierarchical ok", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--kinds", default=",".join(KINDS))
    args = parser.parse_args()
    hvd.init(process_sets="dynamic")
    tf.config.threading.set_intra_op_parallelism_threads(1)
    assert hvd.size() == 4 and hvd.cross_rank() == hvd.rank() // 2, "run on 2 hosts x 2 workers"
    for kind in args.kinds.split(","):
        run(kind)
