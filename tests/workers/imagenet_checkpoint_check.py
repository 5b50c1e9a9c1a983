"""Runs examples/pytorch_imagenet_resnet50.py (arguments passed through) and, when it
resumes from a checkpoint, checks on every rank that the restored compressor memories equal
exactly the part this rank saved (or, on another number of workers, the parts of every rank
redistributed)."""
import re
import sys
from pathlib import Path

import horovod.torch as hvd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import pytorch_imagenet_resnet50 as example  # noqa: E402
from horovod_dgc.torch.checkpoint import redistribute  # noqa: E402


def expected_state(folder: Path, epoch: int) -> tuple:
    """(what this rank must hold after resuming from ``epoch``, how it was obtained)."""
    files = sorted(folder.glob(f"compressor-{epoch:03d}-rank*-of-*.pt"))
    saved_world = int(re.search(r"-of-(\d+)\.pt$", files[0].name).group(1))
    checkpoints = example.Checkpoints(folder, 0)
    if saved_world == hvd.size():
        return torch.load(checkpoints.part_file(epoch, hvd.rank(), saved_world)), "saved"
    parts = [torch.load(checkpoints.part_file(epoch, r, saved_world)) for r in range(saved_world)]
    return redistribute(parts, hvd.size(), hvd.rank()), f"redistributed from {saved_world} ranks"


def check_restored(args):
    def check(epoch: int, compression) -> None:
        expected, how = expected_state(args.checkpoint_dir, epoch)
        restored = compression.state_dict()
        assert restored["steps"] == expected["steps"] and restored["epoch"] == expected["epoch"]
        assert restored["states"].keys() == expected["states"].keys()
        assert any(v.any() for s in expected["states"].values() for v in s.values()), "all zero"
        for name, tensors in expected["states"].items():
            for key, value in tensors.items():
                assert torch.equal(restored["states"][name][key], value), f"{name}.{key} differs"
        print(f"rank {hvd.rank()} restored memories of epoch {epoch} equal the {how} ones "
              f"({len(expected['states'])} tensors)", flush=True)
    return check


if __name__ == "__main__":
    arguments = example.parse_args(sys.argv[1:])
    example.main(arguments, on_resume=check_restored(arguments))
