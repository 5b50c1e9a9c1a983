"""Horovod's own example scripts with only their compression line changed.

Takes a checkout of Horovod's repository (its ``examples/`` folder; nothing of it is kept in
this project), copies each script below to ``--work`` (with its output, ``<script>.log``),
replaces the line that builds Horovod's compression by an import of horovod_dgc and
``compression = Compression.<method>(...)`` (the same indentation, nothing else touched),
runs it under ``horovodrun -np 2 --gloo`` with small arguments for a CPU, and prints the line
of its output that shows it trained (images per second, loss or accuracy). Every script runs
as a fixed 2-worker job, the elastic one included (its ``hvd.elastic.run`` loop and state).
The ImageNet scripts train on a small generated ImageFolder; a method that keeps momentum itself (DGC) runs them
with ``--momentum 0``, their SGD's momentum flag (the compressor refuses to apply it twice),
and DGC with ``--wd 0`` and the script's ``args.wd`` given to the compressor (torch's SGD
would apply it outside DGC's momentum, which is refused).

Keras' ``keras/keras_imagenet_resnet50.py`` is not run: it imports ``keras`` itself, which
with TensorFlow 2.21 is Keras 3, where ``keras.preprocessing.image.ImageDataGenerator`` no
longer exists and Horovod 0.28.1's Keras glue does not apply.

    python -m benchmarks.horovod_examples --horovod-examples ~/horovod/examples \\
        --methods dgc blocksign
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from horovod_dgc.core.methods import BY_NAME

BIN = Path(sys.executable).parent
# Horovod's examples build their compression with this line, whatever the framework.
_COMPRESSION_LINE = re.compile(
    r"^(?P<indent>\s*)compression = hvd\.Compression\.fp16 if args\.fp16_allreduce "
    r"else hvd\.Compression\.none\s*$", re.M)
METHOD_OPTIONS = {"dgc": "density=0.001", "topk": "density=0.001", "gaussiank": "density=0.001",
                  "scalecom": "density=0.001", "blocksign": ""}
# Small synthetic runs: a CPU does a ResNet-50 step on a few images in seconds.
_SYNTHETIC = ["--batch-size", "4", "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
              "--num-iters", "2", "--no-cuda"]
_LEGACY_KERAS = {"TF_USE_LEGACY_KERAS": "1"}  # Horovod's Keras glue needs Keras 2 (tf_keras)
# TensorFlow traces each compressed tensor's exchange into the graph: with ResNet-50's
# kernels, tracing and the first run's graph optimization take about 10 minutes on this CPU
# (measured, DGC, one rank), and the TF 2 script traces its step twice. VGG16 has 16
# kernels (138M parameters).
_TF_MODEL = ("--model", "VGG16")


@dataclass(frozen=True)
class Example:
    """One of Horovod's scripts: where it is, its framework, how to run it small, and the
    pattern of the output line that shows it trained."""

    path: str
    framework: str
    args: Tuple[str, ...]
    shows: str
    env: Dict[str, str] = field(default_factory=dict)


EXAMPLES = (
    Example("pytorch/pytorch_synthetic_benchmark.py", "torch", tuple(_SYNTHETIC), r"Img/sec per"),
    Example("elastic/pytorch/pytorch_synthetic_benchmark_elastic.py", "torch", tuple(_SYNTHETIC),
            r"Img/sec per"),
    Example("pytorch/pytorch_imagenet_resnet50.py", "torch",
            ("--epochs", "1", "--batch-size", "2", "--val-batch-size", "2", "--no-cuda",
             "--train-dir", "{images}", "--val-dir", "{images}"), r"accuracy"),
    Example("tensorflow2/tensorflow2_synthetic_benchmark.py", "tensorflow",
            (*_SYNTHETIC, *_TF_MODEL), r"Img/sec per", _LEGACY_KERAS),
    Example("tensorflow2/tensorflow2_keras_synthetic_benchmark.py", "tensorflow",
            ("--batch-size", "4", "--num-batches-per-iter", "2", "--num-iters", "2", *_TF_MODEL),
            r"Img/sec per", _LEGACY_KERAS),
)


def rewrite(source: str, framework: str, method: str) -> Tuple[str, str]:
    """(the script with its compression line replaced, the new line); ValueError if the
    script has no such line or several."""
    found = _COMPRESSION_LINE.findall(source)
    if len(found) != 1:
        raise ValueError(f"expected one compression line, found {len(found)}")
    indent = found[0]
    options = METHOD_OPTIONS[method]
    if _decays_inside(method) and "args.wd" in source:
        options += ", weight_decay=args.wd"  # the SGD's, which arguments() sets to 0
    line = f"compression = Compression.{method}({options})"
    new = f"{indent}from horovod_dgc.{framework} import Compression\n{indent}{line}"
    return _COMPRESSION_LINE.sub(lambda _: new, source), line


def _decays_inside(method: str) -> bool:
    """Whether ``method`` keeps the momentum and has a weight decay of its own (DGC): torch's
    SGD would apply its decay outside that momentum, which the compressor refuses."""
    config = BY_NAME[method].build().config
    return config.needs_plain_optimizer and hasattr(config, "weight_decay")


def arguments(example: Example, method: str, images: Path) -> List[str]:
    """The script's command-line arguments for ``method``."""
    args = [a.format(images=images) for a in example.args]
    if "--train-dir" in args and BY_NAME[method].build().config.needs_plain_optimizer:
        args += ["--momentum", "0"]
        if _decays_inside(method):
            args += ["--wd", "0"]
    return args


