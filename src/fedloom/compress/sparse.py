"""Sparsifiers: Top-k and Rand-k, with an exact wire encoding.

Top-k keeps the ``k`` entries of largest magnitude, over the whole vector,
per tensor or per layer group (``scope``). The budget of a unit of ``n`` entries
(``k_rule``; ``round`` is Python's, half to even):

- ``flare`` (the default with ``scope=tensor``): ``k = min(n, round(n·ratio) + 1)``, the
  public FLARE code's count (RanGreidi/FLARE, src/FLARE_utils.py, ``sparsify_layer``: it
  takes the ``round(n·R) + 2`` largest magnitudes with ``tf.nn.top_k`` and keeps the entries
  strictly above the smallest of them, ``round(n·R) + 1`` entries, ``tf.round`` also half to
  even). Every tensor sends at least one entry, so the real density is above the ratio:
  report it. On a 700-entry tensor at 1 %: 8 entries, where ``round`` keeps 7.
- ``round`` (the default with ``scope=global`` or ``group``):
  ``k = min(n, max(1, round(n·ratio)))``.

Departures from the public count: ``n·ratio`` is computed in float64 from the fraction
(the public code multiplies ``n`` by ``R/100`` in float32, ``R`` in percent: the counts
agree unless ``n·ratio`` lies within float32 rounding, ~1e-7 relative, of a half-integer);
exactly ``k`` entries are kept when magnitudes tie at the k-th (the public ``>`` keeps fewer,
and none of an all-zero tensor); ``k`` is capped at ``n`` (the public ``top_k`` fails when
``round(n·R) + 2 > n``). Rand-k keeps ``k`` uniformly random entries, scaled by ``d/k``
(unbiased) or not (SA-PEF's code). :func:`topk_indices` gives ``torch.topk``'s index set.

The payload layout, the decoder's checks, refused values and the Top-k search:
docs/explanation/methods.md (Sparsifiers in detail).
"""

from __future__ import annotations

import math
import numbers
import struct
from collections.abc import Callable
from typing import Literal

import numpy as np
import torch

from fedloom.capabilities import CompressorCaps
from fedloom.compress.base import (
    PayloadError,
    check_checksum_option,
    check_fits,
    check_vector,
    pack,
    unpack_header,
)
from fedloom.compress.coding import decode_indices, encode_indices
from fedloom.params import Layout
from fedloom.registry import register

__all__ = ["RandK", "TopK", "decode_sparse", "encode_sparse", "topk_indices"]

CODEC_TOPK = 2
CODEC_RANDK = 3
_SPARSE = struct.Struct("<IBBI")
_VALUE_DTYPES = {0: ("<f4", 4), 1: ("<f2", 2)}
_VCODE = {"float32": 0, "float16": 1}
ValueDtype = Literal["float32", "float16"]
KRule = Literal["flare", "round"]
_CODEC_NAMES = {CODEC_TOPK: "topk", CODEC_RANDK: "randk"}


