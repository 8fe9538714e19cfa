"""The run's state, a round's plan and outcome and a run's result: what the stages
pass along.

:class:`RunState` is all a run is: the experiment keeps none of it, so two states
advance side by side on one experiment and a checkpoint is the state. Its client
rows (:class:`~fedloom.state.ClientStateStore`) are the one part a round updates
in place rather than returns anew: ``N × d`` rows (memory-mapped for large
populations) are not copied a round to return new ones, as a donated buffer. The
state a round returns holds the same store, the one given is spent; a caller that
keeps an earlier state takes :meth:`RunState.copy` before the round.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedloom.compress.feedback import UplinkResult
from fedloom.config import Config
from fedloom.hooks import RoundAdjust
from fedloom.job import ClientJob, ClientResult
from fedloom.params import Layout
from fedloom.state import ClientStateStore

__all__ = ["Callback", "LastPerClient", "Result", "RoundOutcome", "RoundPlan", "RunState",
           "model_sha256", "withdraw"]


def model_sha256(w: torch.Tensor) -> str:
    """SHA-256 of the flat parameter vector's bytes (its own dtype, C order)."""
    return hashlib.sha256(w.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class LastPerClient:
    """The per-client numbers of the last evaluation (written to ``client_acc.json``);
    ``None`` until one is taken."""

    client_acc: np.ndarray | None = None
    # a causal LM's per-client test perplexities (client_acc.json's client_ppl)
    client_ppl: np.ndarray | None = None
    personal_acc: np.ndarray | None = None
    # a causal LM's per-client perplexities of the personal models (personal_ppl)
    personal_ppl: np.ndarray | None = None


def _no_rows() -> ClientStateStore:
    return ClientStateStore(0, {})


@dataclass
class RunState:
    """Everything a run is (see the module docstring); a checkpoint is this state.
    ``clients`` is updated in place by a round (the state returned holds it)."""

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
    # the clients' state rows (Experiment.init makes them; default: a run whose
    # clients keep none)
    clients: ClientStateStore = field(default_factory=_no_rows)
    # the per-client numbers of the last evaluation (client_acc.json)
    evaluation: LastPerClient = field(default_factory=LastPerClient)

    def copy(self) -> RunState:
        """This state with a copy of its client rows, so that a round on either leaves
        the other as it is (a round returns new values for everything else)."""
        return replace(self, clients=self.clients.copy())


@dataclass(frozen=True)
class RoundPlan:
    """What the plan stage decides of a round: its cohort, lr and client jobs, and
    what the server keeps of them until the end. Immutable: the stages after it
    return what came of it (:class:`RoundOutcome`); the system model's cut step
    budgets and the kept clients' part (:meth:`keep`) are new plans
    (``dataclasses.replace``)."""

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
    # The client selector's state after it chose this cohort (cohort.selection); the
    # round's reports update it when the round ends.
    selection_state: dict[str, Any] = field(default_factory=dict)
    # The event-driven modes (fedloom.engine.events): per cohort position, a row added
    # to the decoded row (FedAsync's w_t − w_τ) and the staleness weight s(τ) it is
    # then scaled by, applied by the server half before screening
    row_shifts: list[torch.Tensor | None] | None = None
    row_scales: list[float] | None = None

    def keep(self, kept: Sequence[int]) -> tuple[RoundPlan, list[int]]:
        """The plan of the cohort positions ``kept``, and the clients of the others
        (dropped: their worker failed)."""
        if len(kept) == len(self.cohort):
            return self, []
        gone = sorted(set(range(len(self.cohort))) - set(kept))
        return self.select(kept), [int(self.cohort[i]) for i in gone]

    def select(self, kept: Sequence[int]) -> RoundPlan:
        """The plan of the cohort positions ``kept`` (the jobs and the measurements
        stay the whole cohort's: what was planned and sent)."""
        pos = torch.tensor(kept, dtype=torch.long)
        return replace(
            self, cohort=self.cohort[pos],
            old_rows={f: v[pos] for f, v in self.old_rows.items()},
            alphas=[self.alphas[i] for i in kept], fb_rows=[self.fb_rows[i] for i in kept],
            row_shifts=(None if self.row_shifts is None
                        else [self.row_shifts[i] for i in kept]),
            row_scales=(None if self.row_scales is None
                        else [self.row_scales[i] for i in kept]))


@dataclass(frozen=True)
class RoundOutcome:
    """What came of a round's plan before the server's half: the kept clients'
    results and what each sent (cohort position ``i`` of the kept clients' plan),
    and who is missing or refused. Returned by the uplink stage
    (:func:`fedloom.engine.stages.uplink.uplink_round`, Flower's strategy); read by
    receive and the round's record."""

    results: list[ClientResult]
    ups: list[UplinkResult]
    # the planned clients not kept: their worker failed, or the system model kept
    # them out (mid-round dropouts, late)
    dropped: list[int] = field(default_factory=list)
    # kept cohort positions refused before or during the uplink, with the reason
    refused: dict[int, str] = field(default_factory=dict)
    # privacy.mode=local: updates the clients clipped (None where the clients clip
    # elsewhere, as on Flower)
    dp_clipped: int | None = None
    # Kept cohort positions whose payload was already decoded into the server's row
    # as the result arrived (fedloom.engine.stages.uplink.EarlyUplink): receive skips it.
    predecoded: frozenset[int] = frozenset()
    # [m] float64: each row's norm as decoded, where every row is the client's dense
    # update read in place (EarlyUplink; the norm taken by the worker): receive's size
    # rules use these instead of another pass over the rows. None: receive takes them.
    prenorms: torch.Tensor | None = None


def withdraw(plan: RoundPlan, sent: RoundOutcome, gone: Sequence[int]
             ) -> tuple[RoundPlan, RoundOutcome]:
    """Remove the kept cohort positions ``gone`` after the uplink (late clients of
    the system model): dropped, not rejected; nothing of them is aggregated and
    their state rows are never scattered. Rows decoded early are decoded again (by
    their new positions)."""
    out = set(gone)
    kept = [i for i in range(len(plan.cohort)) if i not in out]
    new_pos = {old: new for new, old in enumerate(kept)}
    return plan.select(kept), RoundOutcome(
        [sent.results[i] for i in kept], [sent.ups[i] for i in kept],
        dropped=[*sent.dropped, *(int(plan.cohort[i]) for i in gone)],
        refused={new_pos[i]: why for i, why in sent.refused.items() if i in new_pos},
        dp_clipped=sent.dp_clipped)


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
