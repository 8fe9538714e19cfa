"""Compressor interface and the common wire header.

A compressor's ``encode`` returns the **bytes sent**: ``len(payload)`` is what
the byte metrics count, not an estimate. Every payload starts with an 8-byte
header::

    magic  b"FL"   2 bytes
    version        u8  (1)
    codec id       u8
    d              u32 little-endian, the length of the decoded vector

``decode`` validates the header and the body length and raises
:class:`PayloadError` (a ``ValueError``) with a one-line reason on truncated or
corrupt input; it never returns a silently wrong vector.
"""

from __future__ import annotations

import struct
from typing import Protocol

import torch

__all__ = ["HEADER", "Compressor", "PayloadError", "pack_header", "unpack_header"]

MAGIC = b"FL"
VERSION = 1
HEADER = struct.Struct("<2sBBI")


class PayloadError(ValueError):
    """A payload that cannot be decoded (truncated, oversized, corrupt)."""


def pack_header(codec: int, d: int) -> bytes:
    if not 0 <= d < 2**32:
        raise ValueError(f"payload: vector length {d} does not fit the u32 header")
    return HEADER.pack(MAGIC, VERSION, codec, d)


def unpack_header(
    payload: bytes, codec: int, expected_d: int | None = None
) -> tuple[int, memoryview]:
    """Check the header (and ``d`` against ``expected_d``); return ``d`` and the body."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise PayloadError(f"payload: expected bytes, got {type(payload).__name__}")
    if len(payload) < HEADER.size:
        raise PayloadError(f"payload: truncated header ({len(payload)} of {HEADER.size} bytes)")
    magic, version, got_codec, d = HEADER.unpack_from(payload)
    if magic != MAGIC:
        raise PayloadError(f"payload: bad magic {magic!r}")
    if version != VERSION:
        raise PayloadError(f"payload: unsupported version {version}")
    if got_codec != codec:
        raise PayloadError(f"payload: codec id {got_codec}, this decoder reads {codec}")
    if expected_d is not None and d != expected_d:
        raise PayloadError(f"payload: holds a vector of size {d}, expected {expected_d}")
    return d, memoryview(payload)[HEADER.size :]


class Compressor(Protocol):
    """``decode(encode(x))`` is the vector the receiver sees."""

    name: str

    def encode(self, x: torch.Tensor, *, gen: torch.Generator | None = None) -> bytes: ...

    def decode(self, payload: bytes, d: int | None = None) -> torch.Tensor:
        """Validate and decode; ``d``, when given, must match the payload's size."""
        ...
