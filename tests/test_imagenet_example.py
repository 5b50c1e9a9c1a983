"""examples/pytorch_imagenet_resnet50.py on a generated ImageFolder: checkpoints every epoch,
exact resume of the compressor memories, and the documented flags."""
import json
import sys
from pathlib import Path

import pytest

from conftest import ROOT, horovodrun

sys.path.insert(0, str(ROOT / "examples"))
from _imagefolder import make_image_folder  # noqa: E402
import pytorch_imagenet_resnet50 as example  # noqa: E402

WORKER = "imagenet_checkpoint_check.py"  # runs the example, checks memories on resume
TINY = ["--image-size", "32", "--batch-size", "4", "--steps-per-epoch", "2",
        "--loader-workers", "0", "--base-lr", "0.002", "--warmup-epochs", "1"]


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("imagefolder"), classes=4,
                             images_per_class=16, size=32)


def history(path: Path) -> list:
    return json.loads(path.read_text())


def drop_epoch(folder: Path, epoch: int) -> None:
    """Delete an epoch's checkpoint files, as if the run had stopped before writing them."""
    for f in folder.glob(f"*-{epoch:03d}*.pt"):
        f.unlink()


def test_dgc_resume_restores_the_memories_exactly_and_the_loss_continues(image_folder, tmp_path):
    ckpt = tmp_path / "checkpoints"
    args = ["--train-dir", str(image_folder), *TINY, "--compression", "dgc", "--density", "0.01",
            "--sparsity-warmup-epochs", "0", "--checkpoint-dir", str(ckpt), "--epochs", "3"]
    horovodrun(WORKER, 2, [*args, "--json", str(tmp_path / "straight.json")])
    assert sorted(f.name for f in ckpt.iterdir()) == [
        "checkpoint-002.pt", "checkpoint-003.pt",
        "compressor-002-rank0-of-2.pt", "compressor-002-rank1-of-2.pt",
        "compressor-003-rank0-of-2.pt", "compressor-003-rank1-of-2.pt"]
    drop_epoch(ckpt, 3)
    out = horovodrun(WORKER, 2, [*args, "--json", str(tmp_path / "resumed.json")])
    assert "resumed after epoch 2" in out, out
    assert out.count("restored memories of epoch 2 equal the saved ones") == 2, out

    straight, resumed = history(tmp_path / "straight.json"), history(tmp_path / "resumed.json")
    assert [m["epoch"] for m in straight] == [1, 2, 3] and [m["epoch"] for m in resumed] == [3]
    jump = abs(resumed[0]["loss"] - straight[2]["loss"])
    epoch_to_epoch = abs(straight[1]["loss"] - straight[0]["loss"])
    print(f"losses {[round(m['loss'], 5) for m in straight]}, resumed epoch 3: "
          f"{resumed[0]['loss']:.5f}")
    assert jump <= 1e-4 * straight[2]["loss"], "the resumed run does not retrace the straight one"
    assert jump <= epoch_to_epoch
    assert resumed[0]["compression_ratio"] > 40


@pytest.mark.slow
def test_fused_resume_on_three_workers_mid_warmup(image_folder, tmp_path):
    """Resume on 3 workers from 2 (memories redistributed), inside DGC's sparsity warm-up."""
    ckpt = tmp_path / "checkpoints"
    args = ["--train-dir", str(image_folder), *TINY, "--compression", "dgc", "--density", "0.01",
            "--sparsity-warmup-epochs", "2", "--optimizer", "fused", "--checkpoint-dir", str(ckpt)]
    horovodrun(WORKER, 2, [*args, "--epochs", "1", "--json", str(tmp_path / "first.json")])
    out = horovodrun(WORKER, 3, [*args, "--epochs", "3", "--json", str(tmp_path / "resumed.json")],
                     timeout_s=600)
    assert "resumed after epoch 1" in out, out
    assert out.count("restored memories of epoch 1 equal the redistributed from 2 ranks") == 3, out
    first, resumed = history(tmp_path / "first.json"), history(tmp_path / "resumed.json")
    c = 0.01 ** (1 / 3)  # the warm-up's factor: c ** (W + 1) == density, W = 2
    assert [m["density"] for m in first + resumed] == pytest.approx([c, c * c, 0.01], rel=1e-9)
    assert all(m["loss"] < 2 * first[0]["loss"] for m in resumed), resumed


def test_help_documents_every_flag():
    parser = example.build_parser()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 25
    undocumented = [a.option_strings[0] for a in flags if not (a.help or "").strip()]
    assert not undocumented
    text = parser.format_help()
    assert all(a.option_strings[0] in text for a in flags)
