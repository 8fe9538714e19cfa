"""FLAIR (Song et al., NeurIPS 2022) from disk, in pfl-research's HDF5 layout: multi-label images.

``<root>/flair/flair_federated.hdf5`` as pfl-research's
``benchmarks/dataset/flair/prepare_dataset.py`` writes it: per user
``/{train,val,test}/<user>/images`` (uint8 ``[n, H, W, 3]``, 256 x 256 as published),
``labels_row``/``labels_col`` (the 17 coarse labels) and
``fine_grained_labels_row``/``_col`` (the 1,628 fine ones) as sparse indices of the
multi-hot target, ``image_ids``; ``/metadata/label_mapping`` and
``fine_grained_label_mapping`` (json, label → column).

Each training user is one client (its first ``max_user_images`` images, pfl's 512);
the ``eval_split`` users (``val``, pfl's central evaluation) are the global test set.
Images are resized to ``image_size`` (0: as stored) and normalised with ImageNet's
statistics (pfl's ``get_channel_mean_stddevs('imagenet')``). The targets are multi-hot
``[n, C]`` int64 in {0, 1}: with a model whose logits are ``[B, 2, C]`` with the first
row zero (:mod:`fedloom.models.published`), cross-entropy over the two rows is
binary cross-entropy with logits per label, averaged over labels and images as pfl's
``BCEWithLogitsLoss``; the token accuracy of a sequence target is then pfl's micro
accuracy. Averaged precision per class: :func:`fedloom.metrics.averaged_precision`.
``verify`` checks label indices, row counts and the mapping's size (17 or 1,628).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import torch
from torch.nn import functional as F

from fedloom.config import DataConfig
from fedloom.data.disk.common import _cached, _here, _looked, _normalise, data_root
from fedloom.data.disk.stackoverflow import INSTALL_H5, h5_part, open_h5
from fedloom.data.sources import Dataset, DatasetUnavailable, _has_module, _source
from fedloom.registry import Range

__all__ = ["flair", "read_flair"]

_IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
_PUBLISHED_CLASSES = {"coarse": 17, "fine": 1628}


def _file(root: Path) -> Path | None:
    for p in (root / "flair" / "flair_federated.hdf5", root / "flair_federated.hdf5"):
        if p.is_file():
            return p
    return None


def _resize(u8: np.ndarray, size: int) -> np.ndarray:
    if not size or u8.shape[1:3] == (size, size) or not len(u8):
        return u8
    x = torch.from_numpy(u8).permute(0, 3, 1, 2).float()
    x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return x.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def _user(f: Any, path: Path, key: str, prefix: str, classes: int, cap: int, size: int,
          verify: bool) -> tuple[np.ndarray, np.ndarray]:
    imgs = h5_part(f, f"{key}/images", path)
    n_all = int(imgs.shape[0])
    n = min(n_all, cap) if cap else n_all
    x = np.asarray(imgs[:n])
    if x.ndim != 4 or x.shape[-1] != 3 or x.dtype != np.uint8:
        raise DatasetUnavailable(f"{path}: {key}/images must be uint8 [n, H, W, 3], got "
                                 f"{x.dtype} {x.shape}")
    rows = np.asarray(h5_part(f, f"{key}/{prefix}_row", path)[()]).astype(np.int64)
    cols = np.asarray(h5_part(f, f"{key}/{prefix}_col", path)[()]).astype(np.int64)
    if len(rows) != len(cols) or (verify and len(rows) and (
            rows.min() < 0 or rows.max() >= n_all or cols.min() < 0 or cols.max() >= classes)):
        raise DatasetUnavailable(f"{path}: {key}/{prefix}_row/_col: {len(rows)} and {len(cols)} "
                                 f"indices, rows within 0..{n_all - 1} and columns within "
                                 f"0..{classes - 1} needed (data.options.verify=false skips "
                                 "the ranges)")
    y = np.zeros((n, classes), dtype=np.int64)
    keep = rows < n
    y[rows[keep], np.clip(cols[keep], 0, classes - 1)] = 1
    return _resize(x, size), y


def read_flair(path: Path, split: str, *, labels: str = "coarse", max_user_images: int = 512,
               max_clients: int = 0, image_size: int = 0, verify: bool = True
               ) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """The users of one split (``train``, ``val``, ``test``) as ``(images, multi-hot)``
    in sorted order of their ids, and the number of classes."""
    prefix = "labels" if labels == "coarse" else "fine_grained_labels"
    with open_h5(path) as f:
        key = "metadata/label_mapping" if labels == "coarse" else \
            "metadata/fine_grained_label_mapping"
        try:
            classes = len(json.loads(h5_part(f, key, path)[()]))
        except (ValueError, TypeError) as e:
            raise DatasetUnavailable(f"{path}: {key} is not a json mapping ({e})") from None
        if verify and classes != _PUBLISHED_CLASSES[labels]:
            raise DatasetUnavailable(f"{path}: {key} has {classes} labels, FLAIR has "
                                     f"{_PUBLISHED_CLASSES[labels]} (data.options.verify=false "
                                     "skips this check)")
        users = sorted(h5_part(f, split, path).keys())[: max_clients or None]
        out = [_user(f, path, f"{split}/{u}", prefix, classes, max_user_images, image_size,
                     verify) for u in users]
    return out, classes


def _probe(data: DataConfig, *, root: str = "", **_: Any) -> str | None:
    where = data_root(root)
    if _file(where) is None:
        return f"data.name=flair: {where / 'flair' / 'flair_federated.hdf5'}: missing"
    return None if _has_module("h5py") else f"data.name=flair needs h5py; {INSTALL_H5}"


@_source("flair", "FLAIR multi-label images (pfl-research's HDF5), one client per user",
         _here(lambda r: _file(r) is not None),
         "run pfl-research's benchmarks/dataset/flair/download_dataset.py and "
         "prepare_dataset.py; put flair/flair_federated.hdf5 under data.options.root",
         checks_itself=True, where=_looked("flair/flair_federated.hdf5"), probe=_probe)
def flair(data: DataConfig, seed: int, *, root: str = "", verify: bool = True,
          labels: Literal["coarse", "fine"] = "coarse",
          image_size: Annotated[int, Range(ge=0)] = 0,
          max_user_images: Annotated[int, Range(ge=0)] = 512,
          max_clients: Annotated[int, Range(ge=0)] = 0,
          eval_split: Literal["val", "test"] = "val") -> Dataset:
    """``root``: the data root; ``verify``: check labels; ``labels``: 17 coarse or 1,628
    fine; ``image_size``: resize side (0: as stored); ``max_user_images``: a user's
    first images (pfl: 512); ``max_clients``: the first users of each split (0 all);
    ``eval_split``: the users of the global test set."""
    path = _file(data_root(root))
    if path is None:
        raise DatasetUnavailable(f"data.name=flair: {data_root(root) / 'flair'}: no "
                                 "flair_federated.hdf5 (set data.options.root or $FEDLOOM_DATA)")

    def decode() -> dict[str, np.ndarray]:
        kw: dict[str, Any] = {"labels": labels, "max_user_images": max_user_images,
                              "max_clients": max_clients, "image_size": image_size,
                              "verify": verify}
        train, classes = read_flair(path, "train", **kw)
        test, _ = read_flair(path, eval_split, **kw)
        if not train or not sum(len(x) for x, _ in train):
            raise DatasetUnavailable(f"{path}: no training image")
        both = train + test
        if len({x.shape[1:] for x, _ in both if len(x)}) > 1:
            raise DatasetUnavailable(f"{path}: images differ in size (set "
                                     "data.options.image_size)")
        g = [np.full(len(x), k, dtype=np.int64) for k, (x, _) in enumerate(train)]
        return {"x": np.concatenate([x for x, _ in train]),
                "y": np.concatenate([y for _, y in train]), "g": np.concatenate(g),
                "xt": np.concatenate([x for x, _ in test] or [train[0][0][:0]]),
                "yt": np.concatenate([y for _, y in test] or [train[0][1][:0]]),
                "c": np.array([classes])}

    a = _cached("flair", [path], f"{verify}|{labels}|{image_size}|{max_user_images}|"
                f"{max_clients}|{eval_split}", decode)
    return Dataset("flair", _normalise(a["x"], *_IMAGENET), torch.from_numpy(a["y"]),
                   int(a["c"][0]), groups=a["g"], natural=True,
                   x_test=_normalise(a["xt"], *_IMAGENET), y_test=torch.from_numpy(a["yt"]))
