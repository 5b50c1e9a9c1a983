"""Fashion-MNIST from Debian's ``dataset-fashion-mnist`` package (gzipped IDX files), as
normalised float32 tensors; no download."""
from __future__ import annotations

import gzip
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Tuple

import numpy as np
import torch

DATA_DIR = Path("/usr/share/datasets/fashion-mnist")
MEAN, STD = 0.2860, 0.3530  # of the training images, in [0, 1]
NUM_CLASSES = 10


@dataclass(frozen=True)
class Split:
    images: torch.Tensor  # (n, 1, 28, 28) float32, normalised
    labels: torch.Tensor  # (n,) int64

    def shard(self, rank: int, size: int) -> "Split":
        """Every ``size``-th example from ``rank`` on: the ranks' shards are disjoint."""
        return Split(self.images[rank::size], self.labels[rank::size])

    def first(self, count: int) -> "Split":
        return Split(self.images[:count], self.labels[:count])


def _idx(path: Path) -> np.ndarray:
    """An IDX file's array (the magic number gives the rank; data are unsigned bytes)."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    zero, dtype, dims = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes")
    shape = struct.unpack(f">{dims}I", data[4:4 + 4 * dims])
    return np.frombuffer(data, np.uint8, offset=4 + 4 * dims).reshape(shape)


def load(data_dir: Path = DATA_DIR) -> Tuple[Split, Split]:
    """(train, test): 60,000 and 10,000 28x28 images of 10 classes of clothing."""
    if not (data_dir / "train-images-idx3-ubyte.gz").exists():
        raise FileNotFoundError(f"Fashion-MNIST is not in {data_dir}: install Debian's "
                                f"dataset-fashion-mnist package (make setup does, as root)")

    def split(prefix: str) -> Split:
        images = _idx(data_dir / f"{prefix}-images-idx3-ubyte.gz").astype(np.float32) / 255.0
        labels = _idx(data_dir / f"{prefix}-labels-idx1-ubyte.gz").astype(np.int64)
        return Split(torch.from_numpy((images - MEAN) / STD).unsqueeze(1), torch.from_numpy(labels))

    return split("train"), split("t10k")
