"""Your own data: arrays, ``.npz`` files and CSV tables.

``from_arrays(X, y, client=None, X_test=None, y_test=None)`` validates and
wraps arrays as a :class:`~fedloom.data.sources.Dataset`:

- ``X``: features, any shape per sample (``[n, ...]``), finite;
- ``y``: integer class indices from 0, one per sample (``1 … K`` is refused);
- ``client`` (optional): an integer client id per sample — the split is then
  natural (one client per id) and the partitioner is not used;
- ``X_test``, ``y_test`` (optional): a global test set; without one, the union
  of the clients' own test splits serves.

From the command line: ``data.name=npz data.options.path=FILE.npz`` (arrays
``X``, ``y``, optionally ``client``, ``X_test``, ``y_test``) or ``data.name=csv
data.options.path=FILE.csv data.options.label=COLUMN [data.options.client=COLUMN]
[data.options.features=[COLUMN, ...]]``. Every problem raises :class:`DataError`, one
line naming the file or field (and, for a bad cell, its line and column).

CSV tables are read with pandas (the ``data`` extra), every cell as text: features as
``float()`` (so a CSV, an ``.npz`` and :func:`from_arrays` give the same model bits),
text labels mapped to ``0 … C−1`` in sorted order. Refused, one line each: labels not
below the sample count, object arrays, non-UTF-8 or oversized CSV files (bounds fixed:
:data:`MAX_CSV_BYTES`, :data:`MAX_CSV_COLUMNS`, :data:`MAX_CSV_CELLS`, and the memory
left), and features not finite or beyond float32's range.
Each conversion and refusal, with reasons: docs/howto/datasets.md (Your own data in detail).
"""

from __future__ import annotations

import io
import logging
import os
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from fedloom.bounded import available_memory, size_text
from fedloom.config import DataConfig
from fedloom.data.sources import _SOURCES, Dataset, SourceInfo
from fedloom.registry import register

__all__ = ["MAX_CSV_BYTES", "MAX_CSV_CELLS", "MAX_CSV_COLUMNS", "DataError", "from_arrays",
           "load_csv", "load_npz", "unscaled_features"]

log = logging.getLogger("fedloom")


class DataError(ValueError):
    """Bad user data; the message names the file or field."""


# The bounds on a CSV table, checked before it is parsed (module docstring: fixed,
# so that a file is accepted alike on every machine; about 2-4.5 GB at the peak of
# a parse at MAX_CSV_BYTES, half a minute and 0.8 GB for MAX_CSV_COLUMNS columns).
MAX_CSV_BYTES = 256 * 2**20
MAX_CSV_COLUMNS = 100_000
# Cells (columns × rows): a parse holds about 32 bytes a cell (_parse_memory), so a
# table of short cells under both bounds above could still need 4 GB (99,999 columns
# × 1,000 rows, 200 MB). 60 million cells: about 2 GB at the peak, and room for the
# largest common table (MNIST as CSV: 60,000 rows × 785 columns, 47.1 million).
MAX_CSV_CELLS = 60_000_000


def _parse_memory(columns: int, rows: int, size: int) -> int:
    """The bytes a parse of a table of ``columns`` × ``rows`` cells and ``size``
    bytes holds at its peak, over-estimated: 32 bytes a cell, 4 a byte of text and
    4 KiB a column. Measured (load_csv: pandas 3's pyarrow strings, the float
    columns, the dataset) on tables of 10 to 99,999 columns of one-digit to
    18-digit cells: 24-32 bytes a cell and 4-5 a byte, each table's peak within 0-30%
    below this (pandas 2's Python strings take up to a third more)."""
    return 32 * columns * rows + 4 * size + 4096 * columns


def _labels(y: Any, where: str) -> np.ndarray:
    arr = np.asarray(y)
    if arr.ndim != 1:
        raise DataError(f"{where}: labels must be one integer per sample, got shape {arr.shape}")
    if arr.dtype.kind == "f":
        if not np.isfinite(arr).all() or not np.equal(np.mod(arr, 1), 0).all():
            raise DataError(f"{where}: labels must be integers, found non-integer values")
    elif arr.dtype.kind not in "iub":
        raise DataError(f"{where}: labels must be integers, got dtype {arr.dtype}")
    # Range first, in the array's own dtype: a cast of 1e30 or of a uint64 above
    # 2^63 to int64 would wrap around.
    def show(v: Any) -> str:
        return str(int(v)) if arr.dtype.kind in "iub" else f"{float(v):g}"

    if arr.size and arr.min() < 0:
        raise DataError(f"{where}: labels must be >= 0, found {show(arr.min())}")
    if arr.size and arr.max() >= 2**62:
        raise DataError(f"{where}: labels must be class indices, found {show(arr.max())}")
    return arr.astype(np.int64)


