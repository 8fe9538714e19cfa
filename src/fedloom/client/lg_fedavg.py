"""LG-FedAvg: a personal body, a shared head (Liang et al. 2020).

Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency, "Think
Locally, Act Globally: Federated Learning with Local and Global
Representations" (arXiv 2001.01523, 2020). FedPer's rule
(:class:`fedloom.client.fedper.FedPer`) with the other split: the layer groups
``personal`` stay on the client, by default every group but the last, so the
shared part is the head. A sampled client starts from the received head with its
own body, trains every parameter, keeps the trained body and sends the head's
update only (the body's coordinates as zeros).

Departure: the local layers are trained with the head in one pass, as FedPer's
are (the paper trains the local representation with its own objective).
"""

from __future__ import annotations

from collections.abc import Sequence

from fedloom.client.fedper import FedPer
from fedloom.params import Layout
from fedloom.registry import register

__all__ = ["lg_split"]


def lg_split(layout: Layout, personal: Sequence[str] | None) -> list[str]:
    """The groups kept on the client: ``personal``, or every group but the last."""
    if personal is not None:
        return list(personal)
    body = [g.name for g in layout.groups[:-1]]
    if not body:
        raise ValueError("client.method.options.personal: the model has one layer group; "
                         "LG-FedAvg needs a body and a head")
    return body


@register("method", "lg_fedavg")
def _lg_fedavg(layout: Layout, personal: Sequence[str] | None = None) -> FedPer:
    """LG-FedAvg's split: ``personal`` names the local layers (default: every group
    but the last, the shared head).

    Reference:
        paper: Liang et al., "Think Locally, Act Globally: Federated Learning with Local
            and Global Representations", arXiv 2001.01523, 2020.
        code: none checked (FedPer's rule with the other split).
        departures: the local layers are trained with the head in one pass, as FedPer.
    """
    return FedPer(layout, lg_split(layout, personal))
