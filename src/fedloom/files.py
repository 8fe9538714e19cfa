"""Files fedloom writes: replaced whole, or opened in place only when they are its own.

A path fedloom writes may hold what someone else put there: a link to a file of
value, a FIFO, a second name (hard link) of another file. So every write is one
of two kinds:

- **replaced** (checkpoints, configs, summaries, pages, figures, CSVs, a sweep's
  state): the bytes go to a new temporary file beside the path, are fsynced and
  renamed over it (:func:`replace_bytes`; :func:`write_output` for what a report
  writes, :func:`save_figure` for a plot). A link at the path is replaced by the
  new file; what it pointed to is never opened.
- **in place** (a lock file, an append-only log): :func:`open_in_place` opens the
  path with ``O_NOFOLLOW`` and never truncates it, and refuses
  (:class:`NotInPlace`, one line) a link, anything but a regular file, and a file
  with more than one name, whose other names' content the write would change.
  :func:`lock_pid_file` takes a run's or a sweep's lock on such a file.

Only the standard library: the Flower relay (:mod:`fedloom.integrations.warm`)
and the report commands use it without importing torch.
"""

from __future__ import annotations

import fcntl
import io
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["NotInPlace", "OutputError", "file_kind", "lock_pid_file", "new_tmp",
           "not_a_lock_file", "not_in_place", "open_in_place", "replace_bytes", "save_figure",
           "write_output", "write_tmp"]


class NotInPlace(ValueError):
    """A file fedloom would write in place that is a link, not a regular file, has a
    second name, or (a lock file) holds something other than a pid; one line naming
    it. Nothing was written to it."""


class OutputError(ValueError):
    """A page, figure, CSV or record that could not be written; one line naming it.
    The file it was to replace is as it was."""


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a link"))


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is (``st_mode``), in words."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refusal(path: Path, st: os.stat_result) -> str | None:
    """Why ``path`` (its ``lstat`` or, once opened, ``fstat``) must not be written in
    place, else None."""
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:  # pragma: no cover (replaced meanwhile)
            target = "?"
        return (f"{path}: is a link to {target}; fedloom never writes in place through a "
                "link (remove the link)")
    if not stat.S_ISREG(st.st_mode):
        return (f"{path}: is {file_kind(st.st_mode)}, not a regular file; fedloom never "
                "writes into it (remove it)")
    if st.st_nlink > 1:
        return (f"{path}: has {st.st_nlink} names (hard links), and writing it would change "
                "the others; fedloom leaves it as it is (remove this name)")
    return None


def not_in_place(path: Path) -> str | None:
    """Why the existing ``path`` may not be written in place (one line), else None (a
    regular file with one name, or nothing there)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return _refusal(path, st)


def open_in_place(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags)`` for writing a file in place, never through a link
    (``O_NOFOLLOW``), never blocking on a FIFO (``O_NONBLOCK``), never truncating
    (``O_TRUNC`` is refused: it would act before the checks). :class:`NotInPlace`
    when ``path`` is a link, not a regular file, or has a second name; other
    ``OSError`` as ``os.open`` raises them."""
    if flags & os.O_TRUNC:
        raise ValueError("open_in_place: O_TRUNC would cut the file before it is checked")
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError:
        why = not_in_place(path)  # ELOOP for a link, ENXIO for a FIFO without a reader
        if why is not None:
            raise NotInPlace(why) from None
        raise
    try:
        why = _refusal(path, os.fstat(fd))
        if why is not None:
            raise NotInPlace(why)
    except BaseException:
        os.close(fd)
        raise
    return fd


# A pid line: what fedloom writes into a lock file, and all it overwrites there.
_PID_BYTES = 32


def _not_a_pid(path: Path, head: bytes, size: int) -> str | None:
    """Why a lock file whose first bytes are ``head`` (of ``size``) is not one fedloom
    wrote (anything but empty or one pid line), else None."""
    if size <= _PID_BYTES and (not head.strip() or head.strip().isdigit()):
        return None
    return (f"{path}: holds {size} bytes that are not a pid, not a lock file fedloom "
            "wrote; fedloom leaves it as it is (move it away)")


