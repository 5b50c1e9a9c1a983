"""ResNet-50 for the examples and benchmarks: torchvision's when it imports, else our own.

Our own definition is the usual bottleneck ResNet-50 (stride on the 3x3 convolution, as in
torchvision), so both have 25,557,032 parameters for 1,000 classes and the gradient the
compressors see is the same size whichever is used. Small input images (32x32, say) keep the
compute modest on a CPU while the gradient stays ResNet-50's.
"""
from __future__ import annotations

from typing import List

import torch
from torch import nn

STAGE_BLOCKS = (3, 4, 6, 3)
STAGE_WIDTHS = (64, 128, 256, 512)
EXPANSION = 4


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand, plus the shortcut."""

    def __init__(self, in_channels: int, width: int, stride: int):
        super().__init__()
        out_channels = width * EXPANSION
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + shortcut)


class ResNet50(nn.Module):
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        in_channels = 64
        stages: List[nn.Module] = []
        for index, (blocks, width) in enumerate(zip(STAGE_BLOCKS, STAGE_WIDTHS)):
            layers = []
            for block in range(blocks):
                stride = 2 if index > 0 and block == 0 else 1
                layers.append(Bottleneck(in_channels, width, stride))
                in_channels = width * EXPANSION
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(num_classes: int = 1000) -> nn.Module:
    """ResNet-50 with random weights: torchvision's if it imports, else :class:`ResNet50`."""
    try:
        from torchvision.models import resnet50 as torchvision_resnet50
    except Exception:  # PyPI's torchvision fails to import beside the CPU torch build.
        return ResNet50(num_classes)
    return torchvision_resnet50(weights=None, num_classes=num_classes)
