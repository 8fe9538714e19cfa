"""Quantisers: half-precision casts, scaled sign, QSGD — with exact wire encodings.

- ``fp16`` / ``bf16``: every entry in 2 bytes.
- ``sign``: ``(‖x‖₁/d) sign(x)`` — one float32 scale, then one bit per entry
  (1 = negative; a zero entry is sent as positive).
- ``qsgd`` (Alistarh et al., NeurIPS 2017) with ``s`` levels:
  ``‖x‖₂ sign(x_j) ξ_j / s``, ``ξ_j`` the stochastic rounding of ``s|x_j|/‖x‖₂``
  (unbiased). Payload: float32 norm, u16 s, then per entry a sign bit and a
  level of ``⌈log₂(s+1)⌉`` bits, bit-packed.

What the wire cannot hold is refused by ``encode`` with a ``ValueError`` naming the
compressor (the engine rejects and counts that client), never sent as ±inf: a finite entry
that the cast turns into ±inf (float16: ``|x| ≥ 65520``, the midpoint between its largest
finite value 65504 and 2¹⁶, which rounds to even, to inf; bfloat16: a float64 ``|x|`` past
float32's range, ~3.39e38), and a float32 scale (sign's ``‖x‖₁/d``, QSGD's ``‖x‖₂``) that
is not finite. Entries that are inf or NaN already are cast as they are (the server screens
non-finite rows). A tensor that is not 1-D is refused too.

Every payload ends with the CRC-32C trailer unless ``checksum=False`` (see
:mod:`fedloom.compress.base`). The decoder checks the fields it can against its
own settings: the cast's dtype code, QSGD's ``s`` (= ``levels``), the padding bits
and QSGD's levels ``≤ s``.
"""

from __future__ import annotations

import math
import numbers
import struct
from typing import Literal

import numpy as np
import torch

from fedloom.capabilities import CompressorCaps
from fedloom.compress.base import (
    PayloadError,
    check_checksum_option,
    check_fits,
    check_scale,
    check_vector,
    pack,
    unpack_header,
)
from fedloom.compress.coding import pack_bits, unpack_bits
from fedloom.params import Layout
from fedloom.registry import register

__all__ = ["QSGD", "Cast", "ScaledSign"]

CODEC_CAST = 1
CODEC_SIGN = 4
CODEC_QSGD = 5


class Cast:
    """Dense float16 or bfloat16."""

    codec = CODEC_CAST
    # Dense values on every coordinate: a sum-only server can add them (fedloom.privacy).
    capabilities = CompressorCaps(linear=True, pure=True)

    def __init__(self, dtype: Literal["float16", "bfloat16"] = "float16",
                 checksum: bool = True) -> None:
        if dtype not in ("float16", "bfloat16"):
            raise ValueError(f"cast: dtype must be float16 or bfloat16, got {dtype!r}")
        self.dtype = dtype
        self.name = "fp16" if dtype == "float16" else "bf16"
        self.checksum = check_checksum_option(checksum)

    def encode(self, x: torch.Tensor, *, gen: torch.Generator | None = None) -> bytes:
        check_vector(x, self.name)
        tdt = torch.float16 if self.dtype == "float16" else torch.bfloat16
        cast = x.detach().to(tdt)
        check_fits(x.detach(), cast, self.name, self.dtype)
        raw = cast.contiguous().view(torch.int16).cpu().numpy().astype("<i2")
        return pack(self.codec, x.numel(), bytes([0 if tdt == torch.float16 else 1])
                    + raw.tobytes(), self.checksum)

    def decode(self, payload: bytes, d: int | None = None) -> torch.Tensor:
        d, body = unpack_header(payload, self.codec, d, self.checksum)
        if len(body) != 1 + 2 * d:
            raise PayloadError(f"cast payload: {len(body)} body bytes, expected {1 + 2 * d}")
        # The code must be this receiver's dtype: fp16 bits read as bf16 (or the
        # reverse) are finite numbers of the same length, a silently wrong vector.
        want = 0 if self.dtype == "float16" else 1
        if body[0] != want:
            raise PayloadError(f"cast payload: dtype code {body[0]}, this {self.name} "
                               f"decoder reads {want}")
        tdt = torch.float16 if want == 0 else torch.bfloat16
        raw = torch.from_numpy(np.frombuffer(body[1:], dtype="<i2").astype(np.int16))
        return raw.view(tdt).to(torch.float32)


