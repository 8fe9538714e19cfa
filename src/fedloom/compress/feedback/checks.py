"""An error-feedback policy checked at the door: one given as an object or an import
reference runs two rounds of one client before round 1 on a synthetic update.

The feedback protocol (:class:`fedloom.compress.feedback.NoFeedback`, whose hooks a
policy overrides) is run in the round's order: ``fields(d)``, ``init_server(w)``,
``alpha(lr, steps, server)``, ``start_point``, ``grad_shift``, ``penalty``,
``uplink(g, state, comp, ctx, server)`` → :class:`UplinkResult`, the server's decode
of its payload, ``server_row(up, state, server)``, ``end_round(ups, server, N,
probes)`` → :class:`RoundEnd` and ``round_metrics(server)``; then once more from the
state rows and server state the first round returned (the state round-trip).
Checked: the kinds and arities of what comes back, finite vectors of shape
``(d,)`` for a finite update, the new rows those ``fields`` declared (each finite, of
its size) and numbers for α and the metrics. A policy of fedloom's own (tested by
its suites: tests/test_feedback.py) is not run. A violation is one ``ValueError``
line naming ``compression.feedback``, the class and method, and what came back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch

from fedloom.compress.feedback.base import RoundEnd, UplinkContext, UplinkResult
from fedloom.compress.identity import InPlacePayload
from fedloom.job import Penalty
from fedloom.state import FieldSpec
from fedloom.transforms import (
    called,
    check_mapping,
    check_rows,
    check_vector,
    from_fedloom,
    what,
)

__all__ = ["check_feedback"]

_WHERE = "compression.feedback"
_HOOKS = ("fields", "init_server", "alpha", "start_point", "grad_shift", "penalty", "uplink",
          "server_row", "end_round", "round_metrics")
_PROTOCOL = ("a feedback policy subclasses fedloom.compress.feedback.NoFeedback and "
             "overrides its hooks (uplink(g, state, comp, ctx, server) -> UplinkResult, ...)")


def check_feedback(policy: object, comp: Any, w: torch.Tensor, g: torch.Tensor,
                   gens: tuple[torch.Generator, ...], *, lr: float, momentum: float,
                   num_clients: int) -> None:
    """``policy`` with the compressor ``comp`` on one client's synthetic update ``g``
    (``[d]``) at the parameters ``w``, one round for each of ``gens``."""
    cls = type(policy).__name__
    missing = [h for h in _HOOKS if not callable(getattr(policy, h, None))]
    missing += [a for a in ("probes_smoothness",) if not hasattr(policy, a)]  # each job's
    if missing:
        raise ValueError(f"{_WHERE}: {cls} has no {' and '.join(missing)}; {_PROTOCOL}")
    if from_fedloom(policy):
        return
    fb = cast(Any, policy)
    (d,) = g.shape
    specs = called(f"{_WHERE}: {cls}.fields", f"d = {d}", fb.fields, d)
    if not isinstance(specs, Mapping) or not all(isinstance(s, FieldSpec)
                                                 for s in specs.values()):
        raise ValueError(f"{_WHERE}: {cls}.fields returned {what(specs)}, expected a "
                         "mapping of names to fedloom.state.FieldSpec")
    rows = {n: torch.zeros(s.size, dtype=g.dtype, device=g.device) for n, s in specs.items()}
    server = check_mapping(f"{_WHERE}: {cls}.init_server", called(
        f"{_WHERE}: {cls}.init_server", f"parameters of shape ({d},)", fb.init_server,
        w.clone()), "its server state")
    for r, gen in enumerate(gens):
        rows, server = _round(fb, cls, comp, w, g, gen, rows, server, specs, r=r, lr=lr,
                              momentum=momentum, num_clients=num_clients)


def _round(fb: Any, cls: str, comp: Any, w: torch.Tensor, g: torch.Tensor,
           gen: torch.Generator, rows: dict[str, torch.Tensor], server: Mapping[str, Any],
           specs: Mapping[str, FieldSpec], *, r: int, lr: float, momentum: float,
           num_clients: int) -> tuple[dict[str, torch.Tensor], Mapping[str, Any]]:
    """One client's round ``r`` of the policy; its new rows and server state."""
    d = g.numel()
    on = ("synthetic state rows" if r == 0
          else "the state its first round returned (state round-trip)")
    alpha = called(f"{_WHERE}: {cls}.alpha", on, fb.alpha, lr, 1, server)
    if not isinstance(alpha, int | float) or alpha != alpha:
        raise ValueError(f"{_WHERE}: {cls}.alpha returned {what(alpha)}, expected a number")
    for hook, args in (("start_point", (w.clone(), dict(rows), alpha)),
                       ("grad_shift", (dict(rows), server))):
        out = called(f"{_WHERE}: {cls}.{hook}", on, getattr(fb, hook), *args)
        if out is not None:
            check_vector(f"{_WHERE}: {cls}.{hook}", out, (d,), "vector")
    pen = called(f"{_WHERE}: {cls}.penalty", on, fb.penalty, w.clone(), dict(rows), r)
    if pen is not None and not isinstance(pen, Penalty):
        raise ValueError(f"{_WHERE}: {cls}.penalty returned {what(pen)}, expected None or "
                         "a fedloom.job.Penalty")
    ctx = UplinkContext(r, lr, 1, float(alpha), gen, momentum, 1, num_clients)
    up = called(f"{_WHERE}: {cls}.uplink", on, fb.uplink, g.clone(), dict(rows), comp, ctx,
                server)
    if not isinstance(up, UplinkResult):
        raise ValueError(f"{_WHERE}: {cls}.uplink returned {what(up)}, expected a "
                         "fedloom.compress.feedback.UplinkResult(payload, sent, state)")
    if not isinstance(up.payload, bytes | bytearray | memoryview | InPlacePayload):
        raise ValueError(f"{_WHERE}: {cls}.uplink returned {what(up.payload)} as its payload, "
                         "expected the compressor's bytes (comp.encode(u, gen=ctx.gen))")
    new = check_rows(f"{_WHERE}: {cls}.uplink", up.state,
                     {n: s.size for n, s in specs.items()})
    # the server decodes the bytes it received, as the round's receive stage does
    up.sent = called(f"{_WHERE}: the compressor's decode", f"{cls}.uplink's payload",
                     comp.decode, up.payload, d).to(g.device, g.dtype)
    row = called(f"{_WHERE}: {cls}.server_row", "the decoded payload", fb.server_row, up,
                 dict(rows), server)
    check_vector(f"{_WHERE}: {cls}.server_row", row, (d,), "row")
    end = called(f"{_WHERE}: {cls}.end_round", "one accepted client's result", fb.end_round,
                 [up], server, num_clients, [])
    if not isinstance(end, RoundEnd):
        raise ValueError(f"{_WHERE}: {cls}.end_round returned {what(end)}, expected a "
                         "fedloom.compress.feedback.RoundEnd(w_shift, server)")
    if end.w_shift is not None:
        check_vector(f"{_WHERE}: {cls}.end_round", end.w_shift, (d,), "w_shift")
    server = check_mapping(f"{_WHERE}: {cls}.end_round", end.server, "its server state")
    metrics = called(f"{_WHERE}: {cls}.round_metrics", "the new server state",
                     fb.round_metrics, server)
    for k, v in check_mapping(f"{_WHERE}: {cls}.round_metrics", metrics, "its metrics").items():
        if not isinstance(v, int | float):
            raise ValueError(f"{_WHERE}: {cls}.round_metrics returned metrics[{k!r}] = "
                             f"{what(v)}, expected a number")
    return {**rows, **new}, server


