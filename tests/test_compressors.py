"""Compressors: round trips, exact sizes, unbiasedness, exact top-k, decoder fuzzing."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedloom import Layout
from fedloom.compress import PayloadError, coordinates_sent, make_compressor, topk_indices
from fedloom.compress.coding import varint_decode, varint_encode

ALL = [("identity", {}), ("fp16", {}), ("bf16", {}), ("topk", {"ratio": 0.1}),
       ("topk", {"count": 3, "values": "float16"}), ("randk", {"ratio": 0.2}),
       ("randk", {"ratio": 0.2, "scaled": False}), ("sign", {}), ("qsgd", {"levels": 5})]


def _x(d=200, seed=0):
    return torch.randn(d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name,opts", ALL)
def test_round_trip_and_size(name, opts):
    c = make_compressor(name, **opts)
    x = _x()
    p = c.encode(x, gen=torch.Generator().manual_seed(1))
    assert isinstance(p, bytes)
    y = c.decode(p)
    assert y.shape == x.shape and y.dtype == torch.float32 and torch.isfinite(y).all()
    # the same payload decodes to the same vector; encoding is deterministic given gen
    assert torch.equal(c.decode(p), y)
    assert p == c.encode(x, gen=torch.Generator().manual_seed(1))


def test_exact_values_of_each_compressor():
    x = _x()
    assert torch.equal(make_compressor("identity").decode(make_compressor("identity").encode(x)),
                       x)
    fp16 = make_compressor("fp16")
    assert torch.equal(fp16.decode(fp16.encode(x)), x.half().float())
    bf16 = make_compressor("bf16")
    assert torch.equal(bf16.decode(bf16.encode(x)), x.bfloat16().float())
    top = make_compressor("topk", ratio=0.1)
    y = top.decode(top.encode(x))
    idx = torch.topk(x.abs(), 20).indices
    assert set(y.nonzero().squeeze(1).tolist()) == set(idx.tolist())
    assert torch.equal(y[idx], x[idx])
    sign = make_compressor("sign")
    ys = sign.decode(sign.encode(x))
    scale = float(x.abs().sum() / x.numel())
    assert torch.allclose(ys, scale * torch.where(x < 0, -1.0, 1.0), rtol=1e-6)
    q = make_compressor("qsgd", levels=4)
    yq = q.decode(q.encode(x, gen=torch.Generator().manual_seed(0)))
    levels = (yq.abs() / x.norm() * 4).double()
    assert torch.allclose(levels, levels.round(), atol=1e-5)  # on the grid ‖x‖ l/s
    assert ((yq == 0) | (torch.sign(yq) == torch.sign(x))).all()


@pytest.mark.parametrize("checksum,trailer", [(True, 4), (False, 0)])
def test_sizes_are_what_the_format_says(checksum, trailer):
    x = _x(1000)
    c = {"checksum": checksum}  # the CRC-32C trailer: 4 bytes, or none
    assert len(make_compressor("identity", **c).encode(x)) == 8 + 4000 + trailer
    assert len(make_compressor("fp16", **c).encode(x)) == 8 + 1 + 2000 + trailer
    assert len(make_compressor("sign", **c).encode(x)) == 8 + 4 + 125 + trailer
    assert len(make_compressor("qsgd", levels=7, **c).encode(x, gen=torch.Generator())) == \
        8 + 6 + 125 + 375 + trailer  # 3 bits per level
    p = make_compressor("topk", count=10, **c).encode(x)
    # header 8 + sparse header 10 + varint gaps (≤ 2 bytes each for d = 1000) + 10 × 4 values
    assert 8 + 10 + 10 + 40 + trailer <= len(p) <= 8 + 10 + 20 + 40 + trailer
    assert coordinates_sent(p) == 10 and coordinates_sent(make_compressor("fp16").encode(x)) \
        == 1000


def test_bitmap_index_coding_wins_when_dense():
    x = _x(4096)
    dense = make_compressor("topk", ratio=0.5).encode(x)
    # 2048 indices: varint would need ≥ 2048 bytes, the bitmap needs 512; trailer 4
    assert len(dense) == 8 + 10 + 512 + 2048 * 4 + 4


@pytest.mark.parametrize("name,opts,sigma_scale", [("qsgd", {"levels": 2}, 1.0),
                                                   ("randk", {"ratio": 0.25}, 1.0)])
def test_unbiased_compressors(name, opts, sigma_scale):
    """E[decode(encode(x))] = x. With N draws the mean's error per coordinate has std
    σ_j/√N where σ_j² ≤ (d/k − 1)x_j² for rand-k and ≤ ‖x‖·|x_j|/s for QSGD; we allow 6σ."""
    c = make_compressor(name, **opts)
    x = _x(40, seed=3)
    N = 4000
    acc = torch.zeros(40, dtype=torch.float64)
    for i in range(N):
        acc += c.decode(c.encode(x, gen=torch.Generator().manual_seed(10_000 + i))).double()
    mean = acc / N
    if name == "randk":
        var = (1 / 0.25 - 1) * x.double() ** 2
    else:
        var = x.double().norm() * x.double().abs() / 2
    tol = 6 * torch.sqrt(var / N) * sigma_scale + 1e-6
    assert ((mean - x.double()).abs() <= tol).all()


def test_per_tensor_topk_round_rule_keeps_max_1_k_per_tensor():
    # k_rule=round; the default per-tensor count (the public FLARE one) is in test_flare.py.
    layout = Layout([("a", (1000,)), ("b", (30,)), ("c", (3,))])
    x = _x(layout.size)
    top = make_compressor("topk", ratio=0.01, scope="tensor", layout=layout, k_rule="round")
    y = top.decode(top.encode(x))
    counts = [int((y[t.slice] != 0).sum()) for t in layout.tensors]
    assert counts == [10, 1, 1]  # round(1000·0.01), max(1, round(0.3)), max(1, round(0.03))
    for t in layout.tensors:
        seg = x[t.slice]
        kept = set((y[t.slice] != 0).nonzero().squeeze(1).tolist())
        assert kept == set(torch.topk(seg.abs(), max(1, round(t.numel * 0.01))).indices.tolist())
    assert top.contraction(layout.size) == pytest.approx(layout.size / 12)


@pytest.mark.parametrize("d,k", [(300_000, 3), (300_000, 3000), (1_000_000, 10),
                                 (1_000_000, 100_000), (1000, 999)])
def test_fast_topk_is_exact(d, k):
    x = torch.randn(d, generator=torch.Generator().manual_seed(d + k))
    assert torch.equal(topk_indices(x, k), torch.topk(x.abs(), k).indices.sort().values)


def test_fast_topk_on_adversarial_layouts():
    # a spike train that a strided sample misses entirely: still exact
    x = torch.zeros(500_000)
    x[7::50_001] = torch.arange(1.0, 11.0)
    assert torch.equal(topk_indices(x, 5), torch.topk(x.abs(), 5).indices.sort().values)


def test_varint_round_trip_and_limits():
    v = np.array([0, 1, 127, 128, 16383, 16384, 2**32 - 1], dtype=np.uint64)
    assert (varint_decode(varint_encode(v), len(v)) == v).all()
    with pytest.raises(PayloadError, match="truncated"):
        varint_decode(bytes([0x80]), 1)
    with pytest.raises(PayloadError, match="longer than 5"):
        varint_decode(bytes([0xFF] * 6 + [0x01]), 1)


@settings(max_examples=300, deadline=None)
@given(which=st.integers(0, len(ALL) - 1), cut=st.integers(0, 10_000),
       flip=st.integers(0, 10_000), value=st.integers(0, 255), extra=st.binary(max_size=8),
       mode=st.sampled_from(["truncate", "flip", "append", "random"]))
def test_decoders_reject_corrupt_payloads_with_a_clear_error(which, cut, flip, value, extra,
                                                              mode):
    name, opts = ALL[which]
    c = make_compressor(name, **opts)
    x = _x(64, seed=which)
    p = bytearray(c.encode(x, gen=torch.Generator().manual_seed(0)))
    if mode == "truncate":
        bad = bytes(p[: cut % len(p)])
    elif mode == "flip":
        p[flip % len(p)] = value
        bad = bytes(p)
    elif mode == "append":
        bad = bytes(p) + (extra or b"\x00")
    else:
        bad = extra
    try:
        y = c.decode(bad, 64)
    except PayloadError as e:
        assert str(e) and "\n" not in str(e)
        return
    # a corrupted value byte can decode: then it is a well-formed vector of the header's d
    assert y.ndim == 1 and y.dtype == torch.float32
    assert mode == "flip" and y.numel() == 64


def test_bad_options():
    with pytest.raises(ValueError, match=r"compression\.options\.ratio"):
        make_compressor("topk", ratio=0)
    with pytest.raises(ValueError, match="layout"):
        make_compressor("topk", scope="tensor")
    with pytest.raises(ValueError, match=r"compression\.options\.bogus"):
        make_compressor("sign", bogus=1)
    with pytest.raises(ValueError, match="generator"):
        make_compressor("qsgd").encode(_x())
    assert math.isfinite(make_compressor("topk", ratio=0.5).contraction(10))


@pytest.mark.parametrize("ratio", [1e-5, 1e-3, 0.1, 0.5, 0.9])
def test_topk_indices_sampled_path_is_exact(ratio):
    # d above 4 × the probe size takes the sampled-threshold path, at every k
    d = 300_000
    x = torch.randn(d, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    k = max(1, int(d * ratio))
    want = torch.topk(x.abs(), k, sorted=False).indices.sort().values
    assert torch.equal(topk_indices(x, k), want)
