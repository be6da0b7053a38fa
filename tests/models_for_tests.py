"""Small user models for tests, loaded through import paths like ``tests.models_for_tests:skip_cnn``."""

from __future__ import annotations

import torch
from torch import nn


class SkipCNN(nn.Module):
    """Conv-BN-ReLU twice, a concatenation skip and a linear head: input [N, 3, H, W]."""

    def __init__(self, num_classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.head = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.stem(x)
        b = self.body(a)
        pooled = torch.cat([a, b], dim=1).mean(dim=(2, 3))
        return self.head(pooled)


def skip_cnn(num_classes: int = 5) -> nn.Module:
    return SkipCNN(num_classes)


def not_a_module() -> str:
    return "not a model"


class _Broken(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("expected 4 channels, got 3")


def broken_model() -> nn.Module:
    return _Broken()
