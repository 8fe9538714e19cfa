"""Fault matrix, payloads: damaged, forged and oversized uplink payloads.

Every decode either raises ``PayloadError`` or returns exactly the vector that was
sent — never another exception, never a silently wrong vector. With the CRC-32C
trailer (on by default) that holds for every mutation; without it
(``checksum=False``) it holds for every mutation of the framing (header fields,
lengths, the value dtype, QSGD's ``s``, the index coding, ``k``), while a changed
value byte, sign/level bit or in-range index gap is a different well-formed update
and decodes as one (counted, not asserted away).

Fuzzer: 12 compressor settings at d = 64, six mutation kinds (one bit flipped, one
byte overwritten, truncated, extended by 1–8 random bytes, one header field set to
a neighbour/bit-flipped/zero/random value, 2–4 bytes overwritten), derandomized
(``numpy.random.default_rng(2026)``). Measured with this fuzzer on the decoders
before the trailer and the field checks (12,000 cases, the receiver's d passed):
3,448 silent wrong vectors — 35 through the framing (the fp16/bf16 dtype byte,
QSGD's s), 54 through an index block, 3,359 through values — 8,496 rejected, no
other exception; without d, the same decoders allocated until killed at 9 GB (a
forged d up to 2³² − 1). After: 0 of 10⁴ with the trailer (and 0 of 2,000 without
d); without it, 0 through the framing, 50 through an index gap, 3,359 through values
of 12,000.
"""

from __future__ import annotations

import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import fedloom
from fedloom import Layout
from fedloom.compress import PayloadError, make_compressor
from fedloom.compress.base import crc32c

ROOT = Path(__file__).resolve().parents[1]
D = 64
LAYOUT = Layout([("w", (6, 8)), ("b", (8,)), ("v", (8,))])  # 48 + 8 + 8 = 64
SETTINGS = [
    ("identity", "identity", {}),
    ("fp16", "fp16", {}),
    ("bf16", "bf16", {}),
    ("topk-varint", "topk", {"ratio": 0.1}),                      # k = 6: varint gaps
    ("topk-bitmap", "topk", {"ratio": 0.5}),                      # k = 32: bitmap
    ("topk-count-f16", "topk", {"count": 3, "values": "float16"}),
    # FLARE's compressor: per-tensor Top-k, k_l = max(1, round(n_l R)) = 2, 1, 1
    ("topk-tensor", "topk", {"ratio": 0.05, "scope": "tensor", "layout": LAYOUT}),
    ("randk-scaled", "randk", {"ratio": 0.2}),
    ("randk-unscaled", "randk", {"ratio": 0.2, "scaled": False}),
    ("sign", "sign", {}),
    ("qsgd-s2", "qsgd", {"levels": 2}),
    ("qsgd-s16", "qsgd", {"levels": 16}),
]
FRAME, INDEX, VALUE = 0, 1, 2


def _regions(name: str, p: bytes, trailer: bool) -> np.ndarray:
    """What each byte of a payload is: framing, index block or values."""
    lab = np.full(len(p), VALUE, dtype=np.int8)
    lab[:8] = FRAME                                     # magic, version, codec, d
    if name in ("topk", "randk"):
        lab[8:18] = FRAME                               # k, coding, value dtype, ilen
        ilen = int.from_bytes(p[14:18], "little")
        lab[18 : 18 + ilen] = INDEX
    elif name in ("fp16", "bf16"):
        lab[8] = FRAME                                  # dtype code
    elif name == "qsgd":
        lab[12:14] = FRAME                              # s (the norm before it is a value)
    if trailer:
        lab[-4:] = FRAME
    return lab


def _fields(name: str) -> list[tuple[int, int]]:
    """(offset, width) of each framing field."""
    f = [(0, 2), (2, 1), (3, 1), (4, 4)]
    if name in ("topk", "randk"):
        f += [(8, 4), (12, 1), (13, 1), (14, 4)]
    elif name in ("fp16", "bf16"):
        f += [(8, 1)]
    elif name == "qsgd":
        f += [(12, 2)]
    return f


