"""The one-line change that ``make horovod-examples`` makes to Horovod's scripts: only the
compression line, at its own indentation (TensorFlow 2's sits inside a ``tf.function``)."""
import pytest

from benchmarks.horovod_examples import rewrite

SCRIPT = """import horovod.tensorflow as hvd

@tf.function
def benchmark_step(first_batch):
    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    tape = hvd.DistributedGradientTape(tape, compression=compression)
"""


def test_only_the_compression_line_changes_at_its_indentation():
    text, line = rewrite(SCRIPT, "tensorflow", "dgc")
    assert line == "compression = Compression.dgc(density=0.001)"
    before, after = SCRIPT.splitlines(), text.splitlines()
    assert after[:5] == before[:5] and after[-1] == before[-1]
    assert after[5:7] == ["    from horovod_dgc.tensorflow import Compression", f"    {line}"]
    compile(text, "script.py", "exec")


@pytest.mark.parametrize("source", [SCRIPT.replace("fp16 if", "none if"), SCRIPT + SCRIPT])
def test_a_script_without_exactly_one_compression_line_is_refused(source):
    with pytest.raises(ValueError, match="compression line"):
        rewrite(source, "torch", "blocksign")
