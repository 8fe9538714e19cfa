"""Datasets read from disk (fedloom.data.disk) and the training augmentation.

Every loader is tested on tiny files this test writes in exactly the published
on-disk layout: CIFAR pickle and binary batches, LEAF json, the Tiny-ImageNet
tree, an image folder and a parquet file.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedloom.cli import main
from fedloom.config import DataConfig, PartitionConfig
from fedloom.data.augment import Augment, make_augment
from fedloom.data.sources import DatasetUnavailable, load_dataset


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDLOOM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FEDLOOM_DATA", raising=False)


def _images(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 3072), dtype=np.uint8)


def _write_cifar10_py(root: Path, per_batch: int = 4) -> dict[str, np.ndarray]:
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    xs, ys = [], []
    for i, name in enumerate([*(f"data_batch_{k}" for k in range(1, 6)), "test_batch"]):
        x = _images(per_batch, i)
        y = [(i + j) % 10 for j in range(per_batch)]
        # the published batches are Python-2 pickles with bytes keys
        (d / name).write_bytes(pickle.dumps({b"batch_label": name.encode(), b"data": x,
                                             b"labels": y}, protocol=2))
        xs.append(x)
        ys.append(y)
    return {"train_x": np.concatenate(xs[:5]), "train_y": np.concatenate(ys[:5]),
            "test_x": xs[5], "test_y": np.array(ys[5])}


def _data(name: str, **keys: Any) -> DataConfig:
    """A data section: DataConfig's own keys, the others the source's options."""
    own = {f.name for f in dataclasses.fields(DataConfig)}
    return DataConfig(name=name, options={k: v for k, v in keys.items() if k not in own},
                      **{k: v for k, v in keys.items() if k in own})


def _cfg(root: Path, name: str, **kw: object) -> DataConfig:
    # femnist checks no class counts: it takes no verify option
    checks = {} if name == "femnist" else {"verify": False}
    return _data(name, root=str(root), **checks, **kw)


def test_cifar10_python_layout_pixels_labels_and_normalisation(tmp_path: Path) -> None:
    raw = _write_cifar10_py(tmp_path)
    ds = load_dataset(_cfg(tmp_path, "cifar10"), 0)
    assert ds.x.shape == (20, 3, 32, 32) and ds.x_test is not None
    assert ds.x_test.shape == (4, 3, 32, 32) and ds.num_classes == 10
    assert ds.y.tolist() == raw["train_y"].tolist()
    # row layout: 1024 red, 1024 green, 1024 blue values, row-major 32 x 32
    r0 = raw["train_x"][3]
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    for c in range(3):
        want = (r0[c * 1024:(c + 1) * 1024].reshape(32, 32) / 255.0 - mean[c]) / std[c]
        np.testing.assert_allclose(ds.x[3, c].numpy(), want, rtol=1e-5, atol=1e-5)
    assert ds.augment == "cifar10"


def test_cifar10_binary_layout_equals_python_layout(tmp_path: Path) -> None:
    raw = _write_cifar10_py(tmp_path / "py")
    d = tmp_path / "bin" / "cifar-10-batches-bin"
    d.mkdir(parents=True)
    x, y = raw["train_x"], raw["train_y"]
    for k in range(5):  # 4 records per batch: 1 label byte + 3072 pixel bytes
        rec = np.concatenate([y[4 * k:4 * k + 4, None].astype(np.uint8), x[4 * k:4 * k + 4]], 1)
        rec.tofile(d / f"data_batch_{k + 1}.bin")
    np.concatenate([raw["test_y"][:, None].astype(np.uint8), raw["test_x"]], 1).tofile(
        d / "test_batch.bin")
    a = load_dataset(_cfg(tmp_path / "py", "cifar10"), 0)
    b = load_dataset(_cfg(tmp_path / "bin", "cifar10"), 0)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y) and torch.equal(a.x_test, b.x_test)


def test_cifar100_fine_and_coarse_python_and_binary(tmp_path: Path) -> None:
    d = tmp_path / "py" / "cifar-100-python"
    d.mkdir(parents=True)
    b = tmp_path / "bin" / "cifar-100-binary"
    b.mkdir(parents=True)
    for i, part in enumerate(("train", "test")):
        x = _images(6, 10 + i)
        fine = [(7 * j + i) % 100 for j in range(6)]
        coarse = [f // 5 for f in fine]
        (d / part).write_bytes(pickle.dumps({b"data": x, b"fine_labels": fine,
                                             b"coarse_labels": coarse}, protocol=2))
        rec = np.concatenate([np.array(coarse, np.uint8)[:, None],
                              np.array(fine, np.uint8)[:, None], x], 1)
        rec.tofile(b / f"{part}.bin")
    for root in (tmp_path / "py", tmp_path / "bin"):
        fine_ds = load_dataset(_cfg(root, "cifar100"), 0)
        coarse_ds = load_dataset(_cfg(root, "cifar100", labels="coarse"), 0)
        assert fine_ds.num_classes == 100 and coarse_ds.num_classes == 20
        assert fine_ds.y.tolist() == [(7 * j) % 100 for j in range(6)]
        assert coarse_ds.y.tolist() == [((7 * j) % 100) // 5 for j in range(6)]
        assert torch.equal(fine_ds.x, coarse_ds.x)


def test_cifar_verify_checks_the_published_class_counts(tmp_path: Path) -> None:
    _write_cifar10_py(tmp_path)
    with pytest.raises(DatasetUnavailable, match=r"expected 10 classes x 5000.*verify=false"):
        load_dataset(_data("cifar10", root=str(tmp_path)), 0)


def test_cifar_partial_directory_names_what_is_missing(tmp_path: Path) -> None:
    _write_cifar10_py(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(DatasetUnavailable, match=r"cifar-10-batches-py: missing data_batch_3"):
        load_dataset(_cfg(tmp_path, "cifar10"), 0)
    with pytest.raises(DatasetUnavailable, match=r"neither cifar-100-python/ nor"):
        load_dataset(_cfg(tmp_path, "cifar100"), 0)


def test_cifar_damaged_and_hostile_pickles_are_refused(tmp_path: Path) -> None:
    _write_cifar10_py(tmp_path)
    f = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    f.write_bytes(f.read_bytes()[:100])  # truncated
    with pytest.raises(DatasetUnavailable, match="data_batch_2: not a CIFAR pickle batch"):
        load_dataset(_cfg(tmp_path, "cifar10"), 0)

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            # eval, not print: Ray, once imported in the process, replaces builtins.print
            return (eval, ("print('owned')",))

    f.write_bytes(pickle.dumps({b"data": Evil(), b"labels": []}))
    with pytest.raises(DatasetUnavailable, match=r"refusing to load builtins\.eval"):
        load_dataset(_cfg(tmp_path, "cifar10"), 0)


def test_decoded_arrays_are_cached_and_follow_the_source(tmp_path: Path) -> None:
    _write_cifar10_py(tmp_path)
    a = load_dataset(_cfg(tmp_path, "cifar10"), 0)
    cached = list((tmp_path / "cache").glob("cifar10-*"))
    assert len(cached) == 1 and (cached[0] / "arrays.json").is_file()
    assert not list((tmp_path / "cache").glob(".cifar10-*"))  # no half-written folder left
    b = load_dataset(_cfg(tmp_path, "cifar10"), 0)
    assert torch.equal(a.x, b.x)
    # a changed source file makes a new key: the new labels are read, not the cached ones
    f = tmp_path / "cifar-10-batches-py" / "data_batch_1"
    d = pickle.loads(f.read_bytes(), encoding="bytes")
    d[b"labels"] = [9, 9, 9, 9]
    f.write_bytes(pickle.dumps(d, protocol=2))
    c = load_dataset(_cfg(tmp_path, "cifar10"), 0)
    assert c.y[:4].tolist() == [9, 9, 9, 9]


def _write_leaf(root: Path) -> None:
    rng = np.random.default_rng(0)
    for part, sizes in (("train", {"f_b": 5, "f_a": 4, "f_c": 3}), ("test", {"f_b": 2,
                                                                            "f_a": 1,
                                                                            "f_c": 1})):
        d = root / "femnist" / "data" / part
        d.mkdir(parents=True)
        users = list(sizes)
        data = {u: {"x": rng.random((n, 784)).round(3).tolist(),
                    "y": [int(v) for v in rng.integers(0, 62, n)]} for u, n in sizes.items()}
        (d / f"all_data_0_niid_0_keep_0_{part}_9.json").write_text(json.dumps(
            {"users": users, "num_samples": [sizes[u] for u in users], "user_data": data}))


def test_femnist_natural_writer_split_keeps_leafs_train_test(tmp_path: Path) -> None:
    _write_leaf(tmp_path)
    from fedloom.data.federated import build_federated

    cfg = _cfg(tmp_path, "femnist", partition=PartitionConfig(name="natural"))
    ds = load_dataset(cfg, 0)
    assert ds.x.shape == (16, 1, 28, 28) and ds.num_classes == 62
    fed = build_federated(ds, cfg, 0)
    # writers sorted by id: f_a, f_b, f_c; each keeps LEAF's own train/test sizes
    assert [len(t) for t in fed.train] == [4, 5, 3]
    assert [len(t) for t in fed.test] == [1, 2, 1]
    assert len(fed.y_test) == 4


def test_femnist_writer_fraction_is_seeded(tmp_path: Path) -> None:
    _write_leaf(tmp_path)
    cfg = _cfg(tmp_path, "femnist", writer_fraction=0.34)
    a, b = load_dataset(cfg, 3), load_dataset(cfg, 3)
    assert len(np.unique(a.groups)) == 1 and torch.equal(a.x, b.x)


def test_femnist_damaged_json_names_file_and_user(tmp_path: Path) -> None:
    _write_leaf(tmp_path)
    f = next((tmp_path / "femnist" / "data" / "train").glob("*.json"))
    d = json.loads(f.read_text())
    d["num_samples"][0] = 99
    f.write_text(json.dumps(d))
    with pytest.raises(DatasetUnavailable, match=r"user 'f_b': expected num_samples=99"):
        load_dataset(_cfg(tmp_path, "femnist"), 0)
    f.write_text("{not json")
    with pytest.raises(DatasetUnavailable, match="not a LEAF json file"):
        load_dataset(_cfg(tmp_path, "femnist"), 0)


def _png(path: Path, color: tuple[int, int, int], size: int = 8, fmt: str = "PNG") -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (size, size), color).save(path, format=fmt)


def test_tiny_imagenet_tree(tmp_path: Path) -> None:
    d = tmp_path / "tiny-imagenet-200"
    wnids = ["n01443537", "n01629819"]
    d.mkdir(parents=True)
    (d / "wnids.txt").write_text("\n".join(wnids) + "\n")
    for i, w in enumerate(wnids):
        for j in range(3):
            _png(d / "train" / w / "images" / f"{w}_{j}.JPEG", (200 * i, 10 * j, 50), 64, "PNG")
    lines = []
    for j in range(4):
        _png(d / "val" / "images" / f"val_{j}.JPEG", (200 * (j % 2), 0, 0), 64, "PNG")
        lines.append(f"val_{j}.JPEG\t{wnids[j % 2]}\t0\t0\t63\t63")
    (d / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    ds = load_dataset(_cfg(tmp_path, "tiny-imagenet"), 0)
    assert ds.x.shape == (6, 3, 64, 64) and ds.y.tolist() == [0, 0, 0, 1, 1, 1]
    assert ds.y_test is not None and ds.y_test.tolist() == [0, 1, 0, 1]
    with pytest.raises(DatasetUnavailable, match=r"expected 200 classes x 500"):
        load_dataset(_data("tiny-imagenet", root=str(tmp_path)), 0)
    (d / "val" / "images" / "val_2.JPEG").unlink()
    with pytest.raises(DatasetUnavailable, match=r"val_2.JPEG: listed in val_annotations"):
        load_dataset(_cfg(tmp_path, "tiny-imagenet"), 0)


def test_image_folder_layouts_and_bad_images(tmp_path: Path) -> None:
    for cls, color in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
        for j in range(3):
            _png(tmp_path / "flat" / cls / f"{j}.png", color)
            _png(tmp_path / "split" / "train" / cls / f"{j}.png", color)
        _png(tmp_path / "split" / "test" / cls / "t.png", color)
    flat = load_dataset(_data("image-folder", path=str(tmp_path / "flat")), 0)
    assert flat.y.tolist() == [0, 0, 0, 1, 1, 1] and flat.x_test is None
    split = load_dataset(_data("image-folder", path=str(tmp_path / "split")), 0)
    assert split.y_test is not None and split.y_test.tolist() == [0, 1]
    # normalised with the training part's own per-channel statistics: red is high in "cat"
    assert split.x[0, 0].mean() > 0 > split.x[3, 0].mean()
    _png(tmp_path / "flat" / "dog" / "big.png", (0, 0, 255), size=16)
    with pytest.raises(DatasetUnavailable,
                       match=r"big.png: image is 16x16.*data.options.image_size"):
        load_dataset(_data("image-folder", path=str(tmp_path / "flat")), 0)
    resized = load_dataset(_data("image-folder", path=str(tmp_path / "flat"), image_size=12), 0)
    assert resized.x.shape == (7, 3, 12, 12)
    (tmp_path / "flat" / "dog" / "broken.png").write_bytes(b"not an image")
    with pytest.raises(DatasetUnavailable, match=r"broken\.png: cannot decode"):
        load_dataset(_data("image-folder", path=str(tmp_path / "flat"), image_size=12), 0)


def test_hf_parquet_with_string_labels(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    for part, n in (("train", 8), ("test", 4)):
        feats = rng.random((n, 5)).astype(np.float32)
        table = pa.table({"features": [list(map(float, r)) for r in feats],
                          "species": [["b", "a"][i % 2] for i in range(n)]})
        (tmp_path / "pq").mkdir(exist_ok=True)
        pq.write_table(table, tmp_path / "pq" / f"{part}-00000-of-00001.parquet")
    ds = load_dataset(_data("hf", path=str(tmp_path / "pq"), image_column="features",
                            label="species"), 0)
    assert ds.x.shape == (8, 5) and ds.x_test is not None and ds.x_test.shape == (4, 5)
    assert ds.y.tolist() == [1, 0] * 4 and ds.num_classes == 2  # "a" → 0, "b" → 1
    with pytest.raises(DatasetUnavailable, match=r"no column 'image'"):
        load_dataset(_data("hf", path=str(tmp_path / "pq"), label="species"), 0)


def test_cli_missing_dataset_is_one_line_exit_2(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "configs/quickstart.yaml", "data.name=cifar10",
                 f"data.options.root={tmp_path}", "--out", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "neither cifar-10-batches-py/ nor cifar-10-batches-bin/" in err[0]
    assert not (tmp_path / "run").exists()


def test_cli_runs_on_a_tiny_cifar_copy(tmp_path: Path) -> None:
    _write_cifar10_py(tmp_path, per_batch=8)
    out = tmp_path / "run"
    code = main(["run", "configs/quickstart.yaml", "data.name=cifar10",
                 f"data.options.root={tmp_path}", "data.options.verify=false",
                 "data.num_clients=4", "data.partition=iid",
                 "cohort.size=2", "rounds=1",
                 "model=cnn", "model.options.channels=[2,2]", "client.steps=1",
                 "checkpoint.every=0", "--out", str(out), "--quiet"])
    assert code == 0
    assert json.loads((out / "summary.json").read_text())["rounds"] == 1


# ------------------------------------------------------------------ augmentation
def test_augment_is_a_crop_of_the_padded_image_and_deterministic() -> None:
    x = torch.arange(2 * 3 * 6 * 6, dtype=torch.float32).view(2, 3, 6, 6)
    aug = Augment(padding=2, flip=0.5, fill=(-1.0, -2.0, -3.0))
    a = aug(x, torch.Generator().manual_seed(5))
    b = aug(x, torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and a.shape == x.shape
    g = torch.Generator().manual_seed(5)
    off = torch.randint(0, 5, (2, 2), generator=g)
    flips = torch.rand(2, generator=g) < 0.5
    for i in range(2):  # the same crop computed by hand from the drawn offsets
        pad = torch.stack([torch.nn.functional.pad(x[i, c], (2, 2, 2, 2), value=-(c + 1.0))
                           for c in range(3)])
        want = pad[:, off[0, i]:off[0, i] + 6, off[1, i]:off[1, i] + 6]
        if flips[i]:
            want = want.flip(-1)
        assert torch.equal(a[i], want)


def test_augment_changes_batches_and_depends_on_the_generator() -> None:
    x = torch.randn(16, 3, 8, 8)
    aug = make_augment("cifar10", "auto")
    assert aug is not None
    a = aug(x, torch.Generator().manual_seed(0))
    b = aug(x, torch.Generator().manual_seed(1))
    assert not torch.equal(a, x) and not torch.equal(a, b)
    # with no padding and no flip it is the identity
    assert torch.equal(Augment(padding=0, flip=0.0, fill=(0.0,))(x, torch.Generator()), x)


def test_make_augment_modes() -> None:
    assert make_augment("", "auto") is None and make_augment("cifar10", "none") is None
    aug = make_augment("cifar100", "standard")
    assert aug is not None and aug.fill[0] == pytest.approx(-0.5071 / 0.2673)
    with pytest.raises(ValueError, match=r"data\.augment: the source has no standard"):
        make_augment("", "standard")


def test_hf_saved_to_disk_grayscale_images_one_client_per_writer(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    # the Hub's FEMNIST columns: image (28x28 grayscale), character, writer_id
    writers = ["w3"] * 5 + ["w1"] * 2 + ["w2"] * 4 + ["w4"] * 9
    imgs = [Image.new("L", (28, 28), 10 * i) for i in range(len(writers))]
    ds = datasets.Dataset.from_dict({"image": imgs, "character": [i % 3 for i in
                                                                  range(len(writers))],
                                     "writer_id": writers},
                                    features=datasets.Features({
                                        "image": datasets.Image(),
                                        "character": datasets.Value("int64"),
                                        "writer_id": datasets.Value("string")}))
    ds.save_to_disk(str(tmp_path / "femnist"))
    # writers with 3..8 samples are eligible (w3: 5, w2: 4); both kept (num_clients 5)
    cfg = _data("hf", min_samples=3, num_clients=5, path=str(tmp_path / "femnist"),
                label="character", client="writer_id", max_client_samples=8)
    got = load_dataset(cfg, 0)
    assert got.x.shape == (9, 1, 28, 28) and got.natural
    assert got.groups is not None and np.bincount(got.groups).tolist() == [4, 5]  # w2, w3
    # one of the two eligible writers drawn when num_clients = 1, the same for a seed
    one = _data("hf", min_samples=3, num_clients=1, path=str(tmp_path / "femnist"),
                label="character", client="writer_id", max_client_samples=8)
    a, b = load_dataset(one, 7), load_dataset(one, 7)
    assert len(np.unique(a.groups)) == 1 and torch.equal(a.x, b.x)


def test_relative_data_path_is_looked_up_under_the_data_root(tmp_path: Path) -> None:
    for cls, color in (("a", (255, 0, 0)), ("b", (0, 255, 0))):
        _png(tmp_path / "root" / "shapes" / cls / "0.png", color)
    cfg = _data("image-folder", path="shapes", root=str(tmp_path / "root"))
    assert load_dataset(cfg, 0).y.tolist() == [0, 1]
    with pytest.raises(DatasetUnavailable,
                       match=r"data\.options\.path: nowhere: no such file .*looked"):
        load_dataset(_data("image-folder", path="nowhere", root=str(tmp_path / "root")), 0)


def test_missing_source_probe_and_datasets_listing(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from fedloom.data.sources import missing_source

    assert missing_source(DataConfig(name="mnist")) is None
    line = missing_source(_cfg(tmp_path, "cifar10"))
    assert line is not None and "neither cifar-10-batches-py/ nor" in line
    _write_cifar10_py(tmp_path)
    assert missing_source(_cfg(tmp_path, "cifar10")) is None
    assert "femnist" in (missing_source(_cfg(tmp_path, "femnist")) or "")
    assert main(["datasets", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.startswith("cifar10 "))
    assert " yes " in row and f"looked in: {tmp_path}/cifar-100-python" in out


def _cifar_run(tmp_path: Path, *extra: str) -> torch.Tensor:
    import fedloom

    cfg = {"name": "aug", "seed": 3, "rounds": 2, "dtype": "float64",
           "data": {"name": "cifar10", "options": {"root": str(tmp_path), "verify": False},
                    "num_clients": 3, "partition": {"name": "iid"},
                    "test_fraction": 0.0},
           "model": {"name": "cnn", "options": {"channels": [2, 2]}}, "cohort": {"size": 2},
           "client": {"lr": 0.05, "batch_size": 5, "steps": 3}, "checkpoint": {"every": 0}}
    return fedloom.run(cfg, list(extra)).w


def test_augmentation_in_training_is_seeded_and_backend_independent(tmp_path: Path) -> None:
    _write_cifar10_py(tmp_path, per_batch=6)
    auto = _cifar_run(tmp_path)                      # CIFAR: crop + flip by default
    assert torch.equal(auto, _cifar_run(tmp_path))   # the same draws on a rerun
    assert not torch.equal(auto, _cifar_run(tmp_path, "data.augment=none"))
    assert torch.equal(auto, _cifar_run(tmp_path, "data.augment=standard"))
    # vmap draws each client's crops from the same (seed, round, client, step) streams
    vm = _cifar_run(tmp_path, "backend=vmap")
    assert torch.allclose(auto, vm, rtol=0, atol=1e-12)
    # ... and the process backend's workers too
    pr = _cifar_run(tmp_path, "backend=process", "backend.options.workers=2")
    assert torch.allclose(auto, pr, rtol=0, atol=1e-12)
