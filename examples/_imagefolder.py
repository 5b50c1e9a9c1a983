"""ImageNet-style data for the examples, without torchvision: an ImageFolder reader on Pillow,
a synthetic data set, and a generator of tiny ImageFolder directories for tests and demos.

An ImageFolder directory holds one sub-folder per class (sorted names give the labels) of
JPEG or PNG files. Generate one with

    python examples/_imagefolder.py DIR --classes 4 --images-per-class 32 --size 32
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Tuple

import numpy as np
import torch
from PIL import Image

EXTENSIONS = (".jpg", ".jpeg", ".png")
# ImageNet's per-channel mean and standard deviation (RGB, pixel values in [0, 1]).
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def to_tensor(image: Image.Image, size: int, flip: bool) -> torch.Tensor:
    """RGB image -> normalized float tensor (3, size, size): shorter side resized to
    ``size``, centre crop, optional horizontal flip."""
    image = image.convert("RGB")
    scale = size / min(image.size)
    width, height = max(size, round(image.width * scale)), max(size, round(image.height * scale))
    image = image.resize((width, height), Image.BILINEAR)
    left, top = (width - size) // 2, (height - size) // 2
    image = image.crop((left, top, left + size, top + size))
    if flip:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return (pixels - MEAN) / STD


class ImageFolder(torch.utils.data.Dataset):
    """(image tensor, label) pairs from an ImageFolder directory, read with Pillow.

    Args:
        root: the directory (class sub-folders of JPEG or PNG files).
        image_size: side of the square tensors returned, in pixels.
        train: flip images horizontally at random (augmentation), seeded by the index and
            :meth:`set_epoch`'s epoch so a resumed run sees the images an uninterrupted one would.
    """

    def __init__(self, root: Path, image_size: int, train: bool):
        root = Path(root)
        self.classes = sorted(d.name for d in root.iterdir() if d.is_dir()) if root.is_dir() else []
        if not self.classes:
            raise ValueError(f"{root} is not an ImageFolder directory (no class sub-folders)")
        self.samples: List[Tuple[Path, int]] = [
            (path, label) for label, name in enumerate(self.classes)
            for path in sorted((root / name).iterdir()) if path.suffix.lower() in EXTENSIONS]
        if not self.samples:
            raise ValueError(f"{root} holds no {'/'.join(EXTENSIONS)} images")
        self.image_size, self.train, self.epoch = image_size, train, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        flip = self.train and bool(torch.randint(2, (), generator=torch.Generator().manual_seed(
            self.epoch * len(self.samples) + index)))
        with Image.open(path) as image:
            return to_tensor(image, self.image_size, flip), label


class SyntheticImages(torch.utils.data.Dataset):
    """Random normalized images with random labels, fixed by ``seed`` (for timing runs)."""

    def __init__(self, num_classes: int, image_size: int, length: int, seed: int = 0):
        self.classes = [str(c) for c in range(num_classes)]
        self.image_size, self.length, self.seed = image_size, length, seed

    def set_epoch(self, epoch: int) -> None:
        """Every epoch sees the same images."""

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.randn(3, self.image_size, self.image_size, generator=gen)
        return image, int(torch.randint(len(self.classes), (), generator=gen))


def make_image_folder(root: Path, classes: int = 4, images_per_class: int = 32, size: int = 32,
                      seed: int = 0) -> Path:
    """Write a tiny learnable ImageFolder: class c's images are noisy stripes of colour c
    at angle c, half of them PNG, half JPEG. Returns ``root``."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    for c in range(classes):
        folder = Path(root) / f"class{c:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        angle = np.pi * c / classes
        colour = np.array([np.cos(angle), np.sin(angle), 0.5]) * 0.5 + 0.5
        stripes = np.sin(2 * np.pi * 4 * (x * np.cos(angle) + y * np.sin(angle)))
        for i in range(images_per_class):
            noise = rng.normal(0.0, 0.3, (size, size, 3))
            pixels = (0.5 + 0.4 * stripes[..., None] * colour + noise).clip(0, 1)
            image = Image.fromarray((pixels * 255).astype(np.uint8))
            image.save(folder / f"{i:04d}.{'png' if i % 2 else 'jpg'}")
    return Path(root)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write a tiny generated ImageFolder directory.")
    parser.add_argument("root", type=Path, help="directory to create")
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--images-per-class", type=int, default=32)
    parser.add_argument("--size", type=int, default=32, help="image side, pixels")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    make_image_folder(args.root, args.classes, args.images_per_class, args.size, args.seed)
    print(f"wrote {args.classes} classes x {args.images_per_class} images to {args.root}")
