"""Datasets read from disk, in the layouts their publishers ship.

These machines cannot download CIFAR, FEMNIST or Tiny-ImageNet, but a user has
them on disk. Each loader reads the standard layout under the data root —
``data.root``, else ``$FEDLOOM_DATA``, else ``~/.cache/fedloom/data`` — and
never downloads anything:

- ``cifar10``: ``cifar-10-batches-py/`` (``data_batch_1`` … ``_5``,
  ``test_batch``: pickled dicts with ``data`` N×3072 uint8 and ``labels``) or
  the binary layout ``cifar-10-batches-bin/`` (records of 1 label byte and
  3072 pixel bytes). Krizhevsky (2009).
- ``cifar100``: ``cifar-100-python/`` (``train``, ``test``: ``fine_labels`` and
  ``coarse_labels``) or ``cifar-100-binary/`` (records of a coarse byte, a fine
  byte, 3072 pixel bytes); ``data.labels: fine | coarse``.
- ``femnist``: LEAF (Caldas et al. 2018) ``femnist/data/train/*.json`` and
  ``femnist/data/test/*.json`` (or ``femnist/train``, ``femnist/test``), each
  with ``users``, ``num_samples`` and ``user_data[user] = {x: [[784 floats]],
  y: [int]}``; one client per writer (the natural split), LEAF's own per-writer
  train/test split kept, and ``data.writer_fraction`` samples a fraction of the
  writers as LEAF's ``--sf`` does (drawn from ``(seed, "data")``).
- ``tiny-imagenet``: ``tiny-imagenet-200/`` with ``wnids.txt``,
  ``train/<wnid>/images/*.JPEG`` and ``val/images`` + ``val/val_annotations.txt``
  (the labelled validation set is the test set, as in the SA-PEF code).
- ``image-folder``: ``data.path`` with one sub-folder per class (torchvision's
  ImageFolder layout), or ``train/`` and ``test/`` (or ``val/``) folders of that
  layout; ``data.image_size`` resizes (0 = every image must have one size).
- ``hf``: a Hugging Face dataset saved with ``save_to_disk`` or parquet files
  (``data.path``; a relative path is also looked up under the data root), read
  offline with the ``datasets`` library; the image (or
  feature) column is ``data.image_column``, the label column ``data.label``;
  with ``data.client`` naming a column (e.g. ``writer_id`` of the Hub's
  FEMNIST), each of its values is one client (a natural split), and writers
  with ``data.min_samples`` … ``data.max_client_samples`` samples are eligible,
  ``data.num_clients`` of them drawn from ``(seed, "data")`` as the CRAFT code
  selects FEMNIST writers. Grayscale images keep one channel.

Pickles are read with an unpickler that builds only dicts, lists, strings,
numbers and NumPy arrays: a damaged or hostile file cannot run code.

Checks on load: class counts against the published sizes for CIFAR-10/100 and
Tiny-ImageNet (``data.verify: false`` skips them, for tiny copies); FEMNIST has
no fixed size (LEAF's preprocessing flags choose it), so its check is
structural (``num_samples`` against the records, 784 pixels, labels in 0…61).
A missing or partial directory raises :class:`DatasetUnavailable`, one line
saying what is missing and where fedloom looked.

Decoded arrays are cached like MNIST's: uncompressed ``.npy`` files in the cache
directory, written atomically, keyed by the source files' paths, sizes and
modification times.

Normalisation: per-channel ``(x − μ)/σ`` with the published training-set
statistics of each named dataset (CIFAR-10 μ = (0.4914, 0.4822, 0.4465),
σ = (0.2470, 0.2435, 0.2616); CIFAR-100 μ = (0.5071, 0.4865, 0.4409),
σ = (0.2673, 0.2564, 0.2762); Tiny-ImageNet μ = (0.4802, 0.4481, 0.3975),
σ = (0.2770, 0.2691, 0.2821)); for an image folder or a Hugging Face dataset,
the statistics of its own training part. FEMNIST keeps LEAF's values in [0, 1]
(as the CRAFT and LEAF code feed them).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from fedloom.config import DataConfig
from fedloom.data.sources import Dataset, DatasetUnavailable, _cache_dir, _has_module, _source
from fedloom.rng import Purpose, numpy_gen

__all__ = ["data_root", "read_cifar", "read_femnist", "read_image_folder", "read_tiny_imagenet"]

_IMAGE_EXT = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".tif", ".tiff", ".webp")


def data_root(cfg: DataConfig | None = None) -> Path:
    """``data.root``, else ``$FEDLOOM_DATA``, else ``~/.cache/fedloom/data``."""
    if cfg is not None and cfg.root:
        return Path(cfg.root).expanduser()
    if os.environ.get("FEDLOOM_DATA"):
        return Path(os.environ["FEDLOOM_DATA"]).expanduser()
    return Path.home() / ".cache" / "fedloom" / "data"


# ------------------------------------------------------------------------- cache
def _cached(tag: str, sources: Sequence[Path], extra: str,
            decode: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """``decode()``'s arrays, kept as ``.npy`` files keyed by ``sources``' stat.

    The folder is written under a temporary name and renamed: a cache entry is
    complete or absent. A cache that cannot be written or read is skipped.
    """
    h = hashlib.sha256(f"{tag}|{extra}".encode())
    for p in sorted(sources):
        st = p.stat()
        h.update(f"|{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    folder = _cache_dir() / f"{tag}-{h.hexdigest()[:16]}"
    index = folder / "arrays.json"
    try:
        if index.is_file():
            names = json.loads(index.read_text())
            return {n: np.load(folder / f"{n}.npy") for n in names}
    except (OSError, ValueError):  # unreadable: drop it and decode again
        shutil.rmtree(folder, ignore_errors=True)
    arrs = decode()
    tmp = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{tag}-", dir=folder.parent))
        for n, a in arrs.items():
            np.save(tmp / f"{n}.npy", a)
        (tmp / "arrays.json").write_text(json.dumps(sorted(arrs)))
        tmp.replace(folder)
    except OSError:  # not writable, or another process renamed its copy first
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return arrs


def _normalise(u8_nhwc: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 ``[n, h, w, c]`` → float32 ``[n, c, h, w]``, per-channel ``(x/255 − μ)/σ``."""
    x = torch.from_numpy(np.ascontiguousarray(u8_nhwc)).permute(0, 3, 1, 2).float().div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return x.sub_(m).div_(s).contiguous()


