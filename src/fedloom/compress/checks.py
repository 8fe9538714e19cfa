"""A compressor checked at the door: one given as an object or an import reference
runs before round 1 on a synthetic update of the model's size ``d``.

The Compressor protocol (:class:`fedloom.compress.base.Compressor`) is
``encode(x, *, gen)`` → the bytes sent and ``decode(payload, d)`` → the vector the
server sees. Checked, twice (two generators): ``encode`` returns bytes that start
with fedloom's payload header (:func:`fedloom.compress.base.pack`) and ``decode`` of
them a finite tensor of shape ``(d,)`` for a finite update. A
compressor of fedloom's own (tested by its suites: the payload fuzzing) is not run.
A violation is one ``ValueError`` line naming ``compression``, the class and
method, and what came back.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from fedloom.compress import coordinates_sent
from fedloom.compress.identity import InPlacePayload
from fedloom.transforms import called, check_vector, from_fedloom, what

__all__ = ["check_compressor"]

_PROTOCOL = ("the Compressor protocol is encode(x, *, gen) -> bytes and "
             "decode(payload, d) -> vector")


def check_compressor(comp: object, x: torch.Tensor, gens: tuple[torch.Generator, ...]) -> None:
    """``comp`` on the synthetic update ``x`` (``[d]``), once with each of ``gens``."""
    cls = type(comp).__name__
    missing = [m for m in ("encode", "decode") if not callable(getattr(comp, m, None))]
    if missing:
        raise ValueError(f"compression: {cls} has no {' and '.join(missing)}; {_PROTOCOL}")
    if from_fedloom(comp):
        return
    codec = cast(Any, comp)
    (d,) = x.shape
    for gen in gens:
        payload = called(f"compression: {cls}.encode", f"a synthetic update of shape ({d},)",
                         codec.encode, x.clone(), gen=gen)
        if not isinstance(payload, bytes | bytearray | memoryview | InPlacePayload):
            raise ValueError(f"compression: {cls}.encode returned {what(payload)}, {_PROTOCOL}")
        try:  # what the engine reads of every payload before decoding it
            if not isinstance(payload, InPlacePayload):  # (the row itself, no header)
                coordinates_sent(cast(bytes, payload))  # it reads any buffer, typed bytes
        except ValueError as e:
            raise ValueError(f"compression: {cls}.encode returned {len(payload)} bytes "
                             f"without fedloom's payload header ({e}); write it with "
                             "fedloom.compress.base.pack(codec, d, body, checksum)") from None
        out = called(f"compression: {cls}.decode", "the payload its encode returned",
                     codec.decode, payload, d)
        check_vector(f"compression: {cls}.decode", out, (d,), "vector")
