"""A model or data given in Python to :func:`fedloom.run`, recorded in the run directory
and rebuilt from that record, so that ``fedloom run RUN/config.yaml`` reruns the run.

Model (``model.name: object …``, recorded as components are, :mod:`fedloom.recorded`):
a module is ``object MODULE.CLASS`` with its constructor arguments as ``model.options``
and its own weights (fedloom does not initialise a module given to it: they are the
run's ``w_0``) in ``initial_model.pt`` (the option ``<weights>: run:initial_model.pt``); the rerun
builds the class with those arguments and loads the weights, dtypes as saved. A
factory (a function or class called with no arguments) is ``object MODULE:QUALNAME``;
the rerun calls it as the run did, the global generators seeded from ``(seed, init)``.
What cannot be recorded (an argument the module does not keep, a lambda, a function
defined inside another) is said under ``<unrecorded>``: the run runs, a rerun without
``model=`` is refused in one line naming it.

Data: the arrays of the :class:`~fedloom.data.sources.Dataset` as ``data.npz``
(``data.name: npz``, ``data.options.path: run:data.npz``; ``max_samples: 0`` and
``pool: train``, the data as the run saw it) when they reload to the same fingerprint,
keep every field the run reads (no augmentation, test flags, class names or tokens) and
fit ``run(record_data=…)``: ``None`` (default) records up to :data:`RECORD_DATA_BYTES`,
``True`` any size, ``False`` none. Otherwise ``data.options.path`` says ``<unrecorded>``
why and a rerun without ``data=`` is refused in one line naming the option. A rerun checks the
arrays against the ``data.json`` beside them (a damaged ``data.npz``: one line), and
records both again in its own directory. ``run:NAME`` is a file of the run directory
(:func:`fedloom.recorded.run_files`).
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedloom.bounded import size_text
from fedloom.config import Config, ConfigError, DataConfig, ModelConfig
from fedloom.data.fingerprint import fingerprint
from fedloom.data.sources import Dataset, load_dataset
from fedloom.data.user import from_arrays
from fedloom.files import new_tmp
from fedloom.recorded import (
    OBJECT_PREFIX,
    RUN_FILE,
    UNRECORDED,
    WEIGHTS,
    import_object,
    is_object,
    object_name,
    rebuild,
    record,
    unrecorded,
)
from fedloom.rng import Purpose, derive_seed, seeded_global_rng

__all__ = ["DATA_NPZ_FILE", "INITIAL_MODEL_FILE", "RECORD_DATA_BYTES", "from_record",
           "from_run_dir", "given_module", "record_inputs", "refuse_unrecorded", "run_inputs",
           "write_files"]

Model = torch.nn.Module | Callable[[], torch.nn.Module]

INITIAL_MODEL_FILE = "initial_model.pt"
DATA_NPZ_FILE = "data.npz"
# The most bytes of arrays recorded by default (MNIST as float32 is 220 MB): a run
# directory does not silently grow by a copy of a large data set.
RECORD_DATA_BYTES = 256 << 20
_AGAIN = "fedloom.run(RUN/config.yaml, {}=...)"


def _init_rng(seed: int) -> Any:
    return seeded_global_rng(derive_seed(seed, -1, -1, Purpose.INIT))


# ------------------------------------------------------------------ the record
def record_inputs(cfg: Config, run_dir: Path, model: Model | None, data: Dataset | None,
                  record_data: bool | None) -> tuple[Config, dict[str, Any]]:
    """``cfg`` recording the given ``model`` and ``data`` (module docstring), and the
    files to write into ``run_dir`` for it (name → bytes, or arrays for ``data.npz``).
    A record already naming ``run_dir``'s own files (its config.yaml, read again for a
    resume) names them ``run:NAME`` again."""
    files: dict[str, Any] = {}
    if model is not None:
        section, weights = _model_record(cfg, model)
        cfg = dataclasses.replace(cfg, model=section)
        if weights is not None:
            files[INITIAL_MODEL_FILE] = weights
    if data is not None:
        split, arrays = _data_record(cfg.data, data, record_data)
        cfg = dataclasses.replace(cfg, data=split)
        if arrays is not None:
            files[DATA_NPZ_FILE] = arrays
    own = RUN_FILE + INITIAL_MODEL_FILE
    if _here(cfg.model.options.get(WEIGHTS), run_dir / INITIAL_MODEL_FILE):
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, options={**cfg.model.options, WEIGHTS: own}))
    if _here(_path(cfg.data), run_dir / DATA_NPZ_FILE):
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(
            cfg.data, options={**cfg.data.options, "path": RUN_FILE + DATA_NPZ_FILE}))
    return cfg, files


def run_inputs(cfg: Config, run_dir: Path, model: Model | None, data: Dataset | None,
               record_data: bool | None
               ) -> tuple[Config, dict[str, Any], Model | None, Dataset | None]:
    """What a run in ``run_dir`` records and trains on: :func:`record_inputs` of what is
    given, then what ``cfg`` records rebuilt (:func:`from_run_dir`) and, for a rerun of
    another run's record, recorded here again, so that this directory reruns without
    that one (its config names ``run:NAME`` as the other's did)."""
    cfg, files = record_inputs(cfg, run_dir, model, data, record_data)
    built, loaded = from_run_dir(cfg, run_dir, model, data)
    again = (built if model is None else None, loaded if data is None else None)
    if again != (None, None):
        cfg, more = record_inputs(cfg, run_dir, *again, record_data=True)
        files.update(more)
    return cfg, files, built, loaded


def _here(path: Any, file: Path) -> bool:
    return isinstance(path, str) and bool(path) and Path(path).absolute() == file.absolute()


def write_files(run_dir: Path, files: dict[str, Any], resume: bool) -> None:
    """Each file of :func:`record_inputs` into ``run_dir``, replaced whole (a temporary
    file beside it, fsynced and renamed); a run resumed from a checkpoint keeps those
    it has (a module given again for a resume holds other weights than its ``w_0``)."""
    from fedloom.engine.runs.datarecord import has_checkpoint

    keep = resume and has_checkpoint(run_dir)
    for name, content in files.items():
        path = run_dir / name
        if keep and path.exists():
            continue
        fd, tmp = new_tmp(path)
        try:
            with os.fdopen(fd, "wb") as f:
                if isinstance(content, bytes):
                    f.write(content)
                else:
                    np.savez(f, **content)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def _model_record(cfg: Config, model: Model) -> tuple[ModelConfig, bytes | None]:
    kept = ModelConfig(buffers=cfg.model.buffers)
    if isinstance(model, torch.nn.Module):
        # the record is checked by building the class again: the user's global
        # generators are left as they were
        with _init_rng(cfg.seed):
            options = record(model)
        section = dataclasses.replace(kept, name=object_name(model), options=options)
        if unrecorded(options) is not None:
            return section, None
        buf = io.BytesIO()
        torch.save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, buf)
        options = {**options, WEIGHTS: RUN_FILE + INITIAL_MODEL_FILE}
        return dataclasses.replace(section, options=options), buf.getvalue()
    name, why = _reference(model)
    return dataclasses.replace(kept, name=OBJECT_PREFIX + name,
                               options={UNRECORDED: why} if why else {}), None


