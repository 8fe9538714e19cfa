"""A client selector checked at the door: one given as an object or an import
reference chooses two synthetic rounds' cohorts before round 1.

The Selector protocol (:class:`fedloom.selection.base.Selector`) is ``init(N)`` →
state, ``select(r, candidates, size, state, gen)`` → ``(ids, state)`` and
``observe(state, feedback)`` → state. Run in the round's order: ``init``, then twice
``select`` (from the run's generator stream ``(seed, r, -1, "probe")``, never the
cohort's) and ``observe`` of a :class:`~fedloom.selection.base.Feedback` in which the
chosen clients all reported, the second round on the state the first returned (the
state round-trip). Checked: the arity of what comes back, ``min(size,
len(candidates))`` distinct integer ids among the candidates, and a state that is a
dict a checkpoint can hold (:func:`fedloom.plain.encode`: plain data, NumPy arrays,
tensors). A selector of fedloom's own (tested by tests/test_selection.py) is not
run. A violation is one ``ValueError`` line naming ``cohort.selection``, the class
and method, and what came back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import numpy as np

from fedloom.plain import PlainDataError, encode
from fedloom.selection.base import Feedback
from fedloom.transforms import called, from_fedloom, returned, what

__all__ = ["check_selector"]

_WHERE = "cohort.selection"
_PROTOCOL = ("the Selector protocol is init(num_clients) -> state, select(r, candidates, "
             "size, state, gen) -> (ids, state) and observe(state, feedback) -> state")


def check_selector(selector: object, num_clients: int, size: int,
                   gens: tuple[np.random.Generator, ...], batch_size: int) -> None:
    """``selector`` over ``num_clients`` clients, all available, cohorts of ``size``:
    one round for each of ``gens``."""
    cls = type(selector).__name__
    missing = [m for m in ("init", "select", "observe")
               if not callable(getattr(selector, m, None))]
    if missing:
        raise ValueError(f"{_WHERE}: {cls} has no {' and '.join(missing)}; {_PROTOCOL}")
    if from_fedloom(selector):
        return
    sel = cast(Any, selector)
    state = _state(f"{cls}.init", called(f"{_WHERE}: {cls}.init", f"{num_clients} clients",
                                         sel.init, num_clients))
    candidates = np.arange(num_clients, dtype=np.int64)
    want = min(size, num_clients)
    for r, gen in enumerate(gens):
        on = (f"round {r}'s {num_clients} candidates, size {size}" if r == 0
              else "the state its first round returned (state round-trip)")
        out = called(f"{_WHERE}: {cls}.select", on, sel.select, r, candidates.copy(), size,
                     state, gen)
        ids, state = returned(f"{_WHERE}: {cls}.select", out, "Selector", ("ids", "state"))
        chosen = _ids(cls, ids, candidates, want)
        state = _state(f"{cls}.select", state)
        k = len(chosen)
        seen = Feedback(r, chosen, np.ones(k), np.full(k, batch_size, dtype=np.int64),
                        np.ones(k, dtype=np.int64), batch_size)
        state = _state(f"{cls}.observe", called(f"{_WHERE}: {cls}.observe",
                                                f"round {r}'s reports", sel.observe,
                                                state, seen))


def _ids(cls: str, ids: object, candidates: np.ndarray, want: int) -> np.ndarray:
    """``ids`` as int64 when they are ``want`` distinct candidates, else one line."""
    who = f"{_WHERE}: {cls}.select"
    try:
        arr = np.asarray(ids)
    except Exception:  # the user's object: any conversion error is its violation
        arr = np.asarray(None)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise ValueError(f"{who} returned {what(ids)} as its ids, expected a 1-D array of "
                         f"{want} integer client ids")
    if len(arr) != want or len(np.unique(arr)) != len(arr):
        raise ValueError(f"{who} returned {len(arr)} ids ({len(np.unique(arr))} distinct), "
                         f"expected {want} distinct ids (min(size, len(candidates)))")
    out = np.setdiff1d(arr, candidates)
    if out.size:
        raise ValueError(f"{who} returned id {int(out[0])}, not among the candidates "
                         f"(0 … {len(candidates) - 1})")
    return arr.astype(np.int64)


def _state(who: str, state: object) -> Mapping[str, Any]:
    """``state`` when it is a dict a checkpoint can hold, else one line."""
    if not isinstance(state, Mapping):
        raise ValueError(f"{_WHERE}: {who} returned {what(state)} as its state, expected a "
                         "dict of plain data")
    try:
        encode(dict(state), "state")
    except PlainDataError as e:
        raise ValueError(f"{_WHERE}: {who} returned a state a checkpoint cannot hold "
                         f"({str(e).splitlines()[0]})") from None
    return state
