"""Compressors with an exact wire encoding: ``len(encode(x))`` is the bytes sent."""

from typing import Any

from fedloom.compress.base import Compressor, PayloadError
from fedloom.compress.identity import Identity, InPlacePayload
from fedloom.compress.quant import QSGD, Cast, ScaledSign
from fedloom.compress.sparse import RandK, TopK, topk_indices


def coordinates_sent(payload: bytes | InPlacePayload) -> int:
    """How many coordinates a payload carries: ``k`` for sparse payloads, else ``d``.

    Reads the header (and a sparse payload's u32 ``k``) only; it does not validate the
    body, which ``decode`` does. A payload too short for what it reads, or not a fedloom
    payload at all, is a :class:`PayloadError` naming this function."""
    from fedloom.compress.base import HEADER, MAGIC
    from fedloom.compress.sparse import CODEC_RANDK, CODEC_TOPK

    if isinstance(payload, InPlacePayload):
        return payload.row.numel()
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise PayloadError(f"coordinates_sent: expected bytes, got {type(payload).__name__}")
    if len(payload) < HEADER.size:
        raise PayloadError(f"coordinates_sent: {len(payload)} bytes, shorter than the "
                           f"{HEADER.size}-byte header")
    magic, _, codec, d = HEADER.unpack_from(payload)
    if magic != MAGIC:
        raise PayloadError(f"coordinates_sent: bad magic {magic!r}, not a fedloom payload")
    if codec in (CODEC_TOPK, CODEC_RANDK):
        if len(payload) < HEADER.size + 4:
            raise PayloadError(f"coordinates_sent: sparse payload of {len(payload)} bytes "
                               f"ends before its u32 k")
        return int.from_bytes(payload[HEADER.size : HEADER.size + 4], "little")
    return int(d)


def make_compressor(name: str, **options: Any) -> Compressor:
    """Build a registered compressor (``identity``, ``fp16``, ``bf16``, ``topk``,
    ``randk``, ``sign``, ``qsgd``); unknown options raise a ``ValueError``.

    Every compressor takes ``checksum`` (default ``True``): its payloads end with a
    4-byte CRC-32C trailer that its ``decode`` requires (see
    :mod:`fedloom.compress.base`); ``checksum=False`` gives the bare encoding, byte
    for byte, for byte counts comparable with papers."""
    from fedloom.registry import build

    comp: Compressor = build("compressor", name, options, "compression.options")
    return comp


__all__ = ["QSGD", "Cast", "Compressor", "Identity", "InPlacePayload", "PayloadError", "RandK",
           "ScaledSign", "TopK", "coordinates_sent", "make_compressor", "topk_indices"]
