"""The cross-device benchmarks' loaders (stackoverflow, flair, openimage, reddit), each on
tiny files written by tests/crossdevice_files.py in exactly the published layout."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

from crossdevice_files import (
    FLAIR_COARSE,
    REDDIT,
    SENTENCES,
    pfl_rows,
    tff_vocab,
    write_flair,
    write_openimage,
    write_pfl_stackoverflow,
    write_reddit,
    write_tff_stackoverflow,
)
from fedloom.cli import main
from fedloom.config import DataConfig
from fedloom.data.disk.stackoverflow import encode_sentences
from fedloom.data.sources import DatasetUnavailable, load_dataset


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDLOOM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FEDLOOM_DATA", raising=False)


def _data(name: str, root: Path, **keys: Any) -> DataConfig:
    own = {f.name for f in dataclasses.fields(DataConfig)}
    opts = {"root": str(root), **{k: v for k, v in keys.items() if k not in own}}
    return DataConfig(name=name, options=opts, **{k: v for k, v in keys.items() if k in own})


def _masked(y: np.ndarray) -> np.ndarray:
    return np.where(y == 0, -100, y)


# ------------------------------------------------------------------------ StackOverflow
def test_tff_preprocessing_is_pfls_written_out_longhand() -> None:
    vocab = tff_vocab()
    rows = [s for ss in SENTENCES.values() for s in ss] + ["", "x " * 30]
    for seq_len in (1, 3, 20):
        x, y = encode_sentences(rows, vocab, seq_len)
        px, py = pfl_rows(rows, vocab, seq_len)
        assert np.array_equal(x, px) and np.array_equal(y, py)
    x, y = encode_sentences(["the zz"], vocab, 5)
    # the 1, oov 7, bos 8, eos 9, then padding; the target is the input shifted by one
    assert x.tolist() == [[8, 1, 7, 9, 0]] and y.tolist() == [[1, 7, 9, 0, 0]]


def test_stackoverflow_from_tffs_files(tmp_path: Path) -> None:
    write_tff_stackoverflow(tmp_path)
    ds = load_dataset(_data("stackoverflow", tmp_path, vocab_size=6, eval_fraction=1.0), 0)
    vocab = tff_vocab()
    users = sorted(SENTENCES)
    want_x = np.concatenate([pfl_rows(SENTENCES[u], vocab, 20)[0] for u in users])
    want_y = np.concatenate([pfl_rows(SENTENCES[u], vocab, 20)[1] for u in users])
    assert ds.num_classes == 10 and ds.natural and ds.tokens_per_sample == 20
    assert ds.x.tolist() == want_x.tolist()
    assert ds.y.tolist() == _masked(want_y).tolist()  # padding is cross-entropy's ignore_index
    assert ds.groups is not None and ds.groups.tolist() == [0, 0, 1, 1, 2]
    # the global test set: the held-out users (pfl's val), here all of them
    vx, vy = pfl_rows(["is it", "of a"], vocab, 20)
    assert ds.x_test is not None and ds.y_test is not None
    assert ds.x_test.tolist() == vx.tolist() and ds.y_test.tolist() == _masked(vy).tolist()
    # the second sentence has 22 words: cut to bos + 20 words, no eos
    assert ds.x[1, 0] == 8 and (ds.y[1] != -100).all() and 9 not in ds.y[1].tolist()


def test_pfl_file_reads_as_tffs_files_preprocessed(tmp_path: Path) -> None:
    write_tff_stackoverflow(tmp_path / "tff")
    write_pfl_stackoverflow(tmp_path / "pfl")
    a = load_dataset(_data("stackoverflow", tmp_path / "tff", vocab_size=6), 0)
    b = load_dataset(_data("stackoverflow", tmp_path / "pfl"), 0)
    assert a.num_classes == b.num_classes == 10
    for t in ("x", "y", "x_test", "y_test"):
        assert torch.equal(getattr(a, t), getattr(b, t)), t
    assert a.groups is not None and b.groups is not None
    assert np.array_equal(a.groups, b.groups)


def test_a_users_sentences_are_capped_from_the_seed(tmp_path: Path) -> None:
    users = {"u": [" ".join(["the"] * (i + 1)) for i in range(10)], "v": ["a"]}
    write_pfl_stackoverflow(tmp_path, users=users)
    full = load_dataset(_data("stackoverflow", tmp_path, max_user_sentences=0), 0)
    rows = {tuple(r) for r in full.x[:10].tolist()}
    got = [load_dataset(_data("stackoverflow", tmp_path, max_user_sentences=4), s) for s in
           (0, 0, 1)]
    assert [len(d) for d in got] == [5, 5, 5]  # 4 of u's, v's one
    assert torch.equal(got[0].x, got[1].x) and not torch.equal(got[0].x, got[2].x)
    assert {tuple(r) for r in got[0].x[:4].tolist()} <= rows
    assert got[0].groups is not None and got[0].groups.tolist() == [0, 0, 0, 0, 1]


def test_the_central_test_set_is_the_first_users_holding_the_fraction(tmp_path: Path) -> None:
    write_pfl_stackoverflow(tmp_path)
    # as test users: train's users; tokens (non-pad inputs) 4 + 21 | 3 + 3 | 2 = 33
    ds = load_dataset(_data("stackoverflow", tmp_path, eval_split="val", eval_fraction=0.5), 0)
    assert ds.x_test is not None and len(ds.x_test) == 2  # the only val user, pfl's at least one
    with h5py.File(tmp_path / "stackoverflow" / "stackoverflow.hdf5", "a") as f:
        for u in ("00000001", "00000002", "00000003"):
            f.copy(f[f"train/{u}"], f"val/{u}")
    # val users sorted: 00000001 (25 tokens), 00000002 (6), 00000003 (2), 00000009 (5):
    # searchsorted([25, 31, 33, 38], 0.7 * 38 = 26.6) = 1 -> the first user only
    ds = load_dataset(_data("stackoverflow", tmp_path, eval_fraction=0.7), 0)
    assert ds.x_test is not None and len(ds.x_test) == 2
    assert torch.equal(ds.x_test, ds.x[:2])


def test_stackoverflow_damaged_files_are_one_line(tmp_path: Path) -> None:
    path = write_pfl_stackoverflow(tmp_path)
    with h5py.File(path, "a") as f:
        y = f["train/00000002/targets"][()]
        y[0, 0] = 3  # no longer the input shifted by one
        del f["train/00000002/targets"]
        f["train/00000002/targets"] = y
    with pytest.raises(DatasetUnavailable, match=r"00000002: targets are not the inputs shifted"):
        load_dataset(_data("stackoverflow", tmp_path), 0)
    assert len(load_dataset(_data("stackoverflow", tmp_path, verify=False), 0)) == 5
    path.write_bytes(b"\x89HDF\r\n" + b"\0" * 64)  # truncated: not HDF5 any more
    with pytest.raises(DatasetUnavailable, match=r"stackoverflow.hdf5: not a readable HDF5"):
        load_dataset(_data("stackoverflow", tmp_path), 0)


def test_a_damaged_file_stops_the_run_in_one_line_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_pfl_stackoverflow(tmp_path)
    path.write_bytes(b"not hdf5")
    code = main(["run", "configs/quickstart.yaml", "data.name=stackoverflow",
                 f"data.options.root={tmp_path}", "--out", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and str(path) in err[0] and "HDF5" in err[0]


def test_tffs_word_count_must_hold_the_vocabulary(tmp_path: Path) -> None:
    d = write_tff_stackoverflow(tmp_path)
    with pytest.raises(DatasetUnavailable, match=r"8 words, fewer than the vocabulary size 10"):
        load_dataset(_data("stackoverflow", tmp_path, vocab_size=10), 0)
    (d / "stackoverflow.word_count").write_text("the 3\nbroken\n")
    with pytest.raises(DatasetUnavailable, match=r"word_count: line 2: expected 'word count'"):
        load_dataset(_data("stackoverflow", tmp_path, vocab_size=6), 0)


# ---------------------------------------------------------------------------------- FLAIR
def _multi_hot(n: int, k: int, c: int = 17) -> list[list[int]]:
    out = []
    for j in range(n):
        row = [0] * c
        for lab in {(j + k) % c} | ({(j + k + 1) % c} if j % 2 == 0 else set()):
            row[lab] = 1
        out.append(row)
    return out


def test_flair_from_pfls_file(tmp_path: Path) -> None:
    write_flair(tmp_path)
    ds = load_dataset(_data("flair", tmp_path), 0)
    assert ds.num_classes == 17 and ds.natural and tuple(ds.x.shape) == (9, 3, 8, 8)
    want = _multi_hot(3, 0) + _multi_hot(2, 1) + _multi_hot(4, 2)
    assert ds.y.tolist() == want and ds.y.dtype == torch.int64
    assert ds.groups is not None and ds.groups.tolist() == [0] * 3 + [1] * 2 + [2] * 4
    assert ds.y_test is not None and ds.y_test.tolist() == _multi_hot(2, 0)  # val's user
    with h5py.File(tmp_path / "flair" / "flair_federated.hdf5") as f:
        raw = f["train/u1/images"][()].astype(np.float64) / 255
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    np.testing.assert_allclose(ds.x[:3].permute(0, 2, 3, 1).numpy(), (raw - mean) / std,
                               rtol=1e-5, atol=1e-5)
    small = load_dataset(_data("flair", tmp_path, image_size=4, max_user_images=2,
                               eval_split="test"), 0)
    assert tuple(small.x.shape) == (6, 3, 4, 4) and small.y.tolist() == (
        _multi_hot(2, 0) + _multi_hot(2, 1) + _multi_hot(2, 2))
    assert small.y_test is not None and small.y_test.tolist() == _multi_hot(1, 0)


def test_flair_checks_its_labels(tmp_path: Path) -> None:
    write_flair(tmp_path / "a", coarse=FLAIR_COARSE[:3])
    with pytest.raises(DatasetUnavailable, match=r"label_mapping has 3 labels, FLAIR has 17"):
        load_dataset(_data("flair", tmp_path / "a"), 0)
    path = write_flair(tmp_path / "b")
    with h5py.File(path, "a") as f:
        del f["train/u2/labels_col"]
        f["train/u2/labels_col"] = np.array([40, 0, 1], dtype=np.uint8)
    with pytest.raises(DatasetUnavailable, match=r"train/u2/labels_row/_col: .* columns within "
                                                  r"0..16"):
        load_dataset(_data("flair", tmp_path / "b"), 0)
    with h5py.File(path, "a") as f:
        del f["train/u2/images"]
    with pytest.raises(DatasetUnavailable, match=r"no group 'train/u2/images'"):
        load_dataset(_data("flair", tmp_path / "b"), 0)


# ------------------------------------------------------------------------------ FedScale
def test_openimage_from_fedscales_mapping(tmp_path: Path) -> None:
    write_openimage(tmp_path)
    ds = load_dataset(_data("openimage", tmp_path, image_size=8), 0)
    # rows: (2, 0) (10, 5) (2, 595) (10, 1) (7, 3) (10, 5); clients sort 2, 7, 10
    assert ds.num_classes == 596 and ds.natural and tuple(ds.x.shape) == (6, 3, 8, 8)
    assert ds.y.tolist() == [0, 5, 595, 1, 3, 5]
    assert ds.groups is not None and ds.groups.tolist() == [0, 2, 0, 2, 1, 2]
    assert ds.y_test is not None and ds.y_test.tolist() == [3, 0]
    capped = load_dataset(_data("openimage", tmp_path, image_size=8, max_clients=2,
                                max_client_samples=1, max_test_samples=1), 0)
    assert capped.y.tolist() == [0, 3] and capped.groups.tolist() == [0, 1]  # type: ignore[union-attr]


def test_openimage_damaged_mapping_is_one_line(tmp_path: Path) -> None:
    d = write_openimage(tmp_path)
    csv = d / "client_data_mapping" / "train.csv"
    text = csv.read_text()
    csv.write_text(text.replace("/m/0005,5", "/m/9999,5", 1))
    with pytest.raises(DatasetUnavailable, match=r"train.csv: row 7: label_id 5 is '/m/0005' here "
                                                  r"and '/m/9999' before"):
        load_dataset(_data("openimage", tmp_path, image_size=8), 0)
    csv.write_text(text.replace("client_id,", "client,", 1))
    with pytest.raises(DatasetUnavailable, match=r"train.csv: header must be client_id,"):
        load_dataset(_data("openimage", tmp_path, image_size=8), 0)
    csv.write_text(text + "3,nowhere.jpg,/m/0003,3\n")
    with pytest.raises(DatasetUnavailable, match=r"nowhere.jpg: listed in client_data_mapping"):
        load_dataset(_data("openimage", tmp_path, image_size=8), 0)
    csv.write_text(text.replace("/m/0003,3", "/m/0003,x", 1))
    with pytest.raises(DatasetUnavailable, match=r"row 6: expected 4 fields with an integer"):
        load_dataset(_data("openimage", tmp_path, image_size=8), 0)


def test_reddit_from_fedscales_client_files(tmp_path: Path) -> None:
    write_reddit(tmp_path)
    ds = load_dataset(_data("reddit", tmp_path, vocab_size=3, seq_len=4), 0)
    # training words: the 4, cat 3, sat 1, on 1, mat 1, a 1, dog 2 ("Dog" lowercased):
    # the 1, cat 2, dog 3; oov 4, bos 5, eos 6
    a = [5, 1, 2, 4, 4, 1, 4, 1, 2, 6]  # bos the cat sat on the mat the cat eos
    b = [5, 4, 3, 1, 3, 6]
    c = [5, 2, 6, 0, 0]
    want = [a[0:5], a[4:9], b[0:5], c]
    assert ds.num_classes == 7 and ds.natural and ds.tokens_per_sample == 4
    assert ds.x.tolist() == [w[:4] for w in want]
    assert ds.y.tolist() == [[t if t else -100 for t in w[1:]] for w in want]
    assert ds.groups is not None and ds.groups.tolist() == [0, 0, 1, 2]
    assert ds.x_test is not None and ds.x_test.tolist() == [[5, 1, 3, 4]]
    assert len(REDDIT["train"]) == 3


def test_reddit_undecodable_file_is_one_line(tmp_path: Path) -> None:
    d = write_reddit(tmp_path)
    (d / "train" / "b_user").write_bytes(b"caf\xe9 the")
    with pytest.raises(DatasetUnavailable, match=r"b_user: not UTF-8 text"):
        load_dataset(_data("reddit", tmp_path), 0)
    assert len(load_dataset(_data("reddit", tmp_path, verify=False, seq_len=4), 0)) == 4


@pytest.mark.parametrize("name", ["stackoverflow", "flair", "openimage", "reddit"])
def test_a_missing_copy_says_where_it_looked(tmp_path: Path, name: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(DatasetUnavailable, match=str(tmp_path)):
        load_dataset(_data(name, tmp_path), 0)
    assert main(["datasets", "--root", str(tmp_path)]) == 0
    assert name in capsys.readouterr().out


def test_padded_targets_train_alike_on_every_backend(tmp_path: Path) -> None:
    # the sequential step's F.cross_entropy leaves padding out of its mean; vmap's masked
    # loss divides by the same unpadded tokens, so one round gives the same model
    import fedloom
    from fedloom.config import load_config

    write_pfl_stackoverflow(tmp_path)
    over = [f"data.options.root={tmp_path}", "data.num_clients=3", "rounds=1", "cohort.size=3",
            "cohort.sampling=fixed", "privacy.mode=none", "eval.every=1", "checkpoint.every=0",
            "logging.plots=false", "model.options.embed=8", "model.options.heads=2",
            "model.options.ff=16", "model.options.layers=1", "model.options.dropout=0",
            "client.batch_size=2"]
    cfg = "configs/published/pfl/stackoverflow.yaml"
    seq = fedloom.run(load_config(cfg, over), out=str(tmp_path / "seq"))
    vm = fedloom.run(load_config(cfg, [*over, "backend=vmap"]), out=str(tmp_path / "vmap"))
    assert torch.allclose(seq.w, vm.w, rtol=1e-4, atol=1e-6)
    from fedloom.client.sgd import LocalSGD
    from fedloom.metrics import evaluate
    from fedloom.models import build_model
    from fedloom.params import Layout

    ds = load_dataset(_data("stackoverflow", tmp_path), 0)
    m = build_model(load_config(cfg, over).model, (20,), ds.num_classes, 0)
    layout = Layout.from_module(m)
    w = layout.flatten(m)
    # full_loss is per real token: all windows' tokens pooled
    logits = m.eval()(ds.x)
    want = float(torch.nn.functional.cross_entropy(logits, ds.y))
    assert LocalSGD(m, layout).full_loss(w, ds.x, ds.y, batch=2) == pytest.approx(want, rel=1e-5)
    assert evaluate(m, layout, w, ds.x, ds.y)[1] > 0
