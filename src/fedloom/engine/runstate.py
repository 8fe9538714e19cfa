"""The run's state, a round's plan and a run's result: what the stages pass along."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedloom.config import Config
from fedloom.hooks import RoundAdjust
from fedloom.job import ClientJob
from fedloom.params import Layout

__all__ = ["Callback", "Result", "RoundPlan", "RunState", "model_sha256"]


def model_sha256(w: torch.Tensor) -> str:
    """SHA-256 of the flat parameter vector's bytes (its own dtype, C order)."""
    return hashlib.sha256(w.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


@dataclass
class RunState:
    """Everything a round changes; a checkpoint is this plus the state store."""

    next_round: int
    w: torch.Tensor
    opt_state: Any  # the server optimizer's (a chain's: a tuple, one entry a transform)
    agg_state: Any
    method_state: dict[str, torch.Tensor] = field(default_factory=dict)
    feedback_state: dict[str, Any] = field(default_factory=dict)  # SA-PEF's L̂, SCAFCOM's c
    w_avg: torch.Tensor | None = None  # running mean of the iterates (eval.average_iterates)
    totals: dict[str, int] = field(
        default_factory=lambda: {"uplink_bytes": 0, "downlink_bytes": 0, "rejected_updates": 0,
                                 "rejected_rounds": 0, "clipped_updates": 0}
    )
    sim_time_s: float = 0.0  # the simulated clock (fedloom.system; 0 when off)
    # fedloom.privacy: adaptive clipping's C_t, local mode's participation counts
    privacy_state: dict[str, Any] = field(default_factory=dict)
    # the global module buffers (BatchNorm statistics; fedloom.buffers, model.buffers)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    # the event-driven modes' clients in flight and the models they started from
    # (fedloom.engine.events; empty in sync mode)
    events: dict[str, Any] = field(default_factory=dict)
    # the client selector's state (cohort.selection; fedloom.selection; {} for uniform)
    selection_state: dict[str, Any] = field(default_factory=dict)


@dataclass
class RoundPlan:
    """A round's cohort and jobs, and what the server keeps of them until the end."""

    round: int
    cohort: torch.Tensor
    lr: float
    jobs: list[ClientJob]
    alphas: list[float]
    fb_rows: list[dict[str, torch.Tensor]]
    old_rows: dict[str, torch.Tensor]
    comp: Any
    adjust: RoundAdjust                  # the round planner's changes (compression.adaptive)
    measured: list[list[Any]]            # per client metric hook: the clients' measurements
    dropped: list[int] = field(default_factory=list)
    # Kept cohort positions refused before or during the uplink, with the reason
    # (set by Experiment.uplink_round, after keep()).
    refused: dict[int, str] = field(default_factory=dict)
    # privacy.mode=local: updates the clients clipped (counted by uplink_round; None
    # where the clients clip elsewhere, as on Flower)
    dp_clipped: int | None = None
    # Clients the system model kept out (mid-round dropouts, late): not failed workers.
    withheld: set[int] = field(default_factory=set)
    # The event-driven modes (fedloom.engine.events): per cohort position, a row added
    # to the decoded row (FedAsync's w_t − w_τ) and the staleness weight s(τ) it is
    # then scaled by, applied by the server half before screening
    row_shifts: list[torch.Tensor | None] | None = None
    row_scales: list[float] | None = None
    # The client selector's state after it chose this cohort (cohort.selection); the
    # round's reports update it when the round ends.
    selection_state: dict[str, Any] = field(default_factory=dict)
    # Kept cohort positions whose payload was already decoded into the server's row
    # as the result arrived (fedloom.engine.uplink.EarlyUplink): receive skips it.
    predecoded: set[int] = field(default_factory=set)
    # [m] float64: each row's norm as decoded, where every row is the client's dense
    # update read in place (EarlyUplink; the norm taken by the worker): receive's size
    # rules use these instead of another pass over the rows. None: receive takes them.
    prenorms: torch.Tensor | None = None

    def keep(self, kept: Sequence[int]) -> None:
        """Keep the cohort positions ``kept``; the others are dropped clients
        (their worker failed)."""
        if len(kept) == len(self.cohort):
            return
        gone = sorted(set(range(len(self.cohort))) - set(kept))
        self.dropped = [int(self.cohort[i]) for i in gone]
        self._select(kept)

    def withdraw(self, gone: Sequence[int]) -> list[int]:
        """Remove the kept cohort positions ``gone`` after the uplink (late clients
        of the system model): dropped, not rejected; nothing of them is aggregated
        and their state rows are never scattered. Returns the positions kept."""
        out = set(gone)
        kept = [i for i in range(len(self.cohort)) if i not in out]
        self.dropped = [*self.dropped, *(int(self.cohort[i]) for i in gone)]
        self.withheld = self.withheld | {int(self.cohort[i]) for i in gone}
        new_pos = {old: new for new, old in enumerate(kept)}
        self.refused = {new_pos[i]: why for i, why in self.refused.items() if i in new_pos}
        self._select(kept)
        return kept

    def _select(self, kept: Sequence[int]) -> None:
        pos = torch.tensor(kept, dtype=torch.long)
        self.predecoded = set()  # decoded into rows by the old positions: decode again
        self.prenorms = None
        self.cohort = self.cohort[pos]
        self.old_rows = {f: v[pos] for f, v in self.old_rows.items()}
        self.alphas = [self.alphas[i] for i in kept]
        self.fb_rows = [self.fb_rows[i] for i in kept]
        if self.row_shifts is not None:
            self.row_shifts = [self.row_shifts[i] for i in kept]
        if self.row_scales is not None:
            self.row_scales = [self.row_scales[i] for i in kept]


@dataclass
class Result:
    """What :func:`run` returns."""

    config: Config
    w: torch.Tensor
    layout: Layout
    model: torch.nn.Module
    metrics: list[dict[str, Any]]
    summary: dict[str, Any]
    run_dir: Path | None


Callback = Callable[[RunState, dict[str, Any]], None]