def _mutate(p: bytes, name: str, rng: np.random.Generator) -> tuple[str, bytes, set[int], bool]:
    """(kind, mutated payload, byte positions changed, length changed)."""
    b = bytearray(p)
    kind = ("bitflip", "overwrite", "truncate", "extend", "field", "multi")[rng.integers(6)]
    if kind == "bitflip":
        i = int(rng.integers(len(b)))
        b[i] ^= 1 << int(rng.integers(8))
        return kind, bytes(b), {i}, False
    if kind == "overwrite":
        i = int(rng.integers(len(b)))
        b[i] = (b[i] + int(rng.integers(1, 256))) % 256
        return kind, bytes(b), {i}, False
    if kind == "truncate":
        return kind, bytes(b[: int(rng.integers(len(b)))]), set(), True
    if kind == "extend":
        return kind, bytes(b) + rng.bytes(int(rng.integers(1, 9))), set(), True
    if kind == "field":
        fields = _fields(name)
        off, w = fields[rng.integers(len(fields))]
        old = int.from_bytes(b[off : off + w], "little")
        top = (1 << (8 * w)) - 1
        new = old
        while new == old:
            new = [old + 1, old - 1, old ^ (1 << int(rng.integers(8 * w))), 0,
                   int(rng.integers(top + 1, dtype=np.uint64))][rng.integers(5)] & top
        b[off : off + w] = new.to_bytes(w, "little")
        return kind, bytes(b), set(range(off, off + w)), False
    pos = {int(i) for i in rng.integers(len(b), size=int(rng.integers(2, 5)))}
    for i in pos:
        b[i] = (b[i] + int(rng.integers(1, 256))) % 256
    return kind, bytes(b), pos, False


def fuzz(cases: int, checksum: bool, *, pass_d: bool = True, seed: int = 2026) -> Counter:
    """Outcome counts: ``rejected``, ``same``, ``crash:<type>``, ``wrong:<region>``."""
    rng = np.random.default_rng(seed)
    sent = []
    for j, (label, name, opts) in enumerate(SETTINGS):
        c = make_compressor(name, **opts, checksum=checksum)
        x = torch.randn(D, generator=torch.Generator().manual_seed(j))
        p = c.encode(x, gen=torch.Generator().manual_seed(1))
        sent.append((label, name, c, p, c.decode(p, D), _regions(name, p, checksum)))
    out: Counter = Counter()
    for i in range(cases):
        label, name, c, p, y0, lab = sent[i % len(sent)]
        kind, bad, pos, resized = _mutate(p, name, rng)
        try:
            y = c.decode(bad, D if pass_d else None)
        except PayloadError as e:
            assert str(e) and "\n" not in str(e)
            out["rejected"] += 1
            continue
        except Exception as e:  # any other type is a failure of the decoder
            out[f"crash:{type(e).__name__}:{label}:{kind}"] += 1
            continue
        if y.shape == y0.shape and torch.equal(y, y0):
            out["same"] += 1
            continue
        where = "frame" if resized or any(lab[j] == FRAME for j in pos) else (
            "index" if any(lab[j] == INDEX for j in pos) else "value")
        out[f"wrong:{where}"] += 1
        out[f"wrong:{where}:{label}:{kind}"] += 1
    return out


def test_fuzz_with_the_trailer_never_returns_a_wrong_vector():
    # 10⁴ cases with the receiver's d, and 2,000 more without it (d from the header)
    res = fuzz(10_000, checksum=True) + fuzz(2_000, checksum=True, pass_d=False, seed=7)
    bad = {k: v for k, v in res.items() if k not in ("rejected", "same")}
    assert not bad, bad
    assert res["rejected"] + res["same"] == 12_000


def test_fuzz_without_the_trailer_has_no_structural_wrong_vector():
    res = fuzz(6_000, checksum=False)
    crashes = {k: v for k, v in res.items() if k.startswith("crash")}
    assert not crashes, crashes
    frame = {k: v for k, v in res.items() if k.startswith("wrong:frame")}
    assert not frame, frame
    # Value bytes are not protected without the trailer: a flipped one decodes to
    # another well-formed vector (the fuzzer does reach them).
    assert res["wrong:value"] > 1000
    assert res["rejected"] > 3000


# ---------------------------------------------------------------- the trailer itself
def test_crc32c_known_values():
    assert crc32c(bytes(32)) == 0x8A9136AA            # RFC 3720, appendix B.4
    assert crc32c(b"\xff" * 32) == 0x62A8AB43         # RFC 3720, appendix B.4
    assert crc32c(bytes(range(32))) == 0x46DD794E     # RFC 3720, appendix B.4
    assert crc32c(b"123456789") == 0xE3069283         # CRC-32/ISCSI check value


