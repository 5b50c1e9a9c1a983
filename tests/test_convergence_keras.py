"""Convergence with Keras ``model.fit`` (tf_keras, Horovod's Keras DistributedOptimizer):
DGC at 0.1% density with 4 warm-up epochs, driven by the CompressionWarmup callback, ends
within 1 point of dense training on MNIST-1D (2 ranks, Gloo, 30 epochs)."""
from __future__ import annotations

import json

import pytest

from conftest import horovodrun


def train(compression: str) -> dict:
    out = horovodrun("convergence_keras.py", 2, ["--compression", compression], timeout_s=1200)
    return json.loads(out.split("RESULT ", 1)[1].splitlines()[0])


@pytest.mark.slow
def test_keras_fit_with_dgc_matches_dense_accuracy():
    dense, dgc = train("dense"), train("dgc")
    result = f"dense accuracy {dense['accuracy']:.4f}, dgc {dgc['accuracy']:.4f} ({dgc['ratio']:.1f}x smaller)"
    print(f"\n{result}")
    assert abs(dense["accuracy"] - dgc["accuracy"]) <= 0.01, result
    # A compressor that quietly sent everything would pass the accuracy check trivially.
    assert dgc["ratio"] > 10, result
