"""A client's local work in one round: the contract between the round and the trainers.

:class:`ClientJob` is everything a client needs to train in one round (where
it starts, the model it measures its update from, its data, its generator
seed, the hooks of the feedback policy on local training: a gradient shift, a
penalty on the first steps, a smoothness probe; its module buffers and its
step budget), and :class:`ClientResult` what comes back. The engine builds
jobs in one place (:func:`fedloom.engine.stages.plan.client_job`), whatever the
backend; the sequential trainer (:class:`fedloom.client.sgd.LocalSGD`), the
lock-step trainer (:mod:`fedloom.engine.trainers.vmap`) and Flower's ClientApp
consume them. This module sits below the algorithm packages, so a local
method (``fedloom.client``) and a feedback policy (``fedloom.compress``) share
these types without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ClientJob", "ClientResult", "Penalty", "local_step_sum"]


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
class ClientJob:
    """One client's work in one round."""

    client: int
    round: int
    w: torch.Tensor          # the global model the client received
    lr: float
    x: torch.Tensor          # the client's training samples
    y: torch.Tensor
    gen_seed: int            # seed of the batch-order generator
    start_loss: bool = False  # also report F_k(w), the loss of w on the client's data
    start: torch.Tensor | None = None       # where local SGD starts (default: w)
    grad_shift: torch.Tensor | None = None  # added to every gradient (SCAFFOLD's c − c_k)
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # per-client state rows
    probe_smoothness: bool = False  # report a secant estimate of L after the first step
    penalty: Penalty | None = None  # a regulariser on the first local steps (FLARE)
    epochs: int | None = None       # overrides the trainer's local epochs (FFL)
    # Positions of x, y in the run's training data: backends that run elsewhere
    # ship these instead of the samples (the data is sent to each worker once).
    data_index: torch.Tensor | None = None
    # The module buffers (BatchNorm statistics) local training starts from
    # (fedloom.buffers); empty: the trainer's module's own.
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    # At most this many local steps (the first of those it would run): partial work
    # of a client cut by a round deadline (fedloom.system, late: partial).
    max_steps: int | None = None
    # Set by a local method's run (fedloom.client): the prox weight μ towards w in
    # place of client.prox_mu (FedDyn's α), a 0/1 mask of the coordinates the local
    # steps may move (FedRep's and FedBABU's frozen layers), and an objective that
    # replaces the forward + cross-entropy of a step (MOON's contrastive term).
    prox_mu: float | None = None
    grad_mask: torch.Tensor | None = None
    objective: Any = None
    # Terms of this client's local step a local method adds in its prepare()
    # (fedloom.client.transforms: init/update on [d] and [m, d]), after the step's own
    # and before client.transforms and momentum, on every client backend.
    transforms: tuple[Any, ...] = ()


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
