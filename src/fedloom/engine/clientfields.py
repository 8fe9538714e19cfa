"""Per-client state fields, each with one owner.

Three components keep rows per client in the run's
:class:`~fedloom.state.ClientStateStore`: the local method
(``client.method``: SCAFFOLD's control variate, Ditto's personal model), the
feedback policy (``compression.feedback``: EF residuals, FLARE's accumulator)
and the buffer policy (``model.buffers=local``: each client's BatchNorm
statistics). Each declares its fields by its own names; :class:`ClientFields`
gives each owner its own rows back by those names, so no component (and not
the engine) reads another's fields or cuts names apart.

The store's key of a field is the owner's namespace and the field's name
(``fb.residual``, ``bn.buffers``; the local method's fields are unprefixed):
the keys the checkpoints written before owners existed hold, so those resume.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fedloom.state import FieldSpec

__all__ = ["BUFFERS", "FEEDBACK", "METHOD", "OWNERS", "ClientFields"]

METHOD, FEEDBACK, BUFFERS = "method", "feedback", "buffers"
OWNERS = (METHOD, FEEDBACK, BUFFERS)
# The store key's namespace of each owner (kept as the checkpoints have them).
_NAMESPACE = {METHOD: "", FEEDBACK: "fb.", BUFFERS: "bn."}

Rows = Mapping[str, torch.Tensor]


class ClientFields:
    """The per-client fields of a run, by owner.

    ``declared`` maps each owner to its fields (name → :class:`FieldSpec`).
    """

    def __init__(self, declared: Mapping[str, Mapping[str, FieldSpec]]) -> None:
        unknown = set(declared) - set(OWNERS)
        if unknown:
            raise KeyError(f"unknown owner of per-client fields: {sorted(unknown)}")
        self._keys: dict[str, dict[str, str]] = {
            o: {n: _NAMESPACE[o] + n for n in declared.get(o, {})} for o in OWNERS}
        self.specs: dict[str, FieldSpec] = {
            self._keys[o][n]: spec for o in OWNERS for n, spec in declared.get(o, {}).items()}
        if len(self.specs) != sum(len(v) for v in self._keys.values()):
            raise ValueError("two owners declare per-client fields with one store key")

    def has(self, owner: str) -> bool:
        """Whether ``owner`` keeps any per-client field."""
        return bool(self._keys[owner])

    def names(self, owner: str) -> list[str]:
        """``owner``'s field names, as it declared them."""
        return list(self._keys[owner])

    def key(self, owner: str, name: str) -> str:
        """The store key of ``owner``'s field ``name``."""
        return self._keys[owner][name]

    def keys(self, owner: str) -> list[str]:
        """The store keys of ``owner``'s fields."""
        return list(self._keys[owner].values())

    def own(self, owner: str, rows: Rows, i: int | Any = None) -> dict[str, torch.Tensor]:
        """``owner``'s entries of ``rows`` (keyed by store key), by its own names;
        ``i`` (an index, a mask or positions) selects rows of each."""
        return {n: rows[k] if i is None else rows[k][i] for n, k in self._keys[owner].items()}

    def join(self, owner: str, own: Rows) -> dict[str, torch.Tensor]:
        """``owner``'s rows by its own names → keyed by store key (the reverse of :meth:`own`)."""
        return {self._keys[owner][n]: v for n, v in own.items()}
