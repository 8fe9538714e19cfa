"""Scatter: the accepted clients' new rows back to their owners, and the buffers.

Only after a step that is applied, and only for accepted clients: a rejected
client's rows, and every row of a rejected round, stay as they were. Each
owner (:mod:`fedloom.engine.clientfields`) gets its own rows back: the local
method's from the clients' results (and its server state from
``server_update``), the feedback policy's from the uplink, the buffer
policy's (``model.buffers=local``) from the buffers local training ended with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fedloom.buffers import average_buffers, flatten_buffers
from fedloom.compress.feedback import UplinkResult
from fedloom.engine.clientfields import BUFFERS, FEEDBACK, METHOD
from fedloom.engine.inputs import ClientData
from fedloom.engine.runstate import RoundPlan, RunState
from fedloom.job import ClientResult

__all__ = ["next_buffers", "scatter"]


def scatter(method: Any, clients: ClientData, dtype: torch.dtype, st: RunState,
            plan: RoundPlan, results: Sequence[ClientResult], ups: Sequence[UplinkResult],
            ok: torch.Tensor, *, client_state: bool = True,
            client_buffers: bool = False) -> dict[str, Any]:
    """Write the accepted clients' new rows to the state's store (``st.clients``, in
    place: the state the round returns holds it); return the local
    method's new server state. ``client_state=False``: the clients keep their own
    state (Flower); ``client_buffers=True`` still keeps their own buffers
    (``model.buffers=local``), which they send anyway, for the per-client evaluation."""
    f, store = clients.fields, st.clients
    if not ((client_state or (client_buffers and f.has(BUFFERS))) and f.specs
            and bool(ok.any())):
        return st.method_state
    pos = ok.nonzero().squeeze(1).tolist()
    ids = plan.cohort[ok.nonzero().squeeze(1)]
    new: dict[str, dict[str, torch.Tensor]] = {}
    if client_state:
        new[METHOD] = {n: torch.stack([results[i].state[n] for i in pos])
                       for n in f.names(METHOD)}
        new[FEEDBACK] = {n: torch.stack([ups[i].state[n] for i in pos])
                         for n in f.names(FEEDBACK)}
    if f.has(BUFFERS) and all(results[i].buffers for i in pos):
        new[BUFFERS] = {"buffers": torch.stack([flatten_buffers(results[i].buffers, dtype)
                                                for i in pos]),
                        "buffers_set": torch.ones((len(pos), 1), dtype=dtype)}
    for owner, rows in new.items():
        for key, rows_f in f.join(owner, rows).items():
            store.scatter(key, ids, rows_f)
    if client_state and f.has(METHOD):
        return method.server_update(st.method_state,
                                    f.own(METHOD, plan.old_rows, ok.nonzero().squeeze(1)),
                                    new[METHOD], clients.num_clients)
    return st.method_state


def next_buffers(policy: str, st: RunState, results: Sequence[ClientResult],
                 ok: torch.Tensor) -> dict[str, torch.Tensor]:
    """The global module buffers after an applied step: the data-weighted mean of
    the accepted clients' (``average``, ``local``); never changed under ``keep_global``
    (``policy``: ``model.buffers``)."""
    if not st.buffers or policy == "keep_global":
        return st.buffers
    kept = [i for i, ok_k in enumerate(ok.tolist()) if ok_k and results[i].buffers]
    if not kept:
        return st.buffers
    return average_buffers([results[i].buffers for i in kept],
                           [results[i].num_samples for i in kept])
