"""A run state as a checkpoint, and back.

A checkpoint is the :class:`~fedloom.engine.runstate.RunState`, its clients'
state rows (``st.clients``, the :class:`~fedloom.state.ClientStateStore` a round
updates in place) and the per-client numbers of its last evaluation included:
:func:`checkpoint_state` reads the state, :func:`restore_state` loads a new store
(every row zero until then) and returns the state holding it. Tensors are saved on
the CPU and continued on the run's device.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from fedloom.buffers import check_buffers
from fedloom.config import Config, config_to_dict
from fedloom.device import to_device, to_host
from fedloom.engine.runstate import LastPerClient, RunState
from fedloom.privacy import Privacy
from fedloom.state import ClientStateStore

__all__ = ["checkpoint_state", "restore_state"]


def checkpoint_state(st: RunState, record: Config, snapshot_dir: Path | None = None
                     ) -> dict[str, Any]:
    """The checkpoint of ``st`` with its client rows; memmap state fields are
    copied to files in ``snapshot_dir`` (tagged with the round) instead of into the
    dict. ``record``: the run's config, saved with it (a resume checks it)."""
    return {
        "format": 1,
        "next_round": st.next_round,
        "w": to_host(st.w),
        "opt_state": to_host(st.opt_state),
        "agg_state": to_host(st.agg_state),
        "method_state": to_host(st.method_state),
        "feedback_state": to_host(st.feedback_state),
        "w_avg": to_host(st.w_avg),
        "totals": st.totals,
        "sim_time_s": st.sim_time_s,
        "privacy_state": to_host(st.privacy_state),
        "buffers": to_host(st.buffers),  # the global module buffers (fedloom.buffers)
        "events": to_host(st.events),    # in flight (fedloom.engine.events)
        "selection_state": st.selection_state,  # the client selector's (host) state
        "store": st.clients.state_dict(snapshot_dir, tag=f"r{st.next_round}"),
        "evaluation": {k: v for k, v in vars(st.evaluation).items() if v is not None},
        "config": config_to_dict(record),
    }


def restore_state(ckpt: dict[str, Any], store: ClientStateStore,
                  buffer_template: dict[str, torch.Tensor], privacy: Privacy,
                  device: torch.device, snapshot_dir: Path | None = None) -> RunState:
    """The run state of checkpoint ``ckpt`` (this version's layout: one of an earlier
    version is read through :func:`fedloom.engine.runs.legacy.current_layout` first),
    its client rows loaded into ``store`` (a new one: the state holds it)."""
    bufs = ckpt["buffers"]
    why = check_buffers(bufs, buffer_template)
    if why is not None:
        raise ValueError(f"'buffers' is {why}")
    store.load_state_dict(ckpt["store"], snapshot_dir)
    state = ckpt["selection_state"]
    if not isinstance(state, dict):
        raise ValueError(f"'selection_state' is a {type(state).__name__}, not a mapping")
    evaluation = ckpt["evaluation"]
    if not (isinstance(evaluation, dict) and set(evaluation) <= _PER_CLIENT
            and all(isinstance(v, np.ndarray) for v in evaluation.values())):
        raise ValueError("'evaluation' is not a mapping of per-client arrays")
    # Loaded on the CPU (map_location), continued on the run's device.
    return to_device(RunState(ckpt["next_round"], ckpt["w"], ckpt["opt_state"],
                              ckpt["agg_state"], ckpt["method_state"],
                              ckpt["feedback_state"], ckpt["w_avg"], dict(ckpt["totals"]),
                              float(ckpt["sim_time_s"]),
                              privacy_state=privacy.checked_state(ckpt["privacy_state"]),
                              # check_buffers passed: the mapping the template needs
                              buffers=cast("dict[str, torch.Tensor]", bufs),
                              events=dict(ckpt["events"]),
                              selection_state=dict(state), clients=store,
                              evaluation=LastPerClient(**evaluation)),
                     device)


_PER_CLIENT = {f.name for f in fields(LastPerClient)}