def _channel_stats(u8_nhwc: np.ndarray) -> tuple[list[float], list[float]]:
    x = u8_nhwc.reshape(-1, u8_nhwc.shape[-1]).astype(np.float64) / 255.0
    sd = x.std(0)
    return x.mean(0).tolist(), np.where(sd > 0, sd, 1.0).tolist()


def _check_class_counts(what: str, y: np.ndarray, classes: int, per_class: int,
                        where: Path) -> None:
    counts = np.bincount(y, minlength=classes)
    if len(counts) != classes or not np.all(counts == per_class):
        bad = int(np.argmax(counts != per_class)) if len(counts) == classes else classes
        raise DatasetUnavailable(
            f"{where}: {what} has {int(counts.sum())} samples, expected {classes} classes x "
            f"{per_class} (class {bad}: {int(counts[bad]) if bad < len(counts) else 'extra'}); "
            "partial or wrong copy (data.verify=false skips this check)")


# ----------------------------------------------------------------------- CIFAR
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
                                 "(set data.root or $FEDLOOM_DATA)")
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


def _cifar_dataset(name: str, cfg: DataConfig) -> Dataset:
    root = data_root(cfg)
    arrs = read_cifar(name, root, cfg.labels, cfg.verify)
    mean, std = _CIFAR_STATS[name]
    classes = 10 if name == "cifar10" else (20 if cfg.labels == "coarse" else 100)
    return Dataset(name, _normalise(arrs["train_x"], mean, std),
                   torch.from_numpy(arrs["train_y"]), classes,
                   x_test=_normalise(arrs["test_x"], mean, std),
                   y_test=torch.from_numpy(arrs["test_y"]), augment=name)


def _here(check: Callable[[Path], bool]) -> Callable[[], bool]:
    return lambda: check(data_root())


def _looked(*parts: str) -> Callable[[], str]:
    return lambda: " or ".join(str(data_root() / p) for p in parts)