@pytest.mark.parametrize("label,name,opts", SETTINGS)
def test_trailer_is_four_bytes_and_off_is_the_bare_format(label, name, opts):
    x = torch.randn(D, generator=torch.Generator().manual_seed(5))
    on = make_compressor(name, **opts)  # on by default
    off = make_compressor(name, **opts, checksum=False)
    p = on.encode(x, gen=torch.Generator().manual_seed(1))
    q = off.encode(x, gen=torch.Generator().manual_seed(1))
    assert on.checksum and not off.checksum
    # the same body; version byte 2 (trailer) vs 1; the trailer is the CRC of the rest
    assert len(p) == len(q) + 4 and p[:2] == q[:2] and p[3:-4] == q[3:]
    assert (p[2], q[2]) == (2, 1)
    assert struct.unpack("<I", p[-4:])[0] == crc32c(p[:-4])
    assert torch.equal(on.decode(p, D), off.decode(q, D))
    # the receiver expects what it is configured with, both ways
    with pytest.raises(PayloadError, match=r"compression\.options\.checksum"):
        on.decode(q, D)
    with pytest.raises(PayloadError, match=r"compression\.options\.checksum"):
        off.decode(p, D)


def test_checksum_false_is_byte_for_byte_the_format_without_trailer():
    # identity: b"FL", version 1, codec 0, u32 d, then d little-endian float32
    x = torch.randn(5, generator=torch.Generator().manual_seed(0))
    want = b"FL\x01\x00" + struct.pack("<I", 5) + x.numpy().astype("<f4").tobytes()
    assert make_compressor("identity", checksum=False).encode(x) == want


def test_checksum_option_is_validated():
    with pytest.raises(ValueError, match=r"compression\.options\.checksum"):
        make_compressor("topk", checksum="yes")
    with pytest.raises(fedloom.ConfigError, match=r"compression\.options\.checksum"):
        fedloom.load_config(ROOT / "configs" / "quickstart.yaml",
                            ["compression.options.checksum=1"])


# ---------------------------------------------- framing fields the receiver expects
def test_cast_dtype_code_must_be_the_receivers():
    x = torch.randn(D, generator=torch.Generator().manual_seed(0))
    fp16 = make_compressor("fp16", checksum=False)
    p = bytearray(fp16.encode(x))
    p[8] = 1  # claims bfloat16: the same length, other numbers
    with pytest.raises(PayloadError, match="dtype code 1"):
        fp16.decode(bytes(p), D)
    bf16 = make_compressor("bf16", checksum=False)
    q = bytearray(bf16.encode(x))
    q[8] = 0
    with pytest.raises(PayloadError, match="dtype code 0"):
        bf16.decode(bytes(q), D)


def test_qsgd_levels_must_be_the_receivers():
    q = make_compressor("qsgd", levels=5, checksum=False)
    p = bytearray(q.encode(torch.randn(D, generator=torch.Generator().manual_seed(0)),
                           gen=torch.Generator().manual_seed(0)))
    p[12:14] = struct.pack("<H", 6)  # s = 6: the same 3-bit width, levels on another grid
    with pytest.raises(PayloadError, match="s = 6"):
        q.decode(bytes(p), D)


def test_sparse_value_dtype_and_k_must_be_the_receivers():
    x = torch.randn(D, generator=torch.Generator().manual_seed(0))
    f16 = make_compressor("topk", count=3, values="float16", checksum=False).encode(x)
    with pytest.raises(PayloadError, match="value dtype 1"):
        make_compressor("topk", count=3, checksum=False).decode(f16, D)
    k3 = make_compressor("topk", count=3, checksum=False).encode(x)
    with pytest.raises(PayloadError, match="k = 3"):
        make_compressor("topk", count=4, checksum=False).decode(k3, D)


def test_index_coding_byte_swap_that_still_parses_is_rejected():
    # d = 16, indices {1, 3}: varint gaps 01 01 (2 bytes = a 16-bit bitmap's size);
    # read as a bitmap they are indices {0, 8} — two bits set, as k says.
    x = torch.zeros(16)
    x[1], x[3] = 5.0, -7.0
    top = make_compressor("topk", count=2, checksum=False)
    p = bytearray(top.encode(x))
    assert p[12] == 0 and p[18:20] == b"\x01\x01"
    p[12] = 1
    with pytest.raises(PayloadError, match="not canonical"):
        top.decode(bytes(p), 16)


