"""The papers' own models: ResNet-18 (SA-PEF), VGG-11/16/19, FC and CNN (FLARE).

- ``resnet18``: the SA-PEF code's CIFAR ResNet-18 (He et al. 2016), 11,173,962
  parameters for 10 classes; ``model.options.norm`` BatchNorm (the code's), GroupNorm or
  none; ``resnet9``: the SA-PEF code's CIFAR-10 model (:class:`ResNet9`).
- ``vgg11`` / ``vgg16`` / ``vgg19``: the FLARE code's Keras VGGs for 32×32 CIFAR
  (its ReLU placement and Glorot-uniform initialisation).
- ``flare_fc`` (784 → 4069 → 4069 → 4069 → 10, no activation, 36,356,525
  parameters) and ``flare_cnn`` (582,026 parameters): the FLARE code's MNIST models.
- ``craft_cnn`` (:class:`CraftCNN`), ``pfl_cnn`` (:class:`PflCNN`) and ``leaf_cnn``
  (LEAF's FEMNIST CNN, Caldas et al. 2018; 6,603,710 parameters for 62 classes).

Departures: fedloom's models return logits and the loss is cross-entropy on them
(the FLARE code applies softmax in the model and trains on the probabilities);
Keras flattens channels-last, so the order of the flat features differs, not the
function class or the parameter count. Each architecture layer by layer:
docs/howto/datasets.md (The papers' models in detail).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Annotated, Literal

import torch
from torch import nn
from torch.nn import functional as F

from fedloom.models import two_widths
from fedloom.models.resnet import _norm
from fedloom.registry import Range, register

__all__ = ["VGG", "CraftCNN", "FlareCNN", "FlareFC", "LeafCNN", "ResNet9", "ResNet18",
           "describe_models"]


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _norm(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = _norm(norm, cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                          _norm(norm, cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18, CIFAR variant (docs/howto/datasets.md: The papers' models in detail)."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, norm: str = "batch",
                 width: int = 64) -> None:
        super().__init__()
        if len(in_shape) != 3:
            raise ValueError(f"model.name: resnet18 needs image inputs [C, H, W], got {in_shape}")
        self.conv1 = nn.Conv2d(in_shape[0], width, 3, padding=1, bias=False)
        self.bn1 = _norm(norm, width)
        stages, cin = [], width
        for i, mult in enumerate((1, 2, 4, 8)):
            cout = width * mult
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(_Block(cin, cout, stride, norm),
                                        _Block(cout, cout, 1, norm)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.linear = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return self.linear(F.adaptive_avg_pool2d(out, 1).flatten(1))


def _conv_bn(cin: int, cout: int, norm: str, pool: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, 3, padding=1), _norm(norm, cout), nn.ReLU()]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class ResNet9(nn.Module):
    """ResNet-9 as the SA-PEF code's CIFAR-10 model (Page's DAWNBench network): 3×3
    convolutions with bias, each followed by a norm and ReLU — 64, 128 (+pool), a residual
    pair of 128, 256 (+pool), 512 (+pool), a residual pair of 512 — then global max-pool,
    Dropout(0.2) and Dense(classes). 6,575,370 parameters for 10 classes with BatchNorm."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, norm: str = "batch"
                 ) -> None:
        super().__init__()
        if len(in_shape) != 3:
            raise ValueError(f"model.name: resnet9 needs image inputs [C, H, W], got {in_shape}")
        self.conv1 = _conv_bn(in_shape[0], 64, norm)
        self.conv2 = _conv_bn(64, 128, norm, pool=True)
        self.res1 = nn.Sequential(_conv_bn(128, 128, norm), _conv_bn(128, 128, norm))
        self.conv3 = _conv_bn(128, 256, norm, pool=True)
        self.conv4 = _conv_bn(256, 512, norm, pool=True)
        self.res2 = nn.Sequential(_conv_bn(512, 512, norm), _conv_bn(512, 512, norm))
        self.classifier = nn.Sequential(nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Dropout(0.2),
                                        nn.Linear(512, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv2(self.conv1(x))
        out = self.res1(out) + out
        out = self.conv4(self.conv3(out))
        out = self.res2(out) + out
        return self.classifier(out)


@register("model", "resnet9")
def _resnet9(in_shape: tuple[int, ...], num_classes: int, *,
             norm: Literal["group", "batch", "none"] = "group") -> nn.Module:
    return ResNet9(in_shape, num_classes, norm=norm)


# Per stage: the convolutions' widths. "r" marks where a ReLU follows (FLARE's code).
_VGG = {
    11: [[(64, True)], [(128, True)], [(256, False), (256, True)], [(512, False), (512, True)],
         [(512, False), (512, True)]],
    16: [[(64, True)] * 2, [(128, True)] * 2, [(256, True)] * 3, [(512, True)] * 3,
         [(512, True)] * 3],
    19: [[(64, True)] * 2, [(128, True)] * 2, [(256, True)] * 4, [(512, True)] * 4,
         [(512, True)] * 4],
}


class VGG(nn.Module):
    """VGG-11/16/19 as the FLARE code builds them (docs/howto/datasets.md: The papers'
    models in detail)."""

    fedloom_init = "glorot_uniform"

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, depth: int,
                 hidden: int = 4096, dropout: float = 0.5) -> None:
        super().__init__()
        if depth not in _VGG:
            raise ValueError(f"model.name: vgg depth must be 11, 16 or 19, got {depth}")
        if len(in_shape) != 3 or in_shape[1] % 32 or in_shape[2] % 32:
            raise ValueError(f"model.name: vgg{depth} needs images [C, H, W] with H and W "
                             f"multiples of 32, got {in_shape}")
        layers: list[nn.Module] = []
        cin = in_shape[0]
        for stage in _VGG[depth]:
            for cout, relu in stage:
                layers.append(nn.Conv2d(cin, cout, 3, padding=1))
                if relu:
                    layers.append(nn.ReLU())
                cin = cout
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        flat = cin * (in_shape[1] // 32) * (in_shape[2] // 32)
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _valid_convs(name: str, in_shape: tuple[int, ...], channels: tuple[int, int]
                 ) -> tuple[nn.Sequential, int]:
    """Two 5×5 "valid" convolutions, each followed by ReLU and a 2×2 max-pool (the FLARE
    and CRAFT codes' CNN trunks); returns the trunk and its flattened output size."""
    if len(in_shape) != 3:
        raise ValueError(f"model.name: {name} needs image inputs [C, H, W], got {in_shape}")
    c, h, w = in_shape
    oh, ow = ((h - 4) // 2 - 4) // 2, ((w - 4) // 2 - 4) // 2
    if oh < 1 or ow < 1:
        raise ValueError(f"model.name: {name} needs images of at least 16x16, got {h}x{w}")
    trunk = nn.Sequential(nn.Conv2d(c, channels[0], 5), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(channels[0], channels[1], 5), nn.ReLU(), nn.MaxPool2d(2))
    return trunk, channels[1] * oh * ow


class FlareCNN(nn.Module):
    """The FLARE code's MNIST CNN (docs/howto/datasets.md: The papers' models in detail)."""

    fedloom_init = "glorot_normal"

    def __init__(self, in_shape: tuple[int, ...], num_classes: int,
                 channels: tuple[int, int] = (32, 64)) -> None:
        super().__init__()
        self.features, flat = _valid_convs("flare_cnn", in_shape, channels)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(flat, 512), nn.ReLU(),
                                        nn.Linear(512, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class FlareFC(nn.Module):
    """The FLARE code's MNIST "FC": three hidden linear layers of 4069, no activation."""

    fedloom_init = "glorot_normal"

    def __init__(self, in_features: int, num_classes: int,
                 hidden: tuple[int, ...] = (4069, 4069, 4069)) -> None:
        super().__init__()
        dims = [in_features, *hidden, num_classes]
        self.net = nn.Sequential(nn.Flatten(),
                                 *(nn.Linear(a, b) for a, b in itertools.pairwise(dims)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@register("model", "resnet18")
def _resnet18(in_shape: tuple[int, ...], num_classes: int, *,
              norm: Literal["group", "batch", "none"] = "group",
              width: Annotated[int, Range(ge=1)] = 64) -> nn.Module:
    """``norm``: the normalisation layers; ``width``: the first stage's channels (64; the
    stages double it; smaller for tests)."""
    return ResNet18(in_shape, num_classes, norm=norm, width=width)


def _vgg(depth: int):
    def build(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        return VGG(in_shape, num_classes, depth)

    build.__doc__ = f"VGG-{depth} as the FLARE code builds it."
    return build


for _d in (11, 16, 19):
    register("model", f"vgg{_d}")(_vgg(_d))


@register("model", "flare_fc")
def _flare_fc(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    import math

    return FlareFC(math.prod(in_shape), num_classes)


@register("model", "flare_cnn")
def _flare_cnn(in_shape: tuple[int, ...], num_classes: int, *,
               channels: Annotated[Sequence[int], Range(ge=1)] = (32, 64)) -> nn.Module:
    return FlareCNN(in_shape, num_classes, two_widths("flare_cnn", channels))


class LeafCNN(nn.Module):
    """LEAF's FEMNIST CNN (docs/howto/datasets.md: The papers' models in detail)."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int,
                 channels: tuple[int, int] = (32, 64), hidden: int = 2048) -> None:
        super().__init__()
        if len(in_shape) != 3 or in_shape[1] < 4 or in_shape[2] < 4:
            raise ValueError(f"model.name: leaf_cnn needs images [C, H, W] of at least 4x4, "
                             f"got {in_shape}")
        c, h, w = in_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, channels[0], 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(channels[0], channels[1], 5, padding=2), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(channels[1] * (h // 4) * (w // 4), hidden), nn.ReLU(),
            nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@register("model", "leaf_cnn")
def _leaf_cnn(in_shape: tuple[int, ...], num_classes: int, *,
              channels: Annotated[Sequence[int], Range(ge=1)] = (32, 64)) -> nn.Module:
    return LeafCNN(in_shape, num_classes, two_widths("leaf_cnn", channels))


class CraftCNN(nn.Module):
    """The CRAFT code's CNN for FEMNIST and CIFAR: conv 5×5 "valid" (64) → ReLU → max-pool 2
    → conv 5×5 "valid" (64) → ReLU → max-pool 2 → Dense(384) → Dropout(0.2) → ReLU →
    Dense(192) → Dropout(0.5) → ReLU → Dense(classes); PyTorch's default initialisation.
    583,614 parameters for 62 classes on 28×28 inputs."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int,
                 channels: tuple[int, int] = (64, 64)) -> None:
        super().__init__()
        self.features, flat = _valid_convs("craft_cnn", in_shape, channels)
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(flat, 384), nn.Dropout(0.2), nn.ReLU(),
            nn.Linear(384, 192), nn.Dropout(0.5), nn.ReLU(), nn.Linear(192, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@register("model", "craft_cnn")
def _craft_cnn(in_shape: tuple[int, ...], num_classes: int, *,
               channels: Annotated[Sequence[int], Range(ge=1)] = (64, 64)) -> nn.Module:
    # the flat model.options.channels defaulted to the built-in cnn's [32, 64], which meant this
    # model's own 64/64 (fedloom.config.translate keeps that: [32, 64] was the default)
    return CraftCNN(in_shape, num_classes, two_widths("craft_cnn", channels))


class PflCNN(nn.Module):
    """pfl-research's CIFAR-10 benchmark CNN (its ``simple_cnn``; Granqvist et al. 2024,
    arXiv 2404.06430): conv 3×3 "valid" (32) → ReLU → conv 3×3 "valid" (64) → ReLU →
    max-pool 2 → Dropout(0.25) → Dense(128) → ReLU → Dropout(0.5) → Dense(classes).
    Glorot-uniform weights and PyTorch's default biases, as that code (it re-draws the
    weights with ``xavier_uniform_`` after construction). 1,626,442 parameters for 10
    classes on 3×32×32 inputs. Departure: that code takes channels-last images and
    transposes them in the model; fedloom's images are channels-first already, so the
    transpose is left out (the flattened features are in the same order).
    ``model.options.channels`` narrows the two convolutions."""

    fedloom_init = "xavier_uniform"

    def __init__(self, in_shape: tuple[int, ...], num_classes: int,
                 channels: tuple[int, int] = (32, 64)) -> None:
        super().__init__()
        if len(in_shape) != 3:
            raise ValueError(f"model.name: pfl_cnn needs image inputs [C, H, W], got {in_shape}")
        c, h, w = in_shape
        if h < 6 or w < 6:
            raise ValueError(f"model.name: pfl_cnn needs images of at least 6x6, got {h}x{w}")
        flat = channels[1] * ((h - 4) // 2) * ((w - 4) // 2)
        self.features = nn.Sequential(
            nn.Conv2d(c, channels[0], 3), nn.ReLU(), nn.Conv2d(channels[0], channels[1], 3),
            nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.25))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(flat, 128), nn.ReLU(),
                                        nn.Dropout(0.5), nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@register("model", "pfl_cnn")
def _pfl_cnn(in_shape: tuple[int, ...], num_classes: int, *,
             channels: Annotated[Sequence[int], Range(ge=1)] = (32, 64)) -> nn.Module:
    return PflCNN(in_shape, num_classes, two_widths("pfl_cnn", channels))


# name: (what it is, the model.options it reads (and model.buffers where it matters),
# the input it is counted on, classes)
CATALOG: dict[str, tuple[str, tuple[str, ...], tuple[int, ...], int]] = {
    "mlp": ("MLP, ReLU or none between layers (CRAFT's 2 x 200)", ("hidden", "activation"),
            (1, 28, 28), 10),
    "cnn": ("two 5x5 convolutions + Dense(512) (McMahan et al. 2017)", ("channels",),
            (1, 28, 28), 10),
    "leaf_cnn": ("LEAF's FEMNIST CNN: two 5x5 convolutions + Dense(2048)", ("channels",),
                 (1, 28, 28), 62),
    "resnet": ("CIFAR ResNet-6n+2 (ResNet-20/56/110; CRAFT's code: GroupNorm)",
               ("depth", "width", "norm", "buffers"), (3, 32, 32), 10),
    "resnet18": ("ResNet-18, CIFAR variant (the SA-PEF code's)", ("norm", "buffers"),
                 (3, 32, 32), 10),
    "resnet9": ("ResNet-9 (the SA-PEF code's CIFAR-10 model; BatchNorm, dropout 0.2)",
                ("norm", "buffers"), (3, 32, 32), 10),
    "vgg11": ("VGG-11 as the FLARE code (no norm, Dense 4096 x 2, dropout 0.5)", (),
              (3, 32, 32), 10),
    "vgg16": ("VGG-16 as the FLARE code", (), (3, 32, 32), 10),
    "vgg19": ("VGG-19 as the FLARE code", (), (3, 32, 32), 10),
    "flare_fc": ("the FLARE code's MNIST FC: 784-4069-4069-4069-10, no activation", (),
                 (1, 28, 28), 10),
    "flare_cnn": ("the FLARE code's MNIST CNN: two 5x5 valid convolutions + Dense(512)",
                  ("channels",), (1, 28, 28), 10),
    "craft_cnn": ("the CRAFT code's CNN: two 5x5 valid convolutions (64) + Dense 384-192, "
                  "dropout", ("channels",), (1, 28, 28), 62),
    "pfl_cnn": ("pfl-research's CIFAR-10 benchmark CNN: two 3x3 valid convolutions + "
                "Dense(128), dropout", ("channels",), (3, 32, 32), 10),
    "char_rnn": ("character GRU/LSTM (LEAF's Shakespeare model: 2 x LSTM 256)",
                 ("hidden", "embed", "cell"), (80,), 80),
}


def describe_models() -> list[dict[str, object]]:
    """Every registered model: its description, options and parameter count on the
    input it is listed with (built on the ``meta`` device: nothing is allocated)."""
    import math

    from fedloom.registry import available, get

    rows: list[dict[str, object]] = []
    for name in available("model"):
        desc, opts, shape, classes = CATALOG.get(name, ("(plug-in)", (), (), 0))
        count: int | None = None
        if shape:
            try:
                with torch.device("meta"):
                    m = get("model", name)(shape, classes)
                count = sum(math.prod(p.shape) for p in m.parameters())
            except (ValueError, TypeError):  # a plug-in that needs other inputs
                count = None
        rows.append({"name": name, "description": desc, "options": list(opts),
                     "input": list(shape), "classes": classes, "parameters": count})
    return rows
