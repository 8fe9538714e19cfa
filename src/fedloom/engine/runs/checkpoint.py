"""Run-directory files: atomic writes, checked checkpoints, the run lock.

- Files are written to a temporary name, fsynced and renamed over the target: a
  killed run leaves the previous file or the new one (:func:`remove_leftovers`
  deletes temporary files); a failed write raises :class:`RunDirWriteError`.
- A checkpoint is one header line, ``fedloom-checkpoint 3 sha256=<hex>
  bytes=<n>``, then the ``torch.save`` bytes: :func:`load_checkpoint` checks the
  header, length and digest before decoding, so damage is a
  :class:`CheckpointError`, never a different model; ``keep_previous`` keeps the
  one before.
- Reading a checkpoint runs no code: tensors and plain data only
  (:mod:`fedloom.plain`), read with ``torch.load(weights_only=True)``; older
  formats through a restricted loader. Files that are not regular files are
  never read, nor is one whose load cannot fit in the memory left
  (:func:`_check_memory`); running out of memory while loading is damage too: a
  :class:`CheckpointError`, so a resume falls back to ``prev.pt``.
- :func:`lock_run_dir` writes only into a run directory (new, empty or marked
  ``RUN/.fedloom-run``) and holds an exclusive ``flock`` on ``RUN/.lock`` for the
  run's life (:class:`RunDirError` names the holder's pid). The lock file is
  opened without following a link and never truncated (:mod:`fedloom.files`).

Each guarantee in detail: docs/explanation/reliability.md (Run-directory files).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedloom.bounded import available_memory, size_text
from fedloom.files import (
    NotInPlace,
    file_kind,
    lock_pid_file,
    not_a_lock_file,
    replace_bytes,
    write_tmp,
)
from fedloom.plain import PlainDataError, decode, encode, registered_types

__all__ = [
    "CheckpointError",
    "RunDirError",
    "RunDirLock",
    "RunDirWriteError",
    "atomic_write_bytes",
    "atomic_write_json",
    "check_regular",
    "load_checkpoint",
    "lock_run_dir",
    "remove_leftovers",
    "save_checkpoint",
]

log = logging.getLogger("fedloom")

_MAGIC = b"fedloom-checkpoint"
_VERSION = 3
_LEGACY = 2  # pickled NumPy arrays and state dataclasses (read restricted)
_ZIP = b"PK\x03\x04"  # a bare torch.save file (no digest)
LOCK_FILE = ".lock"
MARKER_FILE = ".fedloom-run"
_MARKER_TEXT = b"fedloom run directory\n"


class RunDirError(ValueError):
    """A run directory, or a file in it, that cannot be used; one line naming it."""


class CheckpointError(RunDirError):
    """A checkpoint that is missing, damaged or not this run's; one line naming it."""


class RunDirWriteError(RunDirError):
    """A file of the run directory that could not be written; one line naming it.
    The file it was to replace is as it was. ``full``: for want of space (a full
    disk, a quota, a file-size limit)."""

    full = False


def _cannot_write(path: Path, e: OSError) -> RunDirWriteError:
    err = RunDirWriteError(f"{path}: cannot be written ({e.strerror or type(e).__name__})")
    err.full = e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    return err


def _not_regular(path: Path, mode: int, what: str) -> str:
    kind = file_kind(mode)
    if stat.S_ISDIR(mode):  # the usual damage: say it as before
        return f"{path}: is a directory, not {what}"
    try:
        link = f"a link to {os.readlink(path)}, " if path.is_symlink() else ""
    except OSError:  # pragma: no cover (replaced meanwhile)
        link = ""
    return f"{path}: is {link}{kind}, not a regular file (never read as {what})"


