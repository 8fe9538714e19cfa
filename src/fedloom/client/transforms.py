"""A local step's direction as one chain of gradient transforms.

The terms are transforms of :mod:`fedloom.transforms` (optax's shape: ``init(W)``
gives a term's state, ``update(D, state, ctx)`` the new direction and state,
:func:`~fedloom.transforms.chain` composes them, its state the tuple of theirs)
whose context is a :class:`StepContext`. Every trainer builds the same chain
(:func:`job_chain` for one client's ``[d]``, :func:`jobs_chain` for ``[m, d]``,
one row a client) and :func:`fedloom.client.loop.step_loop` applies it between
the gradient and the step ``W ← W − η·D``. A job's own terms
(``job.transforms``) take their places by :func:`split_terms`. For a step with
gradient ``g`` at parameters ``w``:

    D = g + s (SCAFFOLD / FedDyn / SCAFCOM shift)
          + ∇P(w) while t < P.steps (FLARE, EC+prox penalty)
          + wd·w (weight decay) + μ(w − w₀) (FedProx; FedDyn's α in place of μ)
    D ← D ⊙ M (frozen coordinates: FedBABU's head, FedRep's phases), a method's terms
    b ← D on the first step, else β·b + D; D ← b (momentum, as torch.optim.SGD)

Each term is the arithmetic the trainers computed before this module, op for op
(``add(…, alpha=·)`` is one fused multiply-add): sequential and lock-step stay bit
for bit what they were. Transforms run under ``torch.no_grad()`` and may update
``D`` in place: it is the step's own buffer or a fresh tensor, never read again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from fedloom.job import ClientJob, Penalty
from fedloom.transforms import Chain, Transform, chain, is_transform, probe_transform

__all__ = ["Chain", "LocalTransform", "Mask", "Momentum", "Objective", "PenaltyTerm", "PerClient",
           "Prox", "Shift", "StepContext", "Terms", "WeightDecay", "chain",
           "check_local_transforms", "job_chain",
           "job_terms", "jobs_chain", "local_chain", "split_terms", "with_term"]


@dataclass(frozen=True)
class StepContext:
    """What a transform may read at a local step: the step ``t`` (0-based), the
    parameters ``W`` before the step (``[d]`` or ``[m, d]``), the round's anchor
    ``W0`` (the model received) and, for ``[m, d]``, which clients still step."""

    step: int
    W: torch.Tensor
    W0: torch.Tensor
    live: Sequence[bool] | None = None


# A term of the local step: a transform whose context is the step's.
LocalTransform = Transform[StepContext]


@dataclass(frozen=True)
class Shift:
    """``D + s``: a control-variate shift, ``[d]`` or one row a client ``[m, d]``."""

    s: torch.Tensor

    def init(self, W: torch.Tensor) -> None:
        return None

    def update(self, D: torch.Tensor, state: None, ctx: StepContext) -> tuple[torch.Tensor, None]:
        return D + self.s, None


@dataclass(frozen=True)
class PenaltyTerm:
    """``D + ∇P(w)`` for each client's own penalty while ``t < P.steps``
    (``None``: that client has none). One penalty and ``D`` of shape ``[d]`` for
    one client; a list, one a row, for ``[m, d]``."""

    penalties: tuple[Penalty | None, ...]

    def init(self, W: torch.Tensor) -> None:
        return None

    def update(self, D: torch.Tensor, state: None, ctx: StepContext) -> tuple[torch.Tensor, None]:
        t = ctx.step
        if D.dim() == 1:
            p = self.penalties[0]
            return (D + p.grad(ctx.W) if p is not None and t < p.steps else D), None
        for k, p in enumerate(self.penalties):
            if p is not None and t < p.steps and (ctx.live is None or ctx.live[k]):
                D[k] = D[k] + p.grad(ctx.W[k])
        return D, None


@dataclass(frozen=True)
class WeightDecay:
    """``D + wd·w`` (L2 weight decay, as torch.optim.SGD's ``weight_decay``)."""

    wd: float

    def init(self, W: torch.Tensor) -> None:
        return None

    def update(self, D: torch.Tensor, state: None, ctx: StepContext) -> tuple[torch.Tensor, None]:
        return D.add(ctx.W, alpha=self.wd), None


@dataclass(frozen=True)
class Prox:
    """``D + μ(w − w₀)``: FedProx's proximal term (Li et al., MLSys 2020)."""

    mu: float

    def init(self, W: torch.Tensor) -> None:
        return None

    def update(self, D: torch.Tensor, state: None, ctx: StepContext) -> tuple[torch.Tensor, None]:
        return D.add(ctx.W - ctx.W0, alpha=self.mu), None


@dataclass(frozen=True)
class Mask:
    """``D ⊙ M`` (0/1 per coordinate): masked coordinates neither step nor enter
    the momentum."""

    mask: torch.Tensor

    @classmethod
    def stack(cls, terms: Sequence[Mask]) -> Mask:
        """The clients' masks as one ``[m, d]`` term (the same products, row by row)."""
        return cls(torch.stack([t.mask for t in terms]))

    def init(self, W: torch.Tensor) -> None:
        return None

    def update(self, D: torch.Tensor, state: None, ctx: StepContext) -> tuple[torch.Tensor, None]:
        return D * self.mask, None


@dataclass(frozen=True)
class Momentum:
    """Momentum as torch.optim.SGD (dampening 0, no Nesterov): ``b = D`` on the
    first step, then ``b ← β·b + D``; the direction is ``b``. State: ``b`` (None
    before the first step); it restarts every round (the server's momentum, whose
    buffer lives across rounds, is :func:`fedloom.server_opt.transforms.heavy_ball`)."""

    beta: float

    def init(self, W: torch.Tensor) -> None:
        return None

    def update(self, D: torch.Tensor, state: torch.Tensor | None, ctx: StepContext
               ) -> tuple[torch.Tensor, torch.Tensor]:
        b = D.clone() if state is None else state.mul_(self.beta).add_(D)
        return b, b


def local_chain(shifts: Sequence[torch.Tensor | None] = (),
                penalties: Sequence[Penalty | None] = (),
                masks: Sequence[torch.Tensor | None] = (), *, weight_decay: float = 0.0,
                prox_mu: float = 0.0, momentum: float = 0.0,
                like: torch.Tensor | None = None,
                extra: Sequence[LocalTransform] = (),
                per_client: Sequence[Sequence[LocalTransform]] = ()) -> Chain[StepContext]:
    """The chain of a local step, its terms in the order of the module docstring;
    a term that is zero or absent for every client is left out.

    ``shifts``, ``penalties`` and ``masks`` hold one entry a client (``None``: none
    for that client); ``per_client`` (each client's ``job.transforms``, from its
    local method) come after them, then ``extra`` (``client.transforms``), then
    momentum. With ``like`` (the stacked parameters ``[m, d]``) the
    per-client terms are stacked one row a client (a zero shift, an all-ones mask
    for a client without); without it there is one client and its ``[d]`` terms
    are used as they are.
    """
    parts: list[LocalTransform] = []

    def stacked(xs: Sequence[torch.Tensor | None], fill: float) -> torch.Tensor:
        assert like is not None
        return torch.stack([x if x is not None else torch.full_like(like[k], fill)
                            for k, x in enumerate(xs)])

    if any(s is not None for s in shifts):
        # without `like` there is one client, and any() above says its shift is set
        parts.append(Shift(stacked(shifts, 0.0) if like is not None
                           else cast(torch.Tensor, shifts[0])))
    if any(p is not None for p in penalties):
        parts.append(PenaltyTerm(tuple(penalties)))
    if weight_decay:
        parts.append(WeightDecay(weight_decay))
    if prox_mu:
        parts.append(Prox(prox_mu))
    if any(mk is not None for mk in masks):
        parts.append(Mask(stacked(masks, 1.0) if like is not None
                          else cast(torch.Tensor, masks[0])))  # as the shift above
    if any(per_client):
        parts.extend(list(per_client[0]) if like is None else _batched(per_client))
    parts.extend(extra)
    if momentum:
        parts.append(Momentum(momentum))
    return chain(*parts)


def jobs_chain(jobs: Sequence[ClientJob], W: torch.Tensor, *, weight_decay: float = 0.0,
               prox_mu: float = 0.0, momentum: float = 0.0,
               extra: Sequence[LocalTransform] = ()) -> Chain[StepContext]:
    """:func:`local_chain` of a cohort's jobs on the stacked parameters ``W``
    (every job's prox weight the same: a backend refuses others by capability)."""
    parts = [split_terms(j.transforms) for j in jobs]
    mus = {prox_mu if p.prox is None else p.prox for p in parts}
    if len(mus) != 1:
        raise ValueError("local training: the clients of one batch differ in their prox weight")
    return local_chain([p.shift for p in parts], [p.penalty for p in parts], (),
                       weight_decay=weight_decay, prox_mu=mus.pop(), momentum=momentum,
                       like=W, extra=extra, per_client=[p.rest for p in parts])


def job_chain(terms: Sequence[Any], *, weight_decay: float = 0.0, prox_mu: float = 0.0,
              momentum: float = 0.0, extra: Sequence[LocalTransform] = ()
              ) -> Chain[StepContext]:
    """:func:`local_chain` of one client's ``job.transforms`` on ``[d]``."""
    p = split_terms(terms)
    return local_chain([p.shift], [p.penalty], (), weight_decay=weight_decay,
                       prox_mu=prox_mu if p.prox is None else p.prox, momentum=momentum,
                       extra=extra, per_client=[p.rest])


@dataclass(frozen=True)
class Objective:
    """A step's loss in place of the cross-entropy of ``module(xb)``:
    ``loss(module, xb, yb, step)`` (MOON's contrastive term). Carried in
    ``job.transforms``; the loop's gradient function reads it, the direction's
    chain does not."""

    loss: Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Terms:
    """A job's terms by their place in the chain (:func:`split_terms`)."""

    shift: torch.Tensor | None
    penalty: Penalty | None
    prox: float | None
    objective: Objective | None
    rest: tuple[LocalTransform, ...]


def split_terms(terms: Sequence[Any]) -> Terms:
    """``job.transforms`` by place: the shift and the penalty go before weight
    decay, a :class:`Prox` replaces ``client.prox_mu`` (FedDyn's α), the
    :class:`Objective` goes to the gradient; the rest (masks, a method's own
    terms) keep their order after the prox term, as the module docstring's chain."""
    shift = penalty = prox = objective = None
    rest: list[LocalTransform] = []
    for t in terms:
        if isinstance(t, Shift):
            shift = t.s
        elif isinstance(t, PenaltyTerm):
            penalty = t.penalties[0]
        elif isinstance(t, Prox):
            prox = t.mu
        elif isinstance(t, Objective):
            objective = t
        else:
            rest.append(t)
    return Terms(shift, penalty, prox, objective, tuple(rest))


def with_term(terms: Sequence[Any], term: Any) -> tuple[Any, ...]:
    """``terms`` with ``term`` in place of the one of its class (appended if none)."""
    out = [term if type(t) is type(term) else t for t in terms]
    return tuple(out) if any(type(t) is type(term) for t in terms) else (*terms, term)


def job_terms(grad_shift: torch.Tensor | None = None, penalty: Penalty | None = None,
              prox_mu: float | None = None, grad_mask: torch.Tensor | None = None
              ) -> tuple[LocalTransform, ...]:
    """The terms of the given hooks, in the chain's order."""
    out: list[LocalTransform] = []
    if grad_shift is not None:
        out.append(Shift(grad_shift))
    if penalty is not None:
        out.append(PenaltyTerm((penalty,)))
    if prox_mu is not None:
        out.append(Prox(prox_mu))
    if grad_mask is not None:
        out.append(Mask(grad_mask))
    return tuple(out)


def _batched(per_client: Sequence[Sequence[LocalTransform]]) -> list[LocalTransform]:
    """Each client's own terms on ``[m, d]``: stacked into one term a position where
    every client has a term of one class that can ``stack`` (a classmethod taking
    the clients' terms, :class:`Mask`), else :class:`PerClient`, row by row."""
    lengths = {len(ts) for ts in per_client}
    if len(lengths) == 1:
        out: list[LocalTransform] = []
        for terms in zip(*per_client, strict=True):
            kind = type(terms[0])
            stack = getattr(kind, "stack", None)
            if stack is None or any(type(t) is not kind for t in terms):
                break
            out.append(stack(terms))
        else:
            return out
    return [PerClient(tuple(tuple(ts) for ts in per_client))]


@dataclass(frozen=True)
class PerClient:
    """Each client's own chain on its row of ``D`` (``[m, d]``): a term written for
    one client runs on the batched trainers unchanged. A client without terms, or
    one that no longer steps, keeps its row."""

    chains: tuple[tuple[LocalTransform, ...], ...]

    def init(self, W: torch.Tensor) -> tuple[tuple[Any, ...], ...]:
        return tuple(chain(*ts).init(W[k]) for k, ts in enumerate(self.chains))

    def update(self, D: torch.Tensor, state: tuple[tuple[Any, ...], ...], ctx: StepContext
               ) -> tuple[torch.Tensor, tuple[tuple[Any, ...], ...]]:
        new = []
        for k, (ts, ss) in enumerate(zip(self.chains, state, strict=True)):
            if not ts or (ctx.live is not None and not ctx.live[k]):
                new.append(ss)
                continue
            D[k], ss = chain(*ts).update(D[k], ss, StepContext(ctx.step, ctx.W[k], ctx.W0[k]))
            new.append(ss)
        return D, tuple(new)


def check_local_transforms(transforms: Sequence[object], w: torch.Tensor, d: torch.Tensor,
                           *, batched: bool = False) -> None:
    """Each of ``client.transforms`` at the door (:func:`fedloom.transforms.probe_transform`):
    a transform of one's own runs on the synthetic direction ``d`` at the parameters
    ``w`` (both ``[d]``, one client's shape), steps 0 and 1, the second on the state
    the first returned, and with ``batched`` (vmap, lock-step) on two clients' rows
    ``[2, d]`` too; a server step given here is refused, one ``ValueError`` line."""
    for i, t in enumerate(transforms):
        where = f"client.transforms[{i}]"
        if not is_transform(t) and callable(getattr(t, "step", None)):
            raise ValueError(f"{where}: {type(t).__name__} is a server step (init, step), not "
                             "a local-step transform (init, update); give it as server=..., "
                             "and local momentum as client.momentum")
        probe_transform(t, where, d, _contexts(w, d), "local-step")
        if batched:
            W, D = torch.stack([w, w + 0.01 * d]), torch.stack([d, -d])
            probe_transform(t, where, D, _contexts(W, D, live=(True, True)), "local-step")


def _contexts(w: torch.Tensor, d: torch.Tensor, live: Sequence[bool] | None = None
              ) -> tuple[StepContext, StepContext]:
    """Steps 0 and 1 of a local step from ``w`` along ``d``."""
    return (StepContext(0, w.clone(), w.clone(), live),
            StepContext(1, w - 0.01 * d, w.clone(), live))
