import pytest
import torch
from torch import nn

from fedloom import Layout, functional_forward
from fedloom.models import CNN, MLP


def test_flatten_unflatten_round_trip():
    torch.manual_seed(0)  # test-only: a deterministic module
    m = MLP(12, [7, 5], 3)
    layout = Layout.from_module(m)
    w = layout.flatten(m)
    assert w.shape == (layout.size,) == (sum(p.numel() for p in m.parameters()),)
    parts = layout.unflatten(w)
    for name, p in m.named_parameters():
        assert torch.equal(parts[name], p)
    # round trip: load a new vector and read it back bit for bit
    w2 = torch.randn(layout.size)
    layout.load_into(m, w2)
    assert torch.equal(layout.flatten(m), w2)


def test_functional_forward_matches_module_and_gives_flat_grad():
    torch.manual_seed(1)
    m = MLP(6, [4], 3)
    layout = Layout.from_module(m)
    x = torch.randn(5, 6)
    w = layout.flatten(m).requires_grad_(True)
    out = functional_forward(m, layout, w, x)
    assert torch.allclose(out, m(x))
    out.sum().backward()
    m(x).sum().backward()
    ref = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
    assert torch.allclose(w.grad, ref)


def test_layer_groups_mlp_weight_and_bias_together():
    layout = Layout.from_module(MLP(6, [4, 4], 3))
    assert [g.tensors for g in layout.groups] == [
        ("net.1.weight", "net.1.bias"),
        ("net.3.weight", "net.3.bias"),
        ("net.5.weight", "net.5.bias"),
    ]
    # groups tile the vector
    assert layout.groups[0].start == 0 and layout.groups[-1].stop == layout.size
    for a, b in zip(layout.groups, layout.groups[1:], strict=False):
        assert a.stop == b.start


def test_norm_layer_joins_preceding_module():
    m = nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv2d(4, 2, 3),
                      nn.Flatten(), nn.Linear(2, 2))
    layout = Layout.from_module(m)
    assert [g.tensors for g in layout.groups] == [
        ("0.weight", "0.bias", "1.weight", "1.bias"),
        ("3.weight", "3.bias"),
        ("5.weight", "5.bias"),
    ]
    assert layout.regroup("global").groups[0].size == layout.size


def test_cnn_layout_groups():
    layout = Layout.from_module(CNN((1, 28, 28), 10))
    assert len(layout.groups) == 4
    assert layout.size == 32 * 25 + 32 + 64 * 32 * 25 + 64 + 3136 * 512 + 512 + 5120 + 10


def test_flat_layout_and_errors():
    layout = Layout.flat(7)
    assert layout.size == 7 and len(layout.groups) == 1
    with pytest.raises(ValueError, match="size 7"):
        layout.unflatten(torch.zeros(6))
    with pytest.raises(ValueError):
        Layout.flat(0)
    with pytest.raises(ValueError, match="groups"):
        Layout([("a", (2,)), ("b", (3,))], [["b"], ["a"]])


def test_resnet_gn_groups_each_conv_with_its_norm():
    from fedloom.config import ModelConfig
    from fedloom.models import build_model

    m = build_model(ModelConfig(name="resnet", options={"depth": 8, "width": 4}), (1, 12, 12), 3,
                    seed=0)
    layout = Layout.from_module(m)
    assert m(torch.zeros(2, 1, 12, 12)).shape == (2, 3)
    # depth 8: stem conv + 3 stages × 1 block × 2 convs = 7 convs, each with its GroupNorm,
    # plus the classifier
    assert len(layout.groups) == 8
    assert layout.groups[0].tensors == ("conv1.weight", "gn1.weight", "gn1.bias")
    assert layout.groups[-1].tensors == ("linear.weight", "linear.bias")
    # the same seed builds the same weights
    m2 = build_model(ModelConfig(name="resnet", options={"depth": 8, "width": 4}), (1, 12, 12), 3,
                    seed=0)
    assert torch.equal(layout.flatten(m), layout.flatten(m2))
    with pytest.raises(ValueError, match="6n"):
        build_model(ModelConfig(name="resnet", options={"depth": 10}), (1, 12, 12), 3,
                    seed=0)
