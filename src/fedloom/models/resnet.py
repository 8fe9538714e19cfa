"""CIFAR-style ResNet with GroupNorm (He et al. 2016, §4.2; as in CRAFT's code).

Three stages of ``n`` basic blocks (depth = 6n + 2; ResNet-20: n = 3) with
``w, 2w, 4w`` channels (w = 16 in the paper), option-A shortcuts (strided
identity, zero-padded channels), BatchNorm replaced by ``GroupNorm(1, C)``
(CRAFT's ``replace_bn_with_gn``: batch statistics are ill-defined under
federated training), convolutions without bias, Kaiming-normal weights.
``width`` shrinks the network for tests.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["ResNetGN"]


class _Shortcut(nn.Module):
    def __init__(self, pad: int) -> None:
        super().__init__()
        self.pad = pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, self.pad, self.pad))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(1, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(1, cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = _Shortcut((cout - cin) // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.gn1(self.conv1(x)))
        out = self.gn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetGN(nn.Module):
    fedloom_init = "kaiming_normal"

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, depth: int = 20,
                 width: int = 16) -> None:
        super().__init__()
        if (depth - 2) % 6 != 0 or depth < 8:
            raise ValueError(f"model.depth: must be 6n + 2 (20, 32, 44, 56, 110), got {depth}")
        if len(in_shape) != 3:
            raise ValueError(f"model.name: resnet needs image inputs [C, H, W], got {in_shape}")
        if width % 4:
            raise ValueError(f"model.width: must be a multiple of 4, got {width}")
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(in_shape[0], width, 3, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(1, width)
        layers, cin = [], width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            blocks = []
            for b in range(n):
                stride = 2 if stage > 0 and b == 0 else 1
                blocks.append(BasicBlock(cin, cout, stride))
                cin = cout
            layers.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = layers
        self.linear = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.gn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)