def topk_indices(x: torch.Tensor, k: int, *, sample: int = 65536) -> torch.Tensor:
    """Indices of the ``k`` largest ``|x_j|``, sorted ascending (exact).

    A strided sample of ``|x|`` gives a threshold ``t`` a little below the k-th
    largest magnitude: ``p_hi = max(c·k/d, k/d + 6σ)`` with σ the standard error of
    a sample quantile (c = 3 for small k, 1.05 for large). Only the entries
    ``≥ t`` (≈ p_hi·d) go to an exact selection — the k largest of them, or, when
    k is most of them, all but the smallest few — so the result is the exact
    top-k whenever at least k entries pass, which is checked; otherwise the
    margin widens and, at worst, ``torch.topk`` on everything decides.
    """
    d = x.numel()
    if k <= 0:
        return torch.zeros(0, dtype=torch.long, device=x.device)
    if k >= d:
        return torch.arange(d, device=x.device)
    if d <= 4 * sample:
        return torch.topk(x.abs(), k, sorted=False).indices.sort().values
    # |x| is never materialised for the whole vector (a 4-byte-per-entry pass and
    # allocation): the probe and the candidates' values take their own abs.
    probe = x[:: d // sample].abs().float()
    p = k / d
    sd = math.sqrt(p * (1 - p) / probe.numel())
    p_hi = min(1.0, max((3.0 if k < 10_000 else 1.05) * p, p + 6 * sd))
    for _ in range(3):
        j = max(1, int((1.0 - p_hi) * probe.numel()))
        t = float(torch.kthvalue(probe, j).values)
        cand = torch.nonzero((x >= t) | (x <= -t), as_tuple=False).squeeze(1)
        n = cand.numel()
        if n >= k:
            # Every top-k entry is >= t because at least k entries are.
            vals = x[cand].abs()
            if 2 * k <= n:
                keep = cand[torch.topk(vals, k, sorted=False).indices]
            else:  # drop the n − k smallest candidates instead
                mask = torch.ones(n, dtype=torch.bool, device=x.device)
                if n > k:
                    mask[torch.topk(vals, n - k, largest=False, sorted=False).indices] = False
                keep = cand[mask]
            return keep.sort().values
        p_hi = min(1.0, 2.0 * p_hi + 6 * sd)
    return torch.topk(x.abs(), k, sorted=False).indices.sort().values


def encode_sparse(codec: int, d: int, idx: torch.Tensor, values: torch.Tensor,
                  value_dtype: ValueDtype, checksum: bool = False) -> bytes:
    vcode = _VCODE[value_dtype]
    # The selection ran where x lives (the run's device): only the k indices and
    # values cross to the host to be encoded.
    kind, index_block = encode_indices(idx.cpu().numpy(), d)
    # Through float32 to float16, as before the range check (the same bits on the wire).
    wire = values.detach().to(torch.float32)
    wire = wire.to(torch.float16) if vcode else wire
    check_fits(values.detach(), wire, _CODEC_NAMES.get(codec, "sparse"), value_dtype)
    vals = wire.cpu().numpy().astype(_VALUE_DTYPES[vcode][0])
    return pack(codec, d, _SPARSE.pack(idx.numel(), kind, vcode, len(index_block))
                + index_block + vals.tobytes(), checksum)


def decode_sparse(payload: bytes, codec: int, expected_d: int | None = None, *,
                  checksum: bool = False, values: ValueDtype | None = None,
                  budget: Callable[[int], list[tuple[int, int, int]]] | None = None,
                  ) -> tuple[int, np.ndarray, np.ndarray]:
    """``(d, indices, values)`` of a sparse payload, validated; ``values`` is the
    value dtype the receiver expects, ``budget(d)`` its ``(start, stop, k_l)`` units."""
    d, body = unpack_header(payload, codec, expected_d, checksum)
    if len(body) < _SPARSE.size:
        raise PayloadError(f"sparse payload: truncated ({len(body)} bytes after the header)")
    k, kind, vcode, ilen = _SPARSE.unpack_from(body)
    if vcode not in _VALUE_DTYPES:
        raise PayloadError(f"sparse payload: unknown value dtype {vcode}")
    if values is not None and vcode != _VCODE[values]:
        raise PayloadError(f"sparse payload: value dtype {vcode}, this decoder reads "
                           f"{_VCODE[values]} ({values})")
    if k > d:
        raise PayloadError(f"sparse payload: k = {k} exceeds d = {d}")
    vdt, vsize = _VALUE_DTYPES[vcode]
    expected = _SPARSE.size + ilen + k * vsize
    if len(body) != expected:
        raise PayloadError(f"sparse payload: {len(body)} body bytes, expected {expected}")
    units = budget(d) if budget is not None else None
    if units is not None and k != (want := sum(u[2] for u in units)):
        raise PayloadError(f"sparse payload: k = {k}, this decoder's budget for d = {d} is "
                           f"{want}")
    iblock = body[_SPARSE.size : _SPARSE.size + ilen]
    idx = decode_indices(kind, iblock, k, d)
    if units is not None and len(units) > 1:
        # Per tensor/group: each unit holds exactly its k_l indices (idx is sorted).
        lo = np.searchsorted(idx, [u[0] for u in units])
        hi = np.searchsorted(idx, [u[1] for u in units])
        got = hi - lo
        want_l = np.array([u[2] for u in units])
        if (got != want_l).any():
            j = int(np.flatnonzero(got != want_l)[0])
            raise PayloadError(f"sparse payload: {int(got[j])} indices in [{units[j][0]}, "
                               f"{units[j][1]}), its budget is {units[j][2]}")
    vals = np.frombuffer(body[_SPARSE.size + ilen :], dtype=vdt).astype(np.float32)
    return d, idx, vals


def _densify(d: int, idx: np.ndarray, vals: np.ndarray) -> torch.Tensor:
    out = torch.zeros(d, dtype=torch.float32)
    out[torch.from_numpy(idx)] = torch.from_numpy(vals)
    return out


def _check_options(ratio: object, count: object, values: object, k_rule: object = None,
                   ) -> None:
    """One-line errors naming the option, before anything is computed with it: a
    ``count`` of 0 would divide by zero in Rand-k's ``d/k``, a string ``ratio``
    would fail deep inside a comparison."""
    if count is not None:
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
            raise ValueError(f"compression.options.count: must be an integer >= 1, "
                             f"got {count!r}")
    elif (ratio is None or isinstance(ratio, bool) or not isinstance(ratio, numbers.Real)
          or not 0 < float(ratio) <= 1):
        raise ValueError(f"compression.options.ratio: must be a number in (0, 1], got {ratio!r}")
    if values not in ("float32", "float16"):
        raise ValueError(f"compression.options.values: must be float32 or float16, "
                         f"got {values!r}")
    if k_rule is not None:
        if k_rule not in ("flare", "round"):
            raise ValueError(f"compression.options.k_rule: must be flare or round, "
                             f"got {k_rule!r}")
        if count is not None:
            raise ValueError("compression.options.k_rule: only with ratio (count sets k)")


def _budget(n: int, ratio: float | None, count: int | None, rule: KRule = "round") -> int:
    """``k`` for a unit of ``n`` entries (module docstring); ``round`` rounds half to even,
    as ``tf.round`` in the public FLARE code."""
    if count is not None:
        return min(n, count)
    assert ratio is not None
    if rule == "flare":
        return min(n, round(n * ratio) + 1)
    return min(n, max(1, round(n * ratio)))


class TopK:
    """Top-k by magnitude.

    Args:
        ratio: fraction of entries kept per scope unit (``k_rule``).
        count: an absolute ``k`` instead (global scope only).
        scope: ``global`` (whole vector), ``tensor`` or ``group`` (needs ``layout``).
        values: ``float32`` or ``float16`` on the wire.
        layout: the model's tensors (``scope`` tensor or group).
        checksum: send (and require) the CRC-32C trailer.
        k_rule: ``flare`` (``round(n·ratio) + 1``, the public FLARE count) or ``round``
            (``max(1, round(n·ratio))``); ``None`` is ``flare`` with ``scope=tensor``,
            ``round`` otherwise (module docstring).
    """

    name = "topk"
    codec = CODEC_TOPK
    # each client's own coordinates: the payloads do not add up
    capabilities = CompressorCaps(pure=True)

    def __init__(self, ratio: float | None = 0.01, count: int | None = None,
                 scope: Literal["global", "tensor", "group"] = "global",
                 values: ValueDtype = "float32", layout: Layout | None = None,
                 checksum: bool = True, k_rule: KRule | None = None) -> None:
        _check_options(ratio, count, values, k_rule)
        self.checksum = check_checksum_option(checksum)
        if count is not None:
            ratio = None
            if scope != "global":
                raise ValueError("compression.options.count: only with scope 'global'")
        if scope not in ("global", "tensor", "group"):
            raise ValueError(f"compression.options.scope: must be global, tensor or group, "
                             f"got {scope!r}")
        if scope != "global" and layout is None:
            raise ValueError(f"topk: scope {scope!r} needs the model's layout")
        self.ratio, self.count, self.scope, self.values = ratio, count, scope, values
        self.layout = layout
        self.k_rule: KRule = k_rule or ("flare" if scope == "tensor" else "round")

    def _units(self, d: int) -> list[tuple[int, int]]:
        if self.scope == "global":
            return [(0, d)]
        assert self.layout is not None
        if self.layout.size != d:
            raise ValueError(f"topk: vector of size {d} for a layout of size {self.layout.size}")
        if self.scope == "tensor":
            return [(t.offset, t.offset + t.numel) for t in self.layout.tensors]
        return [(g.start, g.stop) for g in self.layout.groups]

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """The sorted indices this compressor keeps."""
        parts = []
        for start, stop in self._units(x.numel()):
            k = _budget(stop - start, self.ratio, self.count, self.k_rule)
            parts.append(topk_indices(x[start:stop], k) + start)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def budget(self, d: int) -> list[tuple[int, int, int]]:
        """``(start, stop, k_l)`` of each scope unit for a vector of size ``d``."""
        return [(a, b, _budget(b - a, self.ratio, self.count, self.k_rule))
                for a, b in self._units(d)]

    def encode(self, x: torch.Tensor, *, gen: torch.Generator | None = None) -> bytes:
        check_vector(x, self.name)
        idx = self.select(x)
        return encode_sparse(self.codec, x.numel(), idx, x[idx], self.values, self.checksum)

    def decode(self, payload: bytes, d: int | None = None) -> torch.Tensor:
        if d is None and self.layout is not None and self.scope != "global":
            d = self.layout.size  # the layout says what the receiver expects
        return _densify(*decode_sparse(payload, self.codec, d, checksum=self.checksum,
                                       values=self.values, budget=self.budget))

    def contraction(self, d: int) -> float:
        """``δ = d/k`` (``‖x − C(x)‖² ≤ (1 − 1/δ)‖x‖²``)."""
        k = sum(u[2] for u in self.budget(d))
        return d / k


class RandK:
    """``k`` uniformly random entries, scaled by ``d/k`` when ``scaled`` (unbiased)."""

    name = "randk"
    codec = CODEC_RANDK
    # each client's own coordinates: the payloads do not add up
    capabilities = CompressorCaps(pure=True)

    def __init__(self, ratio: float | None = 0.01, count: int | None = None,
                 scaled: bool = True, values: ValueDtype = "float32",
                 checksum: bool = True) -> None:
        _check_options(ratio, count, values)
        self.checksum = check_checksum_option(checksum)
        if not isinstance(scaled, bool):
            raise ValueError(f"compression.options.scaled: must be true or false, got {scaled!r}")
        self.ratio, self.count, self.scaled, self.values = ratio, count, scaled, values

    def encode(self, x: torch.Tensor, *, gen: torch.Generator | None = None) -> bytes:
        if gen is None:
            raise ValueError("randk.encode: needs a generator (gen=...)")
        check_vector(x, self.name)
        d = x.numel()
        if d == 0:  # k = 0, and d/k would divide by zero
            raise ValueError("randk.encode: empty vector (d = 0), nothing to sample")
        k = _budget(d, self.ratio, self.count)
        idx = torch.randperm(d, generator=gen)[:k].sort().values  # host generator
        vals = x[idx.to(x.device)] * (d / k) if self.scaled else x[idx.to(x.device)]
        return encode_sparse(self.codec, d, idx, vals, self.values, self.checksum)

    def budget(self, d: int) -> list[tuple[int, int, int]]:
        return [(0, d, _budget(d, self.ratio, self.count))]

    def decode(self, payload: bytes, d: int | None = None) -> torch.Tensor:
        return _densify(*decode_sparse(payload, self.codec, d, checksum=self.checksum,
                                       values=self.values, budget=self.budget))

    def contraction(self, d: int) -> float:
        return d / _budget(d, self.ratio, self.count)


@register("compressor", "topk")
def _topk(ratio: float | None = 0.01, count: int | None = None,
          scope: Literal["global", "tensor", "group"] = "global",
          values: ValueDtype = "float32", checksum: bool = True,
          layout: Layout | None = None, k_rule: KRule | None = None) -> TopK:
    """Top-k: the ``k`` entries of largest magnitude, over the vector, per tensor or per layer
    group (``scope``).

    Reference:
        paper: Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018; the
            per-tensor budget of FLARE.
        code: RanGreidi/FLARE, src/FLARE_utils.py ``sparsify_layer`` (per tensor,
            ``k_l = round(n_l R) + 1``: ``k_rule=flare``, the default with ``scope=tensor``;
            checked against that rule written out on tensors of 3 to 700 entries, counts
            equal; ``k_rule=round`` is ``max(1, round(n_l R))``).
        departures: the wire format (varint index gaps or a bitmap, whichever is smaller) is
            fedloom's; the real density is reported (above ``ratio`` per tensor); ties at the
            k-th magnitude keep exactly ``k`` entries (the public ``>`` keeps fewer); ``k`` is
            capped at ``n``; values beyond the wire dtype are refused, not sent as ±inf.
    """
    return TopK(ratio=ratio, count=count, scope=scope, values=values, layout=layout,
                checksum=checksum, k_rule=k_rule)


@register("compressor", "randk")
def _randk(ratio: float | None = 0.01, count: int | None = None, scaled: bool = True,
           values: ValueDtype = "float32", checksum: bool = True,
           layout: Layout | None = None) -> RandK:
    """Rand-k: ``k`` uniformly random entries, scaled by ``d/k`` (unbiased) or not
    (``scaled=False``).

    Reference:
        paper: Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018.
        code: Dawitkiros/SA-PEF (unscaled: ``scaled=False``).
        departures: the indices are drawn from the round's (seed, round, client) generator and
            sent (no shared seed).
    """
    return RandK(ratio=ratio, count=count, scaled=scaled, values=values, checksum=checksum)