def check_regular(path: Path, what: str, error: type[RunDirError] = RunDirError) -> None:
    """Raise ``error`` (one line naming ``path``) unless ``path`` is a regular
    file, after following links: a link to ``/dev/zero``, a FIFO or a device is
    never read (reading one never ends, or blocks). A missing file passes (the
    caller's read names it)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        raise error(_not_regular(path, mode, what))


def _fsync_dir(path: Path) -> None:
    # The renames are durable only once the folder's entry is on disk.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover (a folder we just wrote into)
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover (some file systems refuse fsync on a folder)
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically; :class:`RunDirWriteError` naming
    ``path`` when it cannot be written (the old file is left as it was)."""
    try:
        replace_bytes(path, data)
    except OSError as e:
        raise _cannot_write(path, e) from None


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def save_checkpoint(path: Path, state: dict[str, Any], *,
                    keep_previous: Path | None = None) -> None:
    """Write ``state`` to ``path`` with its digest, atomically.

    With ``keep_previous``, the file at ``path`` (if any) becomes
    ``keep_previous`` first: hard-linked to a temporary name that is renamed
    over ``keep_previous``, so ``path`` itself never goes missing. Every step
    is a link or rename of a complete file: a kill at any point leaves ``path``
    intact (the old checkpoint or the new one) and ``keep_previous`` intact (the
    one before, or the old one). Where hard links are not supported the old
    file is renamed instead; a kill between the two renames then leaves only
    ``keep_previous``, which a resume falls back to.
    """
    try:
        plain = encode(state, "checkpoint")
    except PlainDataError as e:  # a bug or a plug-in's state: nothing is written
        raise CheckpointError(f"{path}: not written: {e}") from None
    buf = io.BytesIO()
    torch.save(plain, buf)
    payload = buf.getvalue()
    header = (f"{_MAGIC.decode()} {_VERSION} sha256={hashlib.sha256(payload).hexdigest()} "
              f"bytes={len(payload)}\n").encode()
    try:
        _write_rotated(path, header + payload, keep_previous)
    except OSError as e:
        raise _cannot_write(path, e) from None
    _fsync_dir(path.parent)


def _write_rotated(path: Path, data: bytes, keep_previous: Path | None) -> None:
    tmp = write_tmp(path, data)
    try:
        if keep_previous is not None and path.is_file():
            link = keep_previous.with_name(f".{keep_previous.name}.{secrets.token_hex(4)}.tmp")
            try:
                os.link(path, link)
            except OSError:  # a file system without hard links
                os.replace(path, keep_previous)
            else:
                os.replace(link, keep_previous)
                # rename() does nothing when both names are links to one file
                # (prev.pt already was last.pt: a kill right after this step).
                link.unlink(missing_ok=True)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read(path: Path) -> bytes:
    """The bytes of checkpoint ``path``: a regular file only (``O_NONBLOCK``: a
    FIFO is not waited on), and no more than its header says it holds."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        what = "a link to a missing file" if path.is_symlink() else "missing"
        raise CheckpointError(f"{path}: {what}") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(_not_regular(path, st.st_mode, "a checkpoint file"))
        head = _read_fd(fd, min(st.st_size, 256))
        expected = _declared_size(head)
        if expected is not None and expected != st.st_size:
            end = head.find(b"\n")
            raise CheckpointError(f"{path}: truncated or extended: {st.st_size - end - 1} bytes "
                                  f"of content, the header says {expected - end - 1}")
        _check_memory(path, st.st_size)
        return head + _read_fd(fd, st.st_size - len(head))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)


# Room for the rest of a load besides the file's bytes and its tensors: the decoder's
# working memory and the run's own allocations meanwhile.
_LOAD_HEADROOM = 64 * 2**20


def _check_memory(path: Path, size: int) -> None:
    """Refuse, unread, a checkpoint of ``size`` bytes whose load needs more than the
    memory this process can still take (:func:`~fedloom.bounded.available_memory`).
    The rule: a load holds twice the file at its peak (its bytes, then the tensors
    decoded from them; measured on a 200 MB checkpoint: 2.0x), plus
    ``_LOAD_HEADROOM``. A 4 GiB file (a sparse one whose header matches its size)
    under a 3 GiB address-space limit is refused here instead of reading until
    ``MemoryError``."""
    need = 2 * size + _LOAD_HEADROOM
    avail = available_memory()
    if avail is not None and need > avail:
        raise CheckpointError(f"{path}: {size} bytes: loading it takes about "
                              f"{size_text(need)} of memory and {size_text(avail)} is "
                              "available; refused unread")


def _read_fd(fd: int, n: int) -> bytes:
    """``n`` bytes from ``fd`` (fewer at its end)."""
    parts, left = [], n
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 24))
        if not chunk:
            break
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _declared_size(head: bytes) -> int | None:
    """The whole file's length by a well-formed header in ``head``, else ``None``
    (the file is then read as it is and :func:`_payload` says what is wrong)."""
    end = head.find(b"\n")
    fields = head[:end].split() if end > 0 else []
    if len(fields) != 4 or fields[0] != _MAGIC or not fields[3].startswith(b"bytes="):
        return None
    try:
        return end + 1 + int(fields[3].removeprefix(b"bytes="))
    except ValueError:
        return None


def _payload(path: Path, data: bytes) -> tuple[bytes, int | None]:
    """The ``torch.save`` bytes of a checkpoint file and its format (``None``: a
    bare ``torch.save`` file, not verified)."""
    if not data:
        raise CheckpointError(f"{path}: empty file (0 bytes)")
    if data.startswith(_ZIP):
        return data, None
    if not data.startswith(_MAGIC):
        raise CheckpointError(f"{path}: not a fedloom checkpoint (no checkpoint header)")
    end = data.find(b"\n", 0, 256)
    fields = data[:end].split() if end > 0 else []
    try:
        if len(fields) != 4 or fields[0] != _MAGIC:
            raise ValueError
        version = int(fields[1])
        digest = fields[2].removeprefix(b"sha256=").decode("ascii")
        size = int(fields[3].removeprefix(b"bytes="))
        if len(digest) != 64 or not fields[2].startswith(b"sha256="):
            raise ValueError
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: damaged checkpoint header") from None
    if version not in (_VERSION, _LEGACY):
        raise CheckpointError(f"{path}: checkpoint format {version}; this fedloom reads "
                              f"formats {_LEGACY} and {_VERSION}")
    payload = data[end + 1:]
    if len(payload) != size:
        raise CheckpointError(f"{path}: truncated or extended: {len(payload)} bytes of content, "
                              f"the header says {size}")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"{path}: content does not match its SHA-256 digest (the file is "
                              "damaged)")
    return payload, version


def _legacy_globals() -> list[Any]:
    """What a format-2 or bare file may name: NumPy's array and scalar rebuilders,
    its dtypes, and the registered state dataclasses; no function that runs code
    of the file's choosing."""
    from numpy._core import multiarray  # numpy >= 2: where its pickles point

    dtypes = {type(np.dtype(c)) for c in np.typecodes["All"] if c not in "O"}
    return [multiarray._reconstruct, multiarray.scalar, np.ndarray, np.dtype, *dtypes,
            *registered_types()]