def _reference(factory: Any) -> tuple[str, str | None]:
    """``MODULE:QUALNAME`` of a factory, and why it cannot be imported by it (or None)."""
    if not (inspect.isfunction(factory) or inspect.isclass(factory)):
        kind = type(factory)
        return (f"{kind.__module__}:{kind.__qualname__}",
                f"a {kind.__qualname__} is not a function or class to import")
    qual = factory.__qualname__
    name = f"{factory.__module__}:{qual}"
    if "<" in qual:
        what = "a lambda" if qual.endswith("<lambda>") else "defined inside a function"
        return name, f"the factory {qual} is {what} (not importable); make it a function " \
                     "of a module"
    try:
        found = import_object(name)
    except Exception:  # an import runs the module's code: any error means not importable
        found = None
    if found is not factory:
        return name, f"the factory is not importable as {name}"
    return name, None


def _data_record(split: DataConfig, ds: Dataset, record_data: bool | None
                 ) -> tuple[DataConfig, dict[str, np.ndarray] | None]:
    base = dataclasses.replace(split, name="npz", max_samples=0, pool="train")
    size = sum(int(a.numel() * a.element_size()) for a in (ds.x, ds.y, ds.x_test, ds.y_test)
               if a is not None)
    why = _not_kept(ds)
    if why is None and record_data is False:
        why = "run(record_data=False)"
    elif why is None and record_data is None and size > RECORD_DATA_BYTES:
        why = (f"{size_text(size)} of arrays, over run(record_data=None)'s bound of "
               f"{size_text(RECORD_DATA_BYTES)}; run(..., record_data=True) records them")
    arrays = None
    if why is None:
        arrays, why = _arrays(ds)
    if why is not None:
        return dataclasses.replace(base, options={"path": f"{UNRECORDED} {why}"}), None
    return dataclasses.replace(base, options={"path": RUN_FILE + DATA_NPZ_FILE}), arrays


