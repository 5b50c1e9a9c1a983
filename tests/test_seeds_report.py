"""benchmarks/seeds.py: per-seed gaps to the same seed's reference, their mean, the verdict."""
import json

import pytest

from benchmarks.seeds import main


def write(directory, seed, accuracies) -> None:
    directory.mkdir()
    for name, accuracy in accuracies.items():
        (directory / f"{name}.json").write_text(json.dumps({"accuracy": accuracy, "seed": seed}))


def test_each_seed_shows_its_gap_to_its_own_reference_and_the_mean_gap_is_judged(tmp_path, capsys):
    # Seed 1 alone fails topk (-1.20), the mean passes (-0.90); scalecom fails on average
    # (-1.10) though seed 0 alone passes (-0.80).
    write(tmp_path / "s0", 0, {"dense": 0.9000, "topk-stock": 0.8920, "scalecom-stock": 0.8920})
    write(tmp_path / "s1", 1, {"dense": 0.9100, "topk-stock": 0.8980, "scalecom-stock": 0.8960})
    write(tmp_path / "s2", 2, {"dense": 0.9050, "topk-stock": 0.8980, "scalecom-stock": 0.8940})
    main([str(tmp_path / d) for d in ("s0", "s1", "s2")])
    out = capsys.readouterr().out
    assert "| topk-stock | 0.8920 (-0.80) | 0.8980 (-1.20) | 0.8980 (-0.70) | 0.8960 | -0.90 |" in out
    assert "- PASS: topk-stock -0.90 points on average against dense over 3 seeds" in out
    assert "- FAIL: scalecom-stock -1.10 points on average against dense over 3 seeds" in out
    assert "| dense | 0.9000 | 0.9100 | 0.9050 | 0.9050 |  |" in out


def test_a_mean_gap_of_exactly_the_bound_passes(tmp_path, capsys):
    write(tmp_path / "s0", 0, {"dense": 0.91, "topk-stock": 0.90})
    write(tmp_path / "s1", 1, {"dense": 0.93, "topk-stock": 0.92})
    main([str(tmp_path / "s0"), str(tmp_path / "s1")])
    assert "- PASS: topk-stock -1.00 points" in capsys.readouterr().out


def test_runs_missing_from_a_seed_are_left_out_and_none_found_is_an_error(tmp_path, capsys):
    write(tmp_path / "s0", 0, {"dense": 0.90, "topk-stock": 0.89, "dgc-stock": 0.89})
    write(tmp_path / "s1", 1, {"dense": 0.91, "topk-stock": 0.90})
    main([str(tmp_path / "s0"), str(tmp_path / "s1")])
    assert "dgc-stock" not in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no run has result files"):
        main([str(tmp_path / "s0"), str(tmp_path / "s1"), "--runs", "dgc-stock"])
