"""The run: build the experiment, open its directory, loop over rounds, write the outputs.

:func:`run` is the entry point of both the CLI and notebooks. It knows no
algorithm and no stage of a round: a round is
:meth:`~fedloom.engine.experiment.Experiment.round` (:mod:`fedloom.engine.round`),
the run directory is :mod:`fedloom.engine.runs.directory`, the summary
:mod:`fedloom.engine.runs.summary`. After each round: log it (``metrics.jsonl``,
CSV, TensorBoard), checkpoint on schedule (the metrics of the rounds a
checkpoint covers are on disk before it, and their digest is in it), call the
callbacks. A run whose first rounds all skip the step stops with a ConfigError
rather than return its starting model (:mod:`fedloom.engine.runs.stepped`). A file
of the run directory that cannot be written (a full disk) ends the run with
:class:`~fedloom.engine.runs.checkpoint.RunDirWriteError` naming it; the
checkpoints written so far stay, and ``resume`` continues from them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from fedloom.buffers import load_buffers
from fedloom.capabilities import backend_caps, backend_name
from fedloom.config import Config, ConfigError, config_to_dict, load_config
from fedloom.data.sources import Dataset
from fedloom.engine.build import resolve_auto
from fedloom.engine.experiment import Experiment
from fedloom.engine.given import refuse_unrecorded, run_inputs, write_files
from fedloom.engine.objects import Components
from fedloom.engine.runs.checkpoint import RunDirWriteError, lock_run_dir
from fedloom.engine.runs.datarecord import DataRecord, data_path, data_source
from fedloom.engine.runs.directory import (
    CHECKPOINT_FILE,
    METRICS_DIGEST,
    METRICS_FILE,
    PREVIOUS_CHECKPOINT_FILE,
    Restorer,
    check_run_dir,
    metrics_digest,
    open_run_dir,
    save,
    write_outputs,
)
from fedloom.engine.runs.sinks import (
    METRICS_CSV_FILE,
    TENSORBOARD_DIR,
    MetricsCSV,
    TensorBoardSink,
    append_text,
)
from fedloom.engine.runs.stepped import stop_if_never_stepped
from fedloom.engine.runs.summary import DivergenceWatch, RunFacts, summarize
from fedloom.engine.runstate import Callback, Result, RunState, model_sha256
from fedloom.models.adapters import write_adapter

__all__ = ["Experiment", "Result", "RunState", "model_sha256", "run", "run_facts"]

log = logging.getLogger("fedloom")


def run(
    config: str | Path | dict[str, Any] | Config,
    overrides: Sequence[str] = (),
    *,
    out: str | Path | None = None,
    resume: bool = False,
    callbacks: Sequence[Callback] = (),
    data: Dataset | None = None,
    model: torch.nn.Module | Callable[[], torch.nn.Module] | None = None,
    aggregator: Any = None,
    server: Any = None,
    compressor: Any = None,
    feedback: Any = None,
    method: Any = None,
    transforms: Sequence[Any] = (),
    selector: Any = None,
    allow_data_change: bool = False,
    record_data: bool | None = None,
) -> Result:
    """Run an experiment; return the final model, metrics and summary.

    Args:
        config: a YAML path, a mapping or a :class:`Config`.
        overrides: dotted ``key=value`` overrides.
        out: the run directory. ``None`` runs in memory (no files, no checkpoints).
            A directory that holds a run is never overwritten unless ``resume``.
            It is locked for the run's life: a second run on it gets
            :class:`~fedloom.engine.runs.checkpoint.RunDirError` naming the holder's pid.
            An existing directory that is not a run directory (not empty, no
            ``.fedloom-run`` marker; a link to ``/``, say) is refused before
            anything in it is touched. A file in it that cannot be written (a full
            disk) raises :class:`~fedloom.engine.runs.checkpoint.RunDirWriteError`
            naming it; ``resume`` then continues the run.
        resume: continue from ``out``'s newest intact checkpoint (``last.pt``, or
            ``prev.pt`` when ``last.pt`` is missing or damaged: a warning names
            both); the config must match the one saved there. The result is
            bit-identical to an uninterrupted run. A damaged checkpoint, state
            snapshot, config or metrics file with no intact one to fall back on
            raises one line naming it. The data must be the data the run was
            trained on (its fingerprint in ``out``'s ``data.json``,
            :mod:`fedloom.engine.runs.datarecord`): other data raises
            :class:`~fedloom.engine.runs.datarecord.DataChangedError`, one line naming it
            and what changed, before anything is written. A run from before
            ``data.json`` resumes unchecked.
        allow_data_change: resume on other data all the same (``--allow-data-change``):
            the rounds after the checkpoint train on it, and ``data.json`` notes the
            round at which the data changed and what changed.
        callbacks: called as ``cb(state, metrics)`` after each round is logged
            (``metrics.jsonl``, ``metrics.csv``, TensorBoard) and checkpointed:
            ``metrics`` is that round's record (``metrics["round"]`` its number,
            equal to ``state.next_round``), so ``wandb.log(metrics,
            step=metrics["round"])`` or ``mlflow.log_metrics(metrics,
            step=metrics["round"])`` (numeric values) sends each round to W&B or
            MLflow. A resumed run calls them for the rounds it runs. An exception
            from a callback stops the run (``KeyboardInterrupt`` included); the
            checkpoints written so far stay, and ``resume`` continues from them.
        data: your own dataset (:func:`fedloom.data.from_arrays`) instead of ``data.name``.
        model: your own ``torch.nn.Module`` (its current weights are ``w_0``) or a
            factory returning one, instead of ``model.name``. Layer groups are
            derived from it, so CRAFT's per-layer mode works on it. With ``out``, both
            are recorded for ``fedloom run out/config.yaml`` (:mod:`fedloom.engine.given`).
        record_data: keep ``data``'s arrays in ``out``: None to 256 MiB, True always, False never.
        aggregator, server, compressor, feedback, method, transforms, selector: component
            objects (e.g. ``CRAFT(step="rprop")``, a class of your own with the
            protocol of its kind; ``transforms``: terms of the local step,
            :mod:`fedloom.client.transforms`; ``selector``: who trains in a round,
            :mod:`fedloom.selection`) used instead of building the config
            section's named ones; the config records each as ``object
            MODULE.CLASS`` (:mod:`fedloom.engine.objects`).
    """
    given = Components(aggregator=aggregator, server=server, compressor=compressor,
                       feedback=feedback, method=method, transforms=tuple(transforms),
                       selector=selector)
    cfg = resolve_auto(given.into(load_config(config, overrides)))
    refuse_unrecorded(config, cfg, model, data)  # a run directory of an earlier version
    if out is None:
        return _run_in_memory(cfg, resume, callbacks, data, model, given)
    return _run_in_dir(cfg, Path(out), resume, callbacks, data, model, given,
                       allow_data_change, record_data)


def _run_in_memory(cfg: Config, resume: bool, callbacks: Sequence[Callback],
                   data: Dataset | None,
                   model: torch.nn.Module | Callable[[], torch.nn.Module] | None,
                   given: Components) -> Result:
    """A run with no directory: no files, no checkpoints."""
    resolved = config_to_dict(cfg)
    if cfg.logging.tensorboard:
        raise ConfigError("logging.tensorboard: writes into the run directory; give out=DIR")
    exp = Experiment.from_config(cfg, data=data, model=model, components=given)
    try:
        return _loop(exp, cfg, resolved, None, resume, callbacks)
    finally:
        exp.close()


def _run_in_dir(cfg: Config, run_dir: Path, resume: bool, callbacks: Sequence[Callback],
                data: Dataset | None,
                model: torch.nn.Module | Callable[[], torch.nn.Module] | None,
                given: Components, allow_data_change: bool,
                record_data: bool | None = None) -> Result:
    """A run in ``run_dir``, locked for its life; a directory this call made that
    holds no checkpoint when the run fails is removed."""
    # a model and data given in Python, recorded for a rerun (fedloom.engine.given)
    cfg, files, model, data = run_inputs(cfg, run_dir, model, data, record_data)
    resolved = config_to_dict(cfg)
    # The lock comes first: nothing in the directory (its memmap state files
    # included, which Experiment creates) is touched by a run that does not hold it.
    lock, created = lock_run_dir(run_dir, resume)
    try:
        check_run_dir(run_dir, resolved, resume)
        record = DataRecord(run_dir, resume, allow_data_change,
                            data_source(cfg.data, data is not None),
                            data_path(cfg.data) if data is None else "")
        with _write_errors(run_dir):  # the memmap state files are made here
            exp = Experiment.from_config(cfg, state_dir=run_dir / "state", data=data,
                                         model=model, components=given,
                                         data_check=record.check)
            try:
                write_files(run_dir, files, resume)  # once the data passed its check
                return _loop(exp, cfg, resolved, run_dir, resume, callbacks, record)
            finally:
                exp.close()
    except BaseException:
        # A run dir made by this call that holds no checkpoint has nothing worth
        # keeping; one with a checkpoint stays so that --resume can continue it.
        if created and not any((run_dir / f).exists()
                               for f in (CHECKPOINT_FILE, PREVIOUS_CHECKPOINT_FILE)):
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    finally:
        lock.release()


# What a full disk looks like: a write that fails for want of space, not a bug.
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


@contextlib.contextmanager
def _write_errors(path: Path) -> Iterator[None]:
    """A full disk while writing ``path`` (a file, or the run directory when the
    write is deeper, e.g. in TensorBoard's writer): :class:`RunDirWriteError`
    naming it, not a traceback."""
    try:
        yield
    except OSError as e:
        if e.errno not in _FULL:
            raise
        where = Path(e.filename) if isinstance(e.filename, str) else path
        what = "cannot be written" if where != path or path.suffix else \
            "a file in it cannot be written"
        err = RunDirWriteError(f"{where}: {what} ({e.strerror or type(e).__name__})")
        err.full = e.errno != errno.EROFS
        raise err from None


class _Sinks:
    """Where each round's metrics go: ``metrics.jsonl`` (appended, flushed), its
    CSV view and TensorBoard (rebuilt from the history on a resume)."""

    def __init__(self, cfg: Config, run_dir: Path | None, history: list[dict[str, Any]],
                 next_round: int, resume: bool) -> None:
        # The digest of the rows so far, for the next checkpoint (rundir.metrics_digest).
        self.digest = metrics_digest(history)
        self.csv: MetricsCSV | None = None
        self.tb: TensorBoardSink | None = None
        self.jsonl: Any = None
        if run_dir is None:
            return
        self.paths = {k: run_dir / name for k, name in (
            ("csv", METRICS_CSV_FILE), ("tb", TENSORBOARD_DIR), ("jsonl", METRICS_FILE))}
        with _write_errors(self.paths["csv"]):
            self.csv = MetricsCSV(self.paths["csv"], history) if cfg.logging.csv else None
            if self.csv is None:
                # resumed with logging.csv off: an older copy would disagree with metrics.jsonl
                self.paths["csv"].unlink(missing_ok=True)
        with _write_errors(self.paths["tb"]):
            self.tb = (TensorBoardSink(self.paths["tb"], next_round + 1 if resume else None)
                       if cfg.logging.tensorboard else None)
        with _write_errors(self.paths["jsonl"]):
            self.jsonl = append_text(self.paths["jsonl"])  # never through a link

    def write(self, m: dict[str, Any]) -> None:
        self.digest = metrics_digest([m], self.digest)
        if self.jsonl is not None:
            with _write_errors(self.paths["jsonl"]):
                self.jsonl.write(json.dumps(m) + "\n")
                self.jsonl.flush()
        if self.csv is not None:
            with _write_errors(self.paths["csv"]):
                self.csv.write_last()
        if self.tb is not None:
            with _write_errors(self.paths["tb"]):
                self.tb.write(m)

    def sync(self) -> None:
        """The metrics written so far are on disk (before a checkpoint that covers them)."""
        if self.jsonl is not None:
            with _write_errors(self.paths["jsonl"]):
                os.fsync(self.jsonl.fileno())

    def close(self, failing: bool = False) -> None:
        """Close the files; while ``failing`` (the run is ending with an error),
        their own errors (a full disk again, flushing) do not hide that one."""
        for f in (self.jsonl, self.tb):
            if f is None:
                continue
            try:
                f.close()
            except OSError:
                if not failing:
                    raise


def run_facts(exp: Experiment) -> RunFacts:
    """What the summary and the run's files say of ``exp`` beside its state and
    metrics, as it is now (a backend ``auto`` chose is named by its choice)."""
    origin = exp.origin
    return RunFacts(exp.cfg, exp.space, exp.clients.fed.dataset, origin.partition_counts,
                    origin.model_from_config, backend_name(exp.backend, exp.cfg.backend.name),
                    backend_caps(exp.backend).worker_threads, exp.threads, exp.privacy)


def _loop(exp: Experiment, cfg: Config, resolved: dict[str, Any], run_dir: Path | None,
          resume: bool, callbacks: Sequence[Callback], record: DataRecord | None = None
          ) -> Result:
    st = exp.init()
    history: list[dict[str, Any]] = []
    snap_files: set[str] = set()
    if run_dir is not None:
        restorer = Restorer(exp.space.layout.size, exp.space.dtype, exp.fresh(), exp.restore)
        st, history, snap_files = open_run_dir(st, restorer, exp.clients.fed.dataset.classes, cfg,
                                               resolved, run_dir, resume)
        if record is not None:  # data.json: the data the rounds from st on train on
            record.write(st.next_round)
    ckpt_dir = (run_dir / CHECKPOINT_FILE).parent if run_dir is not None else None
    # Rounds restored from the run directory are checked silently (the summary
    # still carries the warning); a new round that trips the rule is logged once.
    watch = DivergenceWatch(exp.cfg, exp.clients.fed.num_classes, exp.clients.fed.dataset.x)
    for m in history:
        watch.see(m)
    sinks = _Sinks(cfg, run_dir, history, st.next_round, resume)
    every, stop_reason = cfg.checkpoint.every, None

    def checkpoint(st: RunState) -> set[str]:
        sinks.sync()
        assert ckpt_dir is not None
        state = exp.checkpoint_state(st, ckpt_dir)
        state[METRICS_DIGEST] = sinks.digest  # the rows a resume from it must find
        return save(ckpt_dir, state, snap_files)

    try:
        while st.next_round < cfg.rounds:
            # privacy.target_epsilon: no round that would spend more than the budget.
            stop_reason = exp.privacy.stop_reason(st.privacy_state, st.next_round,
                                                   planned=cfg.rounds)
            if stop_reason is not None:
                log.warning("stopped before round %d: %s", st.next_round + 1, stop_reason)
                if ckpt_dir is not None and every and st.next_round % every:
                    snap_files = checkpoint(st)
                break
            st, m = exp.round(st)
            history.append(m)
            if watch.see(m) is not None:
                log.warning("%s", watch.message)
            sinks.write(m)
            stop_if_never_stepped(history, cfg)
            if ckpt_dir is not None and every and (st.next_round % every == 0
                                                   or st.next_round == cfg.rounds):
                snap_files = checkpoint(st)
            for cb in callbacks:
                cb(st, m)
    except BaseException:
        sinks.close(failing=True)
        raise
    sinks.close()
    space = exp.space
    space.layout.load_into(space.module, st.w)
    load_buffers(space.module, st.buffers)  # model.pt's state_dict and Result.model hold them
    facts = run_facts(exp)
    summary = summarize(facts, st, history, [watch.message] if watch.message else [],
                        stop_reason)
    if run_dir is not None:
        write_outputs(facts, st, run_dir, history, summary)
        # a LoRA run: peft's adapter files beside model.pt (nothing for another model)
        write_adapter(space.module, run_dir)
    return Result(cfg, st.w, space.layout, space.module, history, summary, run_dir)