def _path(data: DataConfig) -> str:
    """``data.options.path`` ("" when not given)."""
    return str(data.options.get("path", ""))


def _not_kept(ds: Dataset) -> str | None:
    """Why ``ds`` is not what its arrays in an ``.npz`` load as (or None)."""
    for what, lost in (("its augmentation", bool(ds.augment)),
                       ("its own test flags", ds.test_mask is not None),
                       ("its class names", ds.classes is not None),
                       ("token data", ds.tokens_per_sample > 0)):
        if lost:
            return f"{what} cannot be kept in an .npz of arrays"
    if ds.natural != (ds.groups is not None):
        return "its client ids are not its split (natural=False), as they would be from an .npz"
    return None


def _arrays(ds: Dataset) -> tuple[dict[str, np.ndarray] | None, str | None]:
    """The arrays of ``ds`` as ``data.npz`` holds them, checked to reload (as
    ``data.name: npz`` loads them) to the same fingerprint."""
    arrays = {"X": ds.x.detach().cpu().numpy(), "y": ds.y.detach().cpu().numpy()}
    if ds.groups is not None:
        arrays["client"] = np.asarray(ds.groups)
    if ds.x_test is not None and ds.y_test is not None:
        arrays["X_test"] = ds.x_test.detach().cpu().numpy()
        arrays["y_test"] = ds.y_test.detach().cpu().numpy()
    try:
        again = from_arrays(arrays["X"], arrays["y"], arrays.get("client"),
                            arrays.get("X_test"), arrays.get("y_test"))
    except ValueError as e:
        return None, f"its arrays do not load as data.name: npz ({str(e).splitlines()[0]})"
    if fingerprint(again, "")["sha256"] != fingerprint(ds, "")["sha256"]:
        return None, ("its arrays load as other data from an .npz (dtypes or class count "
                      "differ from what data.name: npz gives)")
    return arrays, None


# ------------------------------------------------------------------ the rebuild
def from_record(cfg: Config, model: Model | None, data: Dataset | None
                ) -> tuple[Model | None, Dataset | None]:
    """The model and data ``cfg`` records as given in Python (a rerun of a run
    directory's config.yaml), where none is given; one ConfigError line for a record
    that cannot be rebuilt."""
    if model is None and is_object(cfg.model.name):
        model = _model(cfg.model, cfg.seed, weights=True)
    if data is None and cfg.data.name == "npz":
        data = _data(cfg)
    return model, data


