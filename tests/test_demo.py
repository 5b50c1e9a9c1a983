"""``make demo``'s own logic (benchmarks/demo.py), without training anything: the time to an
accuracy on hand-written curves, the parsing of the example's epoch lines, where the runs
go without root, and the closing lines' figures and verdicts."""
import random
import sys
from pathlib import Path

import pytest

from benchmarks import demo
from benchmarks.convergence import Run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from pytorch_fashion_mnist import parse_args as parse_example_args  # noqa: E402

# Lines as examples/pytorch_fashion_mnist.py prints them (dense, then dgc during warm-up).
DENSE_LINE = ("epoch 3/6: loss 0.4312, test accuracy 0.8421 after 61.7 s of training, density 1, "
              "4120.4 kB/step to Horovod (uncompressed)\n")
DGC_LINE = ("epoch 1/6: loss 0.6789, test accuracy 0.7702 after 9.3 s of training, density 0.03162, "
            "262.3 kB/step to Horovod (16x fewer than dense; on the network 14x)\n")
HEADER = ("2 workers, 1,030,090 parameters (99.63% in compressed tensors), dgc on the stock path, "
          "fp32, sgd, 93 steps per epoch\n")


def naive_time_to(curve, target):
    """The reference: the seconds of the first (accuracy, seconds) pair at or above target."""
    for accuracy, seconds in curve:
        if accuracy >= target:
            return seconds
    return None


def points(curve):
    return [demo.Point(i + 1, len(curve), a, s, 4.0) for i, (a, s) in enumerate(curve)]


def test_time_to_accuracy_is_the_first_epoch_at_or_above_the_target():
    # Not monotone: the first crossing counts, not the best epoch nor the last.
    curve = [(0.70, 10.0), (0.80, 20.0), (0.79, 30.0), (0.85, 40.0), (0.84, 50.0)]
    assert demo.time_to_accuracy(points(curve), 0.80) == 20.0   # equal counts as reached
    assert demo.time_to_accuracy(points(curve), 0.81) == 40.0
    assert demo.time_to_accuracy(points(curve), 0.84) == 40.0   # not the last one at 0.84
    assert demo.time_to_accuracy(points(curve), 0.60) == 10.0
    assert demo.time_to_accuracy(points(curve), 0.8501) is None
    assert demo.time_to_accuracy([], 0.5) is None


def test_time_to_accuracy_against_the_naive_reference():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 8)
        # Four-decimal accuracies, as the epoch lines give them, often equal to the target.
        curve = [(rng.randint(7000, 8600) / 10000, 5.0 * (i + 1) + rng.random()) for i in range(n)]
        target = rng.choice([a for a, _ in curve] + [rng.randint(7000, 8700) / 10000])
        assert demo.time_to_accuracy(points(curve), target) == naive_time_to(curve, target)


def test_parse_epoch_lines():
    dense = demo.parse_epoch_line(DENSE_LINE)
    assert (dense.epoch, dense.epochs, dense.accuracy, dense.wall_s, dense.kb_per_step) == \
        (3, 6, 0.8421, 61.7, 4120.4)
    dgc = demo.parse_epoch_line(DGC_LINE)
    assert (dgc.epoch, dgc.epochs, dgc.accuracy, dgc.wall_s, dgc.kb_per_step) == \
        (1, 6, 0.7702, 9.3, 262.3)
    # Rank 0's other lines are not epochs.
    for other in (HEADER, "final test accuracy: 0.8421 after 130 s\n", "", "epoch 3/6\n"):
        assert demo.parse_epoch_line(other) is None


def test_echo_keeps_the_points_and_the_steps_and_prints_short_lines(capsys):
    echo = demo.Echo("dgc")
    for line in (HEADER, DGC_LINE, "[W something Horovod says]\n", DENSE_LINE):
        echo.write(line)
    assert echo.steps_per_epoch == 93 and echo.parameters == 1030090
    assert [p.accuracy for p in echo.points] == [0.7702, 0.8421]
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all(len(line) <= 200 for line in out)
    assert "0.7702" in out[0] and "9.3 s" in out[0] and "262.3 kB/step" in out[0]


