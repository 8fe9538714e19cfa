"""Client-level differential privacy: DP-FedAvg (central) and local Gaussian noise.

Settings in, state out (the optax pattern): :class:`Privacy` holds the
settings; its state (the clip bound ``C_t`` of adaptive clipping, the local
mode's participation counts) goes in and comes back, and lives in the run's
:class:`~fedloom.engine.runstate.RunState` and checkpoint, so a resumed run is
bit-identical to an uninterrupted one. Every noise draw comes from a generator
derived from ``(seed, round, client, purpose)`` (:mod:`fedloom.rng`).

Central mode (``privacy.mode: central``) — DP-FedAvg
-----------------------------------------------------
McMahan, Ramage, Talwar & Zhang, "Learning Differentially Private Recurrent
Language Models" (ICLR 2018), Algorithm 1 with unit client weights
(``w_k = 1``) and the fixed-denominator estimator. In round ``t`` the server
takes the decoded row ``u_k`` of each accepted client of the cohort ``S_t``::

    ũ_k = u_k · min(1, C_t / ‖u_k‖₂)                          (clip)
    Δ_t = (Σ_{k∈S_t accepted} ũ_k + ξ_t) / m̄,  ξ_t ~ N(0, σ_Δ² C_t² I_d)

``m̄ = cohort.size``, the **expected** cohort size (here the exact one: the
cohort is ``cohort.size`` clients drawn uniformly without replacement). The
denominator is fixed: a client that is dropped or rejected (non-finite,
undecodable, above ``server.max_update_norm``) contributes the zero vector
and the sum is still divided by ``m̄``, so no client's data changes the
denominator. ``Δ_t`` replaces the aggregator's direction and goes to the
server optimizer (any optimizer is post-processing). Each client counts once
whatever its sample count: ``fedavg``'s ``n_k`` weighting is not applied
(McMahan et al.'s ``w_k = 1``). The aggregator must declare ``linear``
(``Σ_k a_k g_k`` with coefficients that do not depend on the updates' values)
*and* reduce to the plain mean under unit weights (``dp_mean``) in its
capabilities (:mod:`fedloom.capabilities`): only
``fedavg``. Every other rule is refused with one line: a nonlinear rule
(CRAFT, ConFIG, FedFV, FedLF, median, trimmed mean, Krum, q-FedAvg, AFL,
coordinate mean) has no sensitivity we can state, and FedNova's coefficients
``τ_eff/a_k`` make one client's weight depend on the others' step counts.

The noise comes from ``(seed, round, -1, "dp-noise")``. ``σ_Δ = z``
(``privacy.noise_multiplier``) without adaptive clipping.

Adaptive clipping (``privacy.adaptive_clip.enabled``), Andrew, Thakkar,
McMahan & Ramaswamy, "Differentially Private Learning with Adaptive
Clipping" (NeurIPS 2021), geometric update of their Algorithm 1::

    b̃_t = clamp((Σ_{k accepted} 1[‖u_k‖₂ ≤ C_t] + N(0, σ_b²)) / m̄, 0, 1)   ("dp-count")
    C_{t+1} = C_t · exp(−η_C (b̃_t − γ))

with ``γ`` = ``target_quantile``, ``η_C`` = ``lr``, ``σ_b`` = ``count_stddev``
(default ``m̄/20``, the paper's recommendation). The count is a second
release; the update's noise is raised to ``σ_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2)``
(their Theorem 1) so that the pair costs what one Gaussian release with
noise multiplier ``z`` costs (the accountant below uses ``z``); this needs
``2σ_b > z``, checked with one line. ``C_t`` is public (a function of past
releases); it is in the run state and checkpoint.

Public code checked. TF Privacy's ``QuantileEstimatorQuery``
(tensorflow/privacy, ``dp_query/quantile_estimator_query.py``): the same
count of updates *at or below* the estimate, the fixed denominator (its
``expected_num_records``), the clamp to [0, 1] and the geometric update (it
centres each bit at ±0.5 for an add-or-remove sensitivity of 1/2; under our
replace-one relation the count's sensitivity is 1 either way, and the noise
formula above is the same). Flower 1.42 (``flwr.supercore.differential_privacy``,
installed with the dev extra): the noise std ``z·C/m`` of
``DifferentialPrivacyServerSideFixedClipping`` and ``σ_Δ`` with the default
``σ_b = m/20`` of its adaptive strategy equal ours to 1e-15
(tests/test_privacy.py). Two departures from Flower's
``DifferentialPrivacyServerSideAdaptiveClipping``: it counts the updates that
*were clipped* (scaling factor < 1) in the paper's update, which moves ``C``
the opposite way (for ``γ = 0.5`` and every update clipped it shrinks
``C`` further); and it updates ``C`` before drawing the noise, so the noise is
scaled to ``C_{t+1}`` while the updates were clipped to ``C_t`` (too little
noise whenever ``C`` shrinks). Here the count is of unclipped updates, as the
paper and TF Privacy, and the noise uses ``C_t``.

Accountant (central). The rounds are accounted with Google's
``dp-accounting`` (RDP accountant, its default orders): each round is a
``SampledWithoutReplacementDpEvent(N, m̄, GaussianDpEvent(z/2))``, composed
over the rounds run (``dp_epsilon`` at ``privacy.delta`` in each round's
metrics and in ``summary.json``). Assumptions, stated exactly:

- Sampling: fedloom draws a fixed-size cohort of ``m̄`` of the ``N =
  data.num_clients`` clients uniformly without replacement, independently
  each round (:meth:`~fedloom.engine.experiment.Experiment.sample_cohort`), which is
  what this event describes (Wang, Balle & Kasiviswanathan, "Subsampled Rényi
  Differential Privacy and Analytical Moments Accountant", AISTATS 2019,
  Theorem 27, as implemented by the library). Poisson sampling is *not*
  assumed. A cohort drawn from fewer than ``N`` clients (only the available
  ones, ``system.availability``) would break the ``q = m̄/N`` amplification:
  that combination is refused with one line. Deadlines and mid-round
  dropouts (``system.*``) are fine: a client that does not report adds zero.
- Neighbouring relation: **replace one client** (all of one client's data
  replaced by any other data; ``N`` is public) — the relation under which the
  library accounts sampling without replacement. Under it the L2 sensitivity
  of the clipped sum is ``2C_t`` (two vectors in the ball of radius ``C_t``),
  and of the clipped count 1, so the event's noise multiplier (noise std over
  sensitivity) is ``σ_Δ C_t / 2C_t = z/2`` (adaptive: the pair's combined
  multiplier, also ``z/2``).
- Measured (``N = 100``, ``m̄ = 10``, ``z = 1``, 100 rounds, ``δ = 1e-5``):
  ε = 83.9 with this event; the Poisson/add-or-remove event that Opacus,
  TensorFlow Privacy and Flower's accountant examples use would give 7.9 for
  the same numbers — but fedloom does not sample that way, and that number
  would be false here.

What is private in central mode: the sequence of global models (and the
server optimizer's state, the iterate average, everything computed from them
and public data), against anyone who sees them, for each client, under the
relation above. Not private: the uplink — the server sees every decoded row
before clipping and noise, so the guarantee is **not** against the server
(use local mode, or secure aggregation with client-side clipping, for that).
fedloom's diagnostics computed from the clients' raw data (``train_loss``,
``conflict_rate``, ``residual_norm``, ``grad_mismatch``, per-client
accuracies, rejected-client ids) are not private either: they are the
researcher's view of a simulation, not releases of a deployment.

Composition with compression and error feedback (central): clipping and
noise act on the **decoded** rows at the server, after compression and after
the feedback policy's ``server_row``. The clipped-off part of a row is lost
(not fed back: the client's residual was computed before the server clipped).
The residuals are client state and never released, so EF composes. A policy
whose server keeps or broadcasts something computed from the clients'
messages outside the noised sum — EF21-PP's ``ḡ``, SCAFCOM's ``c``, CSER's
reset ``ē``, SA-PEF's theory schedule (smoothness probes of raw gradients) —
is refused (its capabilities' ``row_only``), and so is a local method with
server state (SCAFFOLD's ``c``). ``server.max_norm_ratio`` is not applied
under privacy: it would make one client's acceptance depend on the others'
norms, and the clip already bounds every contribution.

Local mode (``privacy.mode: local``)
------------------------------------
Each client clips its dense update to ``C`` and adds ``N(0, z² C² I_d)``
from ``(seed, round, client, "dp-noise")`` **before** its feedback policy and
compressor, and before any screening rule: everything it sends afterwards
(the payload, CSER's reset, EF's residual ``e ← u − C(u)``, which now holds
noisy values), and whether it sends at all (``server.max_update_norm`` is
applied to the noisy update), is post-processing of the noisy updates. A
non-finite update is replaced by zero before the noise, not withheld (its
absence would depend on the data). Per round a client's message is the Gaussian mechanism with
sensitivity ``2C`` (replace the client's data) and noise ``zC``; over the
``n`` rounds it took part in, ε is that of ``GaussianDpEvent(z/2)`` composed
``n`` times (RDP accountant; no amplification by sampling: the server sees who
sent). ``dp_epsilon`` reports the largest ``n`` over all clients so far (the
participation counts are in the run state). The guarantee holds against the
server and anyone on the uplink; any aggregator is post-processing, so CRAFT,
median and the others compose. Not private, and refused: aggregators that
read a client's loss at the received model (``requires`` holds
``start_losses``: AFL, FedFV, FedLF, q-FedAvg), SA-PEF's theory schedule, and
local methods with server state (SCAFFOLD). The sample count ``n_k`` (and the
local step count) is sent in the clear, so the relation is: a client's data
replaced by other data **of the same size**. Adaptive clipping is central only.

Measured
--------
MNIST, ``configs/quickstart.yaml`` (100 clients, Dirichlet 0.3, 10 a round,
MLP 784-200-200-10 with 199,210 parameters, seed 0), 30 rounds, unit
weights: ``fedloom run configs/quickstart.yaml rounds=30
'aggregator.options={weighted: false}' privacy.mode=… privacy.clip=…
privacy.noise_multiplier=…``. Final test accuracy: no DP 0.907; central
``z = 1, C = 1`` 0.334 at ε = 32.3 (δ = 1e-5); central ``z = 0.3, C = 0.5``
0.863 at ε = 1226; central adaptive (``z = 1``, ``σ_b = 1``, ``γ = 0.5``,
``η_C = 0.2``) 0.129, ``C`` growing from 1 to 14.4 as the noisy model's
updates grew; local ``z = 1, C = 1`` 0.104 at ε = 45.2. With 10 clients a
round the noise (std ``zC/10`` on each of 199k coordinates) swamps the
signal: DP-FedAvg needs cohorts of hundreds (McMahan et al. 2018).

Not claimed
-----------
The guarantees are for the real-valued Gaussian mechanism. The noise is
floating-point samples from ``torch.randn``; floating-point attacks on
textbook Gaussian samplers (Mironov, CCS 2012; Jin et al., S&P 2022) are not
defended against. Nothing here protects against a malicious server that
changes the code it runs.

Secure aggregation (``server.secure_aggregation: true``)
--------------------------------------------------------
A server that sees only the sum of masked updates (Bonawitz et al., CCS 2017;
SecAgg+, Bell et al., CCS 2020) can compute a rule ``Σ_k a_k g_k`` whose
coefficients come from sums too (``n_k g_k`` and ``n_k`` for FedAvg;
``n_k g_k/a_k``, ``n_k`` and ``n_k a_k`` for FedNova): aggregators declaring
``linear`` capabilities. The payloads must be dense vectors over the same
coordinates for every client, so that their sum decodes to the sum of the
decoded updates: compressors declaring ``linear`` (identity, fp16,
bf16). Top-k and rand-k (per-client supports), sign and QSGD (a per-client
scale) and every nonlinear aggregator are refused with one line. In the
in-process engine the flag checks this composition only: nothing is masked,
and the server-side screening (``server.max_norm_ratio``,
``server.clip_norm``) still sees each row, which a deployed SecAgg server
could not. On Flower, :mod:`fedloom.integrations.secagg` runs Flower's SecAgg+
(its scope is stated there), central DP included: the clients clip before
masking, and the server adds the noise to the unmasked sum (:meth:`Privacy.release`),
so the server then sees only the sum of clipped updates.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedloom.capabilities import aggregator_caps, compressor_caps, feedback_caps
from fedloom.config import ConfigError
from fedloom.rng import Purpose, torch_gen

__all__ = ["AdaptiveClip", "Privacy", "check_secure_aggregation", "clip_update",
           "epsilon_central", "epsilon_local", "l2_norm", "make_privacy"]

log = logging.getLogger("fedloom")


def l2_norm(v: torch.Tensor) -> float:
    """``‖v‖₂`` in float64, without overflow or underflow: a float64 vector of
    1e300 entries has its finite norm, a subnormal one its positive norm.
    A vector holding NaN or ±inf has a NaN or infinite norm."""
    n = float(torch.linalg.vector_norm(v, dtype=torch.float64))
    if math.isnan(n) or (math.isfinite(n) and n > 1e-150):
        return n
    # Squares that overflowed (inf) or may have underflowed: scale by max |v_j| first.
    scale = float(v.detach().abs().max()) if v.numel() else 0.0
    if scale == 0.0 or not math.isfinite(scale):
        return 0.0 if scale == 0.0 else n
    return scale * float(torch.linalg.vector_norm(v.double() / scale))


def clip_update(v: torch.Tensor, bound: float) -> tuple[torch.Tensor, float, bool]:
    """``v · min(1, C/‖v‖₂)``: returns ``(clipped, ‖v‖₂, whether it was scaled)``.

    The result's float64 norm is ``≤ bound`` for every finite input: the factor
    is applied in float64 and the product rounded to ``v``'s dtype, which can
    leave the norm a few ulps above the bound; it is then shrunk by a few ulps
    until it is not. ``v`` itself is not changed.
    """
    n = l2_norm(v)
    if not n > bound:  # also a NaN norm: the engine rejects non-finite rows before
        return v, n, False
    # v / max|v_j| first: its norm is in [1, √d] even where ‖v‖ itself overflows float64.
    u = v.double() / float(v.detach().abs().max())
    out = (u * (bound / float(torch.linalg.vector_norm(u)))).to(v.dtype)
    shrink = 1.0 - 4.0 * torch.finfo(v.dtype).eps
    while l2_norm(out) > bound:
        out = (out.double() * shrink).to(v.dtype)
    return out, n, True


# ------------------------------------------------------------------ accountant
def _accounting() -> Any:
    try:
        import dp_accounting
    except ImportError:  # pragma: no cover (the privacy extra is in dev)
        raise ConfigError("privacy.mode: the accountant needs dp-accounting "
                          "(pip install 'fedloom[privacy]')") from None
    return dp_accounting


@functools.lru_cache(maxsize=16)
def _round_rdp(num_clients: int, cohort: int, sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """RDP orders and the RDP of one round (sampled without replacement), as the
    library computes them for one composed event (~2 s: its orders 512 and 1024)."""
    dpa = _accounting()
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    acc = rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    event = (dpa.GaussianDpEvent(sigma) if cohort >= num_clients else
             dpa.SampledWithoutReplacementDpEvent(num_clients, cohort,
                                                  dpa.GaussianDpEvent(sigma)))
    acc.compose(event)
    # The library keeps the composed RDP in _rdp and adds `count * rdp(event)` for
    # a SelfComposedDpEvent: T · this vector is what it computes for T rounds
    # (tests/test_privacy.py checks ε against its own get_epsilon).
    return np.asarray(acc._orders, dtype=float), np.asarray(acc._rdp, dtype=float)


def epsilon_central(rounds: int, *, num_clients: int, cohort: int, noise_multiplier: float,
                    delta: float) -> float:
    """ε at ``delta`` after ``rounds`` rounds of the central mechanism: the RDP
    accountant of dp-accounting, replace-one relation, ``rounds`` self-composed
    ``SampledWithoutReplacementDpEvent(num_clients, cohort, GaussianDpEvent(z/2))``
    (module docstring)."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    orders, per_round = _round_rdp(num_clients, cohort, noise_multiplier / 2)
    return float(rdp.compute_epsilon(orders, rounds * per_round, delta)[0])