def from_run_dir(cfg: Config, run_dir: Path, model: Model | None, data: Dataset | None
                 ) -> tuple[Model | None, Dataset | None]:
    """:func:`from_record` with ``run:NAME`` read as ``run_dir``'s file (a run resumed
    from its own config.yaml), so that the config keeps naming them so."""
    folder = str(run_dir.absolute())
    weights = cfg.model.options.get(WEIGHTS)
    if isinstance(weights, str) and weights.startswith(RUN_FILE):
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, options={
            **cfg.model.options, WEIGHTS: f"{folder}/{weights[len(RUN_FILE):]}"}))
    path = _path(cfg.data)
    if path.startswith(RUN_FILE):
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(
            cfg.data, options={**cfg.data.options, "path": f"{folder}/{path[len(RUN_FILE):]}"}))
    return from_record(cfg, model, data)


def refuse_unrecorded(config: object, cfg: Config, model: Model | None,
                      data: Dataset | None) -> None:
    """``config`` (as given to the run) is a run directory's config.yaml of a version that
    wrote the configured model and data though the run was given them in Python
    (``model.pt``'s ``model_from_config``, ``data.json``'s source): a rerun of it without
    them is refused in one line, where it trained the configured ones."""
    from fedloom.engine.runs.checkpoint import MARKER_FILE
    from fedloom.engine.runs.datarecord import data_source, read_record

    folder = Path(config).parent if isinstance(config, str | Path) else None
    if folder is None or not (folder / MARKER_FILE).is_file():
        return
    what = []
    path = _path(cfg.data)
    kept = cfg.data.name == "npz" and (path.startswith((RUN_FILE, UNRECORDED))
                                       or Path(path).name == DATA_NPZ_FILE)
    if data is None and not kept:
        rec = read_record(folder)
        if rec is not None and rec["fingerprint"].get("source") == data_source(cfg.data, True):
            what.append("data")
    file = folder / "model.pt"
    if model is None and not is_object(cfg.model.name) and file.is_file():
        try:
            blob = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # a damaged model.pt says nothing of the model: not this check's
            blob = None
        if isinstance(blob, dict) and blob.get("model_from_config") is False:
            what.append("model")
    if what:
        given = " and ".join(what)
        raise ConfigError(f"{config}: the run was given its {given} in Python, which this "
                          "config (of an earlier fedloom) does not record; pass "
                          f"{'them' if len(what) > 1 else 'it'} again: fedloom.run({config}, "
                          f"{', '.join(f'{w}=...' for w in what)})")


def given_module(cfg: Config, file: Path, dtype: torch.dtype) -> torch.nn.Module:
    """``load_model``'s module of a run given its model in Python (``file``: its
    ``model.pt``): rebuilt from the record in ``cfg`` (the class with its arguments, or
    the factory called) in ``dtype``, for the run's weights to be loaded into;
    ``ValueError``, one line, when it cannot be."""
    again = f"pass it as load_model({file.parent}, model=...)"
    if not is_object(cfg.model.name):  # a run of a version that did not record it
        raise ValueError(f"{file}: the run's model was given in Python, not by its "
                         f"config; {again}")
    try:
        got = _model(cfg.model, cfg.seed, weights=False)
        if not isinstance(got, torch.nn.Module):
            with _init_rng(cfg.seed):
                got = _called(got)
    except ConfigError as e:  # the rerun's advice (fedloom.run) is not load_model's
        why = str(e).splitlines()[0].split("; pass it again")[0]
        raise ValueError(f"{file}: {why}; {again}") from None
    return got.to(dtype)


