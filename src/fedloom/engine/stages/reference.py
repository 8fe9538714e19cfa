"""The server's reference update: local training on the server's own root data.

A rule that declares ``AggregatorCaps.reference_samples = k > 0`` (FLTrust's root
data set) gets, in ``CohortInfo.reference``, the update ``g_0 = w − w_0`` that the
server's ``k`` root samples give by the clients' local training from the round's
model: :meth:`fedloom.client.sgd.LocalSGD.run` (the one step loop,
:mod:`fedloom.client.loop`) at the round's step size and epochs, the global buffers,
the batch order from ``(seed, round, -1, "reference")``. No local method, feedback
policy or attack touches it (it is the server's, not a client's: plain local SGD).
The paper runs R local iterations on the server as on each client: ``client.steps``
gives that; under ``client.epochs`` the server makes its epochs over its root samples.

The root samples are drawn once, before any round and before the attackers poison
their samples, uniformly without replacement from every client's training samples,
with the stream ``(seed, "root")`` (:func:`draw_root`). They are clean and of the
task's distribution, as the paper assumes; they are also samples some client holds
(the paper draws its root data from the training set the clients' data come from).
Recomputed each round from the state alone: a resumed run gets the same ``g_0``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedloom.client.sgd import LocalSGD
from fedloom.config import ConfigError
from fedloom.engine.runstate import RoundPlan, RunState
from fedloom.job import ClientJob, JobData, StepPlan
from fedloom.rng import Purpose, derive_seed, numpy_gen

__all__ = ["RootData", "draw_root", "reference_update"]


@dataclass(frozen=True)
class RootData:
    """The server's root samples and the run's seed."""

    x: torch.Tensor
    y: torch.Tensor
    seed: int


def draw_root(k: int, parts: Sequence[np.ndarray], x: torch.Tensor, y: torch.Tensor,
              seed: int, *, population: bool = False) -> RootData | None:
    """``k`` samples drawn uniformly without replacement from the union of ``parts``
    (the clients' training indices into ``x``, ``y``); None for ``k = 0``. One
    :class:`ConfigError` line when there are fewer than ``k``."""
    if k <= 0:
        return None
    if population:
        raise ConfigError("aggregator.options.root_samples: a population generated on "
                          "demand stores no samples to draw the server's root data from")
    pool = np.unique(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
                     if parts else np.empty(0, dtype=np.int64))
    if k > pool.size:
        raise ConfigError(f"aggregator.options.root_samples: {k} is more than the "
                          f"{pool.size} training samples the clients hold")
    pick = np.sort(numpy_gen(seed, purpose=Purpose.ROOT).choice(pool.size, k, replace=False))
    idx = torch.from_numpy(pool[pick]).to(x.device)
    return RootData(x[idx].clone(), y[idx].clone(), seed)


def reference_update(root: RootData | None, local: LocalSGD, st: RunState,
                     plan: RoundPlan) -> torch.Tensor | None:
    """The server's update ``g_0`` of round ``plan.round`` on ``root`` (None without)."""
    if root is None:
        return None
    job = ClientJob(-1, plan.round, st.w, plan.lr, JobData(root.x, root.y),
                    derive_seed(root.seed, plan.round, -1, Purpose.REFERENCE),
                    buffers=dict(st.buffers), steps=StepPlan(epochs=plan.adjust.epochs))
    update: torch.Tensor = local.run(job).update
    return update.clone()
