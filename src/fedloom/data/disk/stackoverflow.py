"""StackOverflow next-word prediction from disk: pfl-research's HDF5 file or TFF's own files.

Two layouts under ``<root>/stackoverflow/`` are read, the first one found:

- ``stackoverflow.hdf5``, written by pfl-research's
  ``benchmarks/dataset/stackoverflow/download_preprocess.py``: groups
  ``/{train,val,test}/<user>/inputs`` and ``/targets`` (int32 ``[n, L]``, L = 20),
  ``/metadata/{vocabulary_size,unk_symbol,pad_symbol}``; read as stored.
- ``stackoverflow_{train,held_out,test}.h5`` and ``stackoverflow.word_count`` as
  ``tff.simulation.datasets.stackoverflow`` downloads them (``examples/<user>/tokens``:
  one space-separated sentence a row); preprocessed here as TFF and pfl do
  (:func:`encode_sentences`): the ``vocab_size`` most frequent words of the word-count
  file are ids 1…V, pad 0, out-of-vocabulary V+1, bos V+2, eos V+3; a sentence is
  ``[bos] + words + [eos]`` cut to ``seq_len + 1`` ids and padded with 0; input the
  first ``seq_len``, target the last ``seq_len``.

Each user is one client (``max_user_sentences`` of its sentences, drawn from the
seed as pfl's 64; ``max_clients`` of the users in sorted order, 0 all). A padded
target is stored as -100, PyTorch's ``ignore_index``: the loss and the token accuracy
are over real tokens only, as pfl's ``LMBase.loss`` (pad excluded). The global test
set is the first ``eval_fraction`` of the ``eval_split`` users by tokens (pfl's
``central_data_fraction`` 0.01 of ``val``). ``verify`` checks the vocabulary ids,
pfl's metadata and that every target row is its input shifted by one.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import torch

from fedloom.config import DataConfig
from fedloom.data.disk.common import _cached, _here, _looked, data_root
from fedloom.data.sources import Dataset, DatasetUnavailable, _has_module, _source
from fedloom.registry import Range
from fedloom.rng import Purpose, numpy_gen

__all__ = ["IGNORE", "encode_sentences", "read_stackoverflow", "stackoverflow"]

IGNORE = -100  # a padded target: torch.nn.functional.cross_entropy's default ignore_index
_TFF_SPLITS = {"train": "train", "val": "held_out", "test": "test"}
INSTALL_H5 = "pip install h5py  (or: pip install 'fedloom[data]')"


def open_h5(path: Path) -> Any:
    """``h5py.File(path, "r")``, or one line naming the file and why it cannot be read."""
    try:
        import h5py  # type: ignore[import-untyped]
    except ImportError:
        raise DatasetUnavailable(f"{path}: reading HDF5 needs h5py; {INSTALL_H5}") from None
    try:
        return h5py.File(path, "r")
    except OSError as e:
        raise DatasetUnavailable(f"{path}: not a readable HDF5 file ({str(e)[:100]})") from None


def h5_part(f: Any, key: str, path: Path) -> Any:
    """``f[key]`` or one line naming the file and the missing group."""
    try:
        return f[key]
    except (KeyError, OSError) as e:
        raise DatasetUnavailable(f"{path}: no group {key!r} ({str(e)[:80]})") from None


def _layout(root: Path) -> tuple[str, Path] | None:
    d = root / "stackoverflow"
    if (d / "stackoverflow.hdf5").is_file():
        return "pfl", d / "stackoverflow.hdf5"
    if (d / "stackoverflow_train.h5").is_file() and (d / "stackoverflow.word_count").is_file():
        return "tff", d
    return None


def read_vocabulary(path: Path, size: int) -> dict[str, int]:
    """The first ``size`` words of TFF's ``stackoverflow.word_count`` (``word count`` a
    line, most frequent first) as ids 1…size (0 is pad)."""
    vocab: dict[str, int] = {}
    with path.open(encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f):
            parts = line.split()
            if len(parts) != 2 or not parts[1].isdigit():
                raise DatasetUnavailable(f"{path}: line {i + 1}: expected 'word count'")
            vocab.setdefault(parts[0], len(vocab) + 1)
            if len(vocab) >= size:
                break
    if len(vocab) < size:
        raise DatasetUnavailable(f"{path}: {len(vocab)} words, fewer than the vocabulary "
                                 f"size {size} (data.options.vocab_size)")
    return vocab


def encode_sentences(sentences: Iterable[str], vocab: dict[str, int],
                     seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """TFF's and pfl's preprocessing of sentences (``vocab``: words → 1…V): inputs
    and targets, int32 ``[n, seq_len]`` each, pad 0.

    >>> x, y = encode_sentences(["a b zz"], {"a": 1, "b": 2}, 4)
    >>> x.tolist(), y.tolist()    # out of vocabulary 3, bos 4, eos 5
    ([[4, 1, 2, 3]], [[1, 2, 3, 5]])
    """
    v = len(vocab)
    oov, bos, eos = v + 1, v + 2, v + 3
    rows = []
    for s in sentences:
        ids = [bos, *(vocab.get(w, oov) for w in s.split(" ")), eos][: seq_len + 1]
        rows.append(ids + [0] * (seq_len + 1 - len(ids)))
    a = np.asarray(rows, dtype=np.int32).reshape(-1, seq_len + 1)
    return a[:, :-1].copy(), a[:, 1:].copy()


def _as_text(rows: Any) -> list[str]:
    return [r.decode("utf-8", "replace") if isinstance(r, bytes) else str(r) for r in rows]


def _read_tff_part(path: Path, vocab: dict[str, int], seq_len: int,
                   max_clients: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    with open_h5(path) as f:
        users = sorted(h5_part(f, "examples", path).keys())
        for u in users[: max_clients or None]:
            x, y = encode_sentences(_as_text(h5_part(f, f"examples/{u}/tokens", path)[()]),
                                    vocab, seq_len)
            out[u] = (x, y)
    return out


def _read_pfl_part(path: Path, split: str, max_clients: int, vocab_size: int,
                   verify: bool) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    with open_h5(path) as f:
        users = sorted(h5_part(f, split, path).keys())
        for u in users[: max_clients or None]:
            x = np.asarray(h5_part(f, f"{split}/{u}/inputs", path)[()])
            y = np.asarray(h5_part(f, f"{split}/{u}/targets", path)[()])
            if x.ndim != 2 or x.shape != y.shape or x.dtype.kind not in "iu":
                raise DatasetUnavailable(f"{path}: {split}/{u}: inputs {x.shape} and targets "
                                         f"{y.shape} must be integer arrays of one shape [n, L]")
            if verify and x.size and (x.min() < 0 or max(x.max(), y.max()) >= vocab_size):
                raise DatasetUnavailable(f"{path}: {split}/{u}: token ids outside 0.."
                                         f"{vocab_size - 1} (metadata/vocabulary_size)")
            if verify and not np.array_equal(x[:, 1:], y[:, :-1]):
                raise DatasetUnavailable(f"{path}: {split}/{u}: targets are not the inputs "
                                         "shifted by one token (a damaged file; "
                                         "data.options.verify=false skips this check)")
            out[u] = (x.astype(np.int32), y.astype(np.int32))
    return out


def _pfl_metadata(path: Path, verify: bool) -> int:
    with open_h5(path) as f:
        try:
            vs = int(f["metadata/vocabulary_size"][()])
            pad, unk = int(f["metadata/pad_symbol"][()]), int(f["metadata/unk_symbol"][()])
        except (KeyError, OSError, TypeError, ValueError) as e:
            raise DatasetUnavailable(f"{path}: metadata/vocabulary_size, pad_symbol and "
                                     f"unk_symbol needed ({str(e)[:80]})") from None
    if verify and (pad != 0 or unk != vs - 3):
        raise DatasetUnavailable(f"{path}: pad_symbol {pad} and unk_symbol {unk} are not pfl's "
                                 f"0 and vocabulary_size - 3 = {vs - 3} (data.options.verify="
                                 "false skips this check)")
    return vs


def read_stackoverflow(root: Path, split: str, *, max_clients: int = 0, vocab_size: int = 10000,
                       seq_len: int = 20, verify: bool = True
                       ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], int]:
    """One split's users (``train``, ``val`` or ``test``) as ``{user: (inputs, targets)}``
    (pad 0) and the number of token ids."""
    found = _layout(root)
    if found is None:
        raise DatasetUnavailable(
            f"data.name=stackoverflow: {root / 'stackoverflow'}: needs stackoverflow.hdf5 "
            "(pfl-research) or stackoverflow_train.h5 and stackoverflow.word_count (TFF) "
            "(set data.options.root or $FEDLOOM_DATA)")
    kind, where = found
    if kind == "pfl":
        vs = _pfl_metadata(where, verify)
        return _read_pfl_part(where, split, max_clients, vs, verify), vs
    part = where / f"stackoverflow_{_TFF_SPLITS[split]}.h5"
    if not part.is_file():
        raise DatasetUnavailable(f"data.name=stackoverflow: {part}: missing")
    vocab = read_vocabulary(where / "stackoverflow.word_count", vocab_size)
    return _read_tff_part(part, vocab, seq_len, max_clients), vocab_size + 4


def _user_arrays(users: dict[str, tuple[np.ndarray, np.ndarray]], cap: int, seed: int
                 ) -> dict[str, np.ndarray]:
    xs, ys, gs = [], [], []
    for k, u in enumerate(sorted(users)):
        x, y = users[u]
        if cap and len(x) > cap:  # pfl: a random max_user_sentences of the user's
            keep = np.sort(numpy_gen(seed, -1, k, Purpose.DATA).permutation(len(x))[:cap])
            x, y = x[keep], y[keep]
        xs.append(x)
        ys.append(y)
        gs.append(np.full(len(x), k, dtype=np.int64))
    return {"x": np.concatenate(xs), "y": np.concatenate(ys), "g": np.concatenate(gs)}


def _central(users: dict[str, tuple[np.ndarray, np.ndarray]], fraction: float
             ) -> tuple[np.ndarray, np.ndarray]:
    """pfl's ``get_fraction_of_users``: the first users holding ``fraction`` of the
    tokens (a user's tokens: its non-pad inputs)."""
    names = sorted(users)
    tokens = np.cumsum([int((users[u][0] != 0).sum()) for u in names])
    cut = len(names) if fraction >= 1 else max(1, int(np.searchsorted(
        tokens, tokens[-1] * fraction, side="left")))
    return (np.concatenate([users[u][0] for u in names[:cut]]),
            np.concatenate([users[u][1] for u in names[:cut]]))


def _targets(y: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(y.astype(np.int64))
    return t.masked_fill_(t == 0, IGNORE)


def _probe(data: DataConfig, *, root: str = "", **_: Any) -> str | None:
    where = data_root(root)
    if _layout(where) is None:
        return (f"data.name=stackoverflow: {where / 'stackoverflow'}: needs stackoverflow.hdf5 "
                "or stackoverflow_train.h5 and stackoverflow.word_count")
    return None if _has_module("h5py") else f"data.name=stackoverflow needs h5py; {INSTALL_H5}"


@_source("stackoverflow", "StackOverflow next word (TFF; pfl-research's HDF5), one client per "
         "user", _here(lambda r: _layout(r) is not None),
         "python benchmarks/dataset/stackoverflow/download_preprocess.py of pfl-research, then "
         "put stackoverflow/stackoverflow.hdf5 under data.options.root",
         checks_itself=True, where=_looked("stackoverflow/stackoverflow.hdf5",
                                           "stackoverflow/stackoverflow_train.h5"),
         probe=_probe)
def stackoverflow(data: DataConfig, seed: int, *, root: str = "", verify: bool = True,
                  max_user_sentences: Annotated[int, Range(ge=0)] = 64,
                  max_clients: Annotated[int, Range(ge=0)] = 0,
                  eval_split: Literal["val", "test"] = "val",
                  eval_fraction: Annotated[float, Range(gt=0, le=1)] = 0.01,
                  vocab_size: Annotated[int, Range(ge=1)] = 10000,
                  seq_len: Annotated[int, Range(ge=1)] = 20) -> Dataset:
    """``root``: the data root; ``verify``: check ids and shifts; ``max_user_sentences``:
    a user's sentences kept (pfl: 64; 0 all); ``max_clients``: the first users (0 all);
    ``eval_split``/``eval_fraction``: the global test set; ``vocab_size``/``seq_len``:
    TFF's files' preprocessing (pfl's file is read as written)."""
    where = data_root(root)
    found = _layout(where)
    sources = [found[1]] if found and found[0] == "pfl" else sorted(
        (where / "stackoverflow").glob("stackoverflow*")) if found else []

    def decode() -> dict[str, np.ndarray]:
        kw: dict[str, Any] = {"max_clients": max_clients, "vocab_size": vocab_size,
                              "seq_len": seq_len, "verify": verify}
        train, vs = read_stackoverflow(where, "train", **kw)
        if not train:
            raise DatasetUnavailable(f"{where / 'stackoverflow'}: no training user")
        ev, _ = read_stackoverflow(where, eval_split, **kw)
        arrs = _user_arrays(train, max_user_sentences, seed)
        arrs["xt"], arrs["yt"] = _central(ev or train, eval_fraction)
        arrs["v"] = np.array([vs])
        return arrs

    extra = f"{verify}|{max_user_sentences}|{max_clients}|{eval_split}|{eval_fraction}|" \
            f"{vocab_size}|{seq_len}|{seed if max_user_sentences else ''}"
    a = _cached("stackoverflow", sources, extra, decode) if found else decode()
    return Dataset("stackoverflow", torch.from_numpy(a["x"].astype(np.int64)), _targets(a["y"]),
                   int(a["v"][0]), groups=a["g"], natural=True,
                   x_test=torch.from_numpy(a["xt"].astype(np.int64)), y_test=_targets(a["yt"]),
                   tokens_per_sample=int(a["x"].shape[1]))
