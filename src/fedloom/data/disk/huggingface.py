"""Hugging Face datasets from disk, offline: ``save_to_disk`` folders or parquet files.

The source ``hf`` reads ``data.options.path`` with the ``datasets`` library (never the Hub),
takes the image or feature column ``data.options.image_column`` and the label column
``data.options.label``, and with ``data.options.client`` makes one client per value of that column,
the writers picked by ``_pick_writers`` as the CRAFT code selects FEMNIST's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch

from fedloom.config import DataConfig
from fedloom.data.disk.common import _probe_path, _user_path
from fedloom.data.disk.images import _images_dataset
from fedloom.data.sources import Dataset, DatasetUnavailable, _has_module, _source
from fedloom.registry import Range
from fedloom.rng import Purpose, numpy_gen


def _hf_splits(path: Path) -> dict[str, Any]:
    import datasets

    try:
        if path.is_dir() and any((path / f).is_file() for f in
                                 ("dataset_dict.json", "dataset_info.json", "state.json")):
            ds = datasets.load_from_disk(str(path))
        else:
            files = ([str(p) for p in sorted(path.rglob("*.parquet"))] if path.is_dir()
                     else [str(path)])
            if not files:
                raise DatasetUnavailable(f"data.options.path: {path}: no save_to_disk "
                                         "dataset and no *.parquet file")
            by_split: dict[str, list[str]] = {}
            for f in files:  # split from the file name, as the Hub's parquet layout names them
                stem = Path(f).stem.lower()
                split = next((s for s in ("train", "test", "validation", "val")
                              if stem.startswith(s) or f"/{s}/" in f.lower()
                              or f"-{s}" in stem), "train")
                by_split.setdefault(split, []).append(f)
            ds = datasets.load_dataset("parquet", data_files=by_split)
    except DatasetUnavailable:
        raise
    except Exception as e:  # the datasets library's own errors, one line
        raise DatasetUnavailable(f"data.options.path: {path}: cannot read it with the datasets "
                                 f"library ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
                                 ) from None
    if isinstance(ds, datasets.Dataset):
        return {"train": ds}
    return dict(ds)


def _hf_arrays(split: Any, col: str, label: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    for c in (col, label):
        if c not in split.column_names:
            raise DatasetUnavailable(f"{where}: no column {c!r} (columns: "
                                     f"{', '.join(split.column_names)}; set "
                                     "data.options.image_column / data.options.label)")
    raw_y = split[label]
    values = split[col]
    first = values[0] if len(values) else None
    if first is not None and hasattr(first, "convert"):  # PIL images (an Image feature)
        # grayscale stays one channel (FEMNIST, MNIST); anything else becomes RGB
        mode = "L" if all(getattr(im, "mode", "") in ("L", "1") for im in values) else "RGB"
        buf = []
        for im in values:
            a = np.asarray(im.convert(mode), dtype=np.uint8)
            buf.append(a[:, :, None] if mode == "L" else a)
        try:
            x = np.stack(buf)
        except ValueError:
            raise DatasetUnavailable(f"{where}: images of different sizes in column "
                                     f"{col!r}") from None
    else:
        try:
            x = np.asarray(values)
        except ValueError:
            raise DatasetUnavailable(f"{where}: column {col!r} is ragged") from None
    return x, np.asarray(raw_y)


def _pick_writers(groups: np.ndarray, cfg: DataConfig, most: int, seed: int) -> np.ndarray:
    """A keep-mask over samples: writers with ``data.min_samples`` … ``most``
    (``data.options.max_client_samples``; 0 = no upper bound) samples are eligible, and
    ``data.num_clients`` of them are drawn from ``(seed, "data")`` when more are eligible
    (the CRAFT code's FEMNIST selection)."""
    ids, counts = np.unique(groups, return_counts=True)
    ok = counts >= cfg.min_samples
    if most:
        ok &= counts <= most
    eligible = ids[ok]
    if len(eligible) == 0:
        raise DatasetUnavailable(f"data.min_samples / data.options.max_client_samples: no "
                                 f"client has {cfg.min_samples}..{most or 'any'} samples")
    if len(eligible) > cfg.num_clients:
        gen = numpy_gen(seed, -1, -1, Purpose.DATA)
        eligible = np.sort(gen.choice(eligible, cfg.num_clients, replace=False))
    return np.isin(groups, eligible)


@_source("hf", "a Hugging Face dataset saved to disk or as parquet (data.options.path), "
         "offline", lambda: _has_module("datasets"),
         "pip install datasets  (or: pip install 'fedloom[hf]')",
         probe=lambda data, *, path="", root="", **_: (
             _probe_path(path, root) if _has_module("datasets") else
             "data.name=hf: needs the datasets library: pip install 'fedloom[hf]'"))
def hf(data: DataConfig, seed: int, *, path: str = "", root: str = "", label: str = "label",
       client: str = "", image_column: str = "image",
       max_client_samples: Annotated[int, Range(ge=0)] = 0) -> Dataset:
    """``path``: a save_to_disk folder or parquet files (also looked for under ``root``);
    ``label``, ``image_column``: its columns; ``client``: the column of the writers, one
    client each (the natural split), those with more than ``max_client_samples`` samples
    not eligible (0: no bound)."""
    if not path:
        raise DatasetUnavailable("data.options.path: hf needs a save_to_disk folder or "
                                 "parquet files")
    folder = _user_path(path, root)
    splits = _hf_splits(folder)
    train_key = "train" if "train" in splits else next(iter(splits))
    test_key = next((k for k in ("test", "validation", "val") if k in splits and k != train_key),
                    None)
    xtr, ytr = _hf_arrays(splits[train_key], image_column, label, f"{folder}[{train_key}]")
    xte, yte = (_hf_arrays(splits[test_key], image_column, label, f"{folder}[{test_key}]")
                if test_key else (None, None))
    # labels: integers kept; anything else mapped in sorted order
    all_y = ytr if yte is None else np.concatenate([ytr, yte])
    if all_y.dtype.kind in "iu":
        ytr_i, yte_i = ytr.astype(np.int64), None if yte is None else yte.astype(np.int64)
        if all_y.min() < 0:
            raise DatasetUnavailable(f"{folder}: column {label!r} has negative labels")
        classes = int(all_y.max()) + 1
    else:
        names = sorted({str(v) for v in all_y})
        idx = {n: i for i, n in enumerate(names)}
        ytr_i = np.array([idx[str(v)] for v in ytr], dtype=np.int64)
        yte_i = None if yte is None else np.array([idx[str(v)] for v in yte], dtype=np.int64)
        classes = len(names)
    if classes < 2:
        raise DatasetUnavailable(f"{folder}: column {label!r} has fewer than 2 classes")
    groups = None
    if client:  # one client per value of this column (writers): the natural split
        col = splits[train_key]
        if client not in col.column_names:
            raise DatasetUnavailable(f"{folder}[{train_key}]: no column {client!r} "
                                     "(data.options.client)")
        _, groups = np.unique(np.asarray([str(v) for v in col[client]]),
                              return_inverse=True)
        keep = _pick_writers(groups, data, max_client_samples, seed)
        xtr, ytr_i = xtr[keep], ytr_i[keep]
        _, groups = np.unique(groups[keep], return_inverse=True)
    if xtr.dtype == np.uint8 and xtr.ndim == 4:  # decoded images, NHWC
        arrs: dict[str, Any] = {"train_x": xtr, "train_y": ytr_i}
        if xte is not None:
            arrs.update(test_x=xte, test_y=yte_i)
        ds = _images_dataset("hf", arrs, classes)
        if groups is not None:
            ds.groups, ds.natural = groups.astype(np.int64), True
        return ds
    if xtr.dtype.kind not in "iuf" or not np.isfinite(xtr.astype(np.float64)).all():
        raise DatasetUnavailable(f"{folder}: column {image_column!r} must hold images or "
                                 "finite numbers")
    to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
    return Dataset("hf", to_t(xtr), torch.from_numpy(ytr_i), classes,
                   x_test=None if xte is None else to_t(xte),
                   y_test=None if yte_i is None else torch.from_numpy(yte_i),
                   groups=None if groups is None else groups.astype(np.int64),
                   natural=groups is not None)
