"""Per-client state: one ``[N, d]`` buffer per field.

Error-feedback residuals, FLARE accumulators, SCAFFOLD control variates and
Ditto's personal models are rows of such buffers, so that state scales to
many clients: no per-client Python objects. A buffer is

- ``dense``: a tensor in RAM;
- ``memmap``: a file on disk, for ``N·d`` too large for RAM. Rows are read
  and written with positional I/O (``pread``/``pwrite``), not through a
  mapping: the operating system's page cache holds what it can, but none of
  it counts as the process's resident memory, so a 4 GB store runs in the
  resident memory of one cohort's rows (benchmarks/results.md). The file is
  sparse: rows never written cost no disk and read as zeros.

``auto`` picks memmap when the buffer exceeds ``memmap_above_mb``. Storage may
be float16 to halve the footprint; rows are always gathered as the compute
dtype. Rows never written read as zeros. Only the rows of the cohort are
gathered and scattered each round; a client that is not sampled keeps its row
untouched.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

__all__ = ["ClientStateStore", "FieldSpec"]


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
        storage: ``dense``, ``memmap`` or ``auto``.
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
        storage: Literal["auto", "dense", "memmap"] = "auto",
        dtype: Literal["float32", "float16"] = "float32",
        directory: str | Path | None = None,
        memmap_above_mb: float = 1024.0,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.num_clients = num_clients
        self.specs = dict(fields)
        self.dtype = dtype
        self.compute_dtype = compute_dtype
        self.directory = Path(directory) if directory is not None else None
        self._buf: dict[str, np.ndarray | _RowFile] = {}
        self.kinds: dict[str, str] = {}
        itemsize = np.dtype(_NP[dtype]).itemsize
        for name, spec in self.specs.items():
            nbytes = num_clients * spec.size * itemsize
            kind = storage
            if kind == "auto":
                kind = "memmap" if nbytes > memmap_above_mb * 2**20 else "dense"
            if kind == "memmap" and self.directory is None:
                # No run directory (an in-memory run): fall back to a temporary file.
                import tempfile

                self.directory = Path(tempfile.mkdtemp(prefix="fedloom-state-"))
            self.kinds[name] = kind
            shape = (num_clients, spec.size)
            if kind == "dense":
                self._buf[name] = np.zeros(shape, dtype=_NP[dtype])
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
        rows = buf.get(idx) if isinstance(buf, _RowFile) else np.asarray(buf[idx])
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
        if isinstance(buf, _RowFile):
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
        and the dict holds ``{"file": name, "bytes": n, "sha256": digest}``: the
        copy streams through the file (1 MB chunks read with ``read``, all-zero
        chunks left as holes), so a 4 GB store is checkpointed without 4 GB of
        resident memory; the SHA-256 of the file's bytes (holes read as zeros)
        is computed on the same pass and checked by :meth:`load_state_dict`, so
        a damaged snapshot is reported, never loaded.
        """
        out: dict[str, np.ndarray | dict[str, Any]] = {}
        for name, b in self._buf.items():
            if isinstance(b, _RowFile) and snapshot_dir is not None:
                b.flush()
                dst = Path(snapshot_dir) / f"state-{name}-{tag}.bin"
                digest = _sparse_copy(b.path, dst)
                out[name] = {"file": dst.name, "bytes": b.nbytes, "sha256": digest}
            elif isinstance(b, _RowFile):
                out[name] = b.get(np.arange(b.shape[0]))
            else:
                out[name] = np.array(b, copy=True)
        return out

    def load_state_dict(self, state: Mapping[str, np.ndarray | dict[str, Any]],
                        snapshot_dir: Path | None = None) -> None:
        """Restore every buffer from :meth:`state_dict`'s output.

        Raises ``ValueError`` (one line naming the field or the snapshot file)
        for other fields, a wrong shape, or a snapshot file that is missing, not
        a file, of the wrong size or whose content does not match its digest
        (snapshots written before the digest existed are checked for size only).
        A buffer is replaced only by a snapshot that passed these checks.
        """
        if not isinstance(state, Mapping) or set(state) != set(self._buf):
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(
                f"state store: checkpoint holds fields {got}, expected {self.fields}"
            )
        for name, arr in state.items():
            buf = self._buf[name]
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
                expect = arr.get("sha256")
                if isinstance(buf, _RowFile):
                    buf.flush()
                    _sparse_copy(src, buf.path, expect=expect)
                    buf.reopen()
                else:
                    raw = src.read_bytes()
                    if expect is not None and hashlib.sha256(raw).hexdigest() != expect:
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


def _sparse_copy(src: Path, dst: Path, chunk: int = 1 << 20, expect: str | None = None) -> str:
    """Copy ``src`` to ``dst`` (written to a temporary name, fsynced, renamed),
    leaving all-zero chunks as holes; return the SHA-256 of ``src``'s bytes.

    With ``expect``, a copy whose digest differs raises ``ValueError`` naming
    ``src`` and ``dst`` is left as it was.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp")
    size = src.stat().st_size
    h = hashlib.sha256()
    try:
        with open(src, "rb") as fi, open(tmp, "wb") as fo:
            while True:
                block = fi.read(chunk)
                if not block:
                    break
                h.update(block)
                if block.count(0) == len(block):
                    fo.seek(len(block), 1)
                else:
                    fo.write(block)
            fo.truncate(size)
            fo.flush()
            os.fsync(fo.fileno())
        digest = h.hexdigest()
        if expect is not None and digest != expect:
            raise ValueError(_DAMAGED.format(src=src))
        tmp.replace(dst)
    except BaseException:
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
        with open(self.path, "wb") as f:  # a sparse file of the full size: rows read 0
            f.truncate(self.nbytes)
        self.reopen()

    def reopen(self) -> None:
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
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

    def __del__(self) -> None:
        fd = getattr(self, "fd", None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:  # pragma: no cover
                pass
