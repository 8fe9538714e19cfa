"""CRAFT: conflict-resolved aggregation (reference-anchored min-norm correction).

Paper: "CRAFT: Conflict-Resolved Aggregation for Federated Training"
(arXiv 2605.21317); public code: github.com/tum-pbs/CRAFT, ``fed/craft.py``.

Per layer group ``q`` (trainable parameters only; buffers follow ``model.buffers``) and
round ``t``: ``min_g ½‖g − ĝ‖²  s.t.  U g = ρ``, with ``U`` the unit rows ``u_i = g_i/‖g_i‖``
of the usable clients (zero rows dropped), ``ρ_i = n_i / Σ n_j`` and ``ĝ`` the previous
aggregate of the group divided by its norm (0 in the first round). Closed form
``g = ĝ + Uᵀλ``, ``λ = G⁺(ρ − Uĝ)`` with the m × m Gram ``G = UUᵀ``; every usable client then has
``⟨u_i, g⟩ = ρ_i > 0``. One usable client → its raw update; none → zeros.

Checked against the public code: ``match_reference=True`` reproduces it bit for bit; the
default meets the constraints to 7.9e-9 where the public code reaches 1.5e-6 (float32 rows,
cos 0.9999, 10 × 1e4, worst of 5 draws), and never worse on tests/test_craft_edges.py's cohorts.

Departures: singular values below ``σ_cut = max(sv_floor, rtol·σ_max)`` are cut (the
public float32 ``pinv`` cuts at ``max(m, d)·eps``); the Gram in float64 column chunks, a
float64 fallback, iterative refinement; layer groups from the model's Layout; the ``step``
modes (``norm_matched``, ``rprop``) and ``targets: loss`` (the paper's future work). The
default is ``step: rprop``, ``step_max: 100`` at ``server.lr: auto`` = 1.0 (untuned, it
beat step fixed at the public 0.1 on six of seven settings, worse on none:
docs/results/craft-default.md); ``step: fixed`` (``server.lr: auto`` = 0.1) is the
paper's, as is ``match_reference`` alone. The cut, numerics, measurements, step modes,
targets and metrics: docs/explanation/methods.md (CRAFT in detail).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from fedloom.aggregate.base import CohortInfo
from fedloom.aggregate.craft_solve import CraftSolver, _normalise
from fedloom.aggregate.craft_solve import GroupSolve as GroupSolve
from fedloom.aggregate.gram import (
    Precision,
    lincomb64,
    safe_norm,
)
from fedloom.capabilities import AggregatorCaps
from fedloom.params import Layout
from fedloom.plain import state_type
from fedloom.registry import register

__all__ = ["CRAFT", "STEPS", "TARGETS", "CraftState"]

Step = Literal["fixed", "norm_matched", "rprop"]
Targets = Literal["data", "loss"]
STEPS: tuple[str, ...] = ("fixed", "norm_matched", "rprop")
TARGETS: tuple[str, ...] = ("data", "loss")
# What `craft` alone gives (issue 54, docs/results/craft-default.md): the rprop step with
# its trust cap at 100; match_reference alone stays the public code (step fixed).
DEFAULT_STEP: Step = "rprop"
DEFAULT_STEP_MAX = 100.0
# What a recorded config that names no step (or rprop without step_max) ran: the defaults
# before issue 54. Every record since names them (CRAFT.resolve_options).
_RECORDED_STEP: Step = "fixed"
_RECORDED_STEP_MAX = 10.0
# q-FedAvg's public code: F_k + 1e-10 keeps log F (and F^q) finite at a zero loss.
_LOSS_OFFSET = 1e-10


@state_type  # checkpoints hold it (fedloom.plain)
@dataclass
class CraftState:
    groups: tuple[tuple[int, int], ...]   # [start, stop) of each layer group
    previous: torch.Tensor | None = None  # last accepted aggregate (before η_g)
    # step="rprop": the trust factor τ^q of each group (float64; None before the first
    # round). A default, so checkpoints written before it load (the class attribute).
    trust: torch.Tensor | None = None


class CRAFT(CraftSolver):
    """Conflict-resolved aggregation.

    Args:
        groups: ``"layer"`` (one problem per layer group) or ``"global"``.
        rtol, sv_floor: singular values of ``U`` below
            ``max(sv_floor, rtol·σ_max)`` count as zero (bounds ``‖g − ĝ‖``).
        atol: the constraint tolerance checked on every group (float64 fallback
            beyond it).
        precision: Gram accumulation, ``"mixed"`` (fast path, float64 where it
            cannot decide or its check fails) or ``"float64"`` (see gram.py).
        chunk: column chunk of the Gram accumulation.
        match_reference: reproduce the public code's float32
            ``torch.linalg.pinv(U)`` path (in the input dtype) exactly.
        step: ``"fixed"`` (the paper and the public code: CRAFT's direction as solved),
            ``"norm_matched"`` (each group at its weighted mean update's length) or
            ``"rprop"`` (norm-matched times a per-group trust factor from the overshoot
            test); docs/explanation/methods.md (CRAFT in detail). ``None`` (the
            default): ``"rprop"``, or ``"fixed"`` with ``match_reference``. Why rprop:
            untuned against untuned, it was better than step fixed at the public
            ``server.lr`` 0.1 on six of seven settings and not worse on the seventh
            (docs/results/craft-default.md).
        step_up, step_down, step_min, step_max: ``rprop``'s growth and shrink factors
            and the bounds of its trust factor (``step_max`` 100, chosen on a tuning
            seed: docs/results/adaptive.md; it was 10 before the default moved).
        targets: ``"data"`` (``ρ_i = n_i/Σn``, the paper) or ``"loss"`` (``ρ_i ∝ n_i
            F_i(w)^q``, q-FFL's weights; needs the start losses).
        targets_q: ``q`` of ``targets="loss"``.

    Reference:
        paper: "CRAFT: Conflict-Resolved Aggregation for Federated Training", arXiv 2605.21317.
        code: tum-pbs/CRAFT (``fed/craft.py``); ``match_reference=True`` reproduces it bit for
            bit.
        departures: ``step`` other than ``"fixed"`` (the default included) and
            ``targets="loss"`` are fedloom's (the paper's future work: scale-aware
            steps, targets from training progress);
            the Gram matrix in column chunks and the m × m system in float64 with the
            cut ``σ_cut = max(sv_floor, rtol·σ_max)``, a float64 fallback and iterative
            refinement (the public float32 ``pinv`` drops or keeps directions by ``max(m,
            d)·eps``); layer groups from the model's Layout.
        measured: constraint violation 7.9e-9 (public 1.5e-6) at cos 0.9999, 10 × 1e4; the full
            table is in docs/explanation/methods.md (CRAFT in detail).
    """

    # server.lr=auto: the public code's server_lr (github.com/tum-pbs/CRAFT, utils/config.yaml):
    # ‖g^q‖ is about 0.1–1 whatever the updates' size, so 1.0 steps each layer ~10× further.
    default_server_lr = 0.1

    @classmethod
    def server_lr_for(cls, options: Mapping[str, Any]) -> float:
        """``server.lr: auto`` for these options: the public 0.1 for ``step: fixed``,
        FedAvg's 1.0 for the modes at the mean update's length (the default, rprop)."""
        return cls.default_server_lr if _step_of(options) == "fixed" else 1.0

    @classmethod
    def resolve_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` with the step mode (and rprop's cap) written out, so that a run's
        ``config.yaml`` says what ran whatever a later version's defaults."""
        out = {**options, "step": _step_of(options)}
        if out["step"] == "rprop" and out.get("step_max") is None:
            out["step_max"] = DEFAULT_STEP_MAX
        return out

    @classmethod
    def recorded_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        """A recorded run's ``options`` as it ran: a record without ``step`` (or rprop
        without ``step_max``) predates issue 54's default, step fixed (rprop's cap 10)."""
        out = dict(options)
        if out.get("step") is None:
            out["step"] = _RECORDED_STEP
        if out["step"] == "rprop" and out.get("step_max") is None:
            out["step_max"] = _RECORDED_STEP_MAX
        return out

    def __init__(
        self,
        groups: Literal["layer", "global"] = "layer",
        rtol: float = 1e-6,
        sv_floor: float = 1e-3,
        atol: float = 1e-6,
        precision: Precision = "mixed",
        chunk: int = 1 << 15,
        match_reference: bool = False,
        step: Literal["fixed", "norm_matched", "rprop"] | None = None,
        step_up: float = 1.2,
        step_down: float = 0.5,
        step_min: float = 0.1,
        step_max: float = DEFAULT_STEP_MAX,
        targets: Literal["data", "loss"] = "data",
        targets_q: float = 1.0,
    ) -> None:
        if groups not in ("layer", "global"):
            raise ValueError(
                f"aggregator.options.groups: must be 'layer' or 'global', got {groups!r}"
            )
        if not rtol > 0:
            raise ValueError(f"aggregator.options.rtol: must be > 0, got {rtol}")
        if not sv_floor >= 0:
            raise ValueError(f"aggregator.options.sv_floor: must be >= 0, got {sv_floor}")
        if not atol > 0:
            raise ValueError(f"aggregator.options.atol: must be > 0, got {atol}")
        if precision not in ("float64", "mixed"):
            raise ValueError(
                f"aggregator.options.precision: must be 'float64' or 'mixed', got {precision!r}"
            )
        # None: the default, or the public code's step where it is reproduced
        step = _step_of({"step": step, "match_reference": match_reference})
        if step not in STEPS:
            raise ValueError(f"aggregator.options.step: must be one of {', '.join(STEPS)}, "
                             f"got {step!r}")
        if targets not in TARGETS:
            raise ValueError(f"aggregator.options.targets: must be one of "
                             f"{', '.join(TARGETS)}, got {targets!r}")
        for key, v, ok, what in (
            ("step_up", step_up, 1 <= step_up < math.inf, ">= 1 and finite"),
            ("step_down", step_down, 0 < step_down <= 1, "in (0, 1]"),
            ("step_min", step_min, 0 < step_min <= 1, "in (0, 1]"),
            ("step_max", step_max, 1 <= step_max < math.inf, ">= 1 and finite"),
            ("targets_q", targets_q, 0 <= targets_q < math.inf, ">= 0 and finite"),
        ):
            if isinstance(v, bool) or not isinstance(v, int | float) or not ok:
                raise ValueError(f"aggregator.options.{key}: must be {what}, got {v!r}")
        self.step: Step = step
        self.step_up, self.step_down = float(step_up), float(step_down)
        self.step_min, self.step_max = float(step_min), float(step_max)
        self.targets = targets
        self.targets_q = float(targets_q)
        self.groups = groups
        self.rtol = rtol
        self.sv_floor = sv_floor
        self.atol = atol
        self.precision = precision
        self.chunk = int(chunk)
        self.match_reference = match_reference

    @property
    def capabilities(self) -> AggregatorCaps:
        """``targets="loss"`` reads the start losses (the engine computes them only then)."""
        return AggregatorCaps(requires=frozenset({"start_losses"}) if self.targets == "loss"
                              else frozenset())

    def init(self, layout: Layout) -> CraftState:
        lay = layout.regroup(self.groups)
        return CraftState(tuple((g.start, g.stop) for g in lay.groups), None)

    def __call__(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        state: CraftState,
        *,
        info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, CraftState, Mapping[str, float]]:
        m, d = updates.shape
        if state.groups[-1][1] != d:
            raise ValueError(
                f"craft: updates have {d} columns, the layout has {state.groups[-1][1]}"
            )
        if weights.shape != (m,) or bool((weights < 0).any()):
            raise ValueError("craft: weights must be a non-negative vector, one per update")
        rho_w = self._target_weights(weights, info)
        out = torch.empty(d, dtype=updates.dtype, device=updates.device)
        viol, align, infeasible = [], [], 0
        scaled = self.step != "fixed"
        p = _normalise(weights.to(torch.float64)) if scaled else None  # FedAvg's weights
        trust_old = getattr(state, "trust", None)
        trust = torch.ones(len(state.groups), dtype=torch.float64)
        if self.step == "rprop" and trust_old is not None:
            trust = trust_old.detach().to("cpu", torch.float64).clone()
        scales = []
        for q, (start, stop) in enumerate(state.groups):
            prev = state.previous[start:stop] if state.previous is not None else None
            R = updates[:, start:stop]
            solve = self._solve(R, rho_w, prev)
            g = solve.g
            if scaled:
                assert p is not None
                mean = lincomb64(R, p.to(R.device), chunk=self.chunk)
                if self.step == "rprop":
                    trust[q] = self._trusted(float(trust[q]), mean, prev)
                c = _length_ratio(mean, g) * (float(trust[q]) if self.step == "rprop" else 1.0)
                scales.append(c)
                g = (g.to(torch.float64) * c).to(updates.dtype) if c == c else g.new_full(
                    g.shape, float("nan"))
            out[start:stop] = g
            if solve.violation == solve.violation:  # not NaN
                viol.append(solve.violation)
                align.append(solve.min_alignment)
            infeasible += int(solve.infeasible)
        metrics = {
            "craft_max_violation": max(viol) if viol else 0.0,
            "craft_min_alignment": min(align) if align else float("nan"),
            "craft_infeasible_groups": float(infeasible),
        }
        if scaled:
            metrics["craft_step_scale"] = _median(scales)
        if self.step == "rprop":
            metrics["craft_trust"] = float(trust.median())
            return out, CraftState(state.groups, out.detach().clone(), trust), metrics
        return out, CraftState(state.groups, out.detach().clone()), metrics

    # ------------------------------------------------------------ step, targets
    def _trusted(self, tau: float, mean: torch.Tensor, prev: torch.Tensor | None) -> float:
        """``rprop``: τ grown by ``step_up`` where the clients' mean update still points
        along the last accepted step (``⟨ḡ, s⟩ > 0``), shrunk by ``step_down`` where it
        points back, kept where the test is undefined; clipped to the bounds."""
        if prev is None:
            return tau
        a, b = _unit64(mean), _unit64(prev.to(mean.device))
        if a is None or b is None:
            return tau
        kappa = float(a @ b)
        if kappa > 0:
            tau *= self.step_up
        elif kappa < 0:
            tau *= self.step_down
        return min(self.step_max, max(self.step_min, tau))

    def _target_weights(self, weights: torch.Tensor, info: CohortInfo | None) -> torch.Tensor:
        """The unnormalised targets: ``n_i`` (``data``) or ``n_i (F_i + 1e-10)^q``
        (``loss``, as ``exp(log n_i + q log F_i − max)``: no overflow at any ``F`` or ``q``)."""
        if self.targets == "data":
            return weights
        if info is None or info.start_losses is None:
            raise ValueError("craft: targets=loss needs the clients' start losses (info)")
        F = info.start_losses.detach().to("cpu", torch.float64)
        if F.shape != weights.shape:
            raise ValueError(f"craft: {F.numel()} start losses for {weights.numel()} updates")
        if bool((F < 0).any()):
            raise ValueError("craft: targets=loss needs losses >= 0")
        finite = torch.isfinite(F)
        if not bool(finite.any()):
            return weights  # no usable progress measure: the data targets
        # a non-finite loss counts as the largest finite one: that client is furthest behind
        F = torch.where(finite, F, F[finite].max()) + _LOSS_OFFSET
        n = weights.detach().to("cpu", torch.float64)
        logw = torch.where(n > 0, n.clamp_min(1e-300).log() + self.targets_q * F.log(),
                           torch.full_like(n, -math.inf))
        if not bool(torch.isfinite(logw).any()):
            return weights
        # relative weights ≥ e^-700 ≈ 1e-304: every client with n_i > 0 keeps ρ_i > 0
        rel = (logw - logw[torch.isfinite(logw)].max()).clamp_min(-700.0).exp()
        return torch.where(n > 0, rel, torch.zeros_like(rel)).to(weights.device)


def _step_of(options: Mapping[str, Any]) -> Any:
    """The step mode ``options`` ask for: theirs, else ``fixed`` under ``match_reference``
    (the public code), else :data:`DEFAULT_STEP`."""
    step = options.get("step")
    if step is None:
        return "fixed" if options.get("match_reference") else DEFAULT_STEP
    return step


def _length_ratio(mean: torch.Tensor, g: torch.Tensor) -> float:
    """``‖ḡ‖ / ‖g‖`` in float64, norms taken without squaring huge or tiny entries;
    0 where either is 0 (the group does not move), NaN where either is not finite."""
    a, b = safe_norm(mean), safe_norm(g)
    if not (math.isfinite(a) and math.isfinite(b)):
        return float("nan")
    if a == 0.0 or b == 0.0:
        return 0.0
    return a / b


def _unit64(v: torch.Tensor) -> torch.Tensor | None:
    """``v/‖v‖`` in float64, or None for a zero or non-finite ``v``."""
    n = safe_norm(v)
    if not (n > 0 and math.isfinite(n)):
        return None
    x = v.to(torch.float64)
    a = x.abs().max()
    return (x / a) / (n / float(a))


def _median(xs: list[float]) -> float:
    finite = sorted(x for x in xs if x == x)
    if not finite:
        return float("nan")
    k = len(finite)
    return finite[k // 2] if k % 2 else 0.5 * (finite[k // 2 - 1] + finite[k // 2])


# The class is its own factory: its constructor arguments are the config options.
register("aggregator", "craft")(CRAFT)