def make_images(root: Path) -> Path:
    """A 2-class ImageFolder of 16 small generated images (examples/_imagefolder.py)."""
    generator = Path(__file__).resolve().parents[1] / "examples" / "_imagefolder.py"
    subprocess.run([sys.executable, str(generator), str(root), "--classes", "2",
                    "--images-per-class", "8"], check=True, capture_output=True)
    return root


def run(example: Example, script: Path, args: Sequence[str], timeout_s: float) -> Tuple[int, str]:
    """(exit status, output) of the script on 2 local ranks."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **example.env}
    cmd = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
           str(script), *args]
    try:
        done = subprocess.run(cmd, env=env, cwd=script.parent, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as expired:
        return 124, f"timed out after {timeout_s:.0f} s\n{expired.stdout or ''}{expired.stderr or ''}"
    return done.returncode, done.stdout + done.stderr


def summary(example: Example, status: int, output: str) -> str:
    """The output line that shows the script trained, or why it did not."""
    lines = output.splitlines()
    shown = [line for line in lines if re.search(example.shows, line)]
    if status == 0 and shown:
        return shown[-1].strip()
    errors = [line for line in lines if re.search(r"Error|error:", line)]
    return f"FAILED (exit {status}): {(errors or lines or ['no output'])[-1].strip()}"


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--horovod-examples", type=Path, required=True,
                   help="the examples/ folder of a checkout of github.com/horovod/horovod")
    p.add_argument("--methods", nargs="+", default=["dgc", "blocksign"], choices=list(METHOD_OPTIONS))
    p.add_argument("--only", nargs="*", default=None, help="run only examples whose path holds this")
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--work", type=Path, default=Path("build/horovod-examples"),
                   help="where the changed scripts and their outputs go")
    args = p.parse_args(list(argv) or None)
    results: List[Tuple[str, str, str]] = []
    images = make_images(args.work.resolve() / "images")
    for example in EXAMPLES:
        if args.only and not any(part in example.path for part in args.only):
            continue
        original = (args.horovod_examples / example.path).read_text()
        for method in args.methods:
            script = (args.work / method / Path(example.path).name).resolve()
            script.parent.mkdir(parents=True, exist_ok=True)
            text, line = rewrite(original, example.framework, method)
            script.write_text(text)
            status, output = run(example, script, arguments(example, method, images), args.timeout_s)
            script.with_suffix(".log").write_text(output)
            results.append((example.path, line, summary(example, status, output)))
            print(f"{example.path}  [{line}]\n    {results[-1][2]}", flush=True)
    failed = [r for r in results if r[2].startswith("FAILED")]
    print(f"\n{len(results) - len(failed)} of {len(results)} runs trained")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
