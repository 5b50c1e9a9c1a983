"""TensorFlow compressor state across a change in the number of workers, on real Horovod
ranks (stock ``hvd.DistributedGradientTape`` inside ``tf.function``).

``--mode save DIR``: 3 steps of each method, every rank pickles ``compression.state_dict()``.
``--mode resume DIR``: every rank loads all saved parts through ``redistribute``; the memories
averaged over the new ranks equal those averaged over the old ones (to 1e-6), blocksign's
server residual is the same vector re-cut into the new ranks' shards, and training goes on.
"""
import argparse
import pickle
from pathlib import Path

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import horovod_dgc.tensorflow as hdgc
from horovod_dgc.tensorflow.checkpoint import redistribute

METHODS = {"dgc": dict(density=0.01, momentum=0.9), "blocksign": dict(block_size=64, momentum=0.5)}
SHAPES = {"first/kernel": (64, 300), "first/bias": (300,), "second/kernel": (300, 50)}


def build(method: str):
    variables = [tf.Variable(tf.zeros(shape), name=name) for name, shape in SHAPES.items()]
    compression = getattr(hdgc.Compression, method)(variables=variables, **METHODS[method])

    @tf.function
    def step(grads):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        return tape.gradient(loss, variables)

    return compression, step


def train(step, steps: int, first: int) -> None:
    for t in range(first, first + steps):
        rs = np.random.RandomState(100 * t + hvd.rank())
        step([tf.constant(rs.standard_normal(shape).astype(np.float32)) for shape in SHAPES.values()])


def save(folder: Path) -> None:
    for method in METHODS:
        compression, step = build(method)
        train(step, 3, 0)
        (folder / f"{method}-rank{hvd.rank()}.pkl").write_bytes(pickle.dumps(compression.state_dict()))
    print(f"rank {hvd.rank()} saved", flush=True)


def resume(folder: Path) -> None:
    for method in METHODS:
        count = len(list(folder.glob(f"{method}-rank*.pkl")))
        parts = [pickle.loads((folder / f"{method}-rank{r}.pkl").read_bytes()) for r in range(count)]
        assert count != hvd.size(), "the resume must change the number of workers"
        compression, step = build(method)
        compression.load_state_dict(redistribute(parts, hvd.size(), hvd.rank()))
        now = compression.state_dict()
        sharded = compression.method.state_layout(True).sharded
        for name, memories in now["states"].items():
            for key, value in memories.items():
                saved = [p["states"][name][key] for p in parts]
                label = f"check.{key}.{name}".replace("/", "_")
                if key in sharded:
                    joined = hvd.allgather(tf.constant(value), name=label).numpy()
                    numel = parts[0]["states"][name]["residual"].size
                    old = np.concatenate(saved)
                    assert np.array_equal(joined[:numel], old[:numel]), f"{method} {name} {key}"
                    assert not joined[numel:].any() and not old[numel:].any(), f"{method} {key}"
                else:
                    mean = hvd.allreduce(tf.constant(value, tf.float64), op=hvd.Sum,
                                         name=label).numpy() / hvd.size()
                    expected = sum(s.astype(np.float64) for s in saved) / len(saved)
                    np.testing.assert_allclose(mean, expected, rtol=1e-6, atol=1e-7,
                                               err_msg=f"{method} {name} {key}: mass not conserved")
        assert now["steps"] == parts[0]["steps"]
        train(step, 2, 3)
        print(f"rank {hvd.rank()} {method} resumed on {hvd.size()} from {count} ok", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["save", "resume"], required=True)
    parser.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args()
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    if args.mode == "save":
        save(args.dir)
    else:
        resume(args.dir)
