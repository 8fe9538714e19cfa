"""FedScale's (Lai et al., ICML 2022) OpenImage and Reddit client partitions, from disk.

``openimage``: ``<root>/open_images/`` as FedScale's ``download.sh open_images``
unpacks it: ``client_data_mapping/{train,test}.csv`` (header ``client_id,
sample_path,label_name,label_id``, one image a row) and the images under
``train/`` and ``test/``. One client per ``client_id`` of train.csv; the test
rows are the global test set. Images are decoded with Pillow, resized to
``image_size`` (FedScale's ``openImg`` transform: 256; 0 keeps the stored size,
which must then be equal) and normalised with that transform's statistics.
``verify`` checks the header, that each label id has one name and the 596 classes.

``reddit``: ``<root>/reddit/{train,test}/``, one text file per client (sorted file
names, as FedScale's ``TextDataset`` numbers its clients; its ``client_data_mapping``
csv maps ALBERT blocks to those clients, so it is not read). FedScale tokenizes with
ALBERT's tokenizer (blocks of 64, a masked-LM loss); here the text is cut into words
(lowercased, split at whitespace), the ``vocab_size`` most frequent training words
are ids 1…V (pad 0, out of vocabulary V+1, bos V+2, eos V+3: StackOverflow's
scheme) and each client's word stream is cut into windows of ``seq_len + 1`` ids
every ``seq_len`` for next-word prediction. ``verify`` checks that every file
decodes as UTF-8.
"""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch

from fedloom.config import DataConfig
from fedloom.data.disk.common import _cached, _here, _looked, _normalise, data_root
from fedloom.data.disk.images import _decode_images
from fedloom.data.sources import Dataset, DatasetUnavailable, _has_module, _source
from fedloom.data.text import windows
from fedloom.registry import Range

__all__ = ["openimage", "read_mapping", "reddit"]

_HEADER = ["client_id", "sample_path", "label_name", "label_id"]
_OPENIMG_STATS = ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010))
_OPENIMG_CLASSES = 596


def _openimage_dir(root: Path) -> Path | None:
    d = root / "open_images"
    m = d / "client_data_mapping"
    return d if (m / "train.csv").is_file() and (m / "test.csv").is_file() else None