def _probe_cifar(name: str) -> Callable[[DataConfig], str | None]:
    def probe(cfg: DataConfig) -> str | None:
        root = data_root(cfg)
        if _cifar_layout(name, root) is None:
            return f"data.name={name}: {_cifar_missing(name, root)}"
        return None

    return probe


def _probe_femnist(cfg: DataConfig) -> str | None:
    root = data_root(cfg)
    if _femnist_dirs(root) is None:
        return (f"data.name=femnist: {root / 'femnist' / 'data'}: needs train/*.json and "
                "test/*.json")
    return None


def _probe_tiny(cfg: DataConfig) -> str | None:
    return (None if _tiny_complete(data_root(cfg)) else
            f"data.name=tiny-imagenet: {_tiny_dir(data_root(cfg))}: missing or incomplete")


def _probe_path(cfg: DataConfig) -> str | None:
    try:
        _user_path(cfg)
    except DatasetUnavailable as e:
        return str(e)
    return None


@_source("cifar10", "CIFAR-10 (50k/10k, 32x32 RGB) from disk: cifar-10-batches-py/ or -bin/",
         _here(lambda r: _cifar_layout("cifar10", r) is not None),
         "put cifar-10-python.tar.gz's cifar-10-batches-py/ under data.root ($FEDLOOM_DATA)",
         checks_itself=True, where=_looked("cifar-10-batches-py/", "cifar-10-batches-bin/"),
         probe=_probe_cifar("cifar10"))
def cifar10(cfg: DataConfig, seed: int) -> Dataset:
    return _cifar_dataset("cifar10", cfg)


@_source("cifar100", "CIFAR-100 (50k/10k, fine or coarse labels) from disk: cifar-100-python/",
         _here(lambda r: _cifar_layout("cifar100", r) is not None),
         "put cifar-100-python.tar.gz's cifar-100-python/ under data.root ($FEDLOOM_DATA)",
         checks_itself=True, where=_looked("cifar-100-python/", "cifar-100-binary/"),
         probe=_probe_cifar("cifar100"))
def cifar100(cfg: DataConfig, seed: int) -> Dataset:
    return _cifar_dataset("cifar100", cfg)


# ----------------------------------------------------------------------- FEMNIST
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
            "test/*.json (LEAF's layout; set data.root or $FEDLOOM_DATA)")
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
         "run LEAF's femnist preprocess and put femnist/data/{train,test}/ under data.root",
         checks_itself=True, where=_looked("femnist/data/{train,test}/", "femnist/{train,test}/"),
         probe=_probe_femnist)
def femnist(cfg: DataConfig, seed: int) -> Dataset:
    arrs = read_femnist(data_root(cfg))
    writer, is_test = arrs["writer"], arrs["test"].astype(bool)
    keep = np.ones(len(writer), dtype=bool)
    if cfg.writer_fraction < 1.0:
        n_w = int(writer.max()) + 1
        n_keep = max(1, round(cfg.writer_fraction * n_w))
        chosen = numpy_gen(seed, -1, -1, Purpose.DATA).choice(n_w, n_keep, replace=False)
        keep = np.isin(writer, chosen)
    # renumber the kept writers 0..K-1 in their original order
    _, groups = np.unique(writer[keep], return_inverse=True)
    x = torch.from_numpy(arrs["x"][keep]).reshape(-1, 1, 28, 28)
    return Dataset("femnist", x, torch.from_numpy(arrs["y"][keep]), 62,
                   groups=groups.astype(np.int64), natural=True, test_mask=is_test[keep])


# ---------------------------------------------------------------- Tiny-ImageNet
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
                im = im.convert("RGB")
                if size:
                    im = im.resize((size, size), Image.BILINEAR)
                a = np.asarray(im, dtype=np.uint8)
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise DatasetUnavailable(f"{p}: cannot decode the image ({e})") from None
        if shape is None:
            shape = a.shape
        elif a.shape != shape:
            raise DatasetUnavailable(f"{p}: image is {a.shape[1]}x{a.shape[0]}, the others "
                                     f"{shape[1]}x{shape[0]} (set data.image_size to resize)")
        out.append(a)
    return np.stack(out) if out else np.zeros((0, size or 1, size or 1, 3), np.uint8)


