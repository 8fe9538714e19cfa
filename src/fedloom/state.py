"""Per-client state: one ``[N, d]`` buffer per field.

Error-feedback residuals, FLARE accumulators, SCAFFOLD control variates and
Ditto's personal models are rows of such buffers, so that state scales to
many clients: no per-client Python objects. A buffer is

- ``dense``: a tensor in RAM;
- ``lazy``: rows in RAM made when first written (a dict from client to row):
  a population of millions costs, and checkpoints, the rows written so far;
- ``memmap``: a file on disk, for ``N·d`` too large for RAM. Rows are read
  and written with positional I/O (``pread``/``pwrite``), not through a
  mapping: the operating system's page cache holds what it can, but none of
  it counts as the process's resident memory, so a 4 GB store runs in the
  resident memory of one cohort's rows (benchmarks/results.md). The file is
  sparse: rows never written cost no disk and read as zeros, and nothing
  reads or writes them: the file is created by ``truncate`` (no zero fill) and
  a checkpoint copies and hashes only the parts of it that hold data
  (:meth:`ClientStateStore.state_dict`), so 10,000 clients × 1M parameters
  (40 GB of float32) cost the disk, time and memory of the rows written.

``auto`` picks memmap above ``memmap_above_mb``, else lazy above :data:`LAZY_ABOVE`
clients, else dense (the same numbers; where rows live differs). Storage may be
float16; rows are gathered as the compute dtype and read as zeros until written.
Only the cohort's rows are gathered and scattered each round.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from fedloom.files import new_tmp

__all__ = ["LAZY_ABOVE", "ClientStateStore", "FieldSpec"]

# auto: more clients than this keep lazy rows in RAM (dense below: every run before
# populations, up to 10,000 clients, keeps its store and checkpoint layout)
LAZY_ABOVE = 65_536


@dataclass(frozen=True)
class FieldSpec:
    """One per-client field of ``size`` entries (usually ``d``)."""

    size: int


_NP = {"float32": np.float32, "float16": np.float16}


class ClientStateStore:
    """``fields[name]`` is an ``[N, size]`` buffer.

    Args:
        num_clients: N.
        fields: name → :class:`FieldSpec`.
        storage: ``dense``, ``lazy``, ``memmap`` or ``auto``.
        dtype: storage dtype, ``float32`` or ``float16``.
        directory: where memmap files go (required for memmap).
        memmap_above_mb: threshold of ``auto``.
        compute_dtype: the dtype rows are gathered as.
    """

    def __init__(
        self,
        num_clients: int,
        fields: Mapping[str, FieldSpec],
        *,
        storage: Literal["auto", "dense", "lazy", "memmap"] = "auto",
        dtype: Literal["float32", "float16"] = "float32",
        directory: str | Path | None = None,
        memmap_above_mb: float = 1024.0,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.num_clients = num_clients
        self.specs = dict(fields)
        self.storage, self.memmap_above_mb = storage, memmap_above_mb
        self.dtype = dtype
        self.compute_dtype = compute_dtype
        self.directory = Path(directory) if directory is not None else None
        self._buf: dict[str, np.ndarray | _RowFile | _LazyRows] = {}
        self.kinds: dict[str, str] = {}
        itemsize = np.dtype(_NP[dtype]).itemsize
        for name, spec in self.specs.items():
            nbytes = num_clients * spec.size * itemsize
            kind = storage
            if kind == "auto":
                kind = ("memmap" if nbytes > memmap_above_mb * 2**20
                        else "lazy" if num_clients > LAZY_ABOVE else "dense")
            if kind == "memmap" and self.directory is None:
                # No run directory (an in-memory run): fall back to a temporary file.
                import tempfile

                self.directory = Path(tempfile.mkdtemp(prefix="fedloom-state-"))
            self.kinds[name] = kind
            shape = (num_clients, spec.size)
            if kind == "dense":
                self._buf[name] = np.zeros(shape, dtype=_NP[dtype])
            elif kind == "lazy":
                self._buf[name] = _LazyRows(shape, np.dtype(_NP[dtype]))
            else:
                assert self.directory is not None
                if self.directory.exists() and not self.directory.is_dir():
                    # e.g. RUN/state replaced by a file: one line naming it, not a traceback
                    raise ValueError(f"{self.directory}: is not a directory (memory-mapped "
                                     "client state lives there)")
                self.directory.mkdir(parents=True, exist_ok=True)
                path = self.directory / f"state-{name}.bin"
                self._buf[name] = _RowFile(path, shape, np.dtype(_NP[dtype]))

    @property
    def fields(self) -> list[str]:
        return list(self.specs)

    def blank(self) -> ClientStateStore:
        """A new store of the same fields and settings, no row written (every row
        zero). Memmap buffers in the same directory take over its file names: each
        store reads and writes the file it opened (its descriptor), so one replaced
        at its name by another's keeps its rows (see :meth:`state_dict`)."""
        return ClientStateStore(self.num_clients, self.specs, storage=self.storage,
                                dtype=self.dtype, directory=self.directory,
                                memmap_above_mb=self.memmap_above_mb,
                                compute_dtype=self.compute_dtype)

    def copy(self) -> ClientStateStore:
        """A new store holding this one's rows (:meth:`blank`, then every row copied;
        a memmap buffer's written parts only)."""
        new = self.blank()
        for name, b in self._buf.items():
            dst = new._buf[name]
            if isinstance(dst, _RowFile):  # the same kind as b: the same sizes and settings
                assert isinstance(b, _RowFile)
                b.flush()
                _sparse_copy(b.fd, dst.path)
                dst.reopen()
            elif isinstance(b, _LazyRows):
                new._buf[name] = b.copy()
            else:
                assert isinstance(dst, np.ndarray)  # the same kind as b: dense
                dst[...] = b.get(np.arange(b.shape[0])) if isinstance(b, _RowFile) else b
        return new

    def _check(self, name: str, ids: torch.Tensor | Iterable[int]) -> np.ndarray:
        if name not in self._buf:
            raise KeyError(f"state store: no field {name!r} (fields: {self.fields})")
        raw = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        idx = np.asarray(raw, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_clients):
            raise IndexError(f"state store: client id out of range [0, {self.num_clients})")
        return idx

    def gather(self, name: str, ids: torch.Tensor | Iterable[int]) -> torch.Tensor:
        """Rows of ``ids`` as a fresh ``[m, size]`` tensor of the compute dtype."""
        idx = self._check(name, ids)
        buf = self._buf[name]
        rows = buf.get(idx) if isinstance(buf, _RowFile | _LazyRows) else np.asarray(buf[idx])
        return torch.from_numpy(rows).to(self.compute_dtype)

    def scatter(self, name: str, ids: torch.Tensor | Iterable[int], rows: torch.Tensor) -> None:
        """Write ``rows`` to the clients ``ids``; other rows stay untouched."""
        idx = self._check(name, ids)
        if tuple(rows.shape) != (idx.size, self.specs[name].size):
            raise ValueError(
                f"state store: rows of shape {tuple(rows.shape)} for {idx.size} clients of "
                f"field {name!r} (size {self.specs[name].size})"
            )
        arr = rows.detach().cpu().numpy().astype(_NP[self.dtype])
        buf = self._buf[name]
        if isinstance(buf, _RowFile | _LazyRows):
            buf.set(idx, arr)
        else:
            buf[idx] = arr

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buf.values())

    def flush(self) -> None:
        for b in self._buf.values():
            if isinstance(b, _RowFile):
                b.flush()

    # ----------------------------------------------------------- checkpointing
    def state_dict(self, snapshot_dir: Path | None = None,
                   tag: str = "") -> dict[str, np.ndarray | dict[str, Any]]:
        """A snapshot of every buffer, so that a resume is exact.

        Dense buffers are copied into the dict. A memmap buffer is copied, when
        ``snapshot_dir`` is given, to the file ``snapshot_dir/state-NAME-TAG.bin``
        and the dict holds ``{"file": name, "bytes": n, "chunks_sha256": digest}``.
        The copy reads only the parts of the file that hold data (``SEEK_DATA``;
        1 MB pieces) and leaves all-zero pieces as holes, so its cost in time,
        resident memory and disk is that of the rows written so far, whatever
        ``N``: the rows of clients never sampled are never read. The digest
        (:func:`_chunk_digest`: SHA-256 over the size and the non-zero pieces
        with their offsets) is computed on the same pass and checked by
        :meth:`load_state_dict`, so a damaged snapshot is reported, never loaded.
        Without ``snapshot_dir`` every row is read into the dict (small stores).
        """
        out: dict[str, np.ndarray | dict[str, Any]] = {}
        for name, b in self._buf.items():
            if isinstance(b, _RowFile) and snapshot_dir is not None:
                b.flush()
                dst = Path(snapshot_dir) / f"state-{name}-{tag}.bin"
                # from its descriptor: its name may be another store's file by now
                digest = _sparse_copy(b.fd, dst)
                out[name] = {"file": dst.name, "bytes": b.nbytes, "chunks_sha256": digest}
            elif isinstance(b, _RowFile):
                out[name] = b.get(np.arange(b.shape[0]))
            elif isinstance(b, _LazyRows):
                ids = b.ids()
                out[name] = {"lazy_ids": ids, "lazy_rows": b.get(ids)}
            else:
                out[name] = np.array(b, copy=True)
        return out

    def load_state_dict(self, state: Mapping[str, np.ndarray | dict[str, Any]],
                        snapshot_dir: Path | None = None) -> None:
        """Restore every buffer from :meth:`state_dict`'s output.

        Raises ``ValueError`` (one line naming the field or the snapshot file)
        for other fields, a wrong shape, or a snapshot file that is missing, not
        a file, of the wrong size or whose content does not match its digest
        (snapshots written before the digest existed are checked for size only;
        those of the fedloom before the chunk digest by the SHA-256 of the whole
        file, which reads it all).
        A buffer is replaced only by a snapshot that passed these checks.
        """
        if not isinstance(state, Mapping) or set(state) != set(self._buf):
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(
                f"state store: checkpoint holds fields {got}, expected {self.fields}"
            )
        for name, arr in state.items():
            buf = self._buf[name]
            if isinstance(buf, _LazyRows):
                buf.load(name, arr)
                continue
            if isinstance(arr, dict):
                if snapshot_dir is None:
                    raise ValueError(f"state store: field {name!r} is in a snapshot file; "
                                     "give its directory")
                if not isinstance(arr.get("file"), str) or Path(arr["file"]).name != arr["file"]:
                    raise ValueError(f"state store: field {name!r} names no snapshot file")
                src = Path(snapshot_dir) / arr["file"]
                want = buf.nbytes
                if not src.is_file() or src.stat().st_size != want:
                    what = "a directory" if src.is_dir() else (
                        f"{src.stat().st_size} bytes" if src.is_file() else "missing")
                    raise ValueError(f"{src}: state snapshot missing or not {want} bytes "
                                     f"({what})")
                # chunks_sha256: written by this fedloom; sha256 (the whole file's
                # bytes): by the one before, checked by reading the whole file
                expect, full = arr.get("chunks_sha256"), arr.get("sha256")
                if isinstance(buf, _RowFile):
                    buf.flush()
                    _sparse_copy(src, buf.path, expect=expect, expect_full=full)
                    buf.reopen()
                else:
                    raw = src.read_bytes()
                    if ((expect is not None and _chunk_digest(len(raw), _bytes_chunks(raw))
                         != expect) or
                            (full is not None and hashlib.sha256(raw).hexdigest() != full)):
                        raise ValueError(_DAMAGED.format(src=src))
                    buf[...] = np.frombuffer(raw, dtype=buf.dtype).reshape(buf.shape)
                continue
            if not isinstance(arr, np.ndarray) or arr.shape != buf.shape:
                shape = arr.shape if isinstance(arr, np.ndarray) else type(arr).__name__
                raise ValueError(f"state store: field {name!r} has shape {shape} in the "
                                 f"checkpoint, expected {buf.shape}")
            if isinstance(buf, _RowFile):
                buf.set(np.arange(buf.shape[0]), arr)
            else:
                buf[...] = arr


