"""Image files from disk, decoded with PIL: Tiny-ImageNet-200 and image folders.

``_decode_images`` decodes (and with ``data.options.image_size`` resizes) a list of image
files into uint8 RGB; :func:`read_tiny_imagenet` reads ``tiny-imagenet-200/`` (the
labelled validation set is the test set) and :func:`read_image_folder` a folder of
class folders, or its ``train/`` and ``test/`` (``val/``) parts. An image folder is
normalised with its own training part's statistics (``_images_dataset``, which the
``hf`` source uses for decoded images too).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch

from fedloom.config import DataConfig
from fedloom.data.disk.common import (
    _cached,
    _channel_stats,
    _check_class_counts,
    _here,
    _looked,
    _normalise,
    _probe_path,
    _user_path,
    data_root,
)
from fedloom.data.sources import Dataset, DatasetUnavailable, _has_module, _source
from fedloom.registry import Range

_IMAGE_EXT = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".tif", ".tiff", ".webp")


def _probe_tiny(data: DataConfig, *, root: str = "", **_: Any) -> str | None:
    return (None if _tiny_complete(data_root(root)) else
            f"data.name=tiny-imagenet: {_tiny_dir(data_root(root))}: missing or incomplete")


def _tiny_dir(root: Path) -> Path:
    return root / "tiny-imagenet-200"


def _tiny_complete(root: Path) -> bool:
    d = _tiny_dir(root)
    return ((d / "wnids.txt").is_file() and (d / "train").is_dir()
            and (d / "val" / "val_annotations.txt").is_file() and (d / "val" / "images").is_dir())


def _decode_images(paths: Sequence[Path], size: int) -> np.ndarray:
    """Decode images to uint8 RGB ``[n, size, size, 3]`` (size 0: as stored, all equal)."""
    from PIL import Image, UnidentifiedImageError

    out: list[np.ndarray] = []
    shape = None
    for p in paths:
        try:
            with Image.open(p) as im:
                rgb = im.convert("RGB")
                if size:
                    rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
                a = np.asarray(rgb, dtype=np.uint8)
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise DatasetUnavailable(f"{p}: cannot decode the image ({e})") from None
        if shape is None:
            shape = a.shape
        elif a.shape != shape:
            raise DatasetUnavailable(f"{p}: image is {a.shape[1]}x{a.shape[0]}, the others "
                                     f"{shape[1]}x{shape[0]} (set data.options.image_size to "
                                     "resize)")
        out.append(a)
    return np.stack(out) if out else np.zeros((0, size or 1, size or 1, 3), np.uint8)


def read_tiny_imagenet(root: Path, verify: bool = True) -> dict[str, np.ndarray]:
    """Tiny-ImageNet-200: train (500 per class) and the labelled val set (50 per class)."""
    d = _tiny_dir(root)
    if not _tiny_complete(root):
        need = [p for p in ("wnids.txt", "train", "val/images", "val/val_annotations.txt")
                if not (d / p).exists()]
        raise DatasetUnavailable(f"data.name=tiny-imagenet: {d}: missing {', '.join(need)} "
                                 "(set data.options.root or $FEDLOOM_DATA)")
    wnids = [w.strip() for w in (d / "wnids.txt").read_text().split() if w.strip()]
    index = {w: i for i, w in enumerate(wnids)}
    train: list[tuple[Path, int]] = []
    for w in wnids:
        imgs = d / "train" / w / "images"
        if not imgs.is_dir():
            raise DatasetUnavailable(f"{imgs}: missing (class {w} of wnids.txt)")
        train += [(p, index[w]) for p in sorted(imgs.iterdir())
                  if p.suffix.lower() in _IMAGE_EXT]
    val: list[tuple[Path, int]] = []
    ann = d / "val" / "val_annotations.txt"
    for i, line in enumerate(ann.read_text().splitlines()):
        parts = line.split("\t")
        if not line.strip():
            continue
        if len(parts) < 2 or parts[1] not in index:
            raise DatasetUnavailable(f"{ann}: line {i + 1}: expected 'file<TAB>wnid' with a "
                                     "wnid of wnids.txt")
        p = d / "val" / "images" / parts[0]
        if not p.is_file():
            raise DatasetUnavailable(f"{p}: listed in val_annotations.txt but missing")
        val.append((p, index[parts[1]]))

    def decode() -> dict[str, np.ndarray]:
        return {"train_x": _decode_images([p for p, _ in train], 0),
                "train_y": np.array([c for _, c in train], dtype=np.int64),
                "test_x": _decode_images([p for p, _ in val], 0),
                "test_y": np.array([c for _, c in val], dtype=np.int64)}

    arrs = _cached("tiny-imagenet", [ann, d / "wnids.txt", *(p for p, _ in train + val)], "",
                   decode)
    if verify:
        _check_class_counts("tiny-imagenet train", arrs["train_y"], 200, 500, d)
        _check_class_counts("tiny-imagenet val", arrs["test_y"], 200, 50, d)
    return arrs


@_source("tiny-imagenet", "Tiny-ImageNet-200 (100k/10k, 64x64 RGB) from disk",
         _here(_tiny_complete),
         "unzip tiny-imagenet-200.zip under data.options.root ($FEDLOOM_DATA)",
         checks_itself=True, where=_looked("tiny-imagenet-200/"), probe=_probe_tiny)
def tiny_imagenet(data: DataConfig, seed: int, *, root: str = "",
                  verify: bool = True) -> Dataset:
    """``root``: the data root; ``verify``: check the class counts."""
    arrs = read_tiny_imagenet(data_root(root), verify)
    mean, std = (0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821)
    classes = 200
    return Dataset("tiny-imagenet", _normalise(arrs["train_x"], mean, std),
                   torch.from_numpy(arrs["train_y"]), classes,
                   x_test=_normalise(arrs["test_x"], mean, std),
                   y_test=torch.from_numpy(arrs["test_y"]), augment="tiny-imagenet")


def _class_dirs(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))


def _list_folder(d: Path, classes: list[str] | None) -> tuple[list[tuple[Path, int]], list[str]]:
    dirs = _class_dirs(d)
    names = [p.name for p in dirs] if classes is None else classes
    index = {n: i for i, n in enumerate(names)}
    items: list[tuple[Path, int]] = []
    for p in dirs:
        if p.name not in index:
            raise DatasetUnavailable(f"{p}: class folder not among the training classes")
        items += [(f, index[p.name]) for f in sorted(p.rglob("*"))
                  if f.is_file() and f.suffix.lower() in _IMAGE_EXT]
    return items, names


def read_image_folder(path: Path, size: int = 0) -> dict[str, Any]:
    """One sub-folder per class (sorted names → labels 0…C−1), or ``train/`` and
    ``test/`` (or ``val/``) folders of that layout."""
    if not path.is_dir():
        raise DatasetUnavailable(f"data.options.path: {path}: no such directory")
    split = path / "train"
    test = next((path / t for t in ("test", "val") if (path / t).is_dir()), None)
    if split.is_dir() and test is not None:
        tr, names = _list_folder(split, None)
        te, _ = _list_folder(test, names)
    else:
        tr, names = _list_folder(path, None)
        te = []
    if len(names) < 2:
        raise DatasetUnavailable(f"data.options.path: {path}: needs one sub-folder per class, "
                                 f"found {len(names)}")
    if not tr:
        raise DatasetUnavailable(f"data.options.path: {path}: no image files "
                                 f"({', '.join(_IMAGE_EXT)})")

    def decode() -> dict[str, np.ndarray]:
        out = {"train_x": _decode_images([p for p, _ in tr], size),
               "train_y": np.array([c for _, c in tr], dtype=np.int64)}
        if te:
            out["test_x"] = _decode_images([p for p, _ in te], size)
            out["test_y"] = np.array([c for _, c in te], dtype=np.int64)
        return out

    arrs: dict[str, Any] = dict(_cached("imagefolder", [p for p, _ in tr + te], str(size),
                                        decode))
    if te and arrs["test_x"].shape[1:] != arrs["train_x"].shape[1:]:
        raise DatasetUnavailable(f"data.options.path: {path}: test images differ in size from the "
                                 "training images (set data.options.image_size)")
    arrs["classes"] = names
    return arrs


def _images_dataset(name: str, arrs: dict[str, Any], classes: int) -> Dataset:
    mean, std = _channel_stats(arrs["train_x"])
    has_test = "test_x" in arrs
    return Dataset(name, _normalise(arrs["train_x"], mean, std),
                   torch.from_numpy(arrs["train_y"]), classes,
                   x_test=_normalise(arrs["test_x"], mean, std) if has_test else None,
                   y_test=torch.from_numpy(arrs["test_y"]) if has_test else None)


@_source("image-folder", "your images, one sub-folder per class (data.options.path)",
         lambda: _has_module("PIL"), "pip install pillow  (or: pip install 'fedloom[images]')",
         checks_itself=True,
         probe=lambda data, *, path="", root="", **_: _probe_path(path, root))
def image_folder(data: DataConfig, seed: int, *, path: str = "", root: str = "",
                 image_size: Annotated[int, Range(ge=0)] = 0) -> Dataset:
    """``path``: the folder of class folders (also looked for under ``root``, the data
    root); ``image_size``: the side images are resized to (0: as stored)."""
    if not path:
        raise DatasetUnavailable("data.options.path: image-folder needs the folder of class "
                                 "folders")
    arrs = read_image_folder(_user_path(path, root), image_size)
    return _images_dataset("image-folder", arrs, len(arrs["classes"]))
