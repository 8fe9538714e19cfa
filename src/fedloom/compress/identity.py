"""Identity compressor: the dense vector as little-endian float32.

Payload: 8-byte header + ``4 d`` bytes (+ the 4-byte CRC-32C trailer unless
``checksum=False``, see :mod:`fedloom.compress.base`). Decoding returns float32.
"""

from __future__ import annotations

import numpy as np
import torch

from fedloom.capabilities import CompressorCaps
from fedloom.compress.base import (
    PayloadError,
    check_checksum_option,
    check_fits,
    pack,
    unpack_header,
)
from fedloom.registry import register

__all__ = ["Identity"]

CODEC_IDENTITY = 0


class Identity:
    name = "identity"
    # a dense vector: a sum of payload vectors is the sum of the updates
    capabilities = CompressorCaps(linear=True)

    def __init__(self, checksum: bool = True) -> None:
        self.checksum = check_checksum_option(checksum)

    def encode(self, x: torch.Tensor, *, gen: torch.Generator | None = None) -> bytes:
        if x.ndim != 1:
            raise ValueError(f"identity.encode: expected a vector, got shape {tuple(x.shape)}")
        sent = x.detach().to(torch.float32)
        if x.dtype == torch.float64:  # a finite float64 entry beyond float32 is not sent as ±inf
            check_fits(x.detach(), sent, "identity", "float32")
        body = sent.contiguous().cpu().numpy().astype("<f4", copy=False)
        return pack(CODEC_IDENTITY, x.shape[0], body.tobytes(), self.checksum)

    def decode(self, payload: bytes, d: int | None = None) -> torch.Tensor:
        d, body = unpack_header(payload, CODEC_IDENTITY, d, self.checksum)
        if len(body) != 4 * d:
            raise PayloadError(f"identity payload: body has {len(body)} bytes, expected {4 * d}")
        return torch.from_numpy(np.frombuffer(body, dtype="<f4").astype(np.float32))


@register("compressor", "identity")
def _identity(checksum: bool = True, layout: object | None = None) -> Identity:
    """The dense vector as little-endian float32 (no compression).

    Reference:
        paper: none (the uncompressed baseline).
        code: none needed.
        departures: none.
    """
    return Identity(checksum)
