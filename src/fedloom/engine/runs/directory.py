"""The run directory: its files, the checks before a run starts or resumes, the
checkpoints it rotates and the outputs a finished run writes.

A new run needs an empty directory; a resumed one the same config (only
``rounds`` may grow, to extend the run), its newest intact checkpoint
(``last.pt``, else ``prev.pt``) and the metrics of every round that
checkpoint covers, checked against it: each checkpoint holds the digest of the
metrics rows it was written after (:func:`metrics_digest`), so rows of another
run, or a file cut before the checkpoint's round, are never continued silently —
the resume falls back to ``prev.pt`` when its rows are intact, as for a damaged
``last.pt``, and says so. Only directories fedloom made run directories are
written into (:func:`~fedloom.engine.runs.checkpoint.lock_run_dir`). Everything
damaged is named in one line
(:class:`~fedloom.engine.runs.checkpoint.RunDirError`,
:class:`~fedloom.engine.runs.checkpoint.CheckpointError`, or
:class:`~fedloom.config.ConfigError` for a config that differs).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from fedloom import bounded
from fedloom.accounting import as_it_ran
from fedloom.aggregate.base import recorded_config
from fedloom.config import Config, ConfigError, config_to_dict, load_config, safe_load_bounded
from fedloom.data.sources import Dataset
from fedloom.device import to_host
from fedloom.engine.inputs import ModelSpace
from fedloom.engine.objects import comparable_records, moved_objects
from fedloom.engine.runs.checkpoint import (
    LOCK_FILE,
    MARKER_FILE,
    CheckpointError,
    RunDirError,
    atomic_write_bytes,
    atomic_write_json,
    check_regular,
    load_checkpoint,
    remove_leftovers,
    save_checkpoint,
)
from fedloom.engine.runs.legacy import Fresh, current_layout
from fedloom.engine.runs.summary import RunFacts
from fedloom.engine.runstate import RunState

__all__ = ["CHECKPOINT_FILE", "CLIENT_ACC_FILE", "CONFIG_FILE", "LABELS_FILE", "METRICS_DIGEST",
           "METRICS_FILE", "MODEL_FILE", "PREVIOUS_CHECKPOINT_FILE", "SUMMARY_FILE", "Restorer",
           "check_run_dir", "load_model", "metrics_digest", "model_blob", "open_run_dir",
           "read_metrics", "save", "write_outputs"]

log = logging.getLogger("fedloom")

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CHECKPOINT_FILE = "checkpoints/last.pt"
PREVIOUS_CHECKPOINT_FILE = "checkpoints/prev.pt"
MODEL_FILE = "model.pt"
CLIENT_ACC_FILE = "client_acc.json"
LABELS_FILE = "labels.json"
# The checkpoint key holding metrics_digest of the rows before its round.
METRICS_DIGEST = "metrics_digest"


def metrics_digest(rows: Sequence[dict[str, Any]], start: str = "") -> str:
    """The chained SHA-256 of metrics rows: ``d_k = sha256(d_{k-1} + json.dumps(row_k))``
    from ``d_0 = start`` (``""``). Of each row's JSON value, as ``metrics.jsonl``
    holds it (``json.dumps(json.loads(line))`` is the line as written), so
    reformatting the file keeps it and any changed, missing or foreign row changes it."""
    d = start
    for m in rows:
        d = hashlib.sha256((d + json.dumps(m)).encode()).hexdigest()
    return d


def _ranges(rounds: Sequence[int]) -> str:
    """``[1, 2, 3, 5]`` → ``"1–3, 5"``."""
    out: list[str] = []
    for k in sorted(rounds):
        if out and out[-1].split("–")[-1] == str(k - 1):
            out[-1] = f"{out[-1].split('–')[0]}–{k}"
        else:
            out.append(str(k))
    return ", ".join(out)


# A checkpoint's totals and the metrics line of its round must agree.
_TOTAL_KEYS = {"uplink_bytes": "uplink_bytes_total", "downlink_bytes": "downlink_bytes_total",
               "rejected_updates": "rejected_updates_total"}


def read_metrics(path: Path, upto: int, totals: dict[str, int] | None = None,
                 digest: str | None = None) -> list[dict[str, Any]]:
    """The metrics of rounds ``1 … upto`` (the checkpoint's round), validated.

    Each line must be a UTF-8 JSON object with an integer ``round``, no longer than
    :data:`~fedloom.bounded.MAX_JSONL_LINE` (a longer one is damaged; the file is
    read line by line and such a line never held whole). Lines of
    later rounds (run after the checkpoint by a killed run; they are run again)
    are dropped, and so is a torn last line (what a kill leaves; alone, it is not
    reported). Other damaged lines are dropped with a warning naming them when
    rounds ``1 … upto`` are all intact without them; otherwise — a
    round missing, repeated or out of order, the file missing or not a regular
    file, rows whose :func:`metrics_digest` differs from the checkpoint's
    ``digest``, or (a checkpoint from before the digest) the line of round
    ``upto`` whose totals differ from the checkpoint's ``totals`` (a file from
    another run) — :class:`RunDirError`, one line naming the file. Rounds are
    never dropped silently.
    """
    if upto == 0:
        return []
    return _metrics_rows(path, _metrics_lines(path, upto), upto, totals, digest)


def _metrics_lines(path: Path, upto: int) -> list[bytes | None]:
    """The metrics file's lines, without their newlines, ``None`` for one longer than
    :data:`~fedloom.bounded.MAX_JSONL_LINE`; :class:`RunDirError` when there is no
    such file to read (whatever checkpoint is resumed)."""
    check_regular(path, "the metrics file")
    try:
        with open(path, "rb") as f:
            return [line if line is None or not line.endswith(b"\n") else line[:-1]
                    for line in bounded.jsonl_lines(f)]
    except IsADirectoryError:
        raise RunDirError(f"{path}: is a directory, not the metrics file") from None
    except FileNotFoundError:
        raise RunDirError(f"{path}: missing, but the checkpoint is at round {upto}: the "
                          f"metrics of rounds {_ranges(range(1, upto + 1))} are lost") from None
    except OSError as e:
        raise RunDirError(f"{path}: cannot be read ({e.strerror or e})") from None


def _damaged(bad: list[int], long: list[int]) -> str:
    """``bad`` (1-based line numbers) for a message; those of ``long`` were over the bound."""
    over = (f"; line{'s' if len(long) > 1 else ''} {_ranges(long)} over the "
            f"{bounded.MAX_JSONL_LINE:,}-byte bound on a metrics line" if long else "")
    return f"{_ranges(bad)}{over}"


def _metrics_rows(path: Path, lines: list[bytes | None], upto: int,
                  totals: dict[str, int] | None, digest: str | None) -> list[dict[str, Any]]:
    """Rounds ``1 … upto`` of the file's ``lines`` checked (see :func:`read_metrics`);
    :class:`RunDirError` when they are not those of the checkpoint."""
    out: list[dict[str, Any]] = []
    bad: list[int] = []  # 1-based line numbers
    long = [no for no, line in enumerate(lines, 1) if line is None]
    for no, line in enumerate(lines, 1):
        try:
            obj: Any = None if line is None else json.loads(line.decode("utf-8"))
        # ValueError: also an integer past Python's int-parsing limit; RecursionError:
        # nesting deeper than the parser's stack. Either is a damaged line.
        except (UnicodeDecodeError, ValueError, RecursionError):
            obj = None
        rnd = obj.get("round") if isinstance(obj, dict) else None
        if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 1:
            bad.append(no)
            continue
        if rnd <= upto:
            if out and rnd <= out[-1]["round"]:
                what = "appears twice" if any(m["round"] == rnd for m in out) else "is out of order"
                raise RunDirError(f"{path}: round {rnd} {what} (line {no})")
            out.append(obj)
    missing = sorted(set(range(1, upto + 1)) - {m["round"] for m in out})
    if missing:
        dmg = f" ({len(bad)} damaged lines: {_damaged(bad, long)})" if bad else ""
        raise RunDirError(f"{path}: rounds {_ranges(missing)} before the checkpoint's round "
                          f"{upto} are missing{dmg}")
    if digest is not None and metrics_digest(out) != digest:
        raise RunDirError(f"{path}: rounds 1–{upto} are not those the checkpoint of round "
                          f"{upto} was written after (their digest differs): the file is not "
                          "this run's")
    if totals is not None:
        last = out[-1]
        for key, name in _TOTAL_KEYS.items():
            if name in last and key in totals and last[name] != totals[key]:
                raise RunDirError(f"{path}: round {upto} has {name}={last[name]}, the checkpoint "
                                  f"{totals[key]}: the file is not this run's")
    # A torn last line is what a kill leaves: no news (a line over the bound is no torn one).
    if bad and (bad != [len(lines)] or long):
        log.warning("%s: dropped %d damaged lines (%s); rounds 1–%d are intact", path, len(bad),
                    _damaged(bad, long), upto)
    return out


def _check_extension(old_rounds: Any, resolved: dict[str, Any]) -> None:
    """Resuming with another ``rounds`` extends a run: allowed when nothing before the
    run's end depends on the total, so the result is that of a run of the new total
    from the start (bit for bit). The cosine schedule does (its rate at round ``t``
    uses the last round), so it is refused, as is a smaller total."""
    new = resolved["rounds"]
    if not isinstance(old_rounds, int) or new < old_rounds:
        raise ConfigError(f"rounds: {new} is below the run's {old_rounds}: a run can be "
                          "extended, not shortened (use another --out)")
    sched = resolved["client"]["schedule"]["name"]
    if sched == "cosine":
        raise ConfigError(f"rounds: cannot extend the run from {old_rounds} to {new} rounds: "
                          "client.schedule.name=cosine depends on the total number of rounds "
                          f"(start a new run with rounds={new})")


def _same_but_rounds(a: dict[str, Any], b: dict[str, Any]) -> bool:
    # `logging` (where metrics are copied to) is not part of the experiment either.
    return {**a, "rounds": None, "logging": None} == {**b, "rounds": None, "logging": None}


def _with_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config with today's defaults filled in (a new setting's default is the
    behaviour from before it; a moved default, as it ran: recorded_config, as_it_ran).
    One that no longer loads (a renamed or removed key, an object) is compared as it
    is, and so differs, but for the names of fedloom's classes that moved."""
    try:
        return recorded_config(config_to_dict(load_config(as_it_ran(saved))))
    except (ConfigError, TypeError, ValueError):
        return moved_objects(saved)


