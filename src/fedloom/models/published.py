"""The cross-device benchmarks' models: next-word LSTM and transformer, multi-label ResNet-18.

- ``nwp_lstm``: Reddi et al. (ICLR 2021, "Adaptive Federated Optimization") and pfl-research's
  StackOverflow LSTM (``benchmarks/model/pytorch/lstm.py``): embedding 96, one LSTM
  of 670, a linear map back to 96, logits against the embedding (tied, pfl's; ``tied:
  false`` adds TFF's own output layer). Initialised as pfl's: LSTM input weights
  Glorot-uniform, recurrent weights orthogonal, embedding N(0, 1), PyTorch's others.
- ``nwp_transformer``: pfl's ``lm_transformer`` (Wang et al. 2021's StackOverflow
  transformer): embedding 96 x √96 plus sinusoidal positions, ``layers`` causal encoder
  layers (``heads`` 8, feed-forward 1536, dropout 0.1), tied output; embedding
  U(±0.05), projections Glorot-uniform.
- ``multilabel_resnet18``: pfl's FLAIR model without pretraining: torchvision's
  ResNet-18 (7x7 stem, max-pool, four stages of two basic blocks) with every BatchNorm
  replaced by ``GroupNorm(min(32, C), C)`` (pfl's ``convert_batchnorm_modules``),
  Kaiming-normal (fan-out) convolutions as torchvision. Its logits ``z`` ``[B, C]``
  are returned as ``[B, 2, C]`` with a zero first row: cross-entropy over that
  axis is ``log(1 + e^z) - y z``, binary cross-entropy with logits per label
  (tests/test_published_models.py checks it against ``binary_cross_entropy_with_logits``).

The next-word models read token ids ``[B, T]`` and return ``[B, V, T]`` (fedloom's
causal-LM convention). Each builds its own weights from the run's seed
(``fedloom_own_init``). Departure: the transformer's width is its embedding's (pfl
adds projections when ``hidden_size`` differs; its benchmark uses 96 for both).
"""

from __future__ import annotations

import math
from typing import Annotated

import torch
from torch import nn
from torch.nn import functional as F

from fedloom.registry import Range, register

__all__ = ["MultiLabelResNet18", "NextWordLSTM", "NextWordTransformer"]


def _tokens(name: str, in_shape: tuple[int, ...]) -> None:
    if len(in_shape) != 1:
        raise ValueError(f"model.name: {name} reads token ids [seq_len], got inputs {in_shape}")


class NextWordLSTM(nn.Module):
    def __init__(self, vocab: int, embed: int, hidden: int, layers: int, tied: bool) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed, padding_idx=0)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.project = nn.Linear(hidden, embed)
        self.head = None if tied else nn.Linear(embed, vocab)
        for name, w in self.lstm.named_parameters():
            if name.startswith("weight_ih"):
                nn.init.xavier_uniform_(w)
            elif name.startswith("weight_hh"):
                nn.init.orthogonal_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embedding(x.long()))
        h = self.project(h)
        logits = h @ self.embedding.weight.t() if self.head is None else self.head(h)
        return logits.transpose(1, 2)


class NextWordTransformer(nn.Module):
    positions: torch.Tensor
    causal: torch.Tensor

    def __init__(self, vocab: int, seq_len: int, embed: int, heads: int, ff: int, layers: int,
                 dropout: float) -> None:
        super().__init__()
        self.scale = math.sqrt(embed)
        self.embedding = nn.Embedding(vocab, embed, padding_idx=0)
        nn.init.uniform_(self.embedding.weight, -0.05, 0.05)
        pos = torch.arange(seq_len, dtype=torch.float32)[:, None]
        freq = torch.exp(torch.arange(0, embed, 2, dtype=torch.float32) * (-math.log(1e4) / embed))
        pe = torch.zeros(seq_len, embed)
        pe[:, 0::2] = torch.sin(pos * freq)
        pe[:, 1::2] = torch.cos(pos * freq[: embed // 2])
        self.register_buffer("positions", pe, persistent=False)
        self.register_buffer("causal", torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool),
                                                  1), persistent=False)
        layer = nn.TransformerEncoderLayer(embed, heads, ff, dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.embedding(x.long()) * self.scale + self.positions[:t]
        h = self.encoder(h, mask=self.causal[:t, :t])
        return (h @ self.embedding.weight.t()).transpose(1, 2)


class _Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.gn1 = _gn(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.gn2 = _gn(cout)
        self.down: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), _gn(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.gn1(self.conv1(x)))
        return F.relu(self.gn2(self.conv2(out)) + self.down(x))


def _gn(c: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(32, c), c)


class MultiLabelResNet18(nn.Module):
    def __init__(self, in_shape: tuple[int, ...], labels: int, width: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_shape[0], width, 7, 2, 3, bias=False), _gn(width),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks: list[nn.Module] = []
        cin = width
        for i in range(4):
            cout = width << i
            blocks += [_Basic(cin, cout, 1 if i == 0 else 2), _Basic(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, labels)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.fc(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))
        return torch.stack([torch.zeros_like(z), z], 1)


@register("model", "nwp_lstm")
def _nwp_lstm(in_shape: tuple[int, ...], num_classes: int, *,
              embed: Annotated[int, Range(ge=1)] = 96, hidden: Annotated[int, Range(ge=1)] = 670,
              layers: Annotated[int, Range(ge=1)] = 1, tied: bool = True) -> nn.Module:
    """``embed``: the embedding width (96); ``hidden``: the LSTM's (670); ``layers``: stacked
    LSTMs (1); ``tied``: logits against the embedding (pfl) or TFF's own output layer."""
    _tokens("nwp_lstm", in_shape)
    return NextWordLSTM(num_classes, embed, hidden, layers, tied)


@register("model", "nwp_transformer")
def _nwp_transformer(in_shape: tuple[int, ...], num_classes: int, *,
                     embed: Annotated[int, Range(ge=2)] = 96,
                     heads: Annotated[int, Range(ge=1)] = 8,
                     ff: Annotated[int, Range(ge=1)] = 1536,
                     layers: Annotated[int, Range(ge=1)] = 3,
                     dropout: Annotated[float, Range(ge=0, lt=1)] = 0.1) -> nn.Module:
    """``embed``: the width (pfl: 96, heads must divide it); ``heads``: 8; ``ff``: the
    feed-forward width (1536); ``layers``: encoder layers (3); ``dropout``: 0.1."""
    _tokens("nwp_transformer", in_shape)
    if embed % heads or embed % 2:
        raise ValueError(f"model.options.embed: {embed} must be even and a multiple of "
                         f"model.options.heads ({heads})")
    return NextWordTransformer(num_classes, in_shape[0], embed, heads, ff, layers, dropout)


@register("model", "multilabel_resnet18")
def _multilabel_resnet18(in_shape: tuple[int, ...], num_classes: int, *,
                         width: Annotated[int, Range(ge=1)] = 64) -> nn.Module:
    """``width``: the first stage's channels (64; the stages double it)."""
    if len(in_shape) != 3:
        raise ValueError(f"model.name: multilabel_resnet18 needs images [C, H, W], got "
                         f"{in_shape}")
    return MultiLabelResNet18(in_shape, num_classes, width)


for _f in (_nwp_lstm, _nwp_transformer, _multilabel_resnet18):
    _f.fedloom_own_init = True  # type: ignore[attr-defined]
