"""Models, built without touching any global RNG.

Modules are constructed on the ``meta`` device (no parameter is drawn), moved
to CPU with :meth:`torch.nn.Module.to_empty`, then initialised from a
generator derived from ``(seed, purpose=init)``. The initialisation
distributions are PyTorch's defaults (Kaiming-uniform with a = √5 for weights,
``U(±1/√fan_in)`` for biases, ones/zeros for norm layers), so results compare
with code that uses the defaults.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import torch
from torch import nn

from fedloom.config import ModelConfig
from fedloom.config.checks import check_model_factory
from fedloom.registry import Range, get, register
from fedloom.rng import Purpose, derive_seed, seeded_global_rng, torch_gen

__all__ = ["CNN", "MLP", "build_model", "init_parameters"]


class MLP(nn.Module):
    """Flatten → [Linear → ReLU] × len(hidden) → Linear (CRAFT's code: 2 × 200)."""

    def __init__(self, in_features: int, hidden: list[int], num_classes: int,
                 activation: str = "relu") -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU() if activation == "relu" else nn.Identity()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """The two-conv CNN of McMahan et al. (2017) and LEAF.

    conv5×5(32, same) → ReLU → maxpool2 → conv5×5(64, same) → ReLU → maxpool2 →
    fc(512) → ReLU → fc(classes) (McMahan et al.'s width; LEAF's FEMNIST CNN,
    ``leaf_cnn``, has 2048 units there). ``channels`` narrows the two
    convolutions (CPU budgets).
    """

    def __init__(self, in_shape: tuple[int, ...], num_classes: int,
                 channels: tuple[int, int] = (32, 64)) -> None:
        super().__init__()
        if len(in_shape) != 3:
            raise ValueError(f"model.name: cnn needs image inputs [C, H, W], got {in_shape}")
        c, h, w = in_shape
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(c, c1, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        )
        flat = c2 * (h // 4) * (w // 4)
        if flat == 0:
            raise ValueError(f"model.name: cnn needs images of at least 4x4, got {h}x{w}")
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(flat, 512), nn.ReLU(), nn.Linear(512, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@register("model", "mlp")
def _mlp(in_shape: tuple[int, ...], num_classes: int, *,
         hidden: Annotated[Sequence[int], Range(ge=1)] = (200, 200),
         activation: Literal["relu", "none"] = "relu") -> nn.Module:
    """``activation: none`` is FLARE's activation-less "FC" model (a linear map)."""
    return MLP(math.prod(in_shape), list(hidden), num_classes, activation)


@register("model", "resnet")
def _resnet(in_shape: tuple[int, ...], num_classes: int, *,
            depth: Annotated[int, Range(ge=8)] = 20, width: Annotated[int, Range(ge=4)] = 16,
            norm: Literal["group", "batch", "none"] = "group") -> nn.Module:
    """CIFAR ResNet-(6n+2) of ``width`` channels in its first stage; ``norm``: GroupNorm(1, C)
    as CRAFT's code, BatchNorm as FLARE's and SA-PEF's code, or none."""
    from fedloom.models.resnet import ResNetGN

    return ResNetGN(in_shape, num_classes, depth=depth, width=width, norm=norm)


class CharRNN(nn.Module):
    """Embedding → GRU/LSTM layers → linear on the last step (LEAF's Shakespeare model:
    embedding 8, two LSTM layers of 256)."""

    def __init__(self, vocab: int, embed: int, hidden: list[int], cell: str,
                 num_classes: int) -> None:
        super().__init__()
        if not hidden or len(set(hidden)) != 1:
            raise ValueError(f"model.options.hidden: char_rnn needs equal layer widths, "
                             f"got {hidden}")
        self.embed = nn.Embedding(vocab, embed)
        rnn = nn.GRU if cell == "gru" else nn.LSTM
        self.rnn = rnn(embed, hidden[0], num_layers=len(hidden), batch_first=True)
        self.head = nn.Linear(hidden[0], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(x.long()))
        return self.head(out[:, -1])


@register("model", "char_rnn")
def _char_rnn(in_shape: tuple[int, ...], num_classes: int, *,
              embed: Annotated[int, Range(ge=1)] = 8,
              hidden: Annotated[Sequence[int], Range(ge=1)] = (200, 200),
              cell: Literal["gru", "lstm"] = "gru") -> nn.Module:
    """``embed``: the embedding width (LEAF: 8); ``hidden``: the recurrent layers' widths."""
    return CharRNN(num_classes, embed, list(hidden), cell, num_classes)


@register("model", "cnn")
def _cnn(in_shape: tuple[int, ...], num_classes: int, *,
         channels: Annotated[Sequence[int], Range(ge=1)] = (32, 64)) -> nn.Module:
    """``channels``: the two convolutions' widths."""
    return CNN(in_shape, num_classes, two_widths("cnn", channels))


def two_widths(name: str, channels: Sequence[int]) -> tuple[int, int]:
    """``channels`` as the two conv widths of model ``name``, else a ValueError naming
    ``model.options.channels``."""
    if len(channels) != 2:
        raise ValueError(f"model.options.channels: {name} needs two conv widths, "
                         f"got {list(channels)}")
    return int(channels[0]), int(channels[1])


def init_parameters(module: nn.Module, gen: torch.Generator) -> None:
    """(Re)initialise every parameter of ``module`` from ``gen`` (PyTorch's defaults).

    Modules are visited in ``named_modules`` order, so the draw order, and hence
    the result, depends only on the architecture and the generator.
    """
    scheme = getattr(module, "fedloom_init", "")
    kaiming_normal = scheme == "kaiming_normal"
    # pfl-research's benchmark CNN: Glorot-uniform weights, PyTorch's default biases
    xavier = scheme == "xavier_uniform"
    if scheme in ("glorot_normal", "glorot_uniform"):
        _init_glorot(module, gen, scheme)
        return
    with torch.no_grad():
        for mod in module.modules():
            own = dict(mod.named_parameters(recurse=False))
            if not own:
                continue
            weight, bias = own.get("weight"), own.get("bias")
            if isinstance(mod, nn.modules.batchnorm._NormBase | nn.GroupNorm | nn.LayerNorm):
                if weight is not None:
                    weight.fill_(1.0)
                if bias is not None:
                    bias.zero_()
                continue
            if isinstance(mod, nn.RNNBase):
                bound = 1.0 / math.sqrt(mod.hidden_size)
                for p in own.values():
                    p.uniform_(-bound, bound, generator=gen)
                continue
            if isinstance(mod, nn.Embedding):
                weight.normal_(0.0, 1.0, generator=gen)  # type: ignore[union-attr]
                continue
            fan_in = None
            for name, p in own.items():
                if name == "bias":
                    continue
                if p.ndim >= 2 and kaiming_normal:  # He et al. (2015), as CRAFT's ResNet
                    nn.init.kaiming_normal_(p, generator=gen)
                    fan_in = nn.init._calculate_fan_in_and_fan_out(p)[0]
                elif p.ndim >= 2 and xavier:
                    nn.init.xavier_uniform_(p, generator=gen)
                    fan_in = nn.init._calculate_fan_in_and_fan_out(p)[0]
                elif p.ndim >= 2:
                    nn.init.kaiming_uniform_(p, a=math.sqrt(5), generator=gen)
                    fan_in = nn.init._calculate_fan_in_and_fan_out(p)[0]
                else:
                    p.uniform_(-1.0, 1.0, generator=gen).mul_(1.0 / math.sqrt(max(1, p.numel())))
            if bias is not None:
                bound = 1.0 / math.sqrt(fan_in) if fan_in else 1.0 / math.sqrt(bias.numel())
                bias.uniform_(-bound, bound, generator=gen)


def _init_glorot(module: nn.Module, gen: torch.Generator, scheme: str) -> None:
    """Keras' Glorot initialisation (Glorot & Bengio 2010), as the FLARE code's models:
    kernels ``U(±√(6/(fan_in+fan_out)))`` (uniform) or a normal of σ = √(2/(fan_in+fan_out))
    truncated at ±2 of its scale σ/0.8796 (Keras' ``GlorotNormal``), biases zero; norm
    layers ones/zeros. Modules are visited in ``named_modules`` order."""
    with torch.no_grad():
        for mod in module.modules():
            own = dict(mod.named_parameters(recurse=False))
            for name, p in own.items():
                if name == "bias" or p.ndim < 2:
                    if isinstance(mod, nn.modules.batchnorm._NormBase | nn.GroupNorm
                                  | nn.LayerNorm) and name == "weight":
                        p.fill_(1.0)
                    else:
                        p.zero_()
                    continue
                fan_in, fan_out = nn.init._calculate_fan_in_and_fan_out(p)
                if scheme == "glorot_uniform":
                    bound = math.sqrt(6.0 / (fan_in + fan_out))
                    p.uniform_(-bound, bound, generator=gen)
                else:
                    scale = math.sqrt(2.0 / (fan_in + fan_out)) / 0.87962566103423978
                    nn.init.trunc_normal_(p, 0.0, scale, -2 * scale, 2 * scale, generator=gen)


def _materialise(module: nn.Module) -> nn.Module:
    """``module.to_empty(device="cpu")`` without its meta-tensor dispatch.

    ``to_empty`` calls ``empty_like`` on each meta tensor, which runs torch's Python
    reference implementation (``torch._refs``); its first call imports
    ``torch.fx.experimental.symbolic_shapes`` and sympy, about a fifth of a short
    run's start on an idle machine (1.2 s of the loaded 2-core machine). Here each
    meta parameter and buffer is replaced by ``torch.empty`` of its shape and dtype
    on the CPU — what ``to_empty`` leaves, uninitialised (a parameter shared by two
    modules stays one parameter).
    """
    new: dict[int, torch.Tensor] = {}
    for mod in module.modules():
        # Any: _parameters holds Parameters, _buffers plain tensors, both filled below
        stores: tuple[dict[str, Any], ...] = (mod._parameters, mod._buffers)
        for store in stores:
            for name, t in store.items():
                if t is None or t.device.type != "meta":
                    continue
                if id(t) not in new:
                    e = torch.empty(t.shape, dtype=t.dtype)
                    new[id(t)] = (nn.Parameter(e, requires_grad=t.requires_grad)
                                  if isinstance(t, nn.Parameter) else e)
                store[name] = new[id(t)]
    return module


def build_model(
    cfg: ModelConfig | Callable[[], nn.Module] | nn.Module,
    in_shape: tuple[int, ...],
    num_classes: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Build a registered model (by ``cfg.name``, called ``factory(in_shape, num_classes,
    **cfg.options)``) and initialise it from ``seed``."""
    if isinstance(cfg, ModelConfig):
        factory = get("model", cfg.name)
        check_model_factory(cfg.name, factory)
        if getattr(factory, "fedloom_own_init", False):
            # A factory that initialises its own weights (a pretrained base, LoRA's
            # zero B; fedloom.models.llm) draws them from (seed, "init") globally.
            with seeded_global_rng(derive_seed(seed, -1, -1, Purpose.INIT)):
                own: nn.Module = factory(in_shape, num_classes, **cfg.options)
            return own.to(dtype)
        with torch.device("meta"):
            module = factory(in_shape, num_classes, **cfg.options)
        module = _materialise(module)
        init_parameters(module, torch_gen(seed, -1, -1, Purpose.INIT))
        # to_empty leaves buffers uninitialised: BatchNorm's running statistics
        # start as PyTorch's (mean 0, variance 1, no batch tracked).
        for mod in module.modules():
            if isinstance(mod, nn.modules.batchnorm._NormBase):
                mod.reset_running_stats()
    elif isinstance(cfg, nn.Module):
        module = cfg
    else:
        module = cfg()
    return module.to(dtype)