def _config_diff(a: Any, b: Any, at: str = "") -> list[str]:
    """The dotted keys where saved config ``a`` and given config ``b`` differ,
    each as ``key: saved → given`` (rounds and logging are not compared)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for k in sorted(set(a) | set(b), key=str):
            if not at and k in ("rounds", "logging"):
                continue
            out += _config_diff(a.get(k, "<unset>"), b.get(k, "<unset>"),
                                f"{at}.{k}" if at else str(k))
        return out
    return [] if a == b else [f"{at}: {a!r} → {b!r}"]


def check_run_dir(run_dir: Path, resolved: dict[str, Any], resume: bool) -> None:
    """A new run needs an empty directory; a resumed one the same config."""
    saved = run_dir / CONFIG_FILE
    if resume:
        if not (saved.exists() or saved.is_symlink()):
            return
        check_regular(saved, "the run's config")  # a link to /dev/zero is never read
        try:
            old = safe_load_bounded(saved.read_bytes().decode("utf-8"), str(saved))
        except IsADirectoryError:
            raise RunDirError(f"{saved}: is a directory, not the run's config") from None
        except UnicodeDecodeError as e:
            raise RunDirError(f"{saved}: not UTF-8 text (byte {e.start}): the run's config is "
                              "damaged") from None
        except yaml.YAMLError as e:
            mark = e.problem_mark if isinstance(e, yaml.MarkedYAMLError) else None
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise RunDirError(f"{saved}: not valid YAML{where}: the run's config is damaged"
                              ) from None
        except OSError as e:
            raise RunDirError(f"{saved}: cannot be read ({e.strerror or e})") from None
        if not isinstance(old, dict):
            raise RunDirError(f"{saved}: holds no config mapping: the run's config is damaged")
        old = comparable_records(_with_defaults(old), resolved)
        if {**old, "logging": None} != {**resolved, "logging": None}:
            if not _same_but_rounds(old, resolved):
                diff = _config_diff(old, resolved)
                raise ConfigError(
                    f"{saved}: the config differs from the one given at "
                    f"{'; '.join(diff[:3])}{' …' if len(diff) > 3 else ''}; resume needs the "
                    "same config and overrides (only rounds may change, to extend the run)"
                )
            _check_extension(old.get("rounds"), resolved)
    elif any(p.name not in (LOCK_FILE, MARKER_FILE) for p in run_dir.iterdir()):
        raise ConfigError(f"{run_dir}: run directory exists and is not empty "
                          "(use --resume to continue it, or another --out)")


# Keys every checkpoint dict holds (the experiment's checkpoint_state).
_CKPT_KEYS = ("format", "next_round", "w", "opt_state", "agg_state", "method_state",
              "feedback_state", "w_avg", "totals", "store", "config")


@dataclass(frozen=True)
class Restorer:
    """What a resume reads of the run: the model's size and dtype (of ``w``), what
    the run starts with (for an earlier version's checkpoint, ``current_layout``) and
    ``restore(checkpoint, folder)``: its state, snapshot files read from ``folder``."""

    size: int
    dtype: torch.dtype
    fresh: Fresh
    restore: Callable[[dict[str, Any], Path], RunState]


def _restore_checked(restorer: Restorer, cfg: Config, resolved: dict[str, Any],
                     path: Path) -> tuple[RunState, set[str], str | None]:
    """Load, check and restore one checkpoint; return its state, the snapshot
    files it names and its metrics digest (``None`` in a checkpoint from before
    it). Raises :class:`CheckpointError` naming ``path``."""
    ck = load_checkpoint(path, _CKPT_KEYS)

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: {what}")

    if ck["format"] != 1:
        raise bad(f"checkpoint dict format {ck['format']!r}, expected 1")
    # Another `rounds` is an extension, checked against config.yaml (_check_extension).
    # A checkpoint of an older version holds its config in the older shape: read as
    # config.yaml is (_with_defaults: translated, today's defaults filled in).
    if isinstance(ck["config"], dict):
        ck["config"] = comparable_records(_with_defaults(ck["config"]), resolved)
    if not (isinstance(ck["config"], dict) and _same_but_rounds(ck["config"], resolved)):
        raise bad("written by a run with another config")
    if ck["config"].get("rounds") != cfg.rounds:
        _check_extension(ck["config"].get("rounds"), resolved)
    nr = ck["next_round"]
    if not isinstance(nr, int) or isinstance(nr, bool) or not 0 <= nr <= cfg.rounds:
        raise bad(f"next_round={nr!r} is not a round of this run (0 … {cfg.rounds})")
    d, dtype = restorer.size, restorer.dtype
    for key in ("w", "w_avg"):
        v = ck[key]
        if key == "w_avg" and v is None and not cfg.eval.average_iterates:
            continue
        if not (isinstance(v, torch.Tensor) and v.dtype == dtype and tuple(v.shape) == (d,)):
            raise bad(f"{key!r} is not a {cfg.dtype} vector of the model's {d} parameters")
    totals = ck["totals"]
    if not (isinstance(totals, dict) and all(k in totals for k in _TOTAL_KEYS)
            and all(isinstance(v, int) for v in totals.values())):
        raise bad("'totals' is not a mapping of the run's integer totals")
    # opt_state: a chain's tuple, or a mapping (an optimizer of one's own, an earlier layout)
    if not isinstance(ck["opt_state"], dict | tuple):
        raise bad(f"'opt_state' is a {type(ck['opt_state']).__name__}, not a tuple or mapping")
    for key in ("method_state", "feedback_state", "store"):
        if not isinstance(ck[key], dict):
            raise bad(f"{key!r} is a {type(ck[key]).__name__}, not a mapping")
    digest = ck.get(METRICS_DIGEST)
    if digest is not None and not isinstance(digest, str):
        raise bad(f"{METRICS_DIGEST!r} is a {type(digest).__name__}, not a digest")
    try:
        # an earlier version's layout in this one's: the one legacy reader
        st = restorer.restore(current_layout(ck, restorer.fresh), path.parent)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError,
            OSError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        # A snapshot file's error names that file; say which checkpoint named it.
        raise (CheckpointError(f"{msg} (named by {path})") if msg.startswith(str(path.parent))
               else bad(f"cannot be restored ({msg})")) from None
    files = {v["file"] for v in ck["store"].values() if isinstance(v, dict) and "file" in v}
    return st, files, digest


_Found = tuple[RunState, set[str], list[dict[str, Any]], str | None]


def _open_checkpoint(restorer: Restorer, cfg: Config, resolved: dict[str, Any],
                     run_dir: Path) -> _Found | None:
    """The newest intact checkpoint of ``run_dir`` whose rounds' metrics are all
    in ``metrics.jsonl``: ``(state, its snapshot files, those metrics, why
    last.pt was passed over or None)``, or ``None`` when there is no checkpoint.

    ``last.pt`` is tried first, then ``prev.pt``; if neither is intact,
    :class:`CheckpointError` names both and what is wrong with each (a
    :class:`RunDirError` when the metrics are what is wrong with one of them).
    """
    ckpt_dir = (run_dir / CHECKPOINT_FILE).parent
    last, prev = ckpt_dir / "last.pt", ckpt_dir / "prev.pt"

    def there(p: Path) -> bool:
        return p.exists() or p.is_symlink()

    if not (there(last) or there(prev)):
        return None
    problems: list[str] = []
    lines: list[bytes | None] | None = None  # metrics.jsonl, read once (no fallback if absent)
    metrics_bad = False
    for p in (last, prev):
        if not there(p):
            problems.append(f"{p}: missing")
            continue
        try:
            st, files, digest = _restore_checked(restorer, cfg, resolved, p)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        path = run_dir / METRICS_FILE
        lines = _metrics_lines(path, st.next_round) if lines is None else lines
        try:
            history = _metrics_rows(path, lines, st.next_round, st.totals, digest)
        except RunDirError as e:  # those rows are not this checkpoint's: as if it were damaged
            problems.append(f"{e}, so {p.name} (round {st.next_round}) cannot be continued")
            metrics_bad = True
            continue
        return st, files, history, (problems[0] if problems else None)
    if metrics_bad:
        raise RunDirError("; ".join(problems) + "; no checkpoint to resume from with the "
                          "metrics of its rounds (start again with another --out)")
    raise CheckpointError("; ".join(problems) + "; no intact checkpoint to resume from (start "
                          "again with another --out)")


def save(ckpt_dir: Path, state: dict[str, Any], keep: set[str]) -> set[str]:
    """Write ``last.pt`` (the one it replaces becomes ``prev.pt``), then drop the
    state snapshot files that neither names: ``keep`` are those of the newest
    checkpoint before this one (the new snapshot files were complete before the
    checkpoint named them). Returns the snapshot files the new checkpoint names."""
    save_checkpoint(ckpt_dir / "last.pt", state, keep_previous=ckpt_dir / "prev.pt")
    new = {v["file"] for v in state["store"].values() if isinstance(v, dict) and "file" in v}
    _drop_snapshots(ckpt_dir, new | keep)
    return new


def _drop_snapshots(ckpt_dir: Path, keep: set[str]) -> None:
    """Delete the state snapshot files of ``ckpt_dir`` not in ``keep`` (a damaged
    one may be a directory: it goes too, the folder is the run's own)."""
    for f in ckpt_dir.glob("state-*.bin"):
        if f.name not in keep:
            if f.is_dir() and not f.is_symlink():
                shutil.rmtree(f, ignore_errors=True)
            else:
                f.unlink(missing_ok=True)


def open_run_dir(start: RunState, restorer: Restorer, classes: Sequence[str] | None,
                 cfg: Config, resolved: dict[str, Any], run_dir: Path, resume: bool
                 ) -> tuple[RunState, list[dict[str, Any]], set[str]]:
    """Prepare ``run_dir`` for the rounds to run: ``(state to start from, the
    metrics of the rounds it covers, the snapshot files of its checkpoint)``.

    Drops temporary files a killed write left; on ``resume``, opens the newest
    intact checkpoint (a damaged ``last.pt`` is kept aside as
    ``last.pt.damaged``) and the metrics it covers, else starts from ``start``
    (the run's initial state); writes the resolved config, the data's class
    names ``classes`` and the metrics file cut to those rounds.
    """
    st = start
    history: list[dict[str, Any]] = []
    snap_files: set[str] = set()
    ckpt_dir = (run_dir / CHECKPOINT_FILE).parent
    if (ckpt_dir.exists() or ckpt_dir.is_symlink()) and not ckpt_dir.is_dir():
        raise RunDirError(f"{ckpt_dir}: is not a directory (the run's checkpoints go there)")
    # A write killed before its rename left a temporary file: never read, drop it.
    gone = [p.name for folder in (run_dir, ckpt_dir) for p in remove_leftovers(folder)]
    if gone:
        log.info("%s: removed %d temporary files left by a killed write (%s)", run_dir,
                 len(gone), ", ".join(sorted(gone)))
    if resume:
        found = _open_checkpoint(restorer, cfg, resolved, run_dir)
        if found is None:
            log.info("%s: no checkpoint; starting at round 1", ckpt_dir)
        else:
            st, snap_files, history, passed_over = found
            if passed_over is not None:
                _set_aside(ckpt_dir, passed_over, st.next_round, snap_files)
    atomic_write_bytes(run_dir / CONFIG_FILE, yaml.safe_dump(resolved, sort_keys=False).encode())
    if classes:  # the user's class names (CSV text labels): class k is classes[k]
        atomic_write_json(run_dir / LABELS_FILE, {name: k for k, name in enumerate(classes)})
    # Rewrite the metrics file to the rounds the state reflects (drops rounds
    # run after the last checkpoint by a killed run; they are run again).
    atomic_write_bytes(run_dir / METRICS_FILE,
                       "".join(json.dumps(m) + "\n" for m in history).encode())
    return st, history, snap_files


def _set_aside(ckpt_dir: Path, why: str, round_: int, snap_files: set[str]) -> None:
    """``last.pt`` was passed over (``why``: it is damaged, or the metrics of its
    rounds are) for ``prev.pt``: keep it aside, out of the rotation, and drop the
    snapshot files only it named."""
    last = ckpt_dir / "last.pt"
    msg = f"{why}; resumed from {ckpt_dir / 'prev.pt'} (round {round_})"
    if last.exists() or last.is_symlink():
        # Out of the rotation (the next save would make it prev.pt), kept to look at.
        kept = last.with_name("last.pt.damaged")
        if kept.is_dir() and not kept.is_symlink():
            shutil.rmtree(kept)
        else:
            kept.unlink(missing_ok=True)
        os.replace(last, kept)
        msg += f"; {last.name} is now {kept.name}, out of the rotation"
    # Only prev.pt's snapshot files are of use now (the rounds after it are run
    # again and write their own).
    _drop_snapshots(ckpt_dir, snap_files)
    log.warning("%s", msg)


def _frozen_entries(module: torch.nn.Module, trained: Sequence[str]) -> list[str]:
    """The ``state_dict`` keys of the parameters not in the Layout (a frozen base),
    tied names included."""
    keep = set(trained)
    frozen = {id(p) for n, p in module.named_parameters() if n not in keep}
    return [k for k, v in module.state_dict(keep_vars=True).items() if id(v) in frozen]


def _tensors_sha256(tensors: Sequence[torch.Tensor]) -> str:
    """SHA-256 of the tensors' bytes, in order (any dtype: bfloat16 has no numpy type)."""
    h = hashlib.sha256()
    for t in tensors:
        # the bytes as a buffer, not a copy (a base of 1B parameters is 4 GB)
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def model_blob(space: ModelSpace, st: RunState, cfg: Config, ds: Dataset,
               from_config: bool) -> dict[str, Any]:
    """``model.pt``'s content: the ``state_dict`` of ``space``'s module, the flat
    vector ``w``, its tensor names, and what :func:`load_model` rebuilds the module
    from (the config, the input shape and number of classes of ``ds``, and whether
    the config built it: ``from_config``). A model built from the config with frozen
    parameters (``hf_causal_lm``'s base) is saved without them: ``base_omitted``
    names them and ``base_sha256`` is their hash, since the config rebuilds them (a
    1B-parameter base is not written again for a run that trained a few MB of adapters)."""
    module, names = space.module, space.layout.names
    state = dict(module.state_dict())
    blob: dict[str, Any] = {"w": to_host(st.w), "names": names, "config": config_to_dict(cfg),
                            "in_shape": list(ds.input_shape), "num_classes": ds.num_classes,
                            "model_from_config": from_config}
    frozen = _frozen_entries(module, names) if from_config else []
    if frozen:
        blob["base_omitted"] = frozen
        blob["base_sha256"] = _tensors_sha256([state[k] for k in frozen])
        state = {k: v for k, v in state.items() if k not in set(frozen)}
    blob["state_dict"] = to_host(state)
    return blob


def load_model(path: str | Path, model: torch.nn.Module | None = None) -> torch.nn.Module:
    """The final model of a run: ``path`` is its run directory or its ``model.pt``.

    The module is ``model`` when given (the run's model was the caller's own), else
    rebuilt from the saved config (on the CPU, in the run's dtype); the saved
    ``state_dict`` is loaded into it. An adapters-only file (``base_omitted``) gets
    its base from the rebuild, checked against ``base_sha256``: a ``model.options.path``
    whose files changed since the run is refused in one line."""
    from fedloom.models import build_model

    p = Path(path)
    file = p / MODEL_FILE if p.is_dir() else p
    blob = torch.load(file, map_location="cpu", weights_only=True)
    if model is None:
        from fedloom.config import config_from_dict
        from fedloom.engine.given import given_module

        cfg = config_from_dict(blob["config"])
        dtype = {"float32": torch.float32, "float64": torch.float64}[cfg.dtype]
        # given in Python: rebuilt from its record (engine.given), or one line to pass it
        model = (build_model(cfg.model, tuple(blob["in_shape"]), int(blob["num_classes"]),
                             cfg.seed, dtype) if blob.get("model_from_config")
                 else given_module(cfg, file, dtype))
    omitted = list(blob.get("base_omitted", []))
    missing, unexpected = model.load_state_dict(blob["state_dict"], strict=not omitted)
    if unexpected or set(missing) - set(omitted):
        raise ValueError(f"{file}: the state_dict does not fit the model (missing "
                         f"{sorted(set(missing) - set(omitted))[:3]}, unexpected "
                         f"{sorted(unexpected)[:3]})")
    if omitted:
        state = model.state_dict()
        if _tensors_sha256([state[k] for k in omitted]) != blob["base_sha256"]:
            raise ValueError(f"{file}: the rebuilt base is not the run's (base_sha256 "
                             "differs: model.options.path's files changed, or another seed)")
    model.eval()
    return model


def write_outputs(run: RunFacts, st: RunState, run_dir: Path,
                  history: Sequence[dict[str, Any]], summary: dict[str, Any]) -> None:
    """A finished run's files: the model (with its buffers), the summary, the
    per-client numbers of the last evaluation (``st.evaluation``) and the plots."""
    buf = io.BytesIO()
    torch.save(model_blob(run.space, st, run.cfg, run.dataset, run.model_from_config), buf)
    atomic_write_bytes(run_dir / MODEL_FILE, buf.getvalue())
    atomic_write_json(run_dir / SUMMARY_FILE, summary)
    last = st.evaluation
    per_client = {name: [None if not np.isfinite(a) else float(a) for a in arr]
                  for name, arr in (("client_acc", last.client_acc),
                                    ("personal_acc", last.personal_acc),
                                    ("client_ppl", last.client_ppl),
                                    ("personal_ppl", last.personal_ppl))
                  if arr is not None}
    atomic_write_json(run_dir / CLIENT_ACC_FILE, per_client)
    cfg = run.cfg
    if cfg.logging.plots:
        from fedloom.report.plots import have_matplotlib, write_run_plots

        if not have_matplotlib():
            # Once a run (here, at its end): silence would look like a run without plots.
            log.warning("plots skipped: matplotlib is not installed (pip install "
                        "'fedloom[report]' for curves.png and partition.png, or set "
                        "logging.plots: false)")
            return
        write_run_plots(run_dir, list(history))
        from fedloom.data.heterogeneity import heterogeneity
        from fedloom.report.partition_plot import write_partition_plot

        write_partition_plot(run_dir / "partition.png", run.partition_counts,
                             heterogeneity(run.partition_counts),
                             f"{cfg.data.name}, {cfg.data.partition.name}")