def read_mapping(path: Path, verify: bool = True) -> list[tuple[str, str, str, int]]:
    """The rows ``(client_id, sample_path, label_name, label_id)`` of a FedScale
    ``client_data_mapping`` csv, or one line naming the file, the row and the reason."""
    rows: list[tuple[str, str, str, int]] = []
    names: dict[int, str] = {}
    with path.open(newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or [h.strip() for h in header] != _HEADER:
            raise DatasetUnavailable(f"{path}: header must be {','.join(_HEADER)}, got "
                                     f"{','.join(header or [])!r}")
        for i, r in enumerate(reader, start=2):
            if not r:
                continue
            try:
                cid, sample, name, lab = r
                lid = int(lab)
            except ValueError:
                raise DatasetUnavailable(f"{path}: row {i}: expected 4 fields with an integer "
                                         f"label_id, got {r!r}") from None
            if verify and names.setdefault(lid, name) != name:
                raise DatasetUnavailable(f"{path}: row {i}: label_id {lid} is {name!r} here and "
                                         f"{names[lid]!r} before (data.options.verify=false "
                                         "skips this check)")
            rows.append((cid, sample, name, lid))
    if not rows:
        raise DatasetUnavailable(f"{path}: no rows")
    return rows


def _clients(rows: list[tuple[str, str, str, int]], max_clients: int, max_samples: int,
             min_samples: int = 0) -> list[tuple[int, str, int]]:
    """(client index, sample path, label) of the kept rows: clients with at least
    ``min_samples`` rows (FedScale's ``filter_less``), the first ``max_clients`` of them in
    sorted order of their ids (numerically where an id is an integer)."""
    count = Counter(r[0] for r in rows)
    ids = sorted((c for c, n in count.items() if n >= min_samples),
                 key=lambda c: (int(c), c) if c.isdigit() else (1 << 62, c))
    index = {c: k for k, c in enumerate(ids[: max_clients or None])}
    seen: Counter[int] = Counter()
    out = []
    for cid, sample, _, lid in rows:
        k = index.get(cid)
        if k is None or (max_samples and seen[k] >= max_samples):
            continue
        seen[k] += 1
        out.append((k, sample, lid))
    return out


def _probe_openimage(data: DataConfig, *, root: str = "", **_: Any) -> str | None:
    where = data_root(root)
    if _openimage_dir(where) is None:
        return (f"data.name=openimage: {where / 'open_images' / 'client_data_mapping'}: needs "
                "train.csv and test.csv")
    return None if _has_module("PIL") else "data.name=openimage needs pillow"


@_source("openimage", "FedScale's OpenImage (596 classes), one client per client_id",
         _here(lambda r: _openimage_dir(r) is not None),
         "bash benchmark/dataset/download.sh download open_images (FedScale), then put "
         "open_images/ under data.options.root",
         checks_itself=True, where=_looked("open_images/client_data_mapping/"),
         probe=_probe_openimage)
def openimage(data: DataConfig, seed: int, *, root: str = "", verify: bool = True,
              image_size: Annotated[int, Range(ge=0)] = 256,
              max_clients: Annotated[int, Range(ge=0)] = 0,
              max_client_samples: Annotated[int, Range(ge=0)] = 0,
              min_client_samples: Annotated[int, Range(ge=0)] = 0,
              max_test_samples: Annotated[int, Range(ge=0)] = 0) -> Dataset:
    """``root``: the data root; ``verify``: check the mapping and the 596 classes;
    ``image_size``: resize side (FedScale: 256); ``max_clients``/``max_client_samples``:
    the first clients and their first rows (0 all); ``min_client_samples``: drop clients
    with fewer rows (FedScale's filter_less, 21); ``max_test_samples``: the first test
    rows (0 all)."""
    d = _openimage_dir(data_root(root))
    if d is None:
        raise DatasetUnavailable(f"data.name=openimage: {data_root(root) / 'open_images'}: "
                                 "needs client_data_mapping/train.csv and test.csv (set "
                                 "data.options.root or $FEDLOOM_DATA)")
    m = d / "client_data_mapping"
    train = _clients(read_mapping(m / "train.csv", verify), max_clients, max_client_samples,
                     min_client_samples)
    if not train:
        raise DatasetUnavailable(f"{m / 'train.csv'}: no client with {min_client_samples} or "
                                 "more rows (data.options.min_client_samples)")
    test = [(0, s, lid) for _, s, _, lid in read_mapping(m / "test.csv", verify)]
    test = test[: max_test_samples or None]
    labels = np.array([lid for *_, lid in train + test], dtype=np.int64)
    classes = _OPENIMG_CLASSES if verify else int(labels.max()) + 1
    if labels.min() < 0 or labels.max() >= classes:
        raise DatasetUnavailable(f"{m}: label_id outside 0..{classes - 1} (FedScale's OpenImage "
                                 "has 596 classes; data.options.verify=false takes the largest)")
    paths = [d / "train" / s for _, s, _ in train] + [d / "test" / s for _, s, _ in test]
    for p in paths:
        if not p.is_file():
            raise DatasetUnavailable(f"{p}: listed in client_data_mapping but missing")

    def decode() -> dict[str, np.ndarray]:
        return {"x": _decode_images(paths, image_size)}

    x = _cached("openimage", [m / "train.csv", m / "test.csv"],
                f"{image_size}|{max_clients}|{max_client_samples}|{min_client_samples}|"
                f"{max_test_samples}", decode)["x"]
    n = len(train)
    xs = _normalise(x, *_OPENIMG_STATS)
    return Dataset("openimage", xs[:n], torch.from_numpy(labels[:n]), classes,
                   groups=np.array([k for k, _, _ in train], dtype=np.int64), natural=True,
                   x_test=xs[n:], y_test=torch.from_numpy(labels[n:]))


def _reddit_dir(root: Path) -> Path | None:
    d = root / "reddit"
    return d if (d / "train").is_dir() and (d / "test").is_dir() else None


def _words(path: Path, verify: bool) -> list[str]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if verify:
            raise DatasetUnavailable(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}; "
                                     "data.options.verify=false replaces such bytes)") from None
        text = raw.decode("utf-8", errors="replace")
    return text.lower().split()


