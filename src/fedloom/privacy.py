"""Client-level differential privacy: DP-FedAvg (central) and local Gaussian noise.

Central (``privacy.mode: central``): McMahan, Ramage, Talwar & Zhang, "Learning
Differentially Private Recurrent Language Models" (ICLR 2018), Algorithm 1 with
unit client weights and the fixed denominator ``m̄ = cohort.size``::

    Δ_t = (Σ_{k accepted} u_k · min(1, C_t/‖u_k‖₂) + ξ_t) / m̄,  ξ_t ~ N(0, σ_Δ² C_t² I_d)

for ``fedavg`` only (``linear`` and ``dp_mean`` capabilities). Adaptive clipping:
Andrew, Thakkar, McMahan & Ramaswamy (NeurIPS 2021), the geometric update
``C_{t+1} = C_t · exp(−η_C (b̃_t − γ))`` with ``σ_Δ`` raised by their Theorem 1.
Local (``privacy.mode: local``): each client clips to ``C`` and adds
``N(0, z² C² I_d)`` before its feedback policy and compressor. ε comes from
``dp-accounting``'s RDP accountant: ``SampledWithoutReplacementDpEvent(N, m̄,
GaussianDpEvent(z/2))`` per round (replace-one relation; central), or
``GaussianDpEvent(z/2)`` composed over a client's rounds (local).

Public code checked: TF Privacy's ``QuantileEstimatorQuery`` (the same count,
denominator, clamp and update); Flower 1.42's noise std ``z·C/m`` and adaptive
``σ_Δ`` equal ours to 1e-15 (tests/test_privacy.py). Departures from Flower's
adaptive strategy: the count is of unclipped updates (as the paper), and the
noise is scaled to ``C_t``, not ``C_{t+1}``.

Assumptions, what is and is not private, composition with compression and
secure aggregation, and measurements: docs/explanation/methods.md (Privacy in detail).
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
    (docs/explanation/methods.md, Privacy in detail). Reads the components' declared
    capabilities only."""
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
