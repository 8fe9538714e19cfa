"""The cross-device benchmarks' models (fedloom.models.published), the multi-label loss they
carry through cross-entropy, padded next-token targets and averaged precision."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score
from torch.nn import functional as F

from fedloom.config import ModelConfig
from fedloom.metrics import averaged_precision, evaluate, evaluate_multilabel
from fedloom.models import build_model
from fedloom.params import Layout


def _model(name: str, shape: tuple[int, ...], classes: int, seed: int = 0, **opts: object
           ) -> torch.nn.Module:
    return build_model(ModelConfig(name=name, options=dict(opts)), shape, classes, seed)


def test_lstm_has_reddi_et_als_sizes_and_ties_its_output() -> None:
    import inspect

    from fedloom.registry import get

    opts = inspect.signature(get("model", "nwp_lstm")).parameters
    assert (opts["embed"].default, opts["hidden"].default, opts["layers"].default) == (96, 670, 1)
    # built small (the full one's orthogonal init takes seconds here)
    v, e, h = 50, 8, 12
    m = _model("nwp_lstm", (20,), v, embed=e, hidden=h)
    n = sum(p.numel() for p in m.parameters())
    # embedding v x e, LSTM 4h x (e + h + 2), projection h x e + e; the output is tied
    assert n == v * e + 4 * h * (e + h + 2) + h * e + e
    untied = _model("nwp_lstm", (20,), v, embed=e, hidden=h, tied=False)
    assert sum(p.numel() for p in untied.parameters()) == n + e * v + v
    x = torch.randint(0, v, (3, 20))
    out = m(x)
    assert tuple(out.shape) == (3, v, 20)
    h_t = m.project(m.lstm(m.embedding(x))[0])  # type: ignore[operator]
    torch.testing.assert_close(out, (h_t @ m.embedding.weight.t()).transpose(1, 2))  # type: ignore[union-attr]
    # the same seed, the same weights; pfl's orthogonal recurrent weights
    again = _model("nwp_lstm", (20,), v, embed=e, hidden=h)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), again.parameters(), strict=True))
    w = m.lstm.weight_hh_l0.detach()  # type: ignore[union-attr]  # [4h, h]
    torch.testing.assert_close(w.T @ w, torch.eye(h), atol=1e-5, rtol=0)


def test_transformer_is_causal() -> None:
    m = _model("nwp_transformer", (6,), 50, embed=8, heads=2, ff=16, layers=2).eval()
    x = torch.randint(1, 50, (2, 6))
    y = x.clone()
    y[:, 4:] = torch.randint(1, 50, (2, 2))
    a, b = m(x), m(y)
    assert tuple(a.shape) == (2, 50, 6)
    torch.testing.assert_close(a[..., :4], b[..., :4])  # earlier positions see no later token
    assert not torch.allclose(a[..., 4:], b[..., 4:])
    # pfl's positional_encoding (benchmarks/model/numpy/layer.py), Vaswani et al. 3.5
    pos = np.arange(6)[:, None]
    div = np.exp(np.arange(0, 8, 2) * (-np.log(10000.0) / 8))
    pe = np.zeros((6, 8))
    pe[:, 0::2], pe[:, 1::2] = np.sin(pos * div), np.cos(pos * div)
    np.testing.assert_allclose(m.positions.numpy(), pe, rtol=0, atol=1e-6)  # type: ignore[operator]
    with pytest.raises(ValueError, match=r"model\.options\.embed: 9 must be even"):
        _model("nwp_transformer", (6,), 50, embed=9, heads=3)
    with pytest.raises(ValueError, match=r"reads token ids \[seq_len\]"):
        _model("nwp_lstm", (3, 8, 8), 50)


def test_two_row_cross_entropy_is_binary_cross_entropy_with_logits() -> None:
    torch.manual_seed(0)
    m = _model("multilabel_resnet18", (3, 16, 16), 17, width=8)
    assert not any(isinstance(mod, torch.nn.BatchNorm2d) for mod in m.modules())
    gns = [mod for mod in m.modules() if isinstance(mod, torch.nn.GroupNorm)]
    assert gns and all(g.num_groups == min(32, g.num_channels) for g in gns)
    out = m(torch.randn(4, 3, 16, 16))
    assert tuple(out.shape) == (4, 2, 17) and torch.equal(out[:, 0], torch.zeros(4, 17))
    z = torch.cat([torch.linspace(-40, 40, 17)[None], torch.randn(3, 17) * 5]).double()
    y = (torch.rand(4, 17) < 0.3).long()
    two = torch.stack([torch.zeros_like(z), z], 1)
    torch.testing.assert_close(F.cross_entropy(two, y),
                               F.binary_cross_entropy_with_logits(z, y.double()),
                               rtol=1e-12, atol=1e-12)


def test_resnet18_at_full_width_has_torchvisions_parameter_count() -> None:
    m = _model("multilabel_resnet18", (3, 32, 32), 17)
    # torchvision resnet18: 11,689,512 with a 1000-way fc (513,000); here a 17-way fc
    # (8,721) and GroupNorm's affine parameters, the same count as BatchNorm's
    assert sum(p.numel() for p in m.parameters()) == 11_689_512 - 513_000 + 8_721


def test_padded_targets_count_no_token() -> None:
    class Fixed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # predicts token x + 1 at every position; the logits of class k: 5 at x + 1
            return F.one_hot(x + 1, 6).float().transpose(1, 2) * 5 + self.w

    m = Fixed()
    layout = Layout.from_module(m)
    w = layout.flatten(m)
    x = torch.tensor([[0, 1, 2, 3], [1, 2, 0, 0]])
    y = torch.tensor([[1, 2, 0, 4], [2, -100, -100, -100]])  # right, right, wrong, right | right
    acc, loss = evaluate(m, layout, w, x, y)
    assert acc == pytest.approx((3 / 4 + 1) / 2)
    right = -F.log_softmax(torch.tensor([0, 5.0, 0, 0, 0, 0]).double(), 0)[1]
    wrong = -F.log_softmax(torch.tensor([0, 0, 0, 5.0, 0, 0]).double(), 0)[0]
    assert loss == pytest.approx(((3 * right + wrong) / 4 + right) / 2)
    # the training loss: cross-entropy's default ignore_index drops them too
    logits = m(x)
    assert float(F.cross_entropy(logits, y).detach()) == pytest.approx(float(4 * right + wrong) / 5,
                                                              rel=1e-6)


def test_averaged_precision_is_scikit_learns() -> None:
    rng = np.random.default_rng(0)
    y = (rng.random((60, 5)) < 0.3).astype(int)
    y[0] = 1
    # scores on a grid of 1/199 with every distinct score in a bucket of its own
    s = rng.choice(np.arange(1, 199), size=(60, 5)) / 199 - 1e-9
    per, macro, micro = averaged_precision(s, y)
    want = [average_precision_score(y[:, c], s[:, c]) for c in range(5)]
    np.testing.assert_allclose(per, want, rtol=0, atol=1e-12)
    assert macro == pytest.approx(np.mean(want), abs=1e-12)
    assert micro == pytest.approx(average_precision_score(y.ravel(), s.ravel()), abs=1e-12)
    # ranking every distinct score: scikit-learn's on any scores
    s2 = rng.random((60, 5))
    per2, _, micro2 = averaged_precision(s2, y, thresholds=0)
    np.testing.assert_allclose(per2, [average_precision_score(y[:, c], s2[:, c])
                                      for c in range(5)], rtol=0, atol=1e-12)
    assert micro2 == pytest.approx(average_precision_score(y.ravel(), s2.ravel()), abs=1e-12)


def test_averaged_precision_edges() -> None:
    y = np.array([[1, 0], [0, 0], [1, 0]])
    s = np.array([[0.9, 0.4], [0.1, 0.8], [0.7, 0.2]])
    per, macro, _ = averaged_precision(s, y)
    # a perfect ranking gives 1; a class without positives 0 and counts in the macro mean
    assert per.tolist() == [1.0, 0.0] and macro == 0.5
    per, _, _ = averaged_precision(1 - s, y)
    # the two positives ranked last of three: precision 1/2 at recall 1/2, 2/3 at recall 1
    assert per[0] == pytest.approx(0.5 * 0.5 + 0.5 * (2 / 3))
    with pytest.raises(ValueError, match=r"must be the same \[N, C\]"):
        averaged_precision(s, y[:2])


def test_evaluate_multilabel_gives_pfls_metrics() -> None:
    # 32 x 32 at width 8: the last stage is 1 x 1 with two channels a group, so a batch of
    # one image still has two values a group to normalise
    m = _model("multilabel_resnet18", (3, 32, 32), 4, width=8)
    layout = Layout.from_module(m)
    w = layout.flatten(m)
    x = torch.randn(10, 3, 32, 32)
    y = (torch.rand(10, 4) < 0.5).long()
    got = evaluate_multilabel(m, layout, w, x, y, batch_size=3)
    with torch.no_grad():
        z = m.eval()(x)[:, 1].double()
    # float32 convolutions batched differently: equal to float32 rounding
    assert got["micro_loss"] == pytest.approx(float(F.binary_cross_entropy_with_logits(
        z, y.double())), rel=1e-5)
    assert got["micro_accuracy"] == pytest.approx(float(((z > 0).long() == y).double().mean()),
                                                  abs=0.026)  # at most one of 40 labels near 0
    # the same numbers through the causal-LM path of fedloom.metrics.evaluate
    acc, loss = evaluate(m, layout, w, x, y)
    assert acc == pytest.approx(got["micro_accuracy"], abs=0.026) and loss == pytest.approx(
        got["micro_loss"], rel=1e-5)
    assert 0 <= got["macro_ap"] <= 1 and 0 <= got["micro_ap"] <= 1


def test_averaged_precision_is_pfl_researchs() -> None:
    # tests/data/averaged_precision_reference.json: pfl-research's AveragedPrecision
    # (benchmarks/model/numpy/metrics.py) on twelve seeded draws with ties, scores of 0
    # and 1 and classes without positives (benchmarks/ap_reference.py wrote it)
    import json
    from pathlib import Path

    ref = json.loads((Path(__file__).parent / "data" /
                      "averaged_precision_reference.json").read_text())
    assert len(ref["cases"]) == 12
    for case in ref["cases"]:
        _, macro, micro = averaged_precision(np.array(case["scores"]), np.array(case["targets"]))
        assert macro == pytest.approx(case["macro_ap"], abs=1e-12)
        assert micro == pytest.approx(case["micro_ap"], abs=1e-12)