def _encode(words: list[str], vocab: dict[str, int], seq_len: int) -> tuple[np.ndarray, ...]:
    v = len(vocab)
    ids = np.array([v + 2, *(vocab.get(w, v + 1) for w in words), v + 3], dtype=np.int64)
    if len(ids) < seq_len + 1:
        ids = np.concatenate([ids, np.zeros(seq_len + 1 - len(ids), dtype=np.int64)])
    return windows(ids, seq_len, seq_len)


def _reddit_arrays(d: Path, vocab_size: int, seq_len: int, max_clients: int, min_samples: int,
                   verify: bool) -> dict[str, np.ndarray]:
    files = {p: sorted(f for f in (d / p).iterdir() if f.is_file() and "_cached_lm_" not in f.name)
             for p in ("train", "test")}
    files["train"] = files["train"][: max_clients or None]
    if not files["train"]:
        raise DatasetUnavailable(f"{d / 'train'}: no client file")
    text = {p: [_words(f, verify) for f in fs] for p, fs in files.items()}
    counts = Counter(w for ws in text["train"] for w in ws)
    vocab = {w: i + 1 for i, (w, _) in enumerate(sorted(counts.items(),
                                                         key=lambda t: (-t[1], t[0]))[:vocab_size])}
    while len(vocab) < vocab_size:  # fewer distinct words than the vocabulary: unused ids
        vocab[f"\0{len(vocab)}"] = len(vocab) + 1
    out: dict[str, np.ndarray] = {}
    for p, key in (("train", ""), ("test", "t")):
        parts = [_encode(ws, vocab, seq_len) for ws in text[p]]
        if p == "train":  # FedScale's filter_less: clients with fewer windows are dropped
            parts = [xy for xy in parts if len(xy[0]) >= min_samples]
            if not parts:
                raise DatasetUnavailable(f"{d / 'train'}: no client with {min_samples} or more "
                                         "windows (data.options.min_client_samples)")
        out["x" + key] = np.concatenate([x for x, _ in parts] or [np.zeros((0, seq_len))])
        out["y" + key] = np.concatenate([y for _, y in parts] or [np.zeros((0, seq_len))])
        if p == "train":
            out["g"] = np.concatenate([np.full(len(x), k) for k, (x, _) in enumerate(parts)])
    return out


@_source("reddit", "FedScale's Reddit next word (one client per file), word vocabulary",
         _here(lambda r: _reddit_dir(r) is not None),
         "bash benchmark/dataset/download.sh download reddit (FedScale), then put reddit/ under "
         "data.options.root", checks_itself=True, where=_looked("reddit/{train,test}/"),
         probe=lambda data, *, root="", **_: None if _reddit_dir(data_root(root)) else
         f"data.name=reddit: {data_root(root) / 'reddit'}: needs train/ and test/")
def reddit(data: DataConfig, seed: int, *, root: str = "", verify: bool = True,
           vocab_size: Annotated[int, Range(ge=1)] = 10000,
           seq_len: Annotated[int, Range(ge=1)] = 20,
           max_clients: Annotated[int, Range(ge=0)] = 0,
           min_client_samples: Annotated[int, Range(ge=0)] = 0) -> Dataset:
    """``root``: the data root; ``verify``: files must be UTF-8; ``vocab_size``: the most
    frequent training words kept; ``seq_len``: tokens a window; ``max_clients``: the first
    client files (0 all); ``min_client_samples``: drop those with fewer windows
    (FedScale's filter_less, 21)."""
    from fedloom.data.disk.stackoverflow import _targets

    d = _reddit_dir(data_root(root))
    if d is None:
        raise DatasetUnavailable(f"data.name=reddit: {data_root(root) / 'reddit'}: needs train/ "
                                 "and test/ (set data.options.root or $FEDLOOM_DATA)")
    srcs = sorted(f for p in ("train", "test") for f in (d / p).iterdir() if f.is_file())
    a = _cached("reddit", srcs, f"{verify}|{vocab_size}|{seq_len}|{max_clients}|"
                f"{min_client_samples}",
                lambda: _reddit_arrays(d, vocab_size, seq_len, max_clients, min_client_samples,
                                       verify))
    return Dataset("reddit", torch.from_numpy(a["x"].astype(np.int64)), _targets(a["y"]),
                   vocab_size + 4, groups=a["g"].astype(np.int64), natural=True,
                   x_test=torch.from_numpy(a["xt"].astype(np.int64)), y_test=_targets(a["yt"]),
                   tokens_per_sample=seq_len)
