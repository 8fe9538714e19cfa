"""FFL: the uplink's rate and the local epochs follow the global test loss.

A round planner (:class:`fedloom.hooks.RoundPlanner`, ``compression.adaptive=ffl``).
Before round t the server evaluates the global model's test loss ``L_t``
(``L_0`` from the first round it plans, kept in the server state as
``ffl_loss0``) and sets

    R_t = min(1, R (L_0/L_t)^(1/3)),    E_t = max(1, round(E (L_t/L_0)^(1/3))),

with ``R`` the compressor's configured ``ratio`` (``compression.options.ratio``,
0.01 when unset) and ``E`` ``client.epochs``: as the loss falls, more
coordinates are sent and fewer local epochs run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fedloom.hooks import RoundAdjust
from fedloom.registry import register

__all__ = ["FFL"]


class FFL:
    """``R_t = R (L_0/L_t)^(1/3)``, ``E_t = max(1, round(E (L_t/L_0)^(1/3)))``.

    Reference:
        paper: Nori, Yun & Kim, "Fast Federated Learning by Balancing Communication
            Trade-Offs", IEEE Trans. Communications 2021 (FFL).
        code: no public implementation checked; the rule as FLARE's experiments
            state their FFL baseline.
        departures: ``L_t`` is the global model's loss on the global test set,
            evaluated before each round; the rate is capped at 1.
    """

    def plan(self, r: int, w: torch.Tensor, state: Mapping[str, Any],
             exp: Any) -> RoundAdjust:
        _, loss = exp.global_eval(w)
        loss0 = float(state.get("ffl_loss0", loss))
        ratio0 = float(exp.cfg.compression.options.get("ratio", 0.01))
        ratio = min(1.0, ratio0 * (loss0 / loss) ** (1 / 3))
        epochs = max(1, round(exp.cfg.client.epochs * (loss / loss0) ** (1 / 3)))
        return RoundAdjust(exp.make_uplink(ratio=ratio), epochs,
                           {"ffl_ratio": ratio, "ffl_epochs": epochs}, {"ffl_loss0": loss0})


register("planner", "ffl")(FFL)