def test_without_root_the_demo_runs_on_loopback_and_says_so(monkeypatch):
    import benchmarks.cluster.netns as netns
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    shaped, why = demo.network_choice(loopback=False)
    assert shaped is False
    assert "root" in why and "loopback" in why


def test_as_root_with_the_tools_the_demo_uses_namespaces(monkeypatch):
    import benchmarks.cluster.netns as netns
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: f"/sbin/{tool}")
    assert demo.network_choice(loopback=False) == (True, "")
    shaped, why = demo.network_choice(loopback=True)
    assert shaped is False and "loopback" in why


def outcome(name, curve, kb):
    return demo.Outcome(Run(name), [demo.Point(i + 1, len(curve), a, s, kb)
                                    for i, (a, s) in enumerate(curve)], launch_s=0.0)


def test_summary_figures_and_verdicts():
    dense = outcome("dense", [(0.80, 40.0), (0.84, 80.0), (0.85, 120.0)], 4120.4)
    # dgc crosses 0.85 at its third epoch (30 s): 120 / 30 = 4.0x sooner, +0.20 points.
    dgc = outcome("dgc", [(0.78, 10.0), (0.84, 20.0), (0.852, 30.0), (0.851, 40.0)], 4.12)
    lines, held = demo.summary({"dense": dense, "dgc": dgc}, shaped=True, link_name="100mbit")
    text = "\n".join(lines)
    assert held, text
    assert "+0.10 points" in text and "1000x fewer" in text and "4.0x sooner" in text, text
    assert "30.0 s against 120.0 s" in text, text
    assert all(len(line) <= 200 for line in lines)

    # 1.1 points below and never at dense's final: both claims fail.
    low = outcome("dgc", [(0.80, 10.0), (0.839, 20.0)], 4.12)
    lines, held = demo.summary({"dense": dense, "dgc": low}, shaped=True, link_name="100mbit")
    text = "\n".join(lines)
    assert not held and "not reached" in text and text.count("FAIL") == 2, text

    # Reached, but only 2x sooner.
    slow = outcome("dgc", [(0.85, 60.0)], 4.12)
    lines, held = demo.summary({"dense": dense, "dgc": slow}, shaped=True, link_name="100mbit")
    assert not held and "2.0x sooner" in "\n".join(lines)

    # On loopback nothing is judged.
    lines, held = demo.summary({"dense": dense, "dgc": low}, shaped=False, link_name="100mbit")
    assert held and "not judged" in "\n".join(lines) and "FAIL" not in "\n".join(lines)


def test_both_runs_share_data_batches_and_learning_rate_and_each_gets_its_epochs(tmp_path):
    """The flags the demo gives the example, read by the example's own parser."""
    args = demo.parse_args(["--epochs", "5", "--dgc-epochs", "7", "--train-images", "1234",
                            "--lr", "0.08"])
    dense_run, dgc_run = demo.runs(args)
    dense = parse_example_args(demo.flags_of(args, dense_run, tmp_path / "dense.json"))
    dgc = parse_example_args(demo.flags_of(args, dgc_run, tmp_path / "dgc.json"))
    assert (dense.compression, dense.epochs, dgc.compression, dgc.epochs) == ("dense", 5, "dgc", 7)
    for key in ("train_images", "batch_size", "lr", "seed", "path", "momentum", "optimizer"):
        assert getattr(dense, key) == getattr(dgc, key), key
    assert (dense.train_images, dense.lr) == (1234, 0.08)
    assert dgc.json == tmp_path / "dgc.json"
    # --dgc-epochs 0: both train as long.
    args = demo.parse_args(["--epochs", "4", "--dgc-epochs", "0"])
    assert [parse_example_args(demo.flags_of(args, run, tmp_path / "m.json")).epochs
            for run in demo.runs(args)] == [4, 4]


def test_the_demo_refuses_an_unshaped_link():
    with pytest.raises(SystemExit):
        demo.parse_args(["--link", "unshaped"])
