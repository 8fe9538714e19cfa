"""A local method checked at the door: one given as an object or an import reference
runs two rounds of one tiny job before round 1 (two samples of the run's data, one
local step).

The LocalMethod protocol (:class:`fedloom.client.methods.LocalMethod`, whose hooks a
method overrides) is run in the round's order: ``fields(d)``, ``init_server(w)``,
``prepare(job, server)`` → a :class:`~fedloom.job.ClientJob`, ``run(trainer, job)``
→ a :class:`~fedloom.job.ClientResult`, ``server_update(server, old, new, N)``,
``adjust_model(w, server)`` and, for a method that keeps personal models,
``personal_models(rows, w)``; then once more from the rows and server state the first
round returned (the state round-trip). Checked: the kinds and arities of what comes
back, a finite update and model of shape ``(d,)``, the new rows the method's
``fields`` declared (each finite, of its size). The trainer is a copy of the run's
(its own flat module): the run's trainer is not touched. A method of fedloom's own
(tested by its suites) is not run. A violation is one ``ValueError`` line naming
``client.method``, the class and method, and what came back.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, cast

import torch

from fedloom.client.sgd import LocalSGD
from fedloom.job import ClientJob, ClientResult, local_job
from fedloom.state import FieldSpec
from fedloom.transforms import (
    called,
    check_mapping,
    check_rows,
    check_vector,
    from_fedloom,
    returned,
    what,
)

__all__ = ["check_method", "check_method_hooks"]

_WHERE = "client.method"
_HOOKS = ("check_trainer", "fields", "init_server", "prepare", "run", "complete",
          "server_update", "adjust_model", "personal_models")
_PROTOCOL = ("a local method subclasses fedloom.client.methods.LocalMethod and overrides "
             "its hooks (prepare(job, server) -> ClientJob, run(trainer, job) -> ClientResult, "
             "...)")


def check_method_hooks(method: object) -> None:
    """One line when ``method`` lacks a hook the engine calls."""
    missing = [h for h in _HOOKS if not callable(getattr(method, h, None))]
    missing += [a for a in ("personal",) if not hasattr(method, a)]  # read each round
    if missing:
        raise ValueError(f"{_WHERE}: {type(method).__name__} has no {' and '.join(missing)}; "
                         f"{_PROTOCOL}")


def check_method(method: object, trainer: LocalSGD, w: torch.Tensor, x: torch.Tensor,
                 y: torch.Tensor, *, lr: float, seeds: tuple[int, ...], num_clients: int
                 ) -> None:
    """``method`` on client 0's job of the samples ``x, y`` from the parameters ``w``,
    one round (one local step) for each batch-order seed of ``seeds``."""
    check_method_hooks(method)
    if from_fedloom(method):
        return
    lm = cast(Any, method)
    cls, d = type(method).__name__, w.numel()
    specs = called(f"{_WHERE}: {cls}.fields", f"d = {d}", lm.fields, d)
    if not isinstance(specs, Mapping) or not all(isinstance(s, FieldSpec)
                                                 for s in specs.values()):
        raise ValueError(f"{_WHERE}: {cls}.fields returned {what(specs)}, expected a "
                         "mapping of names to fedloom.state.FieldSpec")
    rows = {n: torch.zeros(s.size, dtype=w.dtype, device=w.device) for n, s in specs.items()}
    server = check_mapping(f"{_WHERE}: {cls}.init_server", called(
        f"{_WHERE}: {cls}.init_server", f"parameters of shape ({d},)", lm.init_server,
        w.clone()), "its server state")
    trainer = copy.copy(trainer)  # its own flat module: the run's trainer keeps its own
    for r, seed in enumerate(seeds):
        on = (f"a job of {len(y)} samples and one step" if r == 0
              else "the state its first round returned (state round-trip)")
        job = local_job(0, r, w.clone(), lr, x, y, seed, state=dict(rows), max_steps=1)
        job = called(f"{_WHERE}: {cls}.prepare", on, lm.prepare, job, server)
        if not isinstance(job, ClientJob):
            raise ValueError(f"{_WHERE}: {cls}.prepare returned {what(job)}, expected the "
                             "fedloom.job.ClientJob to run")
        res = called(f"{_WHERE}: {cls}.run", on, lm.run, trainer, job)
        if not isinstance(res, ClientResult):
            raise ValueError(f"{_WHERE}: {cls}.run returned {what(res)}, expected a "
                             "fedloom.job.ClientResult")
        check_vector(f"{_WHERE}: {cls}.run", res.update, (d,), "update")
        new = check_rows(f"{_WHERE}: {cls}.run", res.state,
                         {n: s.size for n, s in specs.items()})
        old1, new1 = ({n: v.unsqueeze(0) for n, v in rs.items()} for rs in (rows, new))
        server = check_mapping(f"{_WHERE}: {cls}.server_update", called(
            f"{_WHERE}: {cls}.server_update", "one accepted client's rows", lm.server_update,
            dict(server), old1, new1, num_clients), "its server state")
        model = called(f"{_WHERE}: {cls}.adjust_model", "the new server state",
                       lm.adjust_model, w.clone(), server)
        check_vector(f"{_WHERE}: {cls}.adjust_model", model, (d,), "model")
        if getattr(method, "personal", False):
            _check_personal(lm, cls, new1, w)
        rows = new


def _check_personal(lm: Any, cls: str, rows: Mapping[str, torch.Tensor],
                    w: torch.Tensor) -> None:
    who = f"{_WHERE}: {cls}.personal_models"
    out = called(who, "one client's rows", lm.personal_models, dict(rows), w.clone())
    if out is None:
        raise ValueError(f"{who} returned None, and {cls}.personal is True (a method that "
                         "keeps personal models returns (models [n, d], has [n]))")
    models, has = returned(who, out, "LocalMethod", ("models", "has"))
    check_vector(who, models, (1, w.numel()), "models")
    if not isinstance(has, torch.Tensor) or tuple(has.shape) != (1,):
        raise ValueError(f"{who} returned {what(has)} as has, expected a bool tensor of "
                         "shape (1,)")