def _check_classes(ys: np.ndarray, yt: np.ndarray | None, source: str) -> int:
    """The number of classes, ``max label + 1``, bounded by the number of samples
    (see the module docstring: labels are class indices, not ids)."""
    n = ys.size + (yt.size if yt is not None else 0)
    for name, arr in (("y", ys), ("y_test", yt)):
        if arr is not None and arr.size and int(arr.max()) >= n:
            raise DataError(
                f"{source}: {name}: label {int(arr.max())} is not a class index below the "
                f"number of samples ({n}); remap labels to 0..C-1, e.g. with "
                "numpy.unique(y, return_inverse=True)"
            )
    return int(max(ys.max(), yt.max() if yt is not None and yt.size else 0)) + 1


def _check_zero_based(ys: np.ndarray, yt: np.ndarray | None, source: str) -> None:
    """Refuse labels of which none is 0: class ``k`` is the model's output ``k``, so
    labels ``1 … K`` (R's and many tables' numbering) would make a class ``0`` no sample
    has and ask for ``K + 1`` outputs, a mismatch a model of ``K`` outputs would
    otherwise be blamed for. The fix is named: shift by the smallest label, or map."""
    lo = int(min(ys.min(), yt.min() if yt is not None and yt.size else ys.min()))
    if lo > 0:
        test = " (and y_test)" if yt is not None else ""
        raise DataError(
            f"{source}: y: labels run from {lo} to {int(ys.max())} and none is 0, but class "
            f"indices start at 0; pass y - {lo}{test}, or map labels to 0..C-1 with "
            "numpy.unique(y, return_inverse=True)"
        )


# Features are float32: a larger magnitude would become inf in the cast (numpy warns).
_F32_MAX = float(np.finfo(np.float32).max)


def _features(x: Any, where: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind not in "iufb":
        raise DataError(f"{where}: features must be numeric, got dtype {arr.dtype}")
    if arr.ndim < 1 or arr.shape[0] == 0:
        raise DataError(f"{where}: no samples")
    # Checked before the cast, on the given values: NaN/Inf first, then the finite
    # values float32 cannot hold (comparisons with NaN are False, and warn not).
    rows = arr.reshape(arr.shape[0], -1)
    bad = ~np.isfinite(rows).all(axis=1)
    if bad.any():
        raise DataError(f"{where}: NaN or Inf in sample {int(np.flatnonzero(bad)[0])} "
                        f"({int(bad.sum())} samples affected)")
    big = (np.abs(rows) > _F32_MAX).any(axis=1) if arr.dtype.kind == "f" else bad
    if big.any():
        raise DataError(f"{where}: a value beyond float32's range (|x| > {_F32_MAX:.4g}) in "
                        f"sample {int(np.flatnonzero(big)[0])} ({int(big.sum())} samples "
                        "affected)")
    return arr.astype(np.float32)


def from_arrays(
    X: Any, y: Any, client: Any | None = None, X_test: Any | None = None,
    y_test: Any | None = None, *, name: str = "arrays", source: str = "X",
) -> Dataset:
    """Validate arrays and wrap them as a dataset (see the module docstring)."""
    return _dataset(X, y, client, X_test, y_test, name=name, source=source, zero_based=True)


def _dataset(
    X: Any, y: Any, client: Any | None = None, X_test: Any | None = None,
    y_test: Any | None = None, *, name: str, source: str, zero_based: bool,
) -> Dataset:
    """:func:`from_arrays`; ``zero_based``: refuse labels of which none is 0 (arrays
    and ``.npz`` files; a CSV's integer labels are kept as written, a class per value)."""
    xs = _features(X, f"{source}: X")
    ys = _labels(y, f"{source}: y")
    if xs.shape[0] != ys.shape[0]:
        raise DataError(f"{source}: X has {xs.shape[0]} samples but y has {ys.shape[0]}")
    groups = None
    if client is not None:
        c = np.asarray(client)
        if c.ndim != 1 or c.shape[0] != xs.shape[0]:
            raise DataError(f"{source}: client has {c.shape[0] if c.ndim else 0} entries for "
                            f"{xs.shape[0]} samples")
        if c.dtype.kind not in "iu":
            raise DataError(f"{source}: client ids must be integers, got dtype {c.dtype}")
        groups = c.astype(np.int64)
    xt = yt = None
    if (X_test is None) != (y_test is None):
        raise DataError(f"{source}: give both X_test and y_test, or neither")
    if X_test is not None:
        xt = _features(X_test, f"{source}: X_test")
        yt = _labels(y_test, f"{source}: y_test")
        if xt.shape[0] != yt.shape[0]:
            raise DataError(f"{source}: X_test has {xt.shape[0]} samples but y_test has "
                            f"{yt.shape[0]}")
        if xt.shape[1:] != xs.shape[1:]:
            raise DataError(f"{source}: X_test samples have shape {xt.shape[1:]}, X samples "
                            f"{xs.shape[1:]}")
    num_classes = _check_classes(ys, yt, source)
    if zero_based:
        _check_zero_based(ys, yt, source)
    if num_classes < 2:
        raise DataError(f"{source}: y holds a single class; classification needs two or more")
    return Dataset(
        name, torch.from_numpy(xs), torch.from_numpy(ys), num_classes, groups=groups,
        x_test=torch.from_numpy(xt) if xt is not None else None,
        y_test=torch.from_numpy(yt) if yt is not None else None, natural=groups is not None,
    )


def _path(name: str, path: str) -> Path:
    if not path:
        raise DataError(f"data.options.path: required for data.name={name}")
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: file not found (data.options.path)")
    return p


# What numpy raises on a damaged archive: an empty file (EOFError), a truncated
# or non-zip one (BadZipFile), a bad member (zlib.error, BadZipFile "Bad CRC"),
# a bad .npy header (ValueError), an unreadable file (OSError).
_NPZ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)


