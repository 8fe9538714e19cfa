"""The run: build the experiment, open its directory, loop over rounds, write the outputs.

:func:`run` is the entry point of both the CLI and notebooks. It knows no
algorithm and no stage of a round: a round is
:meth:`~fedloom.engine.experiment.Experiment.round` (:mod:`fedloom.engine.round`),
the run directory is :mod:`fedloom.engine.rundir`, the summary
:mod:`fedloom.engine.summary`. After each round: log it (``metrics.jsonl``,
CSV, TensorBoard), checkpoint on schedule (the metrics of the rounds a
checkpoint covers are on disk before it), call the callbacks.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from fedloom.buffers import load_buffers
from fedloom.config import Config, ConfigError, config_to_dict, load_config
from fedloom.data.sources import Dataset
from fedloom.engine.checkpoint import lock_run_dir
from fedloom.engine.experiment import Experiment
from fedloom.engine.rundir import (
    CHECKPOINT_FILE,
    METRICS_FILE,
    PREVIOUS_CHECKPOINT_FILE,
    check_run_dir,
    open_run_dir,
    save,
    write_outputs,
)
from fedloom.engine.runlog import METRICS_CSV_FILE, TENSORBOARD_DIR, MetricsCSV, TensorBoardSink
from fedloom.engine.runstate import Callback, Result, RunState, model_sha256
from fedloom.engine.setup import resolve_auto
from fedloom.engine.summary import DivergenceWatch, summarize

__all__ = ["Experiment", "Result", "RunState", "model_sha256", "run"]

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
) -> Result:
    """Run an experiment; return the final model, metrics and summary.

    Args:
        config: a YAML path, a mapping or a :class:`Config`.
        overrides: dotted ``key=value`` overrides.
        out: the run directory. ``None`` runs in memory (no files, no checkpoints).
            A directory that holds a run is never overwritten unless ``resume``.
            It is locked for the run's life: a second run on it gets
            :class:`~fedloom.engine.checkpoint.RunDirError` naming the holder's pid.
        resume: continue from ``out``'s newest intact checkpoint (``last.pt``, or
            ``prev.pt`` when ``last.pt`` is missing or damaged: a warning names
            both); the config must match the one saved there. The result is
            bit-identical to an uninterrupted run. A damaged checkpoint, state
            snapshot, config or metrics file with no intact one to fall back on
            raises one line naming it.
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
            derived from it, so CRAFT's per-layer mode works on it.
    """
    cfg = resolve_auto(load_config(config, overrides))
    run_dir = Path(out) if out is not None else None
    resolved = config_to_dict(cfg)
    if run_dir is None:
        if cfg.logging.tensorboard:
            raise ConfigError("logging.tensorboard: writes into the run directory; give out=DIR")
        exp = Experiment(cfg, data=data, model=model)
        try:
            return _loop(exp, cfg, resolved, None, resume, callbacks)
        finally:
            exp.close()
    # The lock comes first: nothing in the directory (its memmap state files
    # included, which Experiment creates) is touched by a run that does not hold it.
    lock, created = lock_run_dir(run_dir)
    try:
        check_run_dir(run_dir, resolved, resume)
        exp = Experiment(cfg, state_dir=run_dir / "state", data=data, model=model)
        try:
            return _loop(exp, cfg, resolved, run_dir, resume, callbacks)
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


class _Sinks:
    """Where each round's metrics go: ``metrics.jsonl`` (appended, flushed), its
    CSV view and TensorBoard (rebuilt from the history on a resume)."""

    def __init__(self, cfg: Config, run_dir: Path | None, history: list[dict[str, Any]],
                 next_round: int, resume: bool) -> None:
        self.csv = (MetricsCSV(run_dir / METRICS_CSV_FILE, history)
                    if run_dir is not None and cfg.logging.csv else None)
        if run_dir is not None and self.csv is None:
            # resumed with logging.csv off: an older copy would disagree with metrics.jsonl
            (run_dir / METRICS_CSV_FILE).unlink(missing_ok=True)
        self.tb = (TensorBoardSink(run_dir / TENSORBOARD_DIR, next_round + 1 if resume else None)
                   if run_dir is not None and cfg.logging.tensorboard else None)
        self.jsonl = open(run_dir / METRICS_FILE, "a") if run_dir is not None else None

    def write(self, m: dict[str, Any]) -> None:
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(m) + "\n")
            self.jsonl.flush()
        if self.csv is not None:
            self.csv.write_last()
        if self.tb is not None:
            self.tb.write(m)

    def sync(self) -> None:
        """The metrics written so far are on disk (before a checkpoint that covers them)."""
        if self.jsonl is not None:
            os.fsync(self.jsonl.fileno())

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


def _loop(exp: Experiment, cfg: Config, resolved: dict[str, Any], run_dir: Path | None,
          resume: bool, callbacks: Sequence[Callback]) -> Result:
    if run_dir is not None:
        st, history, snap_files = open_run_dir(exp, cfg, resolved, run_dir, resume)
    else:
        st, history, snap_files = exp.initial_state(), [], set()
    ckpt_dir = (run_dir / CHECKPOINT_FILE).parent if run_dir is not None else None
    # Rounds restored from the run directory are checked silently (the summary
    # still carries the warning); a new round that trips the rule is logged once.
    watch = DivergenceWatch(exp.cfg, exp.fed.num_classes)
    for m in history:
        watch.see(m)
    sinks = _Sinks(cfg, run_dir, history, st.next_round, resume)
    every, stop_reason = cfg.checkpoint.every, None

    def checkpoint(st: RunState) -> set[str]:
        sinks.sync()
        assert ckpt_dir is not None
        return save(ckpt_dir, exp.checkpoint_state(st, ckpt_dir), snap_files)

    try:
        while st.next_round < cfg.rounds:
            # privacy.target_epsilon: no round that would spend more than the budget.
            stop_reason = exp.privacy.stop_reason(st.privacy_state, st.next_round)
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
            if ckpt_dir is not None and every and (st.next_round % every == 0
                                                   or st.next_round == cfg.rounds):
                snap_files = checkpoint(st)
            for cb in callbacks:
                cb(st, m)
    finally:
        sinks.close()
    exp.layout.load_into(exp.module, st.w)
    load_buffers(exp.module, st.buffers)  # model.pt's state_dict and Result.model hold them
    summary = summarize(exp, st, history, [watch.message] if watch.message else [],
                        stop_reason)
    if run_dir is not None:
        write_outputs(exp, st, run_dir, history, summary)
    return Result(cfg, st.w, exp.layout, exp.module, history, summary, run_dir)
