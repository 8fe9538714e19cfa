"""CRAFT: conflict-resolved aggregation (reference-anchored min-norm correction).

Paper: "CRAFT: Conflict-Resolved Aggregation for Federated Training"
(arXiv 2605.21317); public code: github.com/tum-pbs/CRAFT, ``fed/craft.py``.

It acts on the trainable parameters only (the rows are ``w − w_k``); module
buffers such as BatchNorm statistics follow ``model.buffers``
(:mod:`fedloom.buffers`), as with every aggregator.

Per layer group ``q`` and round ``t``::

    min_g ½‖g − ĝ‖²   s.t.   U g = ρ

- ``U`` (m × d_q): rows ``u_i = g_i/‖g_i‖`` of the usable clients (rows with
  ``‖g_i‖ = 0`` are dropped with their ρ entries);
- ``ρ``: data proportions ``n_i / Σ n_j`` over the usable clients;
- ``ĝ``: the previous round's aggregate of this group divided by its norm
  (0 in the first round and whenever that aggregate is 0).

Closed form ``g = ĝ + U⁺(ρ − Uĝ)``, computed through the m × m Gram matrix
``G = UUᵀ``: ``g = ĝ + Uᵀλ``, ``λ = G⁺(ρ − Uĝ)``. Cost ``O(d m² + Q m³)``;
``U⁺`` (d × m) is never formed. Every usable client then has
``⟨u_i, g⟩ = ρ_i > 0``: no client conflicts with the aggregate.

Dependent directions. Singular values of ``U`` below
``σ_cut = max(sv_floor, rtol·σ_max)`` (defaults 1e-3 and 1e-6, so
``σ_cut = 1e-3``: two clients whose directions are within about 1.4e-3 rad,
cosine > 1 − 1e-6, count as one direction) are dropped:
``g = ĝ + U_cut⁺(ρ − Uĝ)``, the minimum-norm solution where ``U`` has full row
rank at the cut, the least-squares one on the kept directions otherwise. Hence
the bound, for every group with ≥ 2 usable clients::

    ‖g^q − ĝ‖ ≤ ‖ρ − Uĝ‖ / σ_cut ≤ (1 + σ_max) / σ_cut ≤ (1 + √m) / sv_floor

(``‖ρ‖₂ ≤ 1``, ``‖Uĝ‖ ≤ σ_max ≤ √m``), plus the rounding of ``g`` to the
updates' dtype. Without the floor, two clients 1e-4 apart with different ρ
need ``‖g‖ ≈ |Δρ|/1e-4`` (measured 1.1e3–1.4e3, below): one such round
destroys the model. Such a group, where dependent directions carry targets
that disagree (the constraints miss by more than ``atol``), is counted in
``craft_infeasible_groups``; dependent directions with consistent targets
(two clients with the same direction and the same ρ) meet the constraints and
are not.

Numerics (the default ``precision="mixed"``). The Gram is accumulated over
column chunks in float64, each chunk's product in the input dtype at sgemm
speed. For float32 that Gram carries errors of ``‖E‖₂ ≲ 8·m·eps32``
(:func:`~fedloom.aggregate.gram.gram_noise`), so

1. if an eigenvalue of ``G`` lies within that of ``σ_cut²`` (rank-deficient,
   duplicated or near-duplicate rows, near-collinear cohorts of many clients),
   the cut cannot be decided on it and the group is redone in float64;
2. otherwise ``g`` is formed and ``U g`` measured in the same fused pass; if
   ``|U g − ρ + (I − P)b|`` (the part beyond what the kept directions cannot
   reach) exceeds ``atol`` less the check's own rounding (``8·eps·‖g‖``), one
   step of iterative refinement ``λ ← λ − G_cut⁺(U g − ρ + (I − P)b)`` is tried
   (one more pass), and if that fails too
3. the group is redone in float64: Gram, solve, ``g`` formed in float64 and
   rounded once, ``U g`` of the rounded ``g`` exact, up to two refinement steps.

Well-conditioned groups never leave step 2 (speed unchanged, below). Every
group of full row rank at the cut meets ``|⟨u_i, g⟩ − ρ_i| ≤ atol`` (1e-6) up to
the rounding of ``g`` itself to float32, at most ``eps32/2·‖g‖`` per
constraint (Cauchy–Schwarz) and in practice ``~eps32·‖g‖/√d``;
``craft_max_violation`` is measured on the returned ``g``. Rows whose float32
products overflow (|values| ≳ 1e19) or underflow (a Gram diagonal below
``d·tiny/eps``, or 0 for a row that is not zero: entries ≲ 1e-22) are solved in
float64. Before, such a tiny row read as a zero row and lost its constraint:
on 5 rows at d = 40 with one row times 1e-24, ``craft_max_violation`` said
7.0e-8 while the row's real violation was 0.27, and two orders of the rows
differed by 1.5e-8; after, 3.9e-9 reported, 3.3e-9 real, no difference. The
float64 path scales the rows by powers of two (exact) where its own squares
would over- or underflow (norms ≳ 1e154, entries ≲ 1e-162;
:func:`~fedloom.aggregate.gram.row_scales`): the unit-row Gram, ``λ`` and ``g``
are those of the unscaled rows, without the infinite Gram that gave a NaN
direction before. Rows in range are never scaled (bit-identical outputs on
the property suite's ordinary cohorts). Non-finite rows give a NaN direction
(the engine rejects it). ``match_reference`` keeps the public arithmetic
untouched.

Measured (float32 rows, groups="global", round 1, worst of 5 draws; "public" is
``match_reference=True``, the public code bit for bit; "exact" the float64 SVD
solution with the same cut). Before = this module before the cut, the
fallback and the refinement (``rtol = 1e-6`` only, mixed Gram, no check):

==================================  ===================  ===============  ===============
cohort (m × d), quantity            before               after            public
==================================  ===================  ===============  ===============
cos 0.9999 (10 × 1e4), violation    1.5e-3               7.9e-9           1.5e-6
cos 0.99999 (10 × 1e4), violation   1.1e-2               3.4e-8           9.6e-2 [1]_
cos 0.9999 (100 × 1e4), violation   1.6e-4               1.1e-9           7.8e-3 [1]_
rank 10 (50 × 1e4), eigvals kept    31 of 50             10               —
rank 10 (50 × 1e4), rel. error      5.8                  2.5e-8           2.8e-6
m > width (50 × 30), rel. error     16 (‖g‖ 1.82)        2.8e-8 (0.199)   8.7e-7 (0.199)
duplicate row (10 × 1e3), rel. err  1.7                  2.6e-8           9.5e-7
near-dup. 1e-4 (10 × 1e3), ‖g‖      242 (float64 1.1e3)  0.328            0.328
near-dup. 1e-4 (10 × 1e4), ‖g‖      6.1 (float64 1.4e3)  0.341            0.341
independent (10 × 1e4), violation   5.3e-8               5.3e-8           5.5e-7
cos 0.9 (10 × 1e4), violation       1.0e-6               5.2e-7           6.6e-7
==================================  ===================  ===============  ===============

.. [1] the public tolerance drops every direction but the common one.

The default is never dominated by the public output: it meets the constraints
at least as well, or takes the shorter step where the public ``pinv``'s
``max(m, d)·eps·σ_max`` tolerance keeps a direction narrower than ``sv_floor``
(near-duplicates 1e-4 apart at d = 200: public ‖g‖ 2.7e3 meeting the
constraints to 2.9e-4, default 0.45 missing them by 0.12, counted infeasible);
tests/test_craft_edges.py checks this on every cohort kind.
Speed on well-conditioned rows (the benchmark's correlated updates, layer
groups of an MLP, d = 987,210, one thread): new/old time 0.95–0.97 at m = 10
and m = 100 (the fast path is the old path plus an m × m comparison).

Departures from the public code, each on purpose:

- Gram in chunks (above) and the m × m system solved in float64 with the cut
  ``σ_cut``. The public code calls ``torch.linalg.pinv(U)`` in float32, whose
  default ``rtol = max(m, d)·eps`` drops almost every singular value at large
  ``d`` when client updates are similar (table: cos 0.99999 at m = 10, cos
  0.9999 at m = 100, d = 1e4), so its constraints silently fail, and keeps
  directions 1e-4 apart at small ``d``.
  ``match_reference=True`` reproduces that path exactly, for comparison.
- Layer groups come from the model's :class:`~fedloom.params.Layout` (one
  module's weight and bias; a norm layer joins the module before it).

Edge cases as in the public code: one usable client → its raw update; no
usable client, or a zero result → zeros.

The server step keeps the public meaning ``w ← w − η_g g``. Scale trap:
``‖g^q‖`` is about 0.1–1 whatever the size of the client updates, so ``η_g``
(``server.lr``) sets each layer's step length directly (public defaults: 0.1
for CIFAR-10, 1.0 for CIFAR-100). With ``step: fixed``, ``server.lr: auto`` takes the
public code's default 0.1 (``default_server_lr``), not FedAvg's 1.0 (the other step
modes below take 1.0: their length is the mean update's); it is a safe start, not a
tuned step: on configs/quickstart.yaml (MNIST MLP, 30 rounds, seed 0) test
accuracy is 0.33 at 0.1 and 0.86 at 1.0 (FedAvg at 1.0: 0.90).

Step modes (``step``; the issue's "scale-aware CRAFT", the paper's future work).
Per layer group ``q`` with CRAFT's direction ``g^q`` (above) and the weighted mean
update ``ḡ^q = Σ_i p_i g_i^q`` (``p_i = n_i/Σn`` over the accepted clients, zero rows
included), the returned group is ``c^q g^q`` with

- ``fixed`` (default; the public code): ``c^q = 1``, so ``‖g^q‖ ≈ 0.1 … 1`` and
  ``server.lr`` is the step length per layer (``server.lr: auto`` → 0.1);
- ``norm_matched``: ``c^q = ‖ḡ^q‖ / ‖g^q‖``: CRAFT's direction at FedAvg's length,
  so ``server.lr: auto`` → 1.0 (FedAvg's step) and the length follows the client
  step and the round as FedAvg's does;
- ``rprop``: ``c^q = τ_t^q ‖ḡ^q‖ / ‖g^q‖``, norm-matched times a per-group trust
  factor adapted from round to round by the overshoot test of Rprop (Riedmiller &
  Braun, ICNN 1993; sign agreement as in Jacobs' delta-bar-delta, 1988): with
  ``s_{t−1}^q`` the previous **accepted** aggregate of the group (the state; a step
  the engine skipped never becomes it) and ``κ_t^q = ⟨ḡ_t^q, s_{t−1}^q⟩``,
  ``τ_t^q = clip(τ_{t−1}^q · step_up, step_min, step_max)`` if ``κ > 0`` (the clients
  still pull along the last step: it stopped short of the minimum along it),
  ``clip(τ_{t−1}^q · step_down, …)`` if ``κ < 0`` (they pull back: it overshot),
  unchanged if ``κ = 0`` or either vector is zero; ``τ_0 = 1``, defaults
  ``step_up = 1.2``, ``step_down = 0.5`` (Rprop's η⁺, η⁻), ``[step_min, step_max] =
  [0.1, 10]``. On a quadratic along ``s_{t−1}`` the sign of ``κ`` is exactly whether
  the last step passed the line minimum. With random signs (noise only) ``log τ``
  drifts down (``0.5·log 1.2 + 0.5·log 0.5 < 0``): τ grows only while at least 79 %
  of the rounds agree. ``ḡ_t`` rather than CRAFT's own ``g_t`` is tested because
  ``g_t = ĝ + Uᵀλ`` is anchored on ``s_{t−1}``'s direction and leans towards it.
  The state ``τ`` (float64, one per group) goes in and comes back with the
  reference, so a resumed run continues bit for bit. Measured (docs/results/adaptive.md,
  untuned against CRAFT with its server step tuned): at the cap 10 rprop trails by 40 pp
  at a small client step (lr 0.0025), where τ sits at the cap; ``step_max = 100``
  (chosen on one tuning seed) is worse on none of the page's seven CRAFT settings. The
  default stays 10 so that runs made with it keep their meaning.

Constraint preservation: for any ``c^q > 0``, ``⟨u_i, c^q g^q⟩ = c^q ρ_i > 0`` for
every usable client, so no client conflicts with the returned step and the
alignments keep their ratios ``ρ_i/ρ_j``; ``craft_max_violation`` and
``craft_min_alignment`` are measured on the unscaled ``g`` (the constraints as
solved). Where ``ḡ^q = 0`` (updates that cancel, every row zero) ``c^q = 0`` and the
group does not move: the weaker guarantee ``⟨u_i, 0⟩ = 0`` (no client's loss
increases to first order). ``c^q`` is formed in float64 from norms taken without
squaring huge or tiny entries; a non-finite row gives a non-finite ``c^q`` and a NaN
group (rejected by the engine, never averaged).

Composition with the server optimizer. ``fixed`` and ``norm_matched`` compose with
``server.optimizer: momentum`` as the FedAvg family does: the momentum buffer
multiplies the step by up to ``1/(1 − β)``, so ``server.lr`` must be FedAvgM's
(≈ 0.1–0.3 at β = 0.9 for ``norm_matched``, ~10× smaller for ``fixed``), not
``auto``'s 1.0. ``adam``/``yogi``/``adagrad`` divide each coordinate by its own
running scale, so the three modes differ there only through how the length
changes over rounds (Adam is invariant to a constant ``c^q``); ``server.lr`` is
Adam's (≈ 1e-3 … 1e-2). ``rprop``'s test reads the aggregate, not the step the
optimizer applied: with momentum the overshoot it detects is that of the
aggregate's direction, a weaker signal, and τ (up to 10) multiplies the momentum
step too: ``rprop`` is meant for ``sgd``; with momentum take ~10× less than
FedAvgM's step. tests/test_craft_adaptive.py runs every mode with momentum and
Adam on a federated least-squares problem (6 clients, 40 rounds): finite, and the
gap to the minimum shrinks, at momentum steps 0.001 (``fixed``), 0.1
(``norm_matched``) and 0.01 (``rprop``; 0.1 diverged there) and Adam 0.01 for all.

Targets (``targets``): ``data`` (default; the paper): ``ρ_i = n_i/Σn``.
``loss``: ``ρ_i ∝ n_i (F_i(w) + 1e-10)^q`` normalised (``q`` = ``targets_q``, default 1),
``F_i(w)`` the client's loss at the received model before training (the start
losses q-FedAvg reads; the engine computes them only for rules that ask), the
weights of q-FFL's gradient ``Σ p_i F_i^q ∇F_i`` (Li et al., ICLR 2020; ``+ 1e-10``
as q-FedAvg's public code). Guarantee: every usable client still gets
``⟨u_i, g⟩ = ρ_i > 0`` (no conflict), and the first-order decrease of client ``i``'s
loss along ``−η g``, ``η ‖g_i‖ ρ_i`` (with ``u_i`` standing for the direction of
its gradient), is in the ratio ``(n_i/n_j)(F_i/F_j)^q`` between clients: the
clients that are behind get proportionally more alignment; ``q = 0`` is ``data``.
Computed as a softmax of ``log n_i + q·log F_i`` (no overflow at any loss or
``q``); a non-finite start loss counts as the cohort's largest finite one (the
client is the furthest behind), all non-finite → ``data`` targets. Negative
losses are refused (ValueError: the round is skipped). Relative weights are kept
at ``≥ e^-700`` of the largest, so ``ρ_i > 0`` always; a target below ``atol``
(1e-6; e.g. q = 50 and losses 1 against 1e300) is met only to that tolerance, so
the alignment it guarantees is ``⟨u_i, g⟩ ≥ −atol``, not a resolvable ``> 0``.

Metrics each round: ``craft_max_violation`` (max over groups and usable
clients of ``|⟨u_i, g⟩ − ρ_i|``, over groups solved with ≥ 2 clients),
``craft_min_alignment`` (min of ``⟨u_i, g⟩``), ``craft_infeasible_groups``; with
``step`` other than ``fixed`` also ``craft_step_scale`` (the median of ``c^q`` over
the groups) and, for ``rprop``, ``craft_trust`` (the median of ``τ^q``).
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
from fedloom.capabilities import AggregatorCaps, FromCapabilities
from fedloom.params import Layout
from fedloom.plain import state_type
from fedloom.registry import register

__all__ = ["CRAFT", "STEPS", "TARGETS", "CraftState"]

Step = Literal["fixed", "norm_matched", "rprop"]
Targets = Literal["data", "loss"]
STEPS: tuple[str, ...] = ("fixed", "norm_matched", "rprop")
TARGETS: tuple[str, ...] = ("data", "loss")
# The step mode a config that names none gets (what `craft` alone gives:
# docs/explanation/methods.md, "CRAFT and the server step").
DEFAULT_STEP: Step = "fixed"
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
        step: ``"fixed"`` (the public code: CRAFT's direction as solved),
            ``"norm_matched"`` (each group at its weighted mean update's length) or
            ``"rprop"`` (norm-matched times a per-group trust factor from the overshoot
            test); module docstring.
        step_up, step_down, step_min, step_max: ``rprop``'s growth and shrink factors
            and the bounds of its trust factor.
        targets: ``"data"`` (``ρ_i = n_i/Σn``, the paper) or ``"loss"`` (``ρ_i ∝ n_i
            F_i(w)^q``, q-FFL's weights; needs the start losses).
        targets_q: ``q`` of ``targets="loss"``.

    Reference:
        paper: "CRAFT: Conflict-Resolved Aggregation for Federated Training", arXiv 2605.21317.
        code: tum-pbs/CRAFT (``fed/craft.py``); ``match_reference=True`` reproduces it bit for
            bit.
        departures: ``step`` and ``targets`` other than the defaults are fedloom's (the
            paper's future work: scale-aware steps, targets from training progress);
            the Gram matrix in column chunks and the m × m system in float64 with the
            cut ``σ_cut = max(sv_floor, rtol·σ_max)``, a float64 fallback and iterative
            refinement (the public float32 ``pinv`` drops or keeps directions by ``max(m,
            d)·eps``); layer groups from the model's Layout.
        measured: constraint violation 7.9e-9 (public 1.5e-6) at cos 0.9999, 10 × 1e4; the full
            table is in the module docstring.
    """

    # server.lr=auto: the public code's server_lr (github.com/tum-pbs/CRAFT, utils/config.yaml):
    # ‖g^q‖ is about 0.1–1 whatever the updates' size, so 1.0 steps each layer ~10× further.
    default_server_lr = 0.1

    @classmethod
    def server_lr_for(cls, options: Mapping[str, Any]) -> float:
        """``server.lr: auto`` for these options: the public 0.1 for ``step: fixed``,
        FedAvg's 1.0 for the modes at the mean update's length."""
        return cls.default_server_lr if options.get("step", DEFAULT_STEP) == "fixed" else 1.0

    def __init__(
        self,
        groups: Literal["layer", "global"] = "layer",
        rtol: float = 1e-6,
        sv_floor: float = 1e-3,
        atol: float = 1e-6,
        precision: Precision = "mixed",
        chunk: int = 1 << 15,
        match_reference: bool = False,
        step: Literal["fixed", "norm_matched", "rprop"] = DEFAULT_STEP,
        step_up: float = 1.2,
        step_down: float = 0.5,
        step_min: float = 0.1,
        step_max: float = 10.0,
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
        self.step = step
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

    requires = FromCapabilities()  # the loose flag, for the Flower strategy

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