def epsilon_local(participations: int, *, noise_multiplier: float, delta: float) -> float:
    """ε at ``delta`` of one client's messages in local mode after it took part
    ``participations`` times: ``GaussianDpEvent(z/2)`` self-composed (RDP)."""
    if participations <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    dpa = _accounting()
    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(noise_multiplier / 2),
                                        participations))
    return float(acc.get_epsilon(delta))


# ------------------------------------------------------------------ mechanism
@dataclass(frozen=True)
class AdaptiveClip:
    """Andrew et al. 2021: target quantile ``γ``, step ``η_C``, count noise ``σ_b``."""

    target_quantile: float = 0.5
    lr: float = 0.2
    count_stddev: float = 0.5


class Privacy:
    """The DP mechanism of a run (module docstring). ``mode="none"`` does nothing."""

    def __init__(self, mode: str, *, clip: float, noise_multiplier: float, delta: float,
                 cohort_size: int, num_clients: int, seed: int,
                 target_epsilon: float | None = None,
                 adaptive: AdaptiveClip | None = None) -> None:
        if mode not in ("none", "central", "local"):
            raise ConfigError(f"privacy.mode: must be none, central or local, got {mode!r}")
        if mode == "local" and adaptive is not None:
            raise ConfigError("privacy.adaptive_clip.enabled: adaptive clipping is central-mode "
                              "only (the clipped count is a server-side release)")
        self.mode, self.clip, self.z, self.delta = mode, float(clip), float(noise_multiplier), delta
        self.cohort_size, self.num_clients, self.seed = cohort_size, num_clients, seed
        self.target_epsilon, self.adaptive = target_epsilon, adaptive
        self.sigma = self.z
        if adaptive is not None and self.z > 0:
            if not 2 * adaptive.count_stddev > self.z:
                raise ConfigError(
                    f"privacy.adaptive_clip.count_stddev: must be > noise_multiplier/2 "
                    f"({self.z / 2:g}) for the update's noise to be finite, got "
                    f"{adaptive.count_stddev:g}")
            # Andrew et al., Theorem 1: the update and the count together cost z.
            self.sigma = (self.z ** -2 - (2 * adaptive.count_stddev) ** -2) ** -0.5

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def central(self) -> bool:
        return self.mode == "central"

    @property
    def local(self) -> bool:
        return self.mode == "local"

    def init(self) -> dict[str, Any]:
        """The mechanism's state before round 1."""
        if self.central:
            return {"clip": self.clip}
        if self.local:
            return {"participation": torch.zeros(self.num_clients, dtype=torch.int64)}
        return {}

    def checked_state(self, state: Any) -> dict[str, Any]:
        """``state`` from a checkpoint, checked against this mechanism (a
        ``ValueError`` naming the field otherwise)."""
        if not isinstance(state, dict):
            raise ValueError(f"privacy_state: a {type(state).__name__}, not a mapping")
        if self.central:
            c = state.get("clip")
            if not (isinstance(c, float) and math.isfinite(c) and c > 0):
                raise ValueError(f"privacy_state: clip {c!r} is not a positive number")
        if self.local:
            p = state.get("participation")
            if not (isinstance(p, torch.Tensor) and p.dtype == torch.int64
                    and tuple(p.shape) == (self.num_clients,) and bool((p >= 0).all())):
                raise ValueError("privacy_state: participation is not a count per client")
        return state

    # -------------------------------------------------------------- accounting
    def epsilon(self, state: dict[str, Any], rounds: int) -> float:
        """ε spent after ``rounds`` rounds with ``state`` (the state after them)."""
        if self.central:
            return epsilon_central(rounds, num_clients=self.num_clients,
                                   cohort=self.cohort_size, noise_multiplier=self.z,
                                   delta=self.delta)
        if self.local:
            part = state["participation"]
            return epsilon_local(int(part.max()) if part.numel() else 0,
                                 noise_multiplier=self.z, delta=self.delta)
        return 0.0

    def next_epsilon(self, state: dict[str, Any], rounds: int) -> float:
        """ε after one more round (local: a client that took part most so far
        takes part again, the worst case)."""
        if self.local:
            part = state["participation"]
            return epsilon_local((int(part.max()) if part.numel() else 0) + 1,
                                 noise_multiplier=self.z, delta=self.delta)
        return self.epsilon(state, rounds + 1)

    def stop_reason(self, state: dict[str, Any], rounds: int) -> str | None:
        """Why round ``rounds + 1`` must not run (``privacy.target_epsilon``), or None."""
        if not self.enabled or self.target_epsilon is None:
            return None
        nxt = self.next_epsilon(state, rounds)
        if nxt > self.target_epsilon:
            return (f"privacy.target_epsilon={self.target_epsilon:g} reached: round "
                    f"{rounds + 1} would spend epsilon={nxt:.4g} at delta={self.delta:g} "
                    f"(spent {self.epsilon(state, rounds):.4g} in {rounds} rounds)")
        return None

    # -------------------------------------------------------------- local mode
    def privatize(self, u: torch.Tensor, round: int, client: int) -> tuple[torch.Tensor, bool]:
        """Local mode: ``clip(u, C) + N(0, z²C² I)`` from ``(seed, round, client,
        "dp-noise")``; returns the noisy update and whether it was clipped."""
        v, _, clipped = clip_update(u, self.clip)
        gen = torch_gen(self.seed, round, client, Purpose.DP_NOISE)
        # Drawn on the CPU (the derived generator), so every device gets the same bits.
        noise = torch.randn(v.numel(), generator=gen, dtype=torch.float64).to(v.device)
        out = (v.double().reshape(-1) + (self.z * self.clip) * noise).to(u.dtype)
        return out.reshape(u.shape), clipped

    def participated(self, state: dict[str, Any], clients: torch.Tensor) -> dict[str, Any]:
        """Local mode: the state after ``clients`` sent a message this round."""
        part = state["participation"].clone()
        part[clients.long()] += 1
        return {**state, "participation": part}

    # ------------------------------------------------------------ central mode
    def release(self, total: torch.Tensor, state: dict[str, Any], round: int) -> torch.Tensor:
        """Central mode: ``(total + N(0, σ_Δ² C_t² I)) / m̄`` in float64, for ``total``
        the sum of the clipped updates (here, or a secure-aggregation sum)."""
        gen = torch_gen(self.seed, round, -1, Purpose.DP_NOISE)
        noise = torch.randn(total.numel(), generator=gen, dtype=torch.float64)
        scale = self.sigma * float(state["clip"])
        return (total.double() + scale * noise.to(total.device)) / self.cohort_size

    def aggregate(self, rows: torch.Tensor, ok: torch.Tensor, state: dict[str, Any],
                  round: int) -> tuple[torch.Tensor, dict[str, Any], dict[str, float]]:
        """Central mode: clip the accepted ``rows`` (in place) to ``C_t``, sum,
        add ``N(0, σ_Δ² C_t² I)``, divide by ``m̄``; returns ``(Δ_t, new state,
        metrics)``. ``ok`` marks the accepted rows; the others add nothing."""
        c = float(state["clip"])
        d = rows.shape[1]
        total = torch.zeros(d, dtype=torch.float64, device=rows.device)
        clipped = below = 0
        for i in ok.nonzero().flatten().tolist():
            v, n, scaled = clip_update(rows[i], c)
            if scaled:
                rows[i] = v
                clipped += 1
            below += int(n <= c)
            total += rows[i].double()
        agg = self.release(total, state, round).to(rows.dtype)
        metrics = {"dp_clip": c, "dp_clipped": float(clipped)}
        new_state = dict(state)
        if self.adaptive is not None:
            a = self.adaptive
            g = torch_gen(self.seed, round, -1, Purpose.DP_COUNT)
            noisy = (below + a.count_stddev * float(torch.randn(1, generator=g,
                                                                dtype=torch.float64)))
            # Clamped to [0, 1] as TF Privacy's QuantileEstimatorQuery (post-processing).
            frac = min(1.0, max(0.0, noisy / self.cohort_size))
            new_state["clip"] = c * math.exp(-a.lr * (frac - a.target_quantile))
            metrics["dp_unclipped_fraction"] = frac
        return agg, new_state, metrics


