"""Convergence: compressed training matches dense training on MNIST-1D (2 ranks, Gloo).

Runs examples/pytorch_mnist1d.py with the same seed and epochs, dense (SGD momentum) and
with each method through the stock ``hvd.DistributedOptimizer``: DGC and ScaleCom at 0.1%
density with 4 warm-up epochs (within 1 point), blocksign (within 1.5 points).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import ROOT, horovodrun

EXAMPLE = ROOT / "examples" / "pytorch_mnist1d.py"
EPOCHS = 30


def train(tmp_path: Path, *args: str) -> dict:
    """Run the example on 2 ranks; its JSON metrics plus the measured wall time."""
    metrics_path = tmp_path / "metrics.json"
    started = time.perf_counter()
    # horovodrun joins the script to tests/workers/, which an absolute path overrides.
    horovodrun(str(EXAMPLE), np=2, timeout_s=400,
               args=["--epochs", str(EPOCHS), "--seed", "0", "--json", str(metrics_path), *args])
    metrics = json.loads(metrics_path.read_text())
    metrics["wall_s"] = time.perf_counter() - started
    return metrics


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> dict:
    return train(tmp_path_factory.mktemp("dense"), "--compression", "dense")


# (method, its options, accuracy points it may lose against dense, smallest traffic ratio)
CASES = [("dgc", ["--density", "0.001", "--warmup-epochs", "4"], 1.0, 10),
         ("scalecom", ["--density", "0.001", "--warmup-epochs", "4"], 1.0, 10),
         ("blocksign", [], 1.5, 10)]


@pytest.mark.slow
@pytest.mark.parametrize("method,options,points,min_ratio", CASES, ids=[c[0] for c in CASES])
def test_compressed_training_matches_dense_accuracy(tmp_path: Path, dense: dict, method: str,
                                                    options: list, points: float, min_ratio: float) -> None:
    got = train(tmp_path, "--compression", method, *options)
    result = (f"dense accuracy {dense['accuracy']:.4f} ({dense['wall_s']:.0f} s), "
              f"{method} accuracy {got['accuracy']:.4f} ({got['wall_s']:.0f} s, "
              f"{got['ratio']:.1f}x smaller after warm-up)")
    print(f"\n{result}")
    assert abs(dense["accuracy"] - got["accuracy"]) <= points / 100, result
    # A compressor that quietly sent everything would pass the accuracy check trivially.
    assert got["ratio"] > min_ratio, result
