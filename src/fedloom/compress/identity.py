"""Identity compressor: the dense vector as little-endian float32.

Payload: 8-byte header + ``4 d`` bytes (+ the 4-byte CRC-32C trailer unless
``checksum=False``, see :mod:`fedloom.compress.base`). Decoding returns float32.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from fedloom.capabilities import CompressorCaps
from fedloom.compress.base import (
    HEADER,
    TRAILER,
    PayloadError,
    check_checksum_option,
    check_fits,
    pack,
    unpack_header,
)
from fedloom.registry import register

__all__ = ["Identity", "InPlacePayload"]

CODEC_IDENTITY = 0


class InPlacePayload:
    """An identity payload that stays where the update is: a float32 row the server
    reads in place (a ``process`` worker wrote it into the server's row in shared
    memory). ``len`` is the size of :meth:`Identity.encode`'s payload, the bytes the
    run counts as sent; ``bytes(p)`` builds that payload, bit for bit, for whatever
    needs the bytes themselves. Nothing is serialised or checksummed otherwise: the
    vector never leaves the machine's memory, and the checksum guards a transport.
    """

    __slots__ = ("checksum", "row")

    def __init__(self, row: torch.Tensor, checksum: bool) -> None:
        if row.ndim != 1 or row.dtype != torch.float32 or row.device.type != "cpu":
            raise ValueError("InPlacePayload: expected a float32 vector on the host, got "
                             f"{row.dtype} of shape {tuple(row.shape)} on {row.device}")
        self.row, self.checksum = row, checksum

    def __len__(self) -> int:
        return HEADER.size + 4 * self.row.numel() + (TRAILER.size if self.checksum else 0)

    def __bytes__(self) -> bytes:
        return Identity(self.checksum).encode(self.row)


class Identity:
    name = "identity"
    # a dense vector: a sum of payload vectors is the sum of the updates; decoded
    # straight into the server's row (decode_into)
    capabilities = CompressorCaps(linear=True, pure=True, decode_into=True)

    def __init__(self, checksum: bool = True) -> None:
        self.checksum = check_checksum_option(checksum)

    def encode(self, x: torch.Tensor, *, gen: torch.Generator | None = None) -> bytes:
        if x.ndim != 1:
            raise ValueError(f"identity.encode: expected a vector, got shape {tuple(x.shape)}")
        sent = x.detach().to(torch.float32)
        if x.dtype == torch.float64:  # a finite float64 entry beyond float32 is not sent as ±inf
            check_fits(x.detach(), sent, "identity", "float32")
        # The tensor's own buffer where it already is contiguous float32 on the host:
        # the CRC reads it in place and the payload is its one copy.
        body = sent.contiguous().cpu().numpy().astype("<f4", copy=False)
        return pack(CODEC_IDENTITY, x.shape[0], body, self.checksum)

    def _body(self, payload: bytes, d: int | None) -> np.ndarray:
        """The checked payload's values, a read-only view of its bytes."""
        d, body = unpack_header(payload, CODEC_IDENTITY, d, self.checksum)
        if len(body) != 4 * d:
            raise PayloadError(f"identity payload: body has {len(body)} bytes, expected {4 * d}")
        return np.frombuffer(body, dtype="<f4")

    def decode(self, payload: bytes | InPlacePayload, d: int | None = None) -> torch.Tensor:
        if isinstance(payload, InPlacePayload):
            payload = bytes(payload)
        return torch.from_numpy(self._body(payload, d).astype(np.float32))

    def decode_into(self, payload: bytes | InPlacePayload, out: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` written into ``out`` (a vector of the expected size, any
        float dtype and device): the payload's values are read in place and copied
        once, where ``decode`` then a copy into the server's rows copied them twice.
        Returns ``out``."""
        if isinstance(payload, InPlacePayload):
            if payload.checksum != self.checksum or payload.row.shape != out.shape:
                payload = bytes(payload)  # the checks of the bytes, with their messages
            else:
                if payload.row.data_ptr() != out.data_ptr():
                    out.copy_(payload.row)
                return out
        vals = self._body(payload, out.shape[0])
        if not vals.dtype.isnative:  # a big-endian host: the one place a copy is made
            vals = vals.astype(np.float32)
        # a read-only view: torch warns on (but nothing here writes through) such an array
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            out.copy_(torch.from_numpy(vals))
        return out


@register("compressor", "identity")
def _identity(checksum: bool = True, layout: object | None = None) -> Identity:
    """The dense vector as little-endian float32 (no compression).

    Reference:
        paper: none (the uncompressed baseline).
        code: none needed.
        departures: none.
    """
    return Identity(checksum)