def read_tiny_imagenet(root: Path, verify: bool = True) -> dict[str, np.ndarray]:
    """Tiny-ImageNet-200: train (500 per class) and the labelled val set (50 per class)."""
    d = _tiny_dir(root)
    if not _tiny_complete(root):
        need = [p for p in ("wnids.txt", "train", "val/images", "val/val_annotations.txt")
                if not (d / p).exists()]
        raise DatasetUnavailable(f"data.name=tiny-imagenet: {d}: missing {', '.join(need)} "
                                 "(set data.root or $FEDLOOM_DATA)")
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
         "unzip tiny-imagenet-200.zip under data.root ($FEDLOOM_DATA)",
         checks_itself=True, where=_looked("tiny-imagenet-200/"), probe=_probe_tiny)
def tiny_imagenet(cfg: DataConfig, seed: int) -> Dataset:
    arrs = read_tiny_imagenet(data_root(cfg), cfg.verify)
    mean, std = (0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821)
    classes = 200
    return Dataset("tiny-imagenet", _normalise(arrs["train_x"], mean, std),
                   torch.from_numpy(arrs["train_y"]), classes,
                   x_test=_normalise(arrs["test_x"], mean, std),
                   y_test=torch.from_numpy(arrs["test_y"]), augment="tiny-imagenet")