def not_a_lock_file(path: Path) -> str | None:
    """Why the existing ``path`` cannot be fedloom's lock file (:func:`not_in_place`,
    or it holds anything but a pid), else None; read without following a link. For a
    check before anything else is written: :func:`lock_pid_file` checks again on the
    file it locks."""
    why = not_in_place(path)
    if why is not None:
        return why
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # gone, or replaced meanwhile: the lock's own open says what
        return None
    try:
        return _not_a_pid(path, os.pread(fd, _PID_BYTES + 1, 0), os.fstat(fd).st_size)
    finally:
        os.close(fd)


def lock_pid_file(path: Path, in_use: Callable[[str], Exception]) -> int:
    """Open the lock file ``path`` in place (creating it), take an exclusive,
    non-blocking ``flock`` on it and write this process's pid; return its
    descriptor, held until closed. The kernel drops the lock when the process ends
    in any way (``SIGKILL`` included), so a killed holder leaves no stale lock.

    Another process holding it: ``in_use(its pid)`` is raised. The file is never
    truncated: it is written only when it is empty or holds a pid (a lock file of
    an earlier holder), and the new pid line is padded to cover the old one.
    :class:`NotInPlace` for a link, anything but a regular file, a file with a
    second name, or one holding anything else; other ``OSError`` (no space, a file
    system without locks) as raised."""
    fd = open_in_place(path, os.O_RDWR | os.O_CREAT)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = os.pread(fd, _PID_BYTES, 0).decode("ascii", "replace").split()
            raise in_use(held[0] if held else "unknown") from None
        old = os.pread(fd, _PID_BYTES + 1, 0)
        why = _not_a_pid(path, old, os.fstat(fd).st_size)
        if why is not None:
            raise NotInPlace(why)
        line = str(os.getpid()).encode()
        os.pwrite(fd, line.ljust(max(len(line), len(old) - 1)) + b"\n", 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _umask() -> int:
    """The process's umask, read without changing it (``os.umask`` sets it, which
    races with other threads creating files); the usual 0o022 where it cannot be read."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def new_tmp(path: Path) -> tuple[int, Path]:
    """A new, empty temporary file beside ``path`` (``.NAME.*.tmp``, which
    :func:`fedloom.engine.runs.checkpoint.remove_leftovers` knows): its descriptor and path.
    ``mkstemp`` opens it with ``O_EXCL``, so never a file a link there points to.

    ``mkstemp`` makes the file 0600; it gets the mode ``open()`` would give a new
    file (``0666 & ~umask``: 0644 under the usual umask 022, 0640 under 027) so a
    run directory is readable by the group like the files written without a rename.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
    except BaseException:
        os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise
    return fd, Path(tmp)


def write_tmp(path: Path, data: bytes) -> Path:
    """``data`` in a fsynced temporary file beside ``path`` (:func:`new_tmp`); returns
    its path."""
    fd, tmp = new_tmp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def replace_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (:func:`write_tmp`, then a rename over
    it): a kill leaves the old file or the new one, a link at ``path`` is replaced
    and its target left as it was. ``OSError`` as raised (the temporary file removed)."""
    tmp = write_tmp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_output(path: str | Path, data: bytes | str) -> Path:
    """:func:`replace_bytes` for what a command writes for people (a page, a CSV, a
    figure, a sweep's record); text as UTF-8. :class:`OutputError` naming ``path``
    when it cannot be written (a directory there, no space)."""
    p = Path(path)
    try:
        replace_bytes(p, data.encode("utf-8") if isinstance(data, str) else data)
    except OSError as e:
        raise OutputError(f"{p}: cannot be written ({e.strerror or type(e).__name__})"
                          ) from None
    return p


def save_figure(fig: Any, path: str | Path) -> Path:
    """A Matplotlib figure to ``path`` (its format from the suffix; PNG without one),
    through :func:`write_output`: ``savefig(path)`` would open the path itself and
    write through a link there."""
    p = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, format=p.suffix.lstrip(".").lower() or "png")
    return write_output(p, buf.getvalue())
