"""CIFAR-10 and CIFAR-100 from disk: the python (pickled) or the binary batches.

:func:`read_cifar` reads the first complete layout under the data root (python,
then binary) into uint8 NHWC arrays, cached; the sources ``cifar10`` and
``cifar100`` normalise them with the published statistics.

Pickles are read with an unpickler that builds only dicts, lists, strings,
numbers and NumPy arrays: a damaged or hostile file cannot run code.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from fedloom.config import DataConfig
from fedloom.data.disk.common import (
    _cached,
    _check_class_counts,
    _here,
    _looked,
    _normalise,
    data_root,
)
from fedloom.data.sources import Dataset, DatasetUnavailable, _source


class _SafeUnpickler(pickle.Unpickler):
    """Builds dicts, lists, strings, numbers and NumPy arrays, nothing else."""

    _ALLOWED: ClassVar[frozenset[tuple[str, str]]] = frozenset({
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("copy_reg", "_reconstructor"), ("copyreg", "_reconstructor"),
        ("__builtin__", "object"), ("builtins", "object"),
        # protocol-2 pickles written by Python 3 carry bytes as _codecs.encode(s, "latin1")
        ("_codecs", "encode"),
    })

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _load_pickle(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            obj = _SafeUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError) as e:
        raise DatasetUnavailable(f"{path}: not a CIFAR pickle batch ({e})") from None
    if not isinstance(obj, dict):
        raise DatasetUnavailable(f"{path}: not a CIFAR pickle batch (not a dict)")
    return {k.decode() if isinstance(k, bytes) else str(k): v for k, v in obj.items()}


_CIFAR = {
    # name: (python dir, train files, test files, binary dir, bin train, bin test, classes)
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"],
                "cifar-10-batches-bin", [f"data_batch_{i}.bin" for i in range(1, 6)],
                ["test_batch.bin"]),
    "cifar100": ("cifar-100-python", ["train"], ["test"], "cifar-100-binary", ["train.bin"],
                 ["test.bin"]),
}
_CIFAR_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


def _cifar_layout(name: str, root: Path) -> tuple[str, list[Path], list[Path]] | None:
    """The first complete layout under ``root`` (python, then binary), or None."""
    pydir, ptr, pte, bindir, btr, bte = _CIFAR[name]
    for kind, d, tr, te in (("python", pydir, ptr, pte), ("binary", bindir, btr, bte)):
        files = [root / d / f for f in (*tr, *te)]
        if all(f.is_file() for f in files):
            return kind, files[: len(tr)], files[len(tr):]
    return None


def _cifar_missing(name: str, root: Path) -> str:
    pydir, ptr, pte, bindir, btr, bte = _CIFAR[name]
    for d, fs in ((pydir, (*ptr, *pte)), (bindir, (*btr, *bte))):
        if (root / d).is_dir():
            missing = [f for f in fs if not (root / d / f).is_file()]
            return f"{root / d}: missing {', '.join(missing)}"
    return f"{root}: neither {pydir}/ nor {bindir}/ is there"


def _read_cifar_python(files: list[Path], name: str, labels: str) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    key = "labels" if name == "cifar10" else f"{labels}_labels"
    for f in files:
        d = _load_pickle(f)
        if "data" not in d or key not in d:
            raise DatasetUnavailable(f"{f}: a CIFAR batch needs 'data' and '{key}'")
        x = np.asarray(d["data"], dtype=np.uint8)
        y = np.asarray(d[key], dtype=np.int64)
        if x.ndim != 2 or x.shape[1] != 3072 or len(y) != len(x):
            raise DatasetUnavailable(f"{f}: 'data' must be N x 3072 with N labels, got "
                                     f"{x.shape} and {len(y)} labels")
        xs.append(x)
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


def _read_cifar_binary(files: list[Path], name: str, labels: str) -> tuple[np.ndarray, np.ndarray]:
    nlab = 1 if name == "cifar10" else 2
    rec = nlab + 3072
    xs, ys = [], []
    for f in files:
        raw = np.fromfile(f, dtype=np.uint8)
        if raw.size == 0 or raw.size % rec:
            raise DatasetUnavailable(f"{f}: {raw.size} bytes is not a whole number of "
                                     f"{rec}-byte records")
        r = raw.reshape(-1, rec)
        col = 0 if name == "cifar10" or labels == "coarse" else 1
        ys.append(r[:, col].astype(np.int64))
        xs.append(r[:, nlab:])
    return np.concatenate(xs), np.concatenate(ys)


def read_cifar(name: str, root: Path, labels: str = "fine",
               verify: bool = True) -> dict[str, np.ndarray]:
    """CIFAR-10 / CIFAR-100 as uint8 NHWC arrays and int64 labels (train and test)."""
    found = _cifar_layout(name, root)
    if found is None:
        raise DatasetUnavailable(f"data.name={name}: {_cifar_missing(name, root)} "
                                 "(set data.options.root or $FEDLOOM_DATA)")
    kind, tr, te = found
    read = _read_cifar_python if kind == "python" else _read_cifar_binary

    def decode() -> dict[str, np.ndarray]:
        xtr, ytr = read(tr, name, labels)
        xte, yte = read(te, name, labels)
        # stored channel-planar (3 × 32 × 32 per row); kept as NHWC uint8 in the cache
        return {"train_x": xtr.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1).copy(),
                "train_y": ytr, "test_x": xte.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1).copy(),
                "test_y": yte}

    arrs = _cached(name, [*tr, *te], f"{kind}|{labels}", decode)
    classes = 10 if name == "cifar10" else (20 if labels == "coarse" else 100)
    for part in ("train", "test"):
        y = arrs[f"{part}_y"]
        if y.size and (y.min() < 0 or y.max() >= classes):
            raise DatasetUnavailable(f"{root}: {name} {part} labels outside 0..{classes - 1}")
    if verify:
        per = {"cifar10": (5000, 1000), "cifar100": (500, 100)}[name]
        if classes == 20:
            per = (2500, 500)
        _check_class_counts(f"{name} train", arrs["train_y"], classes, per[0], root)
        _check_class_counts(f"{name} test", arrs["test_y"], classes, per[1], root)
    return arrs


def _cifar_dataset(name: str, root_dir: str, verify: bool, labels: str = "fine") -> Dataset:
    root = data_root(root_dir)
    arrs = read_cifar(name, root, labels, verify)
    mean, std = _CIFAR_STATS[name]
    classes = 10 if name == "cifar10" else (20 if labels == "coarse" else 100)
    return Dataset(name, _normalise(arrs["train_x"], mean, std),
                   torch.from_numpy(arrs["train_y"]), classes,
                   x_test=_normalise(arrs["test_x"], mean, std),
                   y_test=torch.from_numpy(arrs["test_y"]), augment=name)


def _probe_cifar(name: str) -> Callable[..., str | None]:
    def probe(data: DataConfig, *, root: str = "", **_: Any) -> str | None:
        root_dir = data_root(root)
        if _cifar_layout(name, root_dir) is None:
            return f"data.name={name}: {_cifar_missing(name, root_dir)}"
        return None

    return probe


@_source("cifar10", "CIFAR-10 (50k/10k, 32x32 RGB) from disk: cifar-10-batches-py/ or -bin/",
         _here(lambda r: _cifar_layout("cifar10", r) is not None),
         "put cifar-10-python.tar.gz's cifar-10-batches-py/ under data.options.root "
         "($FEDLOOM_DATA)",
         checks_itself=True, where=_looked("cifar-10-batches-py/", "cifar-10-batches-bin/"),
         probe=_probe_cifar("cifar10"))
def cifar10(data: DataConfig, seed: int, *, root: str = "", verify: bool = True) -> Dataset:
    """``root``: the data root; ``verify``: check the class counts."""
    return _cifar_dataset("cifar10", root, verify)


@_source("cifar100", "CIFAR-100 (50k/10k, fine or coarse labels) from disk: cifar-100-python/",
         _here(lambda r: _cifar_layout("cifar100", r) is not None),
         "put cifar-100-python.tar.gz's cifar-100-python/ under data.options.root ($FEDLOOM_DATA)",
         checks_itself=True, where=_looked("cifar-100-python/", "cifar-100-binary/"),
         probe=_probe_cifar("cifar100"))
def cifar100(data: DataConfig, seed: int, *, root: str = "", verify: bool = True,
             labels: Literal["fine", "coarse"] = "fine") -> Dataset:
    """``root``: the data root; ``verify``: check the class counts; ``labels``: the 100
    fine classes or the 20 coarse ones."""
    return _cifar_dataset("cifar100", root, verify, labels)
