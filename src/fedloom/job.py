"""A client's local work in one round: the contract between the round and the trainers.

:class:`ClientJob` is what the step loop reads (where it starts and the model
it measures its update from, its data, its generator seed, its state rows and
module buffers, its step plan, and the terms of its local step: a feedback
policy's gradient shift and penalty, a local method's prox weight, mask and
objective, all as transforms of :mod:`fedloom.client.transforms`), and
:class:`ClientResult` what comes back. The engine builds jobs in one place
(:func:`fedloom.engine.stages.plan.client_job`), whatever the backend; the
sequential, vmap and lock-step trainers and Flower's ClientApp consume them.
This module sits below the algorithm packages, so a local method
(``fedloom.client``) and a feedback policy (``fedloom.compress``) share these
types without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

__all__ = ["ClientJob", "ClientResult", "JobData", "Penalty", "StepPlan", "local_job",
           "local_step_sum"]


@dataclass(frozen=True)
class Penalty:
    """A regulariser on the first ``steps`` local steps (FLARE, EC+prox).

    ``l1``: ``τ Σ_j m_j |w_j − t_j|`` (subgradient ``τ m sign(w − t)``);
    ``l2``: ``τ Σ_j m_j (w_j − t_j)²`` (gradient ``2τ m (w − t)``).
    ``mask=None`` means every coordinate.
    """

    target: torch.Tensor
    tau: float
    steps: int
    kind: str = "l1"
    mask: torch.Tensor | None = None

    def grad(self, w: torch.Tensor) -> torch.Tensor:
        diff = w - self.target
        g = torch.sign(diff) if self.kind == "l1" else 2.0 * diff
        if self.mask is not None:
            g = g * self.mask
        return self.tau * g


@dataclass(frozen=True)
class JobData:
    """A client's training samples ``x, y`` and their positions ``index`` in the
    run's training data (backends that run elsewhere ship ``index`` instead of the
    samples: the data is sent to each worker once)."""

    x: torch.Tensor
    y: torch.Tensor
    index: torch.Tensor | None = None


@dataclass(frozen=True)
class StepPlan:
    """How a job's local steps run: where they ``start`` (``None``: the model
    received; SA-PEF's ``w − α e``), at most how many (``epochs`` overrides the
    trainer's, FFL; ``max_steps``: the first of those, a client cut by a round
    deadline), and what else they report (``start_loss``: ``F_k(w)``;
    ``probe``: a secant estimate of L after the first step)."""

    start: torch.Tensor | None = None
    epochs: int | None = None
    max_steps: int | None = None
    start_loss: bool = False
    probe: bool = False


@dataclass(frozen=True)
class ClientJob:
    """One client's work in one round: only what the step loop reads.

    ``transforms`` are the terms of this client's local step
    (:mod:`fedloom.client.transforms`: a feedback policy's shift and penalty, a
    local method's prox weight, mask, objective and own terms), placed by the
    loop's chain between the gradient and the step.
    """

    client: int
    round: int
    w: torch.Tensor          # the global model the client received (the prox anchor)
    lr: float
    data: JobData
    gen_seed: int            # seed of the batch-order generator
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # per-client state rows
    # The module buffers (BatchNorm statistics) local training starts from
    # (fedloom.buffers); empty: the trainer's module's own.
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    transforms: tuple[Any, ...] = ()
    steps: StepPlan = StepPlan()

    @property
    def x(self) -> torch.Tensor:
        return self.data.x

    @property
    def y(self) -> torch.Tensor:
        return self.data.y

    @property
    def start(self) -> torch.Tensor:
        """Where local SGD starts: ``steps.start``, else ``w``."""
        return self.steps.start if self.steps.start is not None else self.w

    def with_start(self, start: torch.Tensor | None) -> ClientJob:
        """This job with its local steps starting at ``start``."""
        return replace(self, steps=replace(self.steps, start=start))

    def cut(self, max_steps: int) -> ClientJob:
        """This job with at most ``max_steps`` local steps."""
        return replace(self, steps=replace(self.steps, max_steps=max_steps))


def local_job(client: int, round: int, w: torch.Tensor, lr: float, x: torch.Tensor,
              y: torch.Tensor, gen_seed: int, *, index: torch.Tensor | None = None,
              state: dict[str, torch.Tensor] | None = None,
              buffers: dict[str, torch.Tensor] | None = None,
              transforms: tuple[Any, ...] = (), **steps: Any) -> ClientJob:
    """A :class:`ClientJob` from flat arguments (``steps``: :class:`StepPlan`'s)."""
    return ClientJob(client, round, w, lr, JobData(x, y, index), gen_seed, dict(state or {}),
                     dict(buffers or {}), tuple(transforms), StepPlan(**steps))


@dataclass
class ClientResult:
    """What comes back: the pseudo-gradient ``g = w − w_k`` and statistics."""

    client: int
    update: torch.Tensor
    num_samples: int
    loss: float              # mean training loss over the local steps
    steps: int
    start_loss: float | None = None
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # new per-client state rows
    extra: dict[str, float] = field(default_factory=dict)         # per-client metrics
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # after local training


def local_step_sum(steps: int, momentum: float) -> float:
    """``S = Σ_s a_s``, the sum of the step multipliers of ``K`` local steps.

    Local SGD with heavy-ball momentum β (``torch.optim.SGD``, dampening 0, the
    buffer restarted every round, as :class:`~fedloom.client.sgd.LocalSGD`)
    moves ``w − y_K = η Σ_s a_s d_s`` with ``a_s = (1 − β^{K−s})/(1 − β)`` for
    the (corrected) gradients ``d_0 … d_{K−1}``, so

        S = Σ_{j=1}^{K} (1 − β^j)/(1 − β) = [K − β(1 − β^K)/(1 − β)] / (1 − β),

    ``K`` at β = 0. ``(w − y_K)/(η S)`` is then the ``a``-weighted mean of the
    local gradients: exactly ``d`` when they are all ``d``. The same
    normaliser as FedNova's ``‖a_k‖₁`` (Wang et al., NeurIPS 2020, Appendix).
    """
    if steps < 1:
        raise ValueError(f"local steps: must be >= 1, got {steps}")
    if not 0 <= momentum < 1:
        raise ValueError(f"client.momentum: must be in [0, 1), got {momentum}")
    if momentum == 0:
        return float(steps)
    b = momentum
    return (steps - b * (1 - b**steps) / (1 - b)) / (1 - b)
