"""The TensorFlow examples run for a few steps on 2 ranks (Gloo, CPU, tiny images)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ROOT, horovodrun

EXAMPLES = ROOT / "examples"
# One density (no warm-up) and one small model keep the traces short.
QUICK = ["--image-size", "16", "--steps-per-epoch", "2", "--epochs", "2", "--num-classes", "10",
         "--sparsity-warmup-epochs", "0"]


@pytest.mark.parametrize("example,method", [("tensorflow_custom_loop.py", "scalecom"),
                                            ("keras_fit.py", "topk")])
def test_example_trains_and_reports_its_traffic(example, method):
    # horovodrun joins the script to tests/workers/, which an absolute path overrides.
    out = horovodrun(str(EXAMPLES / example), 2, ["--compression", method, *QUICK], timeout_s=600)
    assert f"compression {method}" in out and "x fewer than dense), " in out, out[-3000:]
    assert "kB/step sent on the network" in out, out[-3000:]


@pytest.mark.slow
def test_imagenet_resnet50_twin_checkpoints_and_resumes(tmp_path: Path):
    """Epoch 1, then a second run resumes from its checkpoint and trains epoch 2. Only
    ResNet-50's largest kernels are compressed, to keep the trace short."""
    args = ["--synthetic", "--image-size", "32", "--batch-size", "2", "--steps-per-epoch", "2",
            "--num-classes", "10", "--sparsity-warmup-epochs", "0", "--min-numel", "2000000",
            "--compression", "dgc", "--checkpoint-dir", str(tmp_path / "ck"), "--json", str(tmp_path / "m.json")]
    example = str(EXAMPLES / "tensorflow_imagenet_resnet50.py")
    horovodrun(example, 2, [*args, "--epochs", "1"], timeout_s=900)
    assert sorted(p.name for p in (tmp_path / "ck" / "epoch-001").iterdir()) == [
        "complete", "compressor-rank0-of-2.pkl", "compressor-rank1-of-2.pkl", "model.weights.h5", "optimizer.npz"]
    out = horovodrun(example, 2, [*args, "--epochs", "2"], timeout_s=900)
    assert "resumed from" in out and "epoch-001" in out, out[-3000:]
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["resumed_from"] == 1 and [h["epoch"] for h in metrics["history"]] == [2]
    # Only the kernels of 2 M elements or more (about 40% of ResNet-50) are compressed.
    assert metrics["history"][0]["compression_ratio"] > 1.4