def _unsafe_name(e: Exception) -> str | None:
    """The class or function a restricted load refused, from torch's message."""
    text = str(e)
    for marker in ("Unsupported global: GLOBAL ", "unsupported GLOBAL "):
        if marker in text:
            return text.split(marker, 1)[1].split()[0].rstrip(".,")
    return None


def _load_payload(path: Path, payload: bytes, version: int | None) -> Any:
    """Decode ``payload`` with ``torch.load(weights_only=True)``: nothing the file
    names is called (see the module docstring)."""
    try:
        if version == _VERSION:
            return decode(torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True),
                          "checkpoint")
        with torch.serialization.safe_globals(_legacy_globals()):
            return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except PlainDataError as e:
        raise CheckpointError(f"{path}: cannot be decoded ({e})") from None
    except MemoryError:  # not the file's content: load_checkpoint says so
        raise
    except Exception as e:  # a damaged pickle can raise almost anything
        name = _unsafe_name(e)
        if name is not None:
            raise CheckpointError(
                f"{path}: names {name}, which a checkpoint never holds; refused unread (a "
                "pickled object can run code when loaded: checkpoints hold tensors, arrays "
                "and registered state types only)") from None
        msg = str(e).strip().splitlines()
        raise CheckpointError(f"{path}: cannot be decoded ({type(e).__name__}"
                              f"{': ' + msg[0][:120] if msg else ''})") from None


def load_checkpoint(path: Path, required: Iterable[str] = ()) -> dict[str, Any]:
    """The state dict saved by :func:`save_checkpoint`, checked against its digest.

    Raises :class:`CheckpointError` (one line naming ``path``) for a missing,
    unreadable, empty, truncated, damaged or undecodable file, one that is a
    directory, one too large for the memory left (before reading it, or on a
    ``MemoryError`` while loading it), or one whose dict lacks a key of ``required``.
    """
    path = Path(path)
    try:
        payload, version = _payload(path, _read(path))
        state = _load_payload(path, payload, version)
    except MemoryError:  # the memory left was less than _check_memory was told
        raise CheckpointError(f"{path}: ran out of memory while loading it") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a checkpoint dict")
    missing = [k for k in required if k not in state]
    if missing:
        raise CheckpointError(f"{path}: missing keys {', '.join(map(repr, missing))}")
    if version is None:
        log.warning("%s: written without a digest (an older fedloom); loaded unchecked", path)
    return state