def make_privacy(cfg: Any, num_clients: int) -> Privacy:
    """The mechanism of a :class:`~fedloom.config.Config` (``cfg.privacy``)."""
    p = cfg.privacy
    a = p.adaptive_clip
    adaptive = None
    if p.mode != "none" and a.enabled:
        sd = a.count_stddev if a.count_stddev is not None else cfg.cohort.size / 20
        adaptive = AdaptiveClip(a.target_quantile, a.lr, sd)
    return Privacy(p.mode, clip=p.clip, noise_multiplier=p.noise_multiplier, delta=p.delta,
                   cohort_size=cfg.cohort.size, num_clients=num_clients, seed=cfg.seed,
                   target_epsilon=p.target_epsilon, adaptive=adaptive)


# ----------------------------------------------------------------- composition
def check_privacy(privacy: Privacy, *, aggregator: Any, aggregator_name: str, feedback: Any,
                  feedback_name: str, method: Any, method_name: str, w: torch.Tensor) -> None:
    """Refuse, with one line naming the field, what the mechanism cannot cover
    (module docstring). Reads the components' declared capabilities only."""
    if not privacy.enabled:
        return
    mode = privacy.mode
    if method.init_server(w):
        raise ConfigError(f"client.method.name: {method_name} keeps server state built from the "
                          f"clients' unnoised updates; not covered by privacy.mode={mode}")
    agg, fb = aggregator_caps(aggregator), feedback_caps(feedback)
    if fb.schedule == "theory":
        raise ConfigError("compression.feedback.options.alpha_schedule: theory sends unnoised "
                          f"smoothness probes; not covered by privacy.mode={mode}")
    if fb.schedule == "residual":
        raise ConfigError("compression.feedback.options.alpha_schedule: residual sends "
                          f"unnoised update and residual norms; not covered by privacy.mode={mode}")
    if privacy.central:
        if not (agg.linear and agg.dp_mean):
            raise ConfigError(
                f"aggregator.name: {aggregator_name} is not the plain mean of the client updates "
                "under unit weights, so DP-FedAvg's sensitivity does not hold for it "
                "(privacy.mode=central takes fedavg; local mode composes with any rule)")
        if not fb.row_only:
            raise ConfigError(
                f"compression.feedback.name: {feedback_name} keeps or broadcasts server state "
                "built from the clients' unnoised messages; not covered by privacy.mode=central")
        if agg.weighted:
            log.info("privacy.mode=central: each client counts once (DP-FedAvg with unit "
                     "weights); fedavg's sample-count weighting is not applied")
    elif "start_losses" in agg.requires:
        raise ConfigError(f"aggregator.name: {aggregator_name} reads each client's unnoised "
                          "loss; not covered by privacy.mode=local")


def check_secure_aggregation(*, aggregator: Any, aggregator_name: str, compressor: Any,
                             compressor_name: str) -> None:
    """``server.secure_aggregation``: refuse what a sum-only server cannot compute."""
    if not aggregator_caps(aggregator).linear:
        raise ConfigError(f"aggregator.name: {aggregator_name} is not a sum of the client "
                          "updates; server.secure_aggregation needs a linear rule (fedavg, "
                          "fednova)")
    if not compressor_caps(compressor).linear:
        raise ConfigError(f"compression.name: {compressor_name} payloads do not add up to the "
                          "sum of the updates; server.secure_aggregation needs a dense one "
                          "(identity, fp16, bf16)")
