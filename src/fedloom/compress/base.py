"""Compressor interface, the common wire header and the integrity trailer.

A compressor's ``encode`` returns the **bytes sent**: ``len(payload)`` is what
the byte metrics count, not an estimate. Every payload is::

    magic  b"FL"   2 bytes
    version        u8   1 = no trailer, 2 = CRC-32C trailer
    codec id       u8
    d              u32 little-endian, the length of the decoded vector
    body           codec-specific (see each compressor)
    trailer        u32 little-endian CRC-32C of every byte before it (version 2 only)

The trailer (CRC-32C, RFC 3720, from ``google-crc32c``) is on by default
(``compression.options.checksum``); ``checksum: false`` sends version 1, the bare
encoding papers count. ``decode(payload, d)`` validates every field against what
this receiver expects and raises :class:`PayloadError` (a ``ValueError``) on
anything else; without an expected ``d`` no payload makes it allocate more than
``max(2²⁴, 2¹⁶·len(payload))`` entries. Fuzzed (tests/test_faults_payloads.py,
12 settings): with the trailer 0 of 10,000 mutated payloads decode to a wrong
vector. Why CRC-32C, what each check catches and the fuzzing's numbers:
docs/explanation/reliability.md (Payloads: the header and the trailer).
"""

from __future__ import annotations

import math
import struct
import warnings
from typing import Protocol

import google_crc32c
import numpy as np
import torch

from fedloom.capabilities import CompressorCaps

__all__ = ["HEADER", "TRAILER", "Compressor", "PayloadError", "check_checksum_option",
           "check_fits", "check_scale", "check_vector", "crc32c", "pack", "pack_header",
           "unpack_header"]

MAGIC = b"FL"
VERSION = 1            # no trailer (the format before the trailer, unchanged)
VERSION_CRC = 2        # the same, followed by a CRC-32C trailer
HEADER = struct.Struct("<2sBBI")
TRAILER = struct.Struct("<I")
# Without an expected d: at most this many entries, or _MAX_EXPANSION per payload byte.
_MAX_UNCHECKED_D = 2**24
_MAX_EXPANSION = 2**16


if google_crc32c.implementation != "c":  # pragma: no cover (wheels cover the usual platforms)
    warnings.warn("google-crc32c runs without its C extension here: the payload checksum "
                  "costs ~1.4 s per MB; install a google-crc32c wheel or set "
                  "compression.options.checksum=false", RuntimeWarning, stacklevel=2)


class PayloadError(ValueError):
    """A payload that cannot be decoded (truncated, oversized, corrupt)."""


def crc32c(data: bytes | bytearray | memoryview | np.ndarray, crc: int = 0) -> int:
    """CRC-32C (Castagnoli) of ``data``, continuing ``crc`` (the CRC of the bytes
    before it). Read in place: google-crc32c takes ``bytes`` or a NumPy array, not a
    memoryview or bytearray, which are read through a NumPy view rather than copied
    (a payload's CRC was one more copy of its body)."""
    buf = data if isinstance(data, bytes | np.ndarray) else np.frombuffer(data, np.uint8)
    return int(google_crc32c.extend(crc, buf) if crc else google_crc32c.value(buf))


def check_checksum_option(checksum: object) -> bool:
    """``compression.options.checksum`` must be a boolean."""
    if not isinstance(checksum, bool):
        raise ValueError(f"compression.options.checksum: must be true or false, got {checksum!r}")
    return checksum


