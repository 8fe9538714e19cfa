"""FedBN: local batch normalisation (Li, Jiang, Zhang, Kamp, Dou, ICLR 2021).

"FedBN: Federated Learning on Non-IID Features via Local Batch Normalization".
Each client keeps its own BatchNorm statistics; everything else is FedAvg.
In fedloom that is the buffer policy ``model.buffers: local``
(:mod:`fedloom.buffers`); ``client.method: fedbn`` is its name: it sets
``model.buffers`` to ``local`` (a config asking for ``keep_global`` is refused)
and trains with plain local SGD, so a ``fedbn`` run is the ``model.buffers:
local`` run bit for bit (tests/test_personalised.py).

Departure, shared with fedloom's ``local`` policy: BatchNorm's affine weight
and bias are parameters in ``w`` and are averaged; the paper keeps them local
too (its code excludes every ``bn`` key from averaging).
"""

from __future__ import annotations

from fedloom.capabilities import MethodCaps
from fedloom.client.methods import LocalMethod
from fedloom.registry import register

__all__ = ["FedBN"]


class FedBN(LocalMethod):
    name = "fedbn"
    capabilities = MethodCaps(model_buffers="local")


@register("method", "fedbn")
def _fedbn() -> FedBN:
    """FedBN: each client keeps its BatchNorm statistics (``model.buffers: local``).

    Reference:
        paper: Li et al., "FedBN: Federated Learning on Non-IID Features via Local Batch
            Normalization", ICLR 2021.
        code: med-air/FedBN (not run here: its rule is model.buffers=local).
        departures: the BatchNorm affine parameters are averaged (they are part of w).
    """
    return FedBN()


# The buffer policy this method is, on the factory too: fedloom.engine.build resolves
# model.buffers from it before the method is built.
_fedbn.capabilities = FedBN.capabilities  # type: ignore[attr-defined]
