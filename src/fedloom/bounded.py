"""Reads that stay within a bound: a JSON-lines file read line by line, each line
at most :data:`MAX_JSONL_LINE` bytes (a longer one is read past, never held), and
the memory this process can still take, so that a read which cannot fit is
refused before it starts rather than ending in ``MemoryError`` half way.

Only the standard library: the report commands use it without importing torch.
"""

from __future__ import annotations

import resource
from collections.abc import Iterator
from typing import BinaryIO

__all__ = ["MAX_JSONL_LINE", "available_memory", "jsonl_lines", "size_text"]

# The longest line of metrics.jsonl that is read. A run's row is under 1 KB plus
# about 130 bytes for each client its round rejected (the id and the reason) or
# dropped (the id): 16 MiB holds a round that rejected every client of a cohort of
# 120,000. A damaged line of 16 MiB parses in under half a gigabyte (the worst text,
# a list of empty lists or mappings, takes 26 bytes of objects a byte).
MAX_JSONL_LINE = 16 * 2**20


def jsonl_lines(f: BinaryIO, limit: int | None = None) -> Iterator[bytes | None]:
    """Each line of the binary file ``f`` with its newline (the last may have none),
    or ``None`` for a line longer than ``limit`` bytes (default
    :data:`MAX_JSONL_LINE`, read when called). The rest of such a line is read past
    1 MiB at a time, and only when the next line is asked for (a reader that stops
    at the first one reads no further)."""
    bound = MAX_JSONL_LINE if limit is None else limit
    while line := f.readline(bound + 1):
        if len(line) <= bound or line.endswith(b"\n"):
            yield line
            continue
        yield None
        while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
            pass


def size_text(n: int) -> str:
    """A size for a message: ``4.3 GB``, ``512 MB`` or ``900 bytes``."""
    if n >= 10**9:
        return f"{n / 1e9:.1f} GB"
    return f"{n / 1e6:.0f} MB" if n >= 10**6 else f"{n} bytes"


def _proc_fields(path: str, names: tuple[bytes, ...]) -> dict[bytes, int]:
    """The ``NAME: N kB`` fields of a ``/proc`` file, in bytes ({} where it cannot
    be read: not Linux)."""
    out: dict[bytes, int] = {}
    try:
        with open(path, "rb") as f:
            for line in f:
                name, _, rest = line.partition(b":")
                if name in names:
                    out[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out


def available_memory() -> int | None:
    """The bytes this process can still allocate, as far as the system says: the
    least of ``MemAvailable + SwapFree`` (``/proc/meminfo``: what the kernel can
    give without killing anything), the address-space limit less what the process
    maps (``RLIMIT_AS`` less ``VmSize``: ``ulimit -v``, ``prlimit --as``) and the
    data limit less its data (``RLIMIT_DATA`` less ``VmData``); ``None`` where none
    is known (no ``/proc``). A container's cgroup limit is not seen."""
    found: list[int] = []
    mem = _proc_fields("/proc/meminfo", (b"MemAvailable", b"SwapFree"))
    if b"MemAvailable" in mem:
        found.append(mem[b"MemAvailable"] + mem.get(b"SwapFree", 0))
    own = _proc_fields("/proc/self/status", (b"VmSize", b"VmData"))
    for which, used in ((resource.RLIMIT_AS, b"VmSize"), (resource.RLIMIT_DATA, b"VmData")):
        soft = resource.getrlimit(which)[0]
        if soft != resource.RLIM_INFINITY and used in own:
            found.append(max(0, soft - own[used]))
    return min(found) if found else None
