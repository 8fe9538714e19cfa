"""What every on-disk dataset shares: the data root, the cache, normalisation, the user's path.

:func:`data_root` is where the named datasets are looked for; ``_user_path`` finds a
user's ``data.options.path`` (also under the data root); the probes' helpers (``_here``,
``_looked``, ``_probe_path``) say whether and where a source is on this machine.

Decoded arrays are cached like MNIST's: uncompressed ``.npy`` files in the cache
directory, written atomically, keyed by the source files' paths, sizes and
modification times.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from fedloom.data.sources import DatasetUnavailable, _cache_dir


def data_root(root: str = "") -> Path:
    """``root`` (``data.options.root``), else ``$FEDLOOM_DATA``, else
    ``~/.cache/fedloom/data``."""
    if root:
        return Path(root).expanduser()
    if os.environ.get("FEDLOOM_DATA"):
        return Path(os.environ["FEDLOOM_DATA"]).expanduser()
    return Path.home() / ".cache" / "fedloom" / "data"


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
            "partial or wrong copy (data.options.verify=false skips this check)")


def _here(check: Callable[[Path], bool]) -> Callable[[], bool]:
    return lambda: check(data_root())


def _looked(*parts: str) -> Callable[[], str]:
    return lambda: " or ".join(str(data_root() / p) for p in parts)


def _probe_path(path: str, root: str) -> str | None:
    try:
        _user_path(path, root)
    except DatasetUnavailable as e:
        return str(e)
    return None


def _user_path(given: str, root: str) -> Path:
    """``data.options.path``; a relative path that does not exist from the working
    directory is looked up under the data root (so configs can name ``flwrlabs-femnist``)."""
    path = Path(given).expanduser()
    if not path.is_absolute() and not path.exists() and (data_root(root) / path).exists():
        path = data_root(root) / path
    if not path.exists():
        raise DatasetUnavailable(f"data.options.path: {given}: no such file or directory "
                                 f"(looked in {Path.cwd()} and {data_root(root)})")
    return path