_DAMAGED = "{src}: state snapshot damaged (its content does not match its SHA-256 digest)"

# Snapshot digests cover the file in chunks of this many bytes (fixed: it is part of
# what the digest means, so a snapshot written with it is checked with it).
_CHUNK = 1 << 20
_DIGEST_TAG = b"fedloom-state-chunks-1"
_PART = 1 << 16


def _pread(fd: int, n: int, offset: int) -> bytes:
    """``n`` bytes of ``fd`` at ``offset`` (fewer at the end of the file); every
    read of a snapshot goes through here."""
    return os.pread(fd, n, offset)


def _data_chunks(fd: int, size: int, chunk: int = _CHUNK) -> Iterator[int]:
    """Indices ``c`` (increasing) of the ``chunk``-sized pieces ``[c·chunk,
    (c+1)·chunk)`` of the file that hold data, found with ``SEEK_DATA`` /
    ``SEEK_HOLE``: the pieces that are holes (rows never written) are never
    read. A file system that reports no holes reports the whole file as data
    (Linux's generic ``lseek``), and then every piece is yielded."""
    seek_data, seek_hole = getattr(os, "SEEK_DATA", None), getattr(os, "SEEK_HOLE", None)
    if seek_data is None or seek_hole is None:  # pragma: no cover - not Linux/BSD/macOS
        yield from range((size + chunk - 1) // chunk)
        return
    pos, last = 0, -1
    while pos < size:
        try:
            start = os.lseek(fd, pos, seek_data)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no data after pos
                return
            if e.errno == errno.EINVAL:  # pragma: no cover - lseek without SEEK_DATA
                yield from range(last + 1, (size + chunk - 1) // chunk)
                return
            raise
        end = min(os.lseek(fd, start, seek_hole), size)
        for c in range(max(start // chunk, last + 1), (end + chunk - 1) // chunk):
            yield c
            last = c
        pos = max(end, (last + 1) * chunk)


def _chunk_digest(size: int, blocks: Iterable[tuple[int, bytes]]) -> str:
    """SHA-256 of a state file of ``size`` bytes given its non-zero ``chunk``-sized
    pieces ``(index, bytes)`` in increasing order: of the tag, the size (8 bytes,
    little-endian) and, for each piece that is not all zeros, its index (8 bytes)
    and its bytes. All-zero pieces, holes or written zeros alike, contribute
    nothing, so the digest is a function of the content alone (not of where the
    file system keeps holes) and costs a pass over the written rows only; the
    content is determined by the size and the listed pieces, so any change to it
    changes what is hashed."""
    h = hashlib.sha256(_DIGEST_TAG)
    h.update(size.to_bytes(8, "little"))
    for c, block in blocks:
        if block.count(0) != len(block):
            h.update(c.to_bytes(8, "little"))
            h.update(block)
    return h.hexdigest()


def _bytes_chunks(raw: bytes, chunk: int = _CHUNK) -> Iterator[tuple[int, bytes]]:
    for c in range(0, (len(raw) + chunk - 1) // chunk):
        yield c, raw[c * chunk:(c + 1) * chunk]


def _sparse_copy(src: Path | int, dst: Path, expect: str | None = None,
                 expect_full: str | None = None) -> str:
    """Copy ``src`` (a path, or an open descriptor: read with positional I/O, left
    open) to ``dst`` (written to a temporary name, fsynced, renamed); return
    :func:`_chunk_digest` of ``src``.

    Only the pieces of ``src`` that hold data are read (:func:`_data_chunks`)
    and only their non-zero 64 KB parts are written: the rows no client ever wrote stay
    holes in both files and are never touched, so the cost is that of the
    written rows, not of the file's size (a 40 GB store of which 2 GB were
    written costs 2 GB of reading). With ``expect``, a copy whose digest differs
    raises ``ValueError`` naming ``src``, and ``dst`` is left as it was.
    ``expect_full`` is the digest of snapshots written before the chunk digest
    (SHA-256 of every byte of the file, holes read as zeros): checking it reads
    the whole file.
    """
    # a new file (O_EXCL), never one a link at a fixed temporary name points to
    fd, tmp = new_tmp(dst)
    fo = os.fdopen(fd, "wb")  # closed by the with below, or on the way out
    full = hashlib.sha256() if expect_full is not None else None
    try:
        fi = os.dup(src) if isinstance(src, int) else os.open(src, os.O_RDONLY)
        try:
            size = os.fstat(fi).st_size
            chunks = (range((size + _CHUNK - 1) // _CHUNK) if full is not None
                      else _data_chunks(fi, size))
            with fo:

                def pieces() -> Iterator[tuple[int, bytes]]:
                    for c in chunks:
                        block = _pread(fi, _CHUNK, c * _CHUNK)
                        if full is not None:
                            full.update(block)
                        if block.count(0) != len(block):
                            # written in 64 KB parts, all-zero ones left as holes: a
                            # piece the end of a row shares with a hole costs the row only
                            for s in range(0, len(block), _PART):
                                part = block[s:s + _PART]
                                if part.count(0) != len(part):
                                    fo.seek(c * _CHUNK + s)
                                    fo.write(part)
                        yield c, block

                digest = _chunk_digest(size, pieces())
                fo.truncate(size)
                fo.flush()
                os.fsync(fo.fileno())
        finally:
            os.close(fi)
        if (expect is not None and digest != expect) or (
                full is not None and full.hexdigest() != expect_full):
            raise ValueError(_DAMAGED.format(src=src))
        tmp.replace(dst)
    except BaseException:
        fo.close()
        tmp.unlink(missing_ok=True)
        raise
    return digest


class _RowFile:
    """An ``[N, size]`` array in a (sparse) file, read and written row by row with
    positional I/O; never mapped, so none of it is the process's resident memory."""

    def __init__(self, path: Path, shape: tuple[int, int], dtype: np.dtype) -> None:
        self.path = Path(path)
        self.shape = shape
        self.dtype = dtype
        self.itemsize = dtype.itemsize
        self.row_bytes = shape[1] * dtype.itemsize
        self.nbytes = shape[0] * self.row_bytes
        # A sparse file of the full size (rows read 0), new: what stood at the path is
        # unlinked, not truncated, so a link or a second name left there keeps its data.
        self.path.unlink(missing_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o644)
        try:
            os.ftruncate(fd, self.nbytes)
        finally:
            os.close(fd)
        self.reopen()

    def reopen(self) -> None:
        fd: int | None = getattr(self, "fd", None)  # none yet on the first open
        if fd is not None:
            os.close(fd)
        self.fd = os.open(self.path, os.O_RDWR)

    def get(self, idx: np.ndarray) -> np.ndarray:
        out = np.empty((len(idx), self.shape[1]), dtype=self.dtype)
        for j, i in enumerate(idx.tolist()):
            view = memoryview(out[j]).cast("B")
            got = os.preadv(self.fd, [view], int(i) * self.row_bytes)
            if got != self.row_bytes:
                raise OSError(f"{self.path}: short read of row {i}")
        return out

    def set(self, idx: np.ndarray, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        for j, i in enumerate(idx.tolist()):
            data = memoryview(rows[j]).cast("B")
            if os.pwrite(self.fd, data, int(i) * self.row_bytes) != self.row_bytes:
                raise OSError(f"{self.path}: short write of row {i}")

    def flush(self) -> None:
        os.fsync(self.fd)

    # bound here: at interpreter exit the module's globals (``os``) may be gone
    # before the last store is collected
    _close = staticmethod(os.close)

    def __del__(self) -> None:
        fd = getattr(self, "fd", None)
        if fd is not None:
            try:
                self._close(fd)
            except OSError:  # pragma: no cover
                pass


class _LazyRows:
    """An ``[N, size]`` array of which only the rows written exist: a dict from
    client to slot, slots in chunks of ``chunk`` rows made as they fill. Rows never
    written read as zeros; memory is that of the rows written (whatever ``N``)."""

    def __init__(self, shape: tuple[int, int], dtype: np.dtype, chunk: int = 1024) -> None:
        self.shape, self.dtype, self.chunk = shape, dtype, chunk
        self._slot: dict[int, int] = {}
        self._chunks: list[np.ndarray] = []

    @property
    def nbytes(self) -> int:
        return len(self._chunks) * self.chunk * self.shape[1] * self.dtype.itemsize

    def ids(self) -> np.ndarray:
        """The clients whose rows were written, sorted."""
        return np.array(sorted(self._slot), dtype=np.int64)

    def get(self, idx: np.ndarray) -> np.ndarray:
        out = np.zeros((len(idx), self.shape[1]), dtype=self.dtype)
        for j, i in enumerate(idx.tolist()):
            s = self._slot.get(i)
            if s is not None:
                out[j] = self._chunks[s // self.chunk][s % self.chunk]
        return out

    def set(self, idx: np.ndarray, rows: np.ndarray) -> None:
        for j, i in enumerate(idx.tolist()):  # in order: of a repeated id the last wins
            s = self._slot.get(i)
            if s is None:
                s = self._slot[i] = len(self._slot)
                if s // self.chunk == len(self._chunks):
                    self._chunks.append(np.zeros((self.chunk, self.shape[1]), self.dtype))
            self._chunks[s // self.chunk][s % self.chunk] = rows[j]

    def copy(self) -> _LazyRows:
        new = _LazyRows(self.shape, self.dtype, self.chunk)
        new._slot = dict(self._slot)
        new._chunks = [c.copy() for c in self._chunks]
        return new

    def load(self, name: str, state: object) -> None:
        """The rows of :meth:`ClientStateStore.state_dict` (``lazy_ids``, ``lazy_rows``),
        or of a dense ``[N, size]`` array (its non-zero rows); else one line."""
        if isinstance(state, np.ndarray) and state.shape == self.shape:
            ids = np.flatnonzero(np.any(state != 0, axis=1)).astype(np.int64)
            rows = state[ids]
        elif isinstance(state, Mapping) and set(state) == {"lazy_ids", "lazy_rows"}:
            ids, rows = state["lazy_ids"], state["lazy_rows"]
            ok = (isinstance(ids, np.ndarray) and isinstance(rows, np.ndarray)
                  and ids.ndim == 1 and rows.shape == (len(ids), self.shape[1])
                  and np.issubdtype(ids.dtype, np.integer)
                  and len(np.unique(ids)) == len(ids)
                  and (ids.size == 0 or (ids.min() >= 0 and ids.max() < self.shape[0])))
            if not ok:
                raise ValueError(f"state store: field {name!r} holds rows that are not "
                                 f"distinct clients of [0, {self.shape[0]}) with "
                                 f"{self.shape[1]} entries each")
        else:
            raise ValueError(f"state store: field {name!r} is not a lazy store's rows nor "
                             f"an array of shape {self.shape} in the checkpoint")
        self._slot, self._chunks = {}, []
        self.set(np.asarray(ids, dtype=np.int64), np.asarray(rows, dtype=self.dtype))
