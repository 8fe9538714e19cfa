"""The server step checked at the door: a server optimizer given as an object,
an import reference or a chain of server transforms runs once before round 1.

The ServerStep protocol (:class:`fedloom.engine.values.ServerStep`) is ``init(w)``
→ state and ``step(w, agg, state)`` → ``(w, state)``; a chain's terms are server
transforms (``init``, ``update``, :mod:`fedloom.server_opt.transforms`). A term
given where the other is expected (``server=scale(0.5)``; a named optimizer inside
``chain(...)``) is refused with the chain to write instead. A step of a class of
one's own (fedloom's own are tested by its suites), and each such term of a chain,
runs twice on a synthetic aggregate: the second call on the state the first
returned. Each violation is one ``ValueError`` line naming ``server.optimizer``.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from fedloom.transforms import (
    Chain,
    called,
    check_vector,
    from_fedloom,
    is_transform,
    probe_transform,
    returned,
    shown,
)

__all__ = ["check_server_step"]

WHERE = "server.optimizer"
_PROTOCOL = ("the ServerStep protocol is init(w) -> state and step(w, agg, state) -> "
             "(w, state): a ServerOptimizer or a chain of server transforms")


def _is_step(obj: object) -> bool:
    return callable(getattr(obj, "init", None)) and callable(getattr(obj, "step", None))


def _terms(obj: object) -> list[str]:
    """``obj`` as chain terms: a named optimizer's own chain, else ``obj`` itself."""
    inner = getattr(obj, "chain", None)
    if isinstance(inner, Chain):
        return [shown(t) for t in inner.transforms]
    return [shown(obj)]


def check_server_step(server: object, w: torch.Tensor, agg: torch.Tensor) -> None:
    """``server`` on the parameters ``w`` and a synthetic aggregate ``agg`` (both ``[d]``)."""
    cls = type(server).__name__
    if not _is_step(server):
        if is_transform(server):
            raise ValueError(f"{WHERE}: {cls} is a server transform (init, update), not a "
                             f"server step (init, step); use server=chain({shown(server)})")
        missing = " and ".join(m for m in ("init", "step")
                               if not callable(getattr(server, m, None)))
        raise ValueError(f"{WHERE}: {cls} has no {missing}; {_PROTOCOL}")
    if isinstance(server, Chain):
        _check_chain(server, w, agg)
        return
    if from_fedloom(server):
        return
    step = cast(Any, server)
    who = f"{WHERE}: {cls}"
    state = called(f"{who}.init", f"parameters of shape {tuple(w.shape)}", step.init, w.clone())
    for i in range(2):
        on = (f"a synthetic aggregate of shape {tuple(agg.shape)}" if i == 0
              else "the state its first call returned (state round-trip)")
        out = called(f"{who}.step", on, step.step, w.clone(), agg.clone(), state)
        new_w, state = returned(f"{who}.step", out, "ServerStep", ("parameters", "state"))
        w = check_vector(f"{who}.step", new_w, tuple(w.shape), "parameters")


def _check_chain(server: Chain[Any], w: torch.Tensor, agg: torch.Tensor) -> None:
    """Each term a server transform: a server step in its place is refused with the
    chain of its transforms; a term of one's own runs twice."""
    for k, t in enumerate(server.transforms):
        if not is_transform(t) and _is_step(t):
            fix = ", ".join(s for u in server.transforms for s in
                            (_terms(u) if u is t else [shown(u)]))
            raise ValueError(f"{WHERE}: chain term {k}, {type(t).__name__}, is a server step "
                             "(init, step), not a server transform (init, update); chain its "
                             f"transforms instead: server=chain({fix})")
        probe_transform(t, f"{WHERE} (chain term {k})", agg, (w, w - agg), "server")
