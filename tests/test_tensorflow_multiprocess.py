"""Real Horovod jobs (Gloo) through the stock DistributedGradientTape, eagerly and inside
tf.function: aggregation equals the dense reference, misuse is named, traffic is counted."""
import json

import pytest

from conftest import horovodrun

MODES = ("eager", "function")


def test_aggregated_gradient_equals_dense_reference_and_misuse_is_named():
    out = horovodrun("aggregate_tensorflow.py", 2, timeout_s=600)
    for mode in MODES:
        for method in ("topk", "dgc", "gaussiank"):
            assert out.count(f"{method} {mode} aggregate ok") == 2, out
    assert out.count("misuse ok") == 2, out


def test_dgc_hands_horovod_300x_fewer_bytes_than_dense():
    out = horovodrun("traffic_tensorflow.py", 2, timeout_s=600)
    figures = json.loads(out.split("TRAFFIC ", 1)[1].splitlines()[0])
    for mode in MODES:
        dense, dgc = figures[mode]["none"], figures[mode]["dgc"]
        assert dense["params"] >= 1_000_000
        ratio = dense["bytes_per_step"] / dgc["bytes_per_step"]
        print(f"{mode}: dense {dense['bytes_per_step']:.0f} B/step, dgc "
              f"{dgc['bytes_per_step']:.0f} B/step, {ratio:.0f}x fewer")
        assert ratio >= 300, figures
        assert dgc["stats_bytes_per_step"] == pytest.approx(dgc["bytes_per_step"]), "stats() disagrees"