def test_per_tensor_counts_are_checked():
    # two tensors of 8, one index each; gaps rewritten to [9, 0]: indices 9 and 10,
    # both in the second tensor — in range and increasing, but not this budget.
    layout = Layout([("a", (8,)), ("b", (8,))])
    top = make_compressor("topk", ratio=0.125, scope="tensor", layout=layout, checksum=False,
                          k_rule="round")
    x = torch.arange(16.0)
    p = bytearray(top.encode(x))
    assert p[12] == 0 and int.from_bytes(p[14:18], "little") == 2
    p[18:20] = bytes([9, 0])
    with pytest.raises(PayloadError, match="budget is 1"):
        top.decode(bytes(p), 16)


def test_non_minimal_varint_is_rejected():
    # count=1 at index 3: gap 3 as the 2-byte form 0x83 0x00 (the encoder writes 0x03)
    x = torch.zeros(64)
    x[3] = 1.0
    top = make_compressor("topk", count=1, checksum=False)
    p = top.encode(x)
    forged = p[:14] + struct.pack("<I", 2) + b"\x83\x00" + p[19:]
    with pytest.raises(PayloadError, match="redundant"):
        top.decode(forged, 64)


# ------------------------------------------------------------ allocation is capped
@pytest.mark.parametrize("checksum", [True, False])
def test_a_tiny_payload_cannot_claim_a_huge_vector(checksum):
    # header (d = 2³² − 1) + k = 1, varint, float32, one index byte + one value:
    # 23 bytes that would make the decoder allocate 16 GiB
    body = struct.pack("<IBBI", 1, 0, 0, 1) + b"\x00" + struct.pack("<f", 1.0)
    p = b"FL" + bytes([2 if checksum else 1, 2]) + struct.pack("<I", 2**32 - 1) + body
    if checksum:
        p += struct.pack("<I", crc32c(p))
    assert len(p) == 23 + 4 * checksum
    top = make_compressor("topk", count=1, checksum=checksum)
    with pytest.raises(PayloadError, match="pass the expected d"):
        top.decode(p)
    with pytest.raises(PayloadError, match="expected 64"):
        top.decode(p, 64)
    # dense payloads need d·itemsize bytes present before anything is allocated
    ident = make_compressor("identity", checksum=checksum)
    q = b"FL" + bytes([2 if checksum else 1, 0]) + struct.pack("<I", 2**32 - 1) + bytes(8)
    if checksum:
        q += struct.pack("<I", crc32c(q))
    with pytest.raises(PayloadError):
        ident.decode(q)


def test_without_d_a_sparse_payload_of_a_real_model_still_decodes():
    # 10⁶ entries, one sent (27 bytes): below the cap of 2²⁴ entries, decoded
    top = make_compressor("topk", count=1)
    x = torch.zeros(1_000_000)
    x[123_456] = 2.0
    assert torch.equal(top.decode(top.encode(x)), x)


def test_make_compressor_is_public():
    assert fedloom.make_compressor is fedloom.compress.make_compressor
    assert "make_compressor" in fedloom.__all__


def test_checksum_false_in_the_config_reaches_the_uplink(tiny):
    res = fedloom.run(tiny, ["rounds=1", "checkpoint.every=0",
                             "compression.options.checksum=false"])
    d = res.layout.size
    m = res.metrics[0]
    assert m["uplink_bytes"] == m["cohort_size"] * (8 + 4 * d)  # identity, no trailer


@pytest.mark.parametrize("checksum", [True, False])
def test_cser_reset_payload_follows_the_uplinks_checksum(checksum):
    from fedloom.compress.feedback import UplinkContext, make_feedback

    fb = make_feedback("cser", period=1)
    comp = make_compressor("topk", ratio=0.1, checksum=checksum)
    g = torch.randn(D, generator=torch.Generator().manual_seed(0))
    out = fb.uplink(g, {"residual": torch.zeros(D)}, comp,
                    UplinkContext(0, 0.1, 1, 0.0, torch.Generator()), {})
    (reset,) = out.extra_payloads
    assert out.payload[2] == reset[2] == (2 if checksum else 1)  # version: trailer or not