def _reason(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def load_npz(data: DataConfig, seed: int, *, path: str = "") -> Dataset:
    """``path``: the .npz file of arrays ``X``, ``y`` (and ``client``, ``X_test``,
    ``y_test``)."""
    p = _path(data.name, path)
    if p.stat().st_size == 0:
        raise DataError(f"{p}: empty file, not an .npz archive (data.options.path)")
    try:
        z = np.load(p, allow_pickle=False)
    except _NPZ_ERRORS as e:
        raise DataError(f"{p}: not a readable .npz file ({_reason(e)})") from None
    if not isinstance(z, np.lib.npyio.NpzFile):  # a single .npy array
        raise DataError(f"{p}: holds one array (.npy), not an .npz archive of X, y, ...")
    with z:
        for key in ("X", "y"):
            if key not in z.files:
                raise DataError(f"{p}: missing array {key!r} (found: {', '.join(z.files)})")
        get = {}
        for k in z.files:
            try:
                get[k] = z[k]
            except ValueError as e:
                if "allow_pickle" in str(e):  # allow_pickle stays False: no code from files
                    raise DataError(f"{p}: array {k!r} holds Python objects; save numeric "
                                    "arrays (object arrays are not loaded)") from None
                raise DataError(f"{p}: array {k!r} is unreadable ({_reason(e)})") from None
            except _NPZ_ERRORS as e:
                raise DataError(f"{p}: array {k!r} is unreadable ({_reason(e)})") from None
    return from_arrays(get["X"], get["y"], get.get("client"), get.get("X_test"),
                       get.get("y_test"), name="npz", source=str(p))


def _header_columns(source: bytes | BinaryIO, limit: int) -> int:
    """The columns the first line of CSV text names, counted up to ``limit + 1`` (more
    than ``limit``: at least that): commas outside double quotes up to the first
    line break, read 1 MiB at a time and no further than the count needs (a header
    of 10**6 names, or one line of 200 MB, costs no more memory than a chunk)."""
    f = io.BytesIO(source) if isinstance(source, bytes) else source
    count, quoted = 1, False
    while chunk := f.read(1 << 20):
        if not quoted and b'"' not in chunk:  # the common header: C-speed counting
            end = min((i for i in (chunk.find(b"\n"), chunk.find(b"\r")) if i >= 0),
                      default=-1)
            count += chunk[:end].count(b",") if end >= 0 else chunk.count(b",")
            if end >= 0 or count > limit:
                return min(count, limit + 1)
            continue
        for byte in chunk:  # quoted names: byte by byte ("" toggles twice: no change)
            if byte == 0x22:
                quoted = not quoted
            elif not quoted and byte == 0x2C:
                count += 1
                if count > limit:
                    return count
            elif not quoted and byte in (0x0A, 0x0D):
                return count
    return min(count, limit + 1)


def _data_rows(f: BinaryIO) -> int:
    """The rows below the header of CSV text, at most: its line breaks (``\\n``, or
    ``\\r`` alone), a last line without one, less the header. A line break inside
    quotes counts too, and so does a blank line (a row of empty cells to the parser):
    an upper bound, read 1 MiB at a time."""
    lf = cr = 0
    last = b""
    while chunk := f.read(1 << 20):
        lf += chunk.count(b"\n")
        cr += chunk.count(b"\r")
        last = chunk
    lines = max(lf, cr) + (1 if last and last[-1:] not in (b"\n", b"\r") else 0)
    return max(lines - 1, 0)


def _check_csv_bounds(p: Path) -> int:
    """Refuse a table above :data:`MAX_CSV_BYTES`, :data:`MAX_CSV_COLUMNS` or
    :data:`MAX_CSV_CELLS`, or one whose parse would take more memory than is left
    (:func:`_parse_memory` against :func:`~fedloom.bounded.available_memory`), before
    it is parsed; return its size."""
    size = p.stat().st_size
    if size > MAX_CSV_BYTES:
        raise DataError(f"{p}: {size} bytes, above the bound of {MAX_CSV_BYTES} bytes for a "
                        "CSV table (fedloom.data.user.MAX_CSV_BYTES: read as text it needs "
                        "7-17x its size in memory); save the arrays as .npz (data.name=npz)")
    try:
        with open(p, "rb") as f:
            columns = _header_columns(f, MAX_CSV_COLUMNS)
            if columns <= MAX_CSV_COLUMNS:
                f.seek(0, os.SEEK_SET)
                rows = _data_rows(f)
    except OSError as e:
        raise DataError(f"{p}: cannot be read ({e.strerror or e})") from None
    if columns > MAX_CSV_COLUMNS:
        raise DataError(f"{p}: more than {MAX_CSV_COLUMNS} columns in the header, the bound "
                        "for a CSV table (fedloom.data.user.MAX_CSV_COLUMNS); save the arrays "
                        "as .npz (data.name=npz)")
    _check_cells(p, columns, rows, size)
    return size


def _check_cells(p: Path, columns: int, rows: int, size: int) -> None:
    """Refuse a table of more than :data:`MAX_CSV_CELLS` cells, or one whose parse
    would take more memory than this process can still take."""
    shape = f"{columns:,} columns × {rows:,} rows"
    need = _parse_memory(columns, rows, size)
    if columns * rows > MAX_CSV_CELLS:
        raise DataError(f"{p}: {shape} = {columns * rows:,} cells, above the bound of "
                        f"{MAX_CSV_CELLS:,} cells for a CSV table (fedloom.data.user."
                        f"MAX_CSV_CELLS: about {size_text(need)} to parse); save the arrays "
                        "as .npz (data.name=npz)")
    avail = available_memory()
    if avail is not None and need > avail:
        raise DataError(f"{p}: not enough memory to read the table: {shape} ({size} bytes) "
                        f"take about {size_text(need)} to parse and {size_text(avail)} is "
                        "available; save the arrays as .npz (data.name=npz)")


def load_csv(data: DataConfig, seed: int, *, path: str = "", label: str = "label",
             client: str = "", features: Sequence[str] = ()) -> Dataset:
    """A CSV table as a dataset (see the module docstring), read with pandas; a table
    above the size or column bound is refused before it is parsed. ``path``: the file;
    ``label``, ``client``: its label and client columns; ``features``: the feature
    columns (default: every column but the label and client ones)."""
    p = _path(data.name, path)
    try:
        import pandas as pd
    except ImportError:
        raise DataError(f"{p}: reading a CSV file needs pandas (pip install 'fedloom[data]')"
                        ) from None
    size = _check_csv_bounds(p)
    try:
        return _table(p, _read_csv(pd, p), label, client, features, data.standardize)
    except MemoryError:  # below the bounds, on a machine with less memory free
        raise DataError(f"{p}: not enough memory to read the table ({size} bytes; read as "
                        "text it needs 7-17x that); save the arrays as .npz (data.name=npz)"
                        ) from None


def _read_csv(pd: Any, p: Path) -> Any:
    """The table as a DataFrame of text cells; an unreadable file raises DataError."""
    try:
        # Every cell as text ("NA" stays the text "NA"): each column is converted
        # below, so a bad cell is reported with its line and column. utf-8-sig: a
        # byte-order mark (Excel's "CSV UTF-8") is not part of the first column's
        # name; the locale's encoding is never guessed. Blank lines are kept as
        # rows of empty cells and dropped in _table, so that row i is line i + 2.
        df = pd.read_csv(p, dtype=str, keep_default_na=False, encoding="utf-8-sig",
                         skip_blank_lines=False)
    except UnicodeDecodeError as e:
        raise DataError(f"{p}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                        f"{e.start}); save the file as UTF-8") from None
    except pd.errors.EmptyDataError:
        raise DataError(f"{p}: empty file") from None
    except (pd.errors.ParserError, ValueError) as e:
        raise DataError(f"{p}: not a readable CSV file ({_reason(e)})") from None
    return df


def _names(header: list[str], shown: int = 20) -> str:
    """The header's columns for a message: the first ``shown`` and the count (a
    header of thousands of names would make a line of tens of kilobytes)."""
    if len(header) <= shown:
        return ", ".join(header)
    return ", ".join(header[:shown]) + f", … ({len(header)} in all)"


def _table(p: Path, df: Any, label_col: str, client_col: str, feature_cols: Sequence[str],
           standardize: bool) -> Dataset:
    header = [str(h).strip() for h in df.columns]
    df.columns = header
    if len(set(header)) != len(header):
        dup = next(h for h in header if header.count(h) > 1)
        raise DataError(f"{p}: column {dup!r} appears twice in the header")
    if label_col not in header:
        raise DataError(f"{p}: no label column {label_col!r} (data.options.label; columns: "
                        f"{_names(header)})")
    if client_col and client_col not in header:
        raise DataError(f"{p}: no client column {client_col!r} (data.options.client; columns: "
                        f"{_names(header)})")
    # A blank line reads as a row of empty cells (a short line's missing fields
    # read as empty cells too, reported below with their line and column).
    blank = (df == "").all(axis=1).to_numpy()
    lines = np.flatnonzero(~blank) + 2  # the file's line of each kept row
    df = df[~blank]
    if not len(df):
        raise DataError(f"{p}: no data rows")
    if feature_cols:
        for c in feature_cols:
            if c not in header:
                raise DataError(f"{p}: no feature column {c!r} (data.options.features; columns: "
                                f"{_names(header)})")
            if c in (label_col, client_col):
                raise DataError(f"{p}: column {c!r} is the label or client column; it cannot "
                                "be a feature (data.options.features)")
        features = list(feature_cols)
    else:
        features = [h for h in header if h not in (label_col, client_col)]
    if not features:
        raise DataError(f"{p}: no feature columns besides the label")

    def numbers(col: str) -> np.ndarray:
        cells = df[col].str.strip().to_numpy()
        _no_empty(p, col, cells, lines)
        try:
            nums = cells.astype(np.float64)  # Python's float(): what the file says, rounded once
        except ValueError:
            bad = next(i for i, v in enumerate(cells) if not _parses(v, float))
            hint = ("" if any(_parses(v, float) for v in cells) else
                    "; leave the column out with data.options.features, or name it "
                    "data.options.client or data.options.label")
            raise DataError(f"{p}: line {lines[bad]}, column {col!r}: {cells[bad]!r} is not a "
                            f"number{hint}") from None
        _in_float32(p, col, cells, nums, lines)
        return nums

    X = np.stack([numbers(c) for c in features], axis=1)
    cols = {c: df[c].str.strip().to_numpy() for c in (label_col, client_col) if c}
    for c, cells in cols.items():
        _no_empty(p, c, cells, lines)
    labels = cols[label_col]
    if _integers(labels) is None and all(_parses(v, float) for v in labels):
        bad = next(v for v in labels if not float(v).is_integer())
        raise DataError(f"{p}: column {label_col!r}: {bad!r} is neither a class index nor a "
                        "class name (data.options.label must be a class column)")
    y, classes = _label_codes(labels)
    client = _client_codes(cols[client_col]) if client_col else None
    if not standardize:
        _hint_unscaled(p, features, X)
    ds = _dataset(X, y, client, name="csv", source=str(p), zero_based=False)
    ds.classes = classes
    return ds


def _in_float32(p: Path, col: str, cells: np.ndarray, nums: np.ndarray,
                lines: np.ndarray) -> None:
    """Refuse a cell that is not finite (``inf``, ``nan``: ``float()`` reads them) or
    beyond float32's range, naming its line: before the unscaled-features hint,
    whose std of such a column is inf or NaN (numpy warns, or the hint fails)."""
    finite = np.isfinite(nums)
    bad = np.flatnonzero(~finite | (np.abs(np.where(finite, nums, 0.0)) > _F32_MAX))
    if not bad.size:
        return
    i = bad[0]
    why = (f"beyond float32's range (|x| > {_F32_MAX:.4g}); features are float32"
           if finite[i] else "not a finite number")
    raise DataError(f"{p}: line {lines[i]}, column {col!r}: {cells[i]!r} is {why}")


def _no_empty(p: Path, col: str, cells: np.ndarray, lines: np.ndarray) -> None:
    empty = np.flatnonzero(cells == "")
    if empty.size:
        raise DataError(f"{p}: line {lines[empty[0]]}, column {col!r}: empty cell (or the "
                        "line has fewer fields than the header)")


def _integers(cells: np.ndarray) -> np.ndarray | None:
    """The column as float64 when every cell is an integer (``3``, ``3.0``); else None."""
    try:
        nums = cells.astype(np.float64)
    except ValueError:
        return None
    return nums if np.isfinite(nums).all() and np.equal(np.mod(nums, 1), 0).all() else None


def _label_codes(cells: np.ndarray) -> tuple[np.ndarray, list[str] | None]:
    """Labels and the name of each class. Integer labels are kept as they are
    (label ``k`` is class ``k``; names ``None``); any other column (``red``,
    ``good``) is mapped to ``0 … C−1`` in sorted order of its distinct values."""
    nums = _integers(cells)
    if nums is not None:
        return nums, None
    names, codes = np.unique(cells.astype(str), return_inverse=True)
    return codes.astype(np.int64), [str(n) for n in names]


def _client_codes(cells: np.ndarray) -> np.ndarray:
    """Client ids ``0 … K−1`` in sorted order of the column's distinct values (integer
    ids in numeric order, as the natural split orders them; text ids like ``site_4``
    in text order)."""
    nums = _integers(cells)
    _, codes = np.unique(nums if nums is not None else cells.astype(str), return_inverse=True)
    return codes.astype(np.int64)


# A column whose std is this many times another's, or whose |mean| is this many
# times its own std, is far from the unit scale SGD's default step assumes.
_SPREAD, _OFFSET = 100.0, 10.0


def _hint_unscaled(p: Path, features: list[str], X: np.ndarray) -> None:
    """Log one line when the features look unscaled and data.standardize is off."""
    why = unscaled_features(X, features)
    if why is not None:
        log.warning("%s: the features look unscaled (%s); data.standardize=true scales each "
                    "to mean 0, std 1 with the clients' training statistics", p, why)


def unscaled_features(X: np.ndarray, features: Sequence[str] | None = None) -> str | None:
    """Why the columns of ``X`` (``[n, f]``) look unscaled, in a few words (a std
    ``_SPREAD``× another's, or a mean ``_OFFSET``× its own std; ``features`` names
    the columns, else their index); ``None`` when they do not."""
    sd = X.std(axis=0)
    mu = np.abs(X.mean(axis=0))
    live = sd > 0
    if not live.any():
        return None
    spread = float(sd[live].max() / sd[live].min())
    off = np.flatnonzero(live & (mu > _OFFSET * sd))
    if spread <= _SPREAD and not off.size:
        return None
    if spread > _SPREAD:
        return f"column std from {sd[live].min():.3g} to {sd[live].max():.3g}"
    i = int(off[0])
    name = repr(features[i]) if features is not None else str(i)
    return f"column {name} has mean {mu[i]:.3g}, std {sd[i]:.3g}"


def _parses(text: str, kind: type) -> bool:
    try:
        kind(text)
        return True
    except ValueError:
        return False


for _name, _loader, _desc in (("npz", load_npz, "your arrays: data.options.path=FILE.npz "
                                                "(X, y, optional client, X_test, y_test)"),
                              ("csv", load_csv, "your table: data.options.path=FILE.csv "
                                                "data.options.label=COLUMN "
                                                "[data.options.client=COLUMN] "
                                                "[data.options.features=[COLUMN, ...]]")):
    _SOURCES[_name] = SourceInfo(_name, _desc, lambda: True, "(your own file)", _loader)
    register("dataset", _name)(_loader)
