"""The papers' models (fedloom.models.zoo): shapes, parameter counts, initialisation."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedloom.cli import main
from fedloom.config import ModelConfig
from fedloom.models import build_model
from fedloom.models.zoo import FlareFC, describe_models
from fedloom.registry import get


def _count(name: str, shape: tuple[int, ...], classes: int, **kw: object) -> int:
    with torch.device("meta"):
        m = get("model", name)(shape, classes, **kw)
    return sum(math.prod(p.shape) for p in m.parameters())


def _conv(cin: int, cout: int, k: int, bias: bool = True) -> int:
    return cin * cout * k * k + (cout if bias else 0)


def _dense(a: int, b: int) -> int:
    return a * b + b


def test_parameter_counts_derived_by_hand() -> None:
    # ResNet-18 (CIFAR): stem conv 3→64 + BN; stages of two blocks (two 3x3 convs + two BNs
    # each), a 1x1 projection + BN where the width changes; linear 512 → 10.
    bn = lambda c: 2 * c  # noqa: E731  (affine weight and bias)
    blocks = 0
    cin = 64
    for cout in (64, 128, 256, 512):
        for b in range(2):
            c_in = cin if b == 0 else cout
            blocks += (_conv(c_in, cout, 3, False) + bn(cout)
                       + _conv(cout, cout, 3, False) + bn(cout))
            if b == 0 and c_in != cout:
                blocks += _conv(c_in, cout, 1, False) + bn(cout)
        cin = cout
    want = _conv(3, 64, 3, False) + bn(64) + blocks + _dense(512, 10)
    assert want == 11_173_962 == _count("resnet18", (3, 32, 32), 10, norm="batch")
    # ResNet-9 (SA-PEF): conv+BN blocks 3-64, 64-128, 128-128 x 2, 128-256, 256-512,
    # 512-512 x 2 (convs with bias), then linear 512 → 10.
    r9 = [(3, 64), (64, 128), (128, 128), (128, 128), (128, 256), (256, 512), (512, 512),
          (512, 512)]
    assert (sum(_conv(a, b, 3) + bn(b) for a, b in r9) + _dense(512, 10) == 6_575_370
            == _count("resnet9", (3, 32, 32), 10, norm="batch"))
    # VGG-11 (FLARE): convs 3-64, 64-128, 128-256, 256-256, 256-512, 512-512 x 3; five
    # pools leave 1x1x512; Dense 512-4096-4096-10.
    convs = [(3, 64), (64, 128), (128, 256), (256, 256), (256, 512), (512, 512), (512, 512),
             (512, 512)]
    head = _dense(512, 4096) + _dense(4096, 4096) + _dense(4096, 10)
    assert sum(_conv(a, b, 3) for a, b in convs) + head == 28_144_010 == _count(
        "vgg11", (3, 32, 32), 10)
    # VGG-16 adds 64-64, 128-128, 256-256, 512-512 x 2 (stage 4 and 5): 13 convs.
    v16 = [(3, 64), (64, 64), (64, 128), (128, 128), (128, 256), (256, 256), (256, 256),
           (256, 512), (512, 512), (512, 512), (512, 512), (512, 512), (512, 512)]
    assert sum(_conv(a, b, 3) for a, b in v16) + head == _count("vgg16", (3, 32, 32), 10)
    # FLARE FC: 784-4069-4069-4069-10 (36.4M parameters, "36M" in the FLARE issue)
    assert (_dense(784, 4069) + 2 * _dense(4069, 4069) + _dense(4069, 10) == 36_356_525
            == _count("flare_fc", (1, 28, 28), 10))
    # FLARE CNN: valid 5x5 convs 28→24→(pool)12→8→(pool)4: 64·4·4 = 1024 features
    assert (_conv(1, 32, 5) + _conv(32, 64, 5) + _dense(1024, 512) + _dense(512, 10)
            == 582_026 == _count("flare_cnn", (1, 28, 28), 10))
    # CRAFT CNN: valid 5x5 convs of 64: 1024 features, then 384, 192, 62
    assert (_conv(1, 64, 5) + _conv(64, 64, 5) + _dense(1024, 384) + _dense(384, 192)
            + _dense(192, 62) == 583_614 == _count("craft_cnn", (1, 28, 28), 62))
    # LEAF CNN: same-padded convs keep 28, two pools: 7·7·64 = 3136 features
    assert (_conv(1, 32, 5) + _conv(32, 64, 5) + _dense(3136, 2048) + _dense(2048, 62)
            == 6_603_710 == _count("leaf_cnn", (1, 28, 28), 62))


@pytest.mark.parametrize("name,shape", [("resnet18", (3, 32, 32)), ("vgg11", (3, 32, 32)),
                                        ("flare_cnn", (1, 28, 28)), ("leaf_cnn", (1, 28, 28))])
def test_forward_shapes_and_seeded_initialisation(name: str, shape: tuple[int, ...]) -> None:
    cfg = ModelConfig(name=name, options={"channels": [4, 8]} if "cnn" in name else {})
    a = build_model(cfg, shape, 7, seed=1)
    b = build_model(cfg, shape, 7, seed=1)
    c = build_model(cfg, shape, 7, seed=2)
    assert a(torch.zeros(2, *shape)).shape == (2, 7)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())


def test_glorot_normal_is_keras_truncated_normal() -> None:
    m = FlareFC(300, 10, hidden=(500,))
    from fedloom.models import init_parameters

    init_parameters(m, torch.Generator().manual_seed(0))
    w = m.net[1].weight
    sigma = math.sqrt(2.0 / (300 + 500))  # Keras: the truncated normal has this std
    assert w.std().item() == pytest.approx(sigma, rel=0.02)
    assert w.abs().max().item() <= 2 * sigma / 0.87962566103423978 + 1e-7
    assert torch.count_nonzero(m.net[1].bias) == 0


def test_vgg11_relu_placement_follows_the_flare_code() -> None:
    m = build_model(ModelConfig(name="vgg11"), (3, 32, 32), 10, seed=0)
    kinds = [type(x).__name__ for x in m.features]
    # conv64 relu pool | conv128 relu pool | conv conv relu pool (x3)
    assert kinds == (["Conv2d", "ReLU", "MaxPool2d"] * 2
                     + ["Conv2d", "Conv2d", "ReLU", "MaxPool2d"] * 3)
    assert sum(isinstance(x, nn.Dropout) for x in m.classifier) == 2


def test_bad_inputs_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match=r"vgg11 needs images .* multiples of 32"):
        build_model(ModelConfig(name="vgg11"), (3, 28, 28), 10, seed=0)
    with pytest.raises(ValueError, match=r"flare_cnn needs images of at least 16x16"):
        build_model(ModelConfig(name="flare_cnn"), (1, 8, 8), 10, seed=0)


def test_fedloom_models_lists_every_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("resnet18", "vgg19", "flare_fc", "flare_cnn", "leaf_cnn", "resnet", "mlp"):
        assert name in out
    assert "36,356,525" in out
    rows = {r["name"]: r for r in describe_models()}
    assert rows["resnet"]["parameters"] == _count("resnet", (3, 32, 32), 10)
