"""FEMNIST from disk, in LEAF's json layout: one client per writer.

:func:`read_femnist` reads ``femnist/data/{train,test}/*.json`` (or
``femnist/{train,test}``), checks every writer's records (784 pixels in [0, 1],
labels 0…61, ``num_samples``) and caches the decoded arrays; the source
``femnist`` keeps LEAF's per-writer train/test split and samples
``data.options.writer_fraction`` of the writers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch

from fedloom.config import DataConfig
from fedloom.data.disk.common import _cached, _here, _looked, data_root
from fedloom.data.sources import Dataset, DatasetUnavailable, _source
from fedloom.registry import Range
from fedloom.rng import Purpose, numpy_gen


def _probe_femnist(data: DataConfig, *, root: str = "", **_: Any) -> str | None:
    where = data_root(root)
    if _femnist_dirs(where) is None:
        return (f"data.name=femnist: {where / 'femnist' / 'data'}: needs train/*.json and "
                "test/*.json")
    return None


def _femnist_dirs(root: Path) -> tuple[Path, Path] | None:
    for base in (root / "femnist" / "data", root / "femnist"):
        tr, te = base / "train", base / "test"
        if tr.is_dir() and te.is_dir() and any(tr.glob("*.json")) and any(te.glob("*.json")):
            return tr, te
    return None


def _read_leaf_part(files: list[Path]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for f in files:
        try:
            d = json.loads(f.read_bytes())
            users, counts, udata = d["users"], d["num_samples"], d["user_data"]
        except (ValueError, KeyError, TypeError) as e:
            raise DatasetUnavailable(f"{f}: not a LEAF json file ({type(e).__name__}: "
                                     f"{str(e)[:80]})") from None
        if len(users) != len(counts):
            raise DatasetUnavailable(f"{f}: {len(users)} users but {len(counts)} num_samples")
        for u, n in zip(users, counts, strict=True):
            rec = udata.get(u)
            if rec is None:
                raise DatasetUnavailable(f"{f}: user {u!r} has no user_data")
            try:
                x = np.asarray(rec["x"], dtype=np.float32)
                y = np.asarray(rec["y"], dtype=np.int64)
            except (KeyError, ValueError, TypeError) as e:
                raise DatasetUnavailable(f"{f}: user {u!r}: bad x/y ({e})") from None
            if x.ndim != 2 or x.shape[1] != 784 or len(y) != len(x) or len(y) != n:
                raise DatasetUnavailable(
                    f"{f}: user {u!r}: expected num_samples={n} rows of 784 pixels and as many "
                    f"labels, got x {x.shape}, y {y.shape}")
            if len(y) and (y.min() < 0 or y.max() > 61):
                raise DatasetUnavailable(f"{f}: user {u!r}: labels outside 0..61")
            if len(x) and (not np.isfinite(x).all() or x.min() < 0 or x.max() > 1):
                raise DatasetUnavailable(f"{f}: user {u!r}: pixels outside [0, 1]")
            if u in out:  # a writer split over several files: concatenate
                px, py = out[u]
                x, y = np.concatenate([px, x]), np.concatenate([py, y])
            out[u] = (x, y)
    return out


def read_femnist(root: Path) -> dict[str, np.ndarray]:
    """LEAF FEMNIST: per-sample pixels, labels, writer index and test flag.

    Writers are numbered in sorted order of their ids; a writer that appears in
    only one of train/test keeps what it has.
    """
    dirs = _femnist_dirs(root)
    if dirs is None:
        raise DatasetUnavailable(
            f"data.name=femnist: {root / 'femnist' / 'data'}: needs train/*.json and "
            "test/*.json (LEAF's layout; set data.options.root or $FEDLOOM_DATA)")
    trf, tef = sorted(dirs[0].glob("*.json")), sorted(dirs[1].glob("*.json"))

    def decode() -> dict[str, np.ndarray]:
        tr, te = _read_leaf_part(trf), _read_leaf_part(tef)
        writers = sorted(set(tr) | set(te))
        xs, ys, gs, ts = [], [], [], []
        for k, u in enumerate(writers):
            for part, is_test in ((tr, False), (te, True)):
                if u in part:
                    x, y = part[u]
                    xs.append(x)
                    ys.append(y)
                    gs.append(np.full(len(y), k, dtype=np.int64))
                    ts.append(np.full(len(y), is_test))
        return {"x": np.concatenate(xs).astype(np.float32), "y": np.concatenate(ys),
                "writer": np.concatenate(gs), "test": np.concatenate(ts)}

    return _cached("femnist", [*trf, *tef], "", decode)


@_source("femnist", "FEMNIST (LEAF, 62 classes, one client per writer) from disk",
         _here(lambda r: _femnist_dirs(r) is not None),
         "run LEAF's femnist preprocess and put femnist/data/{train,test}/ under data.options.root",
         checks_itself=True, where=_looked("femnist/data/{train,test}/", "femnist/{train,test}/"),
         probe=_probe_femnist)
def femnist(data: DataConfig, seed: int, *, root: str = "",
            writer_fraction: Annotated[float, Range(gt=0, le=1)] = 1.0) -> Dataset:
    """``root``: the data root; ``writer_fraction``: the fraction of writers kept, drawn
    from the seed (LEAF's ``--sf``)."""
    arrs = read_femnist(data_root(root))
    writer, is_test = arrs["writer"], arrs["test"].astype(bool)
    keep = np.ones(len(writer), dtype=bool)
    if writer_fraction < 1.0:
        n_w = int(writer.max()) + 1
        n_keep = max(1, round(writer_fraction * n_w))
        chosen = numpy_gen(seed, -1, -1, Purpose.DATA).choice(n_w, n_keep, replace=False)
        keep = np.isin(writer, chosen)
    # renumber the kept writers 0..K-1 in their original order
    _, groups = np.unique(writer[keep], return_inverse=True)
    x = torch.from_numpy(arrs["x"][keep]).reshape(-1, 1, 28, 28)
    return Dataset("femnist", x, torch.from_numpy(arrs["y"][keep]), 62,
                   groups=groups.astype(np.int64), natural=True, test_mask=is_test[keep])
