"""Compressor edges: short payloads, empty and 2-D inputs, values beyond the wire dtype."""

import pytest
import torch

from fedloom.compress import PayloadError, coordinates_sent, make_compressor


def _x(d=40, seed=0):
    return torch.randn(d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cut", [0, 1, 5, 7])
def test_coordinates_sent_on_a_short_payload_is_a_payload_error(cut):
    p = make_compressor("identity").encode(_x())
    with pytest.raises(PayloadError, match=r"coordinates_sent.*header"):
        coordinates_sent(p[:cut])


@pytest.mark.parametrize("name", ["topk", "randk"])
@pytest.mark.parametrize("cut", [8, 9, 11])
def test_coordinates_sent_on_a_sparse_header_without_k(name, cut):
    # 8..11 bytes: the header is whole, the u32 k is not (it used to read as a smaller k).
    p = make_compressor(name, ratio=0.1).encode(_x(), gen=torch.Generator().manual_seed(0))
    assert coordinates_sent(p) == 4
    with pytest.raises(PayloadError, match=r"coordinates_sent.*k"):
        coordinates_sent(p[:cut])


def test_coordinates_sent_rejects_a_foreign_payload():
    with pytest.raises(PayloadError, match=r"coordinates_sent.*magic"):
        coordinates_sent(b"XY\x01\x02" + bytes(8))
    with pytest.raises(PayloadError, match=r"coordinates_sent.*bytes"):
        coordinates_sent("FL")  # type: ignore[arg-type]


def test_randk_on_an_empty_vector_names_randk():
    c = make_compressor("randk", ratio=0.5)
    with pytest.raises(ValueError, match=r"randk.*empty"):
        c.encode(torch.zeros(0), gen=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name,opts", [("randk", {"ratio": 0.5}), ("qsgd", {"levels": 4}),
                                       ("topk", {"ratio": 0.5}), ("sign", {}), ("fp16", {}),
                                       ("bf16", {})])
@pytest.mark.parametrize("shape", [(3, 4), (2, 2, 3), ()])
def test_compressors_refuse_a_tensor_that_is_not_a_vector(name, opts, shape):
    c = make_compressor(name, **opts)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=rf"{name}.encode: expects a 1-D vector"):
        c.encode(x, gen=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("big", [1e30, -1e30, 65520.0, 7e4])
def test_fp16_refuses_values_beyond_its_range(big):
    # 65504 is float16's largest finite value; 65520 is the midpoint to 2^16 and rounds (to
    # even) to inf, as 7e4 and 1e30 do.
    x = _x()
    x[7] = big
    with pytest.raises(ValueError, match=r"fp16\.encode: 1 entries beyond float16's range"):
        make_compressor("fp16").encode(x)
    x[7] = 65504.0  # the largest finite one is sent exactly
    # An inf or NaN input is the client's (the server screens non-finite rows): cast as it is.
    x[0], x[1] = float("inf"), float("nan")
    y = make_compressor("fp16").decode(make_compressor("fp16").encode(x))
    assert y[7] == 65504.0 and y[0] == float("inf") and bool(y[1].isnan())


def test_bf16_refuses_a_float64_value_beyond_its_range():
    x = _x().double()
    x[3] = 1e300
    with pytest.raises(ValueError, match=r"bf16\.encode: 1 entries beyond bfloat16's range"):
        make_compressor("bf16").encode(x)


@pytest.mark.parametrize("values,big", [("float16", 1e5), ("float32", 1e300)])
def test_sparse_values_beyond_the_wire_dtype_are_refused(values, big):
    x = _x().double()
    x[5] = big
    c = make_compressor("topk", ratio=0.1, values=values)
    with pytest.raises(ValueError, match=rf"topk.encode: 1 entries beyond {values}'s range"):
        c.encode(x)


@pytest.mark.parametrize("name,big,msg", [
    ("sign", 1e100, "beyond float32's range"), ("qsgd", 1e100, "beyond float32's range"),
    ("sign", 1e300, "beyond float32's range"), ("qsgd", 1e300, "overflows float64"),
    ("qsgd", float("nan"), "non-finite")])
def test_scale_beyond_float32_is_refused(name, big, msg):
    # The scale (sign: ‖x‖₁/d, qsgd: ‖x‖₂) travels as float32: 1e100 would become inf, which
    # the decoder rejects; the encoder says so first. QSGD squares 1e300 past float64.
    x = _x().double()
    x[2] = big
    with pytest.raises(ValueError, match=rf"{name}.encode: .*{msg}"):
        make_compressor(name).encode(x, gen=torch.Generator().manual_seed(0))


def test_identity_refuses_a_float64_value_beyond_float32():
    """identity sends float32: a finite float64 entry of 1e300 would arrive as inf.
    It is refused by name (the engine rejects and counts that client); 3e38, inside
    float32's range, and entries that are inf already are sent as they are."""
    comp = make_compressor("identity")
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match=r"identity\.encode: 1 entries beyond float32"):
        comp.encode(torch.tensor([1.0, 1e300, -2.0], dtype=torch.float64), gen=gen)
    ok = torch.tensor([3e38, float("inf"), -1.0], dtype=torch.float64)
    back = comp.decode(comp.encode(ok, gen=gen), 3)
    assert back[0] == torch.tensor(3e38, dtype=torch.float32) and torch.isinf(back[1])