def remove_leftovers(folder: Path) -> list[Path]:
    """Delete the temporary files (``.NAME.*.tmp``) that a write killed before its
    rename left in ``folder``; return them. Call only while holding the run lock:
    another run's write in progress would look the same."""
    gone = []
    if folder.is_dir():
        for p in folder.glob(".*.tmp"):
            if p.is_file() or p.is_symlink():
                p.unlink(missing_ok=True)
                gone.append(p)
    return gone


class RunDirLock:
    """An exclusive ``flock`` on ``RUN/.lock``, held until :meth:`release`
    (or the process ends)."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd: int | None = fd
        self.path = path

    def release(self) -> None:
        # The file stays: unlinking it would let a third run lock a new file
        # while a second still holds the old one.
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _is_run_dir(run_dir: Path) -> bool | None:
    """Whether the existing directory ``run_dir`` is a run directory: ``True``
    when it is, or is empty (a lock file of an older fedloom aside) and so may
    become one, ``None`` for one of a fedloom from before the marker (it gets the
    marker only when resumed), ``False`` for any other."""
    names = {p.name for p in run_dir.iterdir()}
    marker = run_dir / MARKER_FILE
    if not names - {LOCK_FILE, MARKER_FILE} or (marker.is_file() and not marker.is_symlink()):
        return True
    return None if _is_run_dir_before_marker(run_dir) else False


def _is_run_dir_before_marker(run_dir: Path) -> bool:
    """``config.yaml`` with ``checkpoints/`` or ``metrics.jsonl``: what every run
    directory held after its first round (the names are rundir's)."""
    config, ckpt, metrics = (run_dir / n for n in ("config.yaml", "checkpoints", "metrics.jsonl"))
    return (config.is_file() and not config.is_symlink()
            and ((ckpt.is_dir() and not ckpt.is_symlink())
                 or (metrics.is_file() and not metrics.is_symlink())))


def _mark(run_dir: Path) -> None:
    """Write the marker (before the lock file: the directory is a run directory
    before fedloom puts anything else in it). ``O_EXCL``: a new file, never one a
    link there points to."""
    try:
        fd = os.open(run_dir / MARKER_FILE,
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:  # a racing run marked it first, or an earlier life did
        return
    try:
        os.write(fd, _MARKER_TEXT)
    finally:
        os.close(fd)


def lock_run_dir(run_dir: Path, resume: bool = False) -> tuple[RunDirLock, bool]:
    """Create ``run_dir`` if needed, mark it as a run directory and lock it;
    return the lock and whether this call created the folder.

    Raises :class:`RunDirError` when the folder cannot be created or opened, when
    it is an existing directory that is not a run directory (see the module
    docstring: nothing in it is touched), when ``RUN/.lock`` is a link, not a
    regular file, has a second name or holds something other than a pid (nothing
    is written: :func:`fedloom.files.lock_pid_file`), or when another process holds
    the lock (naming its pid).
    """
    lock = run_dir / LOCK_FILE
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(run_dir)
            created = True  # os.mkdir is atomic: of two racing runs one creates it
        except FileExistsError:
            created = False
        if not run_dir.is_dir():
            raise RunDirError(f"{run_dir}: exists and is not a directory")
        known = True if created else _is_run_dir(run_dir)
        if known is False:
            real = f" (a link to {run_dir.resolve()})" if run_dir.is_symlink() else ""
            raise RunDirError(
                f"{run_dir}: not a fedloom run directory{real}: it is not empty and holds "
                f"neither {MARKER_FILE} nor a run's config.yaml with checkpoints/ or "
                "metrics.jsonl; fedloom writes nothing into it (use another --out)")
        # A lock file fedloom could not write: refused before the marker goes in
        # (lock_pid_file checks again on the descriptor it opens).
        why = not_a_lock_file(lock)
        if why is not None:
            raise NotInPlace(why)
        if known or resume:
            _mark(run_dir)
        fd = lock_pid_file(lock, lambda pid: RunDirError(
            f"{run_dir}: in use by another fedloom run (pid {pid}); wait for it to end or use "
            "another --out"))
    except NotInPlace as e:
        raise RunDirError(str(e)) from None
    except OSError as e:  # cannot create it, or a file system without locks
        raise RunDirError(f"{run_dir}: cannot use it as a run directory "
                          f"({e.strerror or type(e).__name__})") from None
    return RunDirLock(fd, lock), created