# ------------------------------------------------------------------ image folder
def _user_path(cfg: DataConfig) -> Path:
    """``data.path``; a relative path that does not exist from the working directory is
    looked up under the data root (so configs can name ``flwrlabs-femnist``)."""
    path = Path(cfg.path).expanduser()
    if not path.is_absolute() and not path.exists() and (data_root(cfg) / path).exists():
        path = data_root(cfg) / path
    if not path.exists():
        raise DatasetUnavailable(f"data.path: {cfg.path}: no such file or directory (looked "
                                 f"in {Path.cwd()} and {data_root(cfg)})")
    return path



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
        raise DatasetUnavailable(f"data.path: {path}: no such directory")
    split = path / "train"
    test = next((path / t for t in ("test", "val") if (path / t).is_dir()), None)
    if split.is_dir() and test is not None:
        tr, names = _list_folder(split, None)
        te, _ = _list_folder(test, names)
    else:
        tr, names = _list_folder(path, None)
        te = []
    if len(names) < 2:
        raise DatasetUnavailable(f"data.path: {path}: needs one sub-folder per class, "
                                 f"found {len(names)}")
    if not tr:
        raise DatasetUnavailable(f"data.path: {path}: no image files "
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
        raise DatasetUnavailable(f"data.path: {path}: test images differ in size from the "
                                 "training images (set data.image_size)")
    arrs["classes"] = names
    return arrs


def _images_dataset(name: str, arrs: dict[str, Any], classes: int) -> Dataset:
    mean, std = _channel_stats(arrs["train_x"])
    has_test = "test_x" in arrs
    return Dataset(name, _normalise(arrs["train_x"], mean, std),
                   torch.from_numpy(arrs["train_y"]), classes,
                   x_test=_normalise(arrs["test_x"], mean, std) if has_test else None,
                   y_test=torch.from_numpy(arrs["test_y"]) if has_test else None)


@_source("image-folder", "your images, one sub-folder per class (data.path)",
         lambda: _has_module("PIL"), "pip install pillow  (or: pip install 'fedloom[images]')",
         checks_itself=True, probe=_probe_path)
def image_folder(cfg: DataConfig, seed: int) -> Dataset:
    if not cfg.path:
        raise DatasetUnavailable("data.path: image-folder needs the folder of class folders")
    arrs = read_image_folder(_user_path(cfg), cfg.image_size)
    return _images_dataset("image-folder", arrs, len(arrs["classes"]))


# ------------------------------------------------------------ Hugging Face datasets
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
                raise DatasetUnavailable(f"data.path: {path}: no save_to_disk dataset and no "
                                         "*.parquet file")
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
        raise DatasetUnavailable(f"data.path: {path}: cannot read it with the datasets "
                                 f"library ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
                                 ) from None
    if isinstance(ds, datasets.Dataset):
        return {"train": ds}
    return dict(ds)


def _hf_arrays(split: Any, col: str, label: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    for c in (col, label):
        if c not in split.column_names:
            raise DatasetUnavailable(f"{where}: no column {c!r} (columns: "
                                     f"{', '.join(split.column_names)}; set data.image_column "
                                     "/ data.label)")
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


def _pick_writers(groups: np.ndarray, cfg: DataConfig, seed: int) -> np.ndarray:
    """A keep-mask over samples: writers with ``data.min_samples`` … ``data.max_client_samples``
    samples (0 = no upper bound) are eligible, and ``data.num_clients`` of them are drawn
    from ``(seed, "data")`` when more are eligible (the CRAFT code's FEMNIST selection)."""
    ids, counts = np.unique(groups, return_counts=True)
    ok = counts >= cfg.min_samples
    if cfg.max_client_samples:
        ok &= counts <= cfg.max_client_samples
    eligible = ids[ok]
    if len(eligible) == 0:
        raise DatasetUnavailable(f"data.min_samples / data.max_client_samples: no client has "
                                 f"{cfg.min_samples}..{cfg.max_client_samples or 'any'} samples")
    if len(eligible) > cfg.num_clients:
        gen = numpy_gen(seed, -1, -1, Purpose.DATA)
        eligible = np.sort(gen.choice(eligible, cfg.num_clients, replace=False))
    return np.isin(groups, eligible)


@_source("hf", "a Hugging Face dataset saved to disk or as parquet (data.path), offline",
         lambda: _has_module("datasets"),
         "pip install datasets  (or: pip install 'fedloom[hf]')",
         probe=lambda cfg: (_probe_path(cfg) if _has_module("datasets") else
                            "data.name=hf: needs the datasets library: pip install "
                            "'fedloom[hf]'"))
def hf(cfg: DataConfig, seed: int) -> Dataset:
    if not cfg.path:
        raise DatasetUnavailable("data.path: hf needs a save_to_disk folder or parquet files")
    path = _user_path(cfg)
    splits = _hf_splits(path)
    train_key = "train" if "train" in splits else next(iter(splits))
    test_key = next((k for k in ("test", "validation", "val") if k in splits and k != train_key),
                    None)
    xtr, ytr = _hf_arrays(splits[train_key], cfg.image_column, cfg.label, f"{path}[{train_key}]")
    xte, yte = (_hf_arrays(splits[test_key], cfg.image_column, cfg.label, f"{path}[{test_key}]")
                if test_key else (None, None))
    # labels: integers kept; anything else mapped in sorted order
    all_y = ytr if yte is None else np.concatenate([ytr, yte])
    if all_y.dtype.kind in "iu":
        ytr_i, yte_i = ytr.astype(np.int64), None if yte is None else yte.astype(np.int64)
        if all_y.min() < 0:
            raise DatasetUnavailable(f"{path}: column {cfg.label!r} has negative labels")
        classes = int(all_y.max()) + 1
    else:
        names = sorted({str(v) for v in all_y})
        idx = {n: i for i, n in enumerate(names)}
        ytr_i = np.array([idx[str(v)] for v in ytr], dtype=np.int64)
        yte_i = None if yte is None else np.array([idx[str(v)] for v in yte], dtype=np.int64)
        classes = len(names)
    if classes < 2:
        raise DatasetUnavailable(f"{path}: column {cfg.label!r} has fewer than 2 classes")
    groups = None
    if cfg.client:  # one client per value of this column (writers): the natural split
        col = splits[train_key]
        if cfg.client not in col.column_names:
            raise DatasetUnavailable(f"{path}[{train_key}]: no column {cfg.client!r} "
                                     "(data.client)")
        _, groups = np.unique(np.asarray([str(v) for v in col[cfg.client]]),
                              return_inverse=True)
        keep = _pick_writers(groups, cfg, seed)
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
        raise DatasetUnavailable(f"{path}: column {cfg.image_column!r} must hold images or "
                                 "finite numbers")
    to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
    return Dataset("hf", to_t(xtr), torch.from_numpy(ytr_i), classes,
                   x_test=None if xte is None else to_t(xte),
                   y_test=None if yte_i is None else torch.from_numpy(yte_i),
                   groups=None if groups is None else groups.astype(np.int64),
                   natural=groups is not None)
