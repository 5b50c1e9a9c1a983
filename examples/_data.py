"""MNIST-1D for the examples: generated procedurally (no download), sharded by rank.

Framework-free (NumPy only) so the PyTorch and TensorFlow examples see the same data.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mnist1d.data import get_dataset_args, make_dataset

NUM_CLASSES = 10


@dataclass(frozen=True)
class Split:
    """Inputs ``x`` (float32, shape ``(n, 40)``) and labels ``y`` (int64, shape ``(n,)``)."""

    x: np.ndarray
    y: np.ndarray

    def shard(self, rank: int, size: int) -> "Split":
        """Every ``size``-th example starting at ``rank``: disjoint, equal-sized shards."""
        n = len(self.y) // size * size
        return Split(self.x[rank:n:size], self.y[rank:n:size])


def load_mnist1d() -> tuple[Split, Split]:
    """The (train, test) splits of MNIST-1D with the package's default arguments.

    The generator seeds itself from those arguments, so every rank gets identical data.
    """
    data = make_dataset(get_dataset_args())
    train = Split(data["x"].astype(np.float32), data["y"].astype(np.int64))
    test = Split(data["x_test"].astype(np.float32), data["y_test"].astype(np.int64))
    return train, test