def _model(section: ModelConfig, seed: int, weights: bool) -> Model:
    path = section.name[len(OBJECT_PREFIX):]
    why = unrecorded(section.options)
    if why is not None:
        raise ConfigError(f"model: {path} was given in Python and cannot be rebuilt from the "
                          f"record ({why}); pass it again: {_AGAIN.format('model')}")
    if ":" in path:  # a factory, called by the engine as the run called it
        try:
            factory = import_object(path)
        except Exception as e:  # an import runs the module's code: any error is one line
            hint = " (a function of the script that ran; move it into a module)" \
                if path.startswith("__main__:") else ""
            raise ConfigError(f"model: cannot import {path}{hint} ({type(e).__name__})"
                              ) from None
        if not callable(factory):
            raise ConfigError(f"model: {path} is a {type(factory).__name__}, not a factory")
        return factory  # type: ignore[no-any-return]
    where = section.options.get(WEIGHTS)
    if weights and not isinstance(where, str):
        raise ConfigError(f"model.options: the initial weights of {path} were not recorded "
                          f"({WEIGHTS}); pass the model again: {_AGAIN.format('model')}")
    state = _weights(where) if weights and isinstance(where, str) else None
    args = {k: v for k, v in section.options.items() if k != WEIGHTS}
    try:
        with _init_rng(seed):
            module = rebuild(section.name, args, "model")
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"model: {path} built a {type(module).__name__}, not a module")
    if state is not None:
        try:  # assign: the weights keep the dtype they were given in
            module.load_state_dict(state, strict=True, assign=True)
        except (RuntimeError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: does not load into {path} "
                              f"({str(e).strip().splitlines()[0]})") from None
    return module


def _called(factory: Callable[[], Any]) -> torch.nn.Module:
    got = factory()
    if not isinstance(got, torch.nn.Module):
        raise ConfigError("model: the factory must return a torch.nn.Module")
    return got


def _weights(where: str) -> dict[str, torch.Tensor]:
    if where.startswith(RUN_FILE):
        raise ConfigError(f"model.options: {where} names a file of the run directory; read "
                          "its config.yaml by its path (fedloom run RUN/config.yaml)")
    try:
        state = torch.load(where, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"{where}: not found (model.options: the run's initial weights)"
                          ) from None
    except Exception as e:  # a damaged or foreign file: torch's reasons vary
        raise ConfigError(f"{where}: cannot be read as the run's initial weights "
                          f"({type(e).__name__})") from None
    if not (isinstance(state, dict) and all(isinstance(v, torch.Tensor)
                                            for v in state.values())):
        raise ConfigError(f"{where}: not a state_dict (the run's initial weights)")
    return state


def _data(cfg: Config) -> Dataset | None:
    """The data recorded in a run directory (``data.json`` beside ``data.npz``), checked
    against that record; None for an ``.npz`` of the user's, loaded as configured."""
    where = _path(cfg.data)
    if where.startswith(UNRECORDED):
        raise ConfigError(f"data: the data given in Python was not recorded "
                          f"({where[len(UNRECORDED):].strip()}); pass it again: "
                          f"{_AGAIN.format('data')}")
    if where.startswith(RUN_FILE):
        raise ConfigError(f"data.options.path: {where} names a file of the run directory; "
                          "read its config.yaml by its path (fedloom run RUN/config.yaml)")
    from fedloom.engine.runs.checkpoint import MARKER_FILE
    from fedloom.engine.runs.datarecord import DATA_FILE, read_record

    file = Path(where)
    if file.name != DATA_NPZ_FILE or not all((file.parent / n).is_file()
                                             for n in (DATA_FILE, MARKER_FILE)):
        return None
    ds = load_dataset(cfg.data, cfg.seed)
    rec = read_record(file.parent)
    was = rec["fingerprint"]["sha256"] if rec is not None else None
    now = fingerprint(ds, "")["sha256"]
    if was is not None and was != now:
        raise ConfigError(f"{file}: not the data the run was given (sha256 {now[:12]}…, its "
                          f"{DATA_FILE} says {was[:12]}…): damaged; pass the data again: "
                          f"{_AGAIN.format('data')}")
    return ds