class ScaledSign:
    """``(‖x‖₁/d) sign(x)``: 1 bit per entry plus one float."""

    name = "sign"
    codec = CODEC_SIGN
    capabilities = CompressorCaps(pure=True)  # one scale per client: the payloads do not add up

    def __init__(self, checksum: bool = True) -> None:
        self.checksum = check_checksum_option(checksum)

    def encode(self, x: torch.Tensor, *, gen: torch.Generator | None = None) -> bytes:
        check_vector(x, self.name)
        d = x.numel()
        scale = float(x.detach().abs().sum(dtype=torch.float64) / d) if d else 0.0
        check_scale(scale, self.name, "the scale ‖x‖₁/d")
        neg = (x.detach() < 0).cpu().numpy()
        return pack(self.codec, d, struct.pack("<f", scale) + pack_bits(neg), self.checksum)

    def decode(self, payload: bytes, d: int | None = None) -> torch.Tensor:
        d, body = unpack_header(payload, self.codec, d, self.checksum)
        if len(body) != 4 + (d + 7) // 8:
            raise PayloadError(f"sign payload: {len(body)} body bytes, expected "
                               f"{4 + (d + 7) // 8}")
        scale: float
        (scale,) = struct.unpack_from("<f", body)
        if not math.isfinite(scale) or scale < 0:
            raise PayloadError(f"sign payload: invalid scale {scale}")
        neg = torch.from_numpy(unpack_bits(body[4:], d).astype(np.float32))
        return scale * (1.0 - 2.0 * neg)


class QSGD:
    """QSGD with ``s`` levels (unbiased stochastic rounding)."""

    name = "qsgd"
    codec = CODEC_QSGD
    # per-client norms and levels: the payloads do not add up
    capabilities = CompressorCaps(pure=True)

    def __init__(self, levels: int = 16, checksum: bool = True) -> None:
        # An integer: ``s`` travels as a u16 and sets the bit width of a level.
        if (isinstance(levels, bool) or not isinstance(levels, numbers.Integral)
                or not 1 <= levels < 2**16):
            raise ValueError(f"compression.options.levels: must be an integer in [1, 65535], "
                             f"got {levels!r}")
        self.levels: int = int(levels)
        self.checksum: bool = check_checksum_option(checksum)

    @staticmethod
    def _width(s: int) -> int:
        return max(1, math.ceil(math.log2(s + 1)))

    def encode(self, x: torch.Tensor, *, gen: torch.Generator | None = None) -> bytes:
        if gen is None:
            raise ValueError("qsgd.encode: needs a generator (gen=...)")
        check_vector(x, self.name)
        d, s = x.numel(), self.levels
        # On the host: the rounding draws come from a host generator, and every
        # level is sent anyway.
        xd = x.detach().cpu().to(torch.float64)
        norm = float(torch.linalg.vector_norm(xd))
        check_scale(norm, self.name, "the norm ‖x‖₂")
        if norm > 0:
            r = s * xd.abs() / norm
            lower = torch.floor(r)
            u = torch.rand(d, generator=gen, dtype=torch.float64)
            level = (lower + (u < (r - lower)).double()).clamp_(0, s).to(torch.int64)
        else:
            level = torch.zeros(d, dtype=torch.int64)
        b = self._width(s)
        lv = level.numpy().astype(np.uint32)
        bits = ((lv[:, None] >> np.arange(b, dtype=np.uint32)) & 1).astype(np.uint8).reshape(-1)
        neg = (xd < 0).numpy()
        return pack(self.codec, d, struct.pack("<fH", norm, s) + pack_bits(neg) + pack_bits(bits),
                    self.checksum)

    def decode(self, payload: bytes, d: int | None = None) -> torch.Tensor:
        d, body = unpack_header(payload, self.codec, d, self.checksum)
        if len(body) < 6:
            raise PayloadError("qsgd payload: truncated")
        norm, s = struct.unpack_from("<fH", body)
        # s is this receiver's levels: another s of the same bit width would decode
        # to the same levels on another grid, a silently wrong vector.
        if s != self.levels:
            raise PayloadError(f"qsgd payload: s = {s}, this decoder has levels = {self.levels}")
        if not math.isfinite(norm) or norm < 0:
            raise PayloadError(f"qsgd payload: invalid norm {norm}")
        b = self._width(s)
        nsign, nlev = (d + 7) // 8, (d * b + 7) // 8
        if len(body) != 6 + nsign + nlev:
            raise PayloadError(f"qsgd payload: {len(body)} body bytes, expected "
                               f"{6 + nsign + nlev}")
        neg = unpack_bits(body[6 : 6 + nsign], d)
        bits = unpack_bits(body[6 + nsign :], d * b).reshape(d, b).astype(np.uint32)
        level = (bits << np.arange(b, dtype=np.uint32)).sum(1)
        if d and level.max() > s:
            raise PayloadError(f"qsgd payload: level {int(level.max())} above s = {s}")
        val = norm * level.astype(np.float64) / s * (1.0 - 2.0 * neg)
        return torch.from_numpy(val.astype(np.float32))


