"""Which layers of the flat vector a local method treats apart (the personal head).

FedPer, FedRep and FedBABU split the model into a body and a head; MOON reads
the representation that enters the head. fedloom names layers by the
:class:`~fedloom.params.Layout`'s layer groups (``fedloom models`` and a run's
``summary.json`` list them: ``net.3``, ``fc2``, ``conv1`` …): a method option
``personal: [net.3]`` names the head's groups, and by default the head is the
last group (the classifier of every model in fedloom's zoo).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedloom.params import Group, Layout

__all__ = ["head_groups", "head_mask"]


def head_groups(layout: Layout, names: Sequence[str] | None, field: str) -> list[Group]:
    """The layer groups ``names`` (default: the last one); an unknown name, an
    empty list or every group (no body left) raises a one-line ``ValueError``
    naming ``field``."""
    groups = {g.name: g for g in layout.groups}
    if names is None:
        return [layout.groups[-1]]
    if isinstance(names, str) or not names:
        raise ValueError(f"{field}: a non-empty list of layer group names, got {names!r}")
    unknown = [n for n in names if n not in groups]
    if unknown:
        raise ValueError(f"{field}: no layer group {unknown[0]!r} (the model's: "
                         f"{', '.join(groups)})")
    if len(set(names)) == len(groups):
        raise ValueError(f"{field}: every layer group is personal; nothing is left to share")
    return [groups[n] for n in dict.fromkeys(names)]


def head_mask(layout: Layout, groups: Sequence[Group], dtype: torch.dtype = torch.float32
              ) -> torch.Tensor:
    """``1`` on the coordinates of ``groups``, ``0`` elsewhere (a ``[d]`` vector)."""
    m = torch.zeros(layout.size, dtype=dtype)
    for g in groups:
        m[g.slice] = 1
    return m
