"""Smoke job: allreduce + allgather through Horovod in one framework; every rank checks the
results and prints one line."""
import argparse
import sys


def torch_job(use_mpi4py: bool) -> str:
    import horovod.torch as hvd
    import torch

    if use_mpi4py:
        from mpi4py import MPI
        hvd.init(comm=MPI.COMM_WORLD)
        assert hvd.mpi_enabled(), "hvd.init(comm=...) did not run on MPI"
    else:
        hvd.init()
    rank, size = hvd.rank(), hvd.size()
    total = hvd.allreduce(torch.full((3,), float(rank)), op=hvd.Sum, name="smoke.sum")
    assert torch.equal(total, torch.full((3,), float(sum(range(size))))), total
    gathered = hvd.allgather(torch.full((rank + 1,), rank, dtype=torch.int32), name="smoke.gather")
    expected = torch.cat([torch.full((r + 1,), r, dtype=torch.int32) for r in range(size)])
    assert torch.equal(gathered, expected), gathered
    return f"torch rank {rank}/{size} ok mpi={hvd.mpi_enabled()} gloo={hvd.gloo_enabled()}"


def tensorflow_job() -> str:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    total = hvd.allreduce(tf.fill([3], float(rank)), op=hvd.Sum, name="smoke.sum")
    tf.debugging.assert_equal(total, tf.fill([3], float(sum(range(size)))))
    gathered = hvd.allgather(tf.fill([rank + 1], rank), name="smoke.gather")
    expected = tf.concat([tf.fill([r + 1], r) for r in range(size)], axis=0)
    tf.debugging.assert_equal(gathered, expected)
    return f"tensorflow rank {rank}/{size} ok"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=["torch", "tensorflow"])
    parser.add_argument("--mpi4py", action="store_true", help="hvd.init(comm=MPI.COMM_WORLD)")
    args = parser.parse_args()
    line = torch_job(args.mpi4py) if args.framework == "torch" else tensorflow_job()
    print(line, flush=True)
    sys.exit(0)