@register("compressor", "fp16")
def _fp16(checksum: bool = True, layout: Layout | None = None) -> Cast:
    """Every entry as IEEE float16 (2 bytes).

    Reference:
        paper: none (a cast).
        code: none needed.
        departures: a finite value beyond float16's range (``|x| ≥ 65520``, which the cast
            would round to ±inf) makes ``encode`` raise a ``ValueError`` (the engine rejects
            that client) rather than send ±inf.
    """
    return Cast("float16", checksum)


@register("compressor", "bf16")
def _bf16(checksum: bool = True, layout: Layout | None = None) -> Cast:
    """Every entry as bfloat16 (2 bytes).

    Reference:
        paper: none (a cast).
        code: none needed.
        departures: a finite value beyond bfloat16's range (a float64 ``|x|`` past ~3.39e38)
            makes ``encode`` raise a ``ValueError`` rather than send ±inf.
    """
    return Cast("bfloat16", checksum)


@register("compressor", "sign")
def _sign(checksum: bool = True, layout: Layout | None = None) -> ScaledSign:
    """Scaled sign: ``(‖x‖₁/d) sign(x)``, one float32 scale and one bit per entry.

    Reference:
        paper: Karimireddy, Rebjock, Stich & Jaggi, "Error Feedback Fixes SignSGD and other
            Gradient Compression Schemes", ICML 2019.
        code: none checked.
        departures: a zero entry is sent as positive.
    """
    return ScaledSign(checksum)


@register("compressor", "qsgd")
def _qsgd(levels: int = 16, checksum: bool = True, layout: Layout | None = None) -> QSGD:
    """QSGD with ``levels`` = s levels: ``‖x‖₂ sign(x_j) ξ_j/s``, ``ξ_j`` stochastic rounding
    (unbiased).

    Reference:
        paper: Alistarh, Grubic, Li, Tomioka & Vojnovic, "QSGD: Communication-Efficient SGD via
            Gradient Quantization and Encoding", NeurIPS 2017.
        code: none checked.
        departures: levels bit-packed at a fixed ``⌈log₂(s+1)⌉`` bits an entry, not the paper's
            Elias coding; rounding draws from the round's (seed, round, client) generator.
    """
    return QSGD(levels=levels, checksum=checksum)
