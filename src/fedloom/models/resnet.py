"""CIFAR-style ResNet (He et al. 2016, §4.2), GroupNorm by default (as in CRAFT's code).

Three stages of ``n`` basic blocks (depth = 6n + 2; ResNet-20: n = 3) with
``w, 2w, 4w`` channels (w = 16 in the paper), option-A shortcuts (strided
identity, zero-padded channels), BatchNorm replaced by ``GroupNorm(1, C)``
(CRAFT's ``replace_bn_with_gn``: batch statistics are ill-defined under
federated training), convolutions without bias, Kaiming-normal weights.
``width`` shrinks the network for tests.

``norm`` (``model.options.norm``) chooses the normalisation after each convolution:
``group`` (default, the above), ``batch`` — ``BatchNorm2d(C)`` with PyTorch's
defaults (momentum 0.1, eps 1e-5), the original ResNet's and the FLARE and
SA-PEF code's choice; its running statistics are module buffers, handled by
``model.buffers`` (:mod:`fedloom.buffers`) — or ``none``. The layers keep
the names ``gn1``/``gn2`` whatever their kind, so the parameter names, the
layer groups (a norm layer's affine parameters join its convolution's group)
and the initial weights of a given seed are the same for ``group`` and
``batch``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["ResNetGN"]


def _norm(kind: str, c: int) -> nn.Module:
    if kind == "group":
        return nn.GroupNorm(1, c)
    if kind == "batch":
        return nn.BatchNorm2d(c)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"model.options.norm: must be group, batch or none, got {kind!r}")


class _Shortcut(nn.Module):
    def __init__(self, pad: int) -> None:
        super().__init__()
        self.pad = pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, self.pad, self.pad))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm: str = "group") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.gn1 = _norm(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.gn2 = _norm(norm, cout)
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
                 width: int = 16, norm: str = "group") -> None:
        super().__init__()
        if (depth - 2) % 6 != 0 or depth < 8:
            raise ValueError(f"model.options.depth: must be 6n + 2 (20, 32, 44, 56, 110), "
                             f"got {depth}")
        if len(in_shape) != 3:
            raise ValueError(f"model.name: resnet needs image inputs [C, H, W], got {in_shape}")
        if width % 4:
            raise ValueError(f"model.options.width: must be a multiple of 4, got {width}")
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(in_shape[0], width, 3, padding=1, bias=False)
        self.gn1 = _norm(norm, width)
        layers, cin = [], width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            blocks = []
            for b in range(n):
                stride = 2 if stage > 0 and b == 0 else 1
                blocks.append(BasicBlock(cin, cout, stride, norm))
                cin = cout
            layers.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = layers
        self.linear = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.gn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)
