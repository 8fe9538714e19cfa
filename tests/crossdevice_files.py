"""Tiny files in the published layouts of the cross-device benchmarks (pfl-research's
StackOverflow and FLAIR HDF5 files, TFF's StackOverflow files, FedScale's OpenImage
and Reddit partitions), written by the tests that read them."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
from PIL import Image

WORDS = ["the", "a", "is", "to", "of", "in", "and", "it"]  # most frequent first
SENTENCES = {  # TFF's examples/<user>/tokens: one space-separated sentence a row
    "00000001": ["the a is", "to of in and it the a is to of in and it the a is to of in x"],
    "00000002": ["it is", "zz the"],
    "00000003": ["a"],
}


def tff_vocab(v: int = 6) -> dict[str, int]:
    return {w: i + 1 for i, w in enumerate(WORDS[:v])}


def write_tff_stackoverflow(root: Path) -> Path:
    d = root / "stackoverflow"
    d.mkdir(parents=True)
    (d / "stackoverflow.word_count").write_text(
        "".join(f"{w}\t{100 - i}\n" for i, w in enumerate(WORDS)))
    for part, users in (("train", SENTENCES), ("held_out", {"00000009": ["is it", "of a"]}),
                        ("test", {"00000007": ["the it"]})):
        with h5py.File(d / f"stackoverflow_{part}.h5", "w") as f:
            for u, rows in users.items():
                f.create_dataset(f"examples/{u}/tokens", data=np.array(rows, dtype=object),
                                 dtype=h5py.string_dtype())
                f.create_dataset(f"examples/{u}/title", data=np.array(["t"] * len(rows),
                                                                      dtype=object),
                                 dtype=h5py.string_dtype())
    return d


def pfl_rows(sentences: list[str], vocab: dict[str, int], seq_len: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """pfl-research's download_preprocess.py, written out longhand: ['BOS'] + words +
    ['EOS'] cut to seq_len + 1 tokens, padded with PAD (0); unknown words UNK."""
    v = len(vocab)
    ids = {"PAD": 0, **vocab, "UNK": v + 1, "BOS": v + 2, "EOS": v + 3}
    rows = []
    for s in sentences:
        toks = (["BOS", *s.split(" "), "EOS"])[: seq_len + 1]
        rows.append([ids.get(t, v + 1) for t in toks] + [0] * (seq_len + 1 - len(toks)))
    a = np.array(rows, dtype=np.int32)
    return a[:, :-1], a[:, 1:]


def write_pfl_stackoverflow(root: Path, seq_len: int = 20, vocab_size: int = 6,
                            users: dict[str, list[str]] | None = None) -> Path:
    d = root / "stackoverflow"
    d.mkdir(parents=True)
    path = d / "stackoverflow.hdf5"
    vocab = tff_vocab(vocab_size)
    with h5py.File(path, "w") as f:
        f["/metadata/vocabulary_size"] = vocab_size + 4
        f["/metadata/unk_symbol"] = vocab_size + 1
        f["/metadata/pad_symbol"] = 0
        for part, us in (("train", users or SENTENCES), ("val", {"00000009": ["is it", "of a"]}),
                         ("test", {"00000007": ["the it"]})):
            for u, rows in us.items():
                x, y = pfl_rows(rows, vocab, seq_len)
                f.create_dataset(f"/{part}/{u}/inputs", data=x)
                f.create_dataset(f"/{part}/{u}/targets", data=y)
    return path


FLAIR_COARSE = [f"label{i:02d}" for i in range(17)]  # FLAIR has 17 coarse labels


def write_flair(root: Path, size: int = 8, coarse: list[str] | None = None) -> Path:
    """Three training users (3, 2 and 4 images), one val and one test user; user k's
    image j carries coarse labels {(j + k) % C} and, for even j, also {(j + k + 1) % C}."""
    coarse = coarse or FLAIR_COARSE
    d = root / "flair"
    d.mkdir(parents=True)
    path = d / "flair_federated.hdf5"
    rng = np.random.default_rng(0)
    c = len(coarse)
    with h5py.File(path, "w") as f:
        for part, users in (("train", {"u1": 3, "u2": 2, "u3": 4}), ("val", {"v1": 2}),
                            ("test", {"t1": 1})):
            for k, (u, n) in enumerate(users.items()):
                rows, cols = [], []
                for j in range(n):
                    labs = {(j + k) % c} | ({(j + k + 1) % c} if j % 2 == 0 else set())
                    rows += [j] * len(labs)
                    cols += sorted(labs)
                g = f"/{part}/{u}"
                f[f"{g}/labels_row"] = np.array(rows, dtype=np.uint16)
                f[f"{g}/labels_col"] = np.array(cols, dtype=np.uint8)
                f[f"{g}/fine_grained_labels_row"] = np.array(rows, dtype=np.uint16)
                f[f"{g}/fine_grained_labels_col"] = np.array(cols, dtype=np.uint16)
                f[f"{g}/image_ids"] = np.array([f"{u}-{j}" for j in range(n)], dtype="S")
                f.create_dataset(f"{g}/images", data=rng.integers(0, 256, (n, size, size, 3),
                                                                  dtype=np.uint8))
        f["/metadata/label_mapping"] = json.dumps({n: i for i, n in enumerate(coarse)})
        f["/metadata/fine_grained_label_mapping"] = json.dumps(
            {n: i for i, n in enumerate(coarse)})
    return path


def write_openimage(root: Path, size: int = 8, classes: int = 596) -> Path:
    """Train rows of clients 2, 10 and 7 (2, 3 and 1 images; clients sort numerically:
    2, 7, 10) and two test images; label ids spread over 0..classes-1."""
    d = root / "open_images"
    m = d / "client_data_mapping"
    m.mkdir(parents=True)
    rng = np.random.default_rng(1)
    rows = {"train": [("2", 0), ("10", 5), ("2", 595 % classes), ("10", 1), ("7", 3),
                      ("10", 5)],
            "test": [("0", 3), ("0", 0)]}
    for part, rs in rows.items():
        (d / part).mkdir()
        lines = ["client_id,sample_path,label_name,label_id"]
        for i, (cid, lab) in enumerate(rs):
            name = f"{part}_{i}.jpg"
            Image.fromarray(rng.integers(0, 256, (size + i, size, 3), dtype=np.uint8)).save(
                d / part / name, quality=95)
            lines.append(f"{cid},{name},/m/{lab:04d},{lab}")
        (m / f"{part}.csv").write_text("\n".join(lines) + "\n")
    return d


REDDIT = {"train": {"a_user": "The cat sat on the mat the cat", "b_user": "a dog the Dog",
                    "c_user": "cat"},
          "test": {"t_user": "the dog sat"}}


def write_reddit(root: Path) -> Path:
    d = root / "reddit"
    for part, users in REDDIT.items():
        (d / part).mkdir(parents=True)
        for u, text in users.items():
            (d / part / u).write_text(text)
    return d