def check_vector(x: object, name: str) -> None:
    """``encode`` takes the flat update vector: anything else (a 2-D or 0-D tensor) is
    refused by name, rather than indexed along its first axis."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}.encode: expects a 1-D vector, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"{name}.encode: expects a 1-D vector, got shape {tuple(x.shape)}")


def check_fits(x: torch.Tensor, sent: torch.Tensor, name: str, dtype: str) -> None:
    """Refuse finite entries of ``x`` that became ±inf in ``sent`` (``x`` cast to the wire
    dtype, round to nearest: an entry overflows when ``|x|`` reaches the midpoint between
    the dtype's largest finite value and the next power of two, 65520 for float16). Entries
    that were inf or NaN already are sent as they are: the server screens such rows."""
    over = torch.isinf(sent) & torch.isfinite(x)
    if bool(over.any()):
        big = float(x[over].abs().max())
        raise ValueError(f"{name}.encode: {int(over.sum())} entries beyond {dtype}'s range "
                         f"(largest |x| = {big:.4g}): refused rather than sent as ±inf")


_F32_MAX = float(torch.finfo(torch.float32).max)


def check_scale(value: float, name: str, what: str) -> None:
    """A scale sent as float32 must be finite there (its decoder rejects one that is not)."""
    if not math.isfinite(value):
        raise ValueError(f"{name}.encode: {what} = {value} (x holds a non-finite entry or "
                         f"overflows float64)")
    if math.isinf(float(torch.tensor(value, dtype=torch.float64).to(torch.float32))):
        raise ValueError(f"{name}.encode: {what} = {value:.4g} is beyond float32's range "
                         f"(max {_F32_MAX:.6g})")


def pack_header(codec: int, d: int, checksum: bool = False) -> bytes:
    if not 0 <= d < 2**32:
        raise ValueError(f"payload: vector length {d} does not fit the u32 header")
    return HEADER.pack(MAGIC, VERSION_CRC if checksum else VERSION, codec, d)


def pack(codec: int, d: int, body: bytes | np.ndarray, checksum: bool) -> bytes:
    """Header, body and (with ``checksum``) the CRC-32C trailer. ``body`` may be a
    contiguous NumPy array (its bytes in memory order): the CRC reads it in place
    and the payload is written in one join, so the body is copied once."""
    head = pack_header(codec, d, checksum)
    # an array's buffer, read by join without a copy of its own
    body_buf = memoryview(body) if isinstance(body, np.ndarray) else body  # type: ignore[arg-type]
    if not checksum:
        return b"".join((head, body_buf))
    crc = crc32c(body, crc32c(head)) if len(body) else crc32c(head)
    return b"".join((head, body_buf, TRAILER.pack(crc)))


def unpack_header(
    payload: bytes, codec: int, expected_d: int | None = None, checksum: bool = False
) -> tuple[int, memoryview]:
    """Check the header, the trailer and ``d``; return ``d`` and the body (without
    the trailer)."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise PayloadError(f"payload: expected bytes, got {type(payload).__name__}")
    if len(payload) < HEADER.size:
        raise PayloadError(f"payload: truncated header ({len(payload)} of {HEADER.size} bytes)")
    magic, version, got_codec, d = HEADER.unpack_from(payload)
    if magic != MAGIC:
        raise PayloadError(f"payload: bad magic {magic!r}")
    if version not in (VERSION, VERSION_CRC):
        raise PayloadError(f"payload: unsupported version {version}")
    if (version == VERSION_CRC) != checksum:
        raise PayloadError(
            f"payload: sent {'with' if version == VERSION_CRC else 'without'} a checksum "
            f"trailer, this receiver expects {'one' if checksum else 'none'} "
            f"(compression.options.checksum)")
    view = memoryview(payload)
    if checksum:
        if len(view) < HEADER.size + TRAILER.size:
            raise PayloadError("payload: truncated (no room for the checksum trailer)")
        (want,) = TRAILER.unpack_from(view, len(view) - TRAILER.size)
        got = crc32c(view[: len(view) - TRAILER.size])
        if got != want:
            raise PayloadError(f"payload: checksum mismatch (CRC-32C {got:#010x}, trailer says "
                               f"{want:#010x}): damaged in transit")
        view = view[: len(view) - TRAILER.size]
    if got_codec != codec:
        raise PayloadError(f"payload: codec id {got_codec}, this decoder reads {codec}")
    if expected_d is not None:
        if d != expected_d:
            raise PayloadError(f"payload: holds a vector of size {d}, expected {expected_d}")
    elif d > max(_MAX_UNCHECKED_D, _MAX_EXPANSION * len(payload)):
        raise PayloadError(f"payload: claims d = {d} in {len(payload)} bytes, more than a "
                           f"decoder allocates unasked; pass the expected d")
    return d, view[HEADER.size :]



class Compressor(Protocol):
    """``decode(encode(x))`` is the vector the receiver sees.

    ``encode`` takes the flat 1-D update and raises a ``ValueError`` naming the compressor
    on what it cannot send faithfully (another shape, a finite value its wire dtype would
    turn into ±inf); the engine rejects and counts that client.
    ``checksum``: whether payloads carry (and ``decode`` requires) the CRC-32C trailer.
    ``capabilities``: a :class:`~fedloom.capabilities.CompressorCaps` (``linear``:
    payloads are dense values on the same coordinates for every client, so a sum-only,
    secure-aggregation server can add them, :mod:`fedloom.privacy`; ``decode_into``: it
    has ``decode_into(payload, out)``, which decodes into the server's row ``out`` and
    returns it); its defaults when absent, read by
    :func:`~fedloom.capabilities.compressor_caps`.
    """

    name: str
    checksum: bool
    capabilities: CompressorCaps

    def encode(self, x: torch.Tensor, *, gen: torch.Generator | None = None) -> bytes: ...

    def decode(self, payload: bytes, d: int | None = None) -> torch.Tensor:
        """Validate and decode; ``d``, when given, must match the payload's size."""
        ...
