"""The one-line change that ``make horovod-examples`` makes to Horovod's scripts: only the
compression line, at its own indentation (TensorFlow 2's sits inside a ``tf.function``); and
what that line builds is a Horovod compressor."""
from importlib import import_module

import pytest

from benchmarks.horovod_examples import rewrite
from horovod_dgc.core.methods import METHODS

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


def test_dgc_takes_the_scripts_weight_decay_where_the_script_has_one():
    """The ImageNet script's SGD decay would act outside DGC's momentum (refused): the
    compressor takes ``args.wd`` (and the run passes ``--wd 0``); blocksign has no decay."""
    imagenet = SCRIPT + "optimizer = optim.SGD(lr, momentum=args.momentum, weight_decay=args.wd)\n"
    assert rewrite(imagenet, "torch", "dgc")[1] == "compression = Compression.dgc(density=0.001, weight_decay=args.wd)"
    assert rewrite(imagenet, "torch", "blocksign")[1] == "compression = Compression.blocksign()"
    assert rewrite(SCRIPT, "torch", "dgc")[1] == "compression = Compression.dgc(density=0.001)"


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_every_compressor_is_a_horovod_compressor_where_horovod_is_installed(framework):
    """Horovod's scripts and users may test for its ``Compressor``; the torch adapter keeps
    it importable without Horovod (the DDP hook) and must not drop the base class for that."""
    horovod = pytest.importorskip(f"horovod.{framework}.compression")
    ours = import_module(f"horovod_dgc.{framework}").Compression
    for spec in METHODS:
        assert isinstance(getattr(ours, spec.name)(), horovod.Compressor), spec.name
