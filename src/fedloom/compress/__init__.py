"""Compressors with an exact wire encoding: ``len(encode(x))`` is the bytes sent."""

from typing import Any

from fedloom.compress.base import Compressor, PayloadError
from fedloom.compress.identity import Identity
from fedloom.compress.quant import QSGD, Cast, ScaledSign
from fedloom.compress.sparse import RandK, TopK, topk_indices


def coordinates_sent(payload: bytes) -> int:
    """How many coordinates a payload carries: ``k`` for sparse payloads, else ``d``."""
    from fedloom.compress.base import HEADER
    from fedloom.compress.sparse import CODEC_RANDK, CODEC_TOPK

    _, _, codec, d = HEADER.unpack_from(payload)
    if codec in (CODEC_TOPK, CODEC_RANDK):
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

    return build("compressor", name, options, "compression.options")


__all__ = ["QSGD", "Cast", "Compressor", "Identity", "PayloadError", "RandK", "ScaledSign",
           "TopK", "coordinates_sent", "make_compressor", "topk_indices"]
