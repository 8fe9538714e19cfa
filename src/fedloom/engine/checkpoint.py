"""Atomic files: write to a temporary file in the same folder, fsync, rename.

A run killed at any point leaves either the previous file or the new one,
never a half-written one.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["atomic_write_bytes", "atomic_write_json", "load_checkpoint", "save_checkpoint"]


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(path, buf.getvalue())


def load_checkpoint(path: Path) -> dict[str, Any]:
    # weights_only=False: the checkpoint holds NumPy arrays of the state store.
    # It is a file this run wrote itself, never one from elsewhere.
    return torch.load(path, map_location="cpu", weights_only=False)
