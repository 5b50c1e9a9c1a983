"""A tape given a process set smaller than the world is refused: our collectives run among
all workers, so a set's gradients would be averaged with the other ranks', silently (seen
before the refusal: each rank got the average of all 4, not of its set's 2). 4 ranks in two
sets of 2, each training under its own set, eagerly: inside a ``tf.function`` Horovod 0.28.1
fails on its own with any compression ("Process set does not exist or has not been
registered")."""
import horovod.tensorflow as hvd
import tensorflow as tf

import horovod_dgc.tensorflow as hdgc

SETS = [hvd.ProcessSet([0, 1]), hvd.ProcessSet([2, 3])]


def main() -> None:
    hvd.init(process_sets=SETS)
    mine = SETS[hvd.rank() // 2]
    weights = tf.Variable(tf.zeros((64, 48)))
    compression = hdgc.Compression.topk(density=0.1)

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(weights * float(hvd.rank() + 1))
        tape = hvd.DistributedGradientTape(tape, compression=compression, process_set=mine)
        return tape.gradient(loss, [weights])

    try:
        step()
    except ValueError as error:
        assert "process sets are not supported" in str(error), str(error)
        assert "a process set of 2" in str(error), str(error)
        print(f"rank {hvd.rank()} process set refused ok", flush=True)
        # No rank shuts Horovod down while another still queries its set.
        hvd.allreduce(tf.constant(1.0), name="all_refused")
        return
    raise AssertionError("a process set of 2 of 4 workers was not refused")


if __name__ == "__main__":
    main()
