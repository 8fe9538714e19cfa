"""Index and bit coding for sparse payloads (vectorised NumPy).

Sorted indices are sent either as

- ``varint``: gaps ``i_0, i_1 − i_0 − 1, …`` in LEB128 (7 bits a byte, the
  high bit says "more bytes follow"), or
- ``bitmap``: ``d`` bits, one per coordinate (``⌈d/8⌉`` bytes),

whichever is smaller for this index set (the bitmap wins above a density of
roughly 1/32 for small gaps; a tie goes to varint). Decoders validate everything and
raise :class:`~fedloom.compress.base.PayloadError` on truncated or corrupt input,
including a non-canonical encoding: a varint with a redundant final zero byte, or
the coding the encoder would not have chosen for this index set. Each index set
then has exactly one encoding, so damage that turns one valid encoding into
another of the same set (a changed coding byte that still parses) is rejected.
"""

from __future__ import annotations

import numpy as np

from fedloom.compress.base import PayloadError

__all__ = [
    "INDEX_BITMAP",
    "INDEX_VARINT",
    "decode_indices",
    "encode_indices",
    "pack_bits",
    "unpack_bits",
    "varint_decode",
    "varint_encode",
    "varint_size",
]

INDEX_VARINT = 0
INDEX_BITMAP = 1
_MAX_VARINT_BYTES = 5  # gaps < 2^35, enough for d < 2^32


def varint_encode(values: np.ndarray) -> bytes:
    """LEB128 of non-negative integers: 7 bits a byte, the high bit set on every byte
    but a value's last.

    >>> varint_encode(np.array([0, 1, 127, 128, 300]))
    b'\\x00\\x01\\x7f\\x80\\x01\\xac\\x02'
    >>> varint_decode(_, 5).tolist()
    [0, 1, 127, 128, 300]
    """
    v = np.asarray(values, dtype=np.uint64)
    if v.size == 0:
        return b""
    nbytes = np.ones(v.size, dtype=np.int64)
    for b in range(1, _MAX_VARINT_BYTES):
        nbytes += (v >= (np.uint64(1) << np.uint64(7 * b))).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(nbytes)[:-1]])
    out = np.zeros(int(nbytes.sum()), dtype=np.uint8)
    for b in range(_MAX_VARINT_BYTES):
        sel = nbytes > b
        if not sel.any():
            break
        chunk = ((v[sel] >> np.uint64(7 * b)) & np.uint64(0x7F)).astype(np.uint8)
        more = (nbytes[sel] > b + 1).astype(np.uint8) << 7
        out[starts[sel] + b] = chunk | more
    return out.tobytes()


def varint_decode(data: bytes | memoryview, count: int) -> np.ndarray:
    """Exactly ``count`` LEB128 integers filling all of ``data``."""
    buf = np.frombuffer(data, dtype=np.uint8)
    if count == 0:
        if buf.size:
            raise PayloadError("varint: trailing bytes after the last value")
        return np.zeros(0, dtype=np.uint64)
    if buf.size == 0 or buf[-1] & 0x80:
        raise PayloadError("varint: truncated (the last value has no final byte)")
    ends = np.flatnonzero((buf & 0x80) == 0)
    if ends.size != count:
        raise PayloadError(f"varint: holds {ends.size} values, expected {count}")
    starts = np.concatenate([[0], ends[:-1] + 1])
    lengths = ends - starts + 1
    if lengths.max() > _MAX_VARINT_BYTES:
        raise PayloadError("varint: a value longer than 5 bytes (corrupt)")
    # The encoder writes the shortest form: a multi-byte value never ends in 0x00.
    if ((lengths > 1) & (buf[ends] == 0)).any():
        raise PayloadError("varint: a value with a redundant final byte (not canonical)")
    pos = np.arange(buf.size) - np.repeat(starts, lengths)
    parts = (buf & 0x7F).astype(np.uint64) << (np.uint64(7) * pos.astype(np.uint64))
    return np.add.reduceat(parts, starts)


def pack_bits(bits: np.ndarray) -> bytes:
    return np.packbits(np.asarray(bits, dtype=np.uint8), bitorder="little").tobytes()


def unpack_bits(data: bytes | memoryview, n: int) -> np.ndarray:
    buf = np.frombuffer(data, dtype=np.uint8)
    if buf.size != (n + 7) // 8:
        raise PayloadError(f"bitmap: {buf.size} bytes for {n} bits, expected {(n + 7) // 8}")
    bits = np.unpackbits(buf, bitorder="little")
    if bits[n:].any():
        raise PayloadError("bitmap: padding bits are set (corrupt)")
    return bits[:n]


def varint_size(values: np.ndarray) -> int:
    """Bytes :func:`varint_encode` takes for ``values`` (without encoding them)."""
    v = np.asarray(values, dtype=np.uint64)
    n = v.size
    for b in range(1, _MAX_VARINT_BYTES):
        n += int(np.count_nonzero(v >= (np.uint64(1) << np.uint64(7 * b))))
    return n


def encode_indices(idx: np.ndarray, d: int) -> tuple[int, bytes]:
    """The smaller of varint gaps and a bitmap for sorted, distinct ``idx`` in ``[0, d)``.

    >>> encode_indices(np.array([2, 5, 6]), 1000)  # gaps 2, 2, 0: three bytes
    (0, b'\\x02\\x02\\x00')
    >>> encode_indices(np.arange(0, 16, 2), 16)     # every other entry: a 2-byte bitmap
    (1, b'UU')
    >>> decode_indices(0, b'\\x02\\x02\\x00', 3, 1000).tolist()
    [2, 5, 6]
    """
    idx = np.asarray(idx, dtype=np.int64)
    gaps = np.diff(idx, prepend=-1) - 1
    varint = varint_encode(gaps)
    if len(varint) <= (d + 7) // 8:
        return INDEX_VARINT, varint
    bits = np.zeros(d, dtype=np.uint8)
    bits[idx] = 1
    return INDEX_BITMAP, pack_bits(bits)


def decode_indices(kind: int, data: bytes | memoryview, k: int, d: int) -> np.ndarray:
    """Inverse of :func:`encode_indices`; checks count, order, range and that the
    coding is the one the encoder chooses."""
    if k > d:
        raise PayloadError(f"indices: {k} indices for d = {d}")
    nbitmap = (d + 7) // 8
    if kind == INDEX_VARINT:
        if len(data) > nbitmap:
            raise PayloadError(f"indices: {len(data)} varint bytes where a bitmap takes "
                               f"{nbitmap} (not canonical)")
        raw = varint_decode(data, k)
        if k and int(raw.max()) >= d:
            raise PayloadError(f"indices: a gap of {int(raw.max())} exceeds d = {d}")
        gaps = raw.astype(np.int64)
        idx = np.cumsum(gaps + 1) - 1
        if k and idx[-1] >= d:
            raise PayloadError(f"indices: index {int(idx[-1])} out of range for d = {d}")
        return idx
    if kind == INDEX_BITMAP:
        bits = unpack_bits(data, d)
        idx = np.flatnonzero(bits)
        if idx.size != k:
            raise PayloadError(f"bitmap: {idx.size} bits set, expected {k}")
        if varint_size(np.diff(idx, prepend=-1) - 1) <= nbitmap:
            raise PayloadError("indices: a bitmap where varint gaps are no longer "
                               "(not canonical)")
        return idx
    raise PayloadError(f"indices: unknown index coding {kind}")
