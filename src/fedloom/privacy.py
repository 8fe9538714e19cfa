"""Client-level differential privacy: DP-FedAvg (central) and local Gaussian noise.

Central (``privacy.mode: central``): McMahan, Ramage, Talwar & Zhang, "Learning
Differentially Private Recurrent Language Models" (ICLR 2018), Algorithm 1 with
unit client weights and the fixed denominator ``m̄ = cohort.size``, or Algorithm 1's
``W = qN`` under ``cohort.sampling: poisson`` (an empty round releases ``ξ_t / m̄``)::

    Δ_t = (Σ_{k accepted} u_k · min(1, C_t/‖u_k‖₂) + ξ_t) / m̄,  ξ_t ~ N(0, σ_Δ² C_t² I_d)

for ``fedavg`` only (``linear`` and ``dp_mean`` capabilities). Adaptive clipping:
Andrew, Thakkar, McMahan & Ramaswamy (NeurIPS 2021), the geometric update
``C_{t+1} = C_t · exp(−η_C (b̃_t − γ))`` with ``σ_Δ`` raised by their Theorem 1.
Local (``privacy.mode: local``): each client clips to ``C`` and adds
``N(0, z² C² I_d)`` before its feedback policy and compressor. ε: :mod:`fedloom.accounting`
(``privacy.accountant``, ``privacy.neighbours``) at ``q = m̄/N`` (central; fixed-size
or Poisson sampling) or ``Gaussian(z/2)`` over a client's rounds (local); ``noise_multiplier:
auto`` solves z for ``target_epsilon`` (:func:`resolve_noise`).

Public code checked: TF Privacy's ``QuantileEstimatorQuery`` (the same count,
denominator, clamp and update); Flower 1.42's noise std ``z·C/m`` and adaptive
``σ_Δ`` equal ours to 1e-15 (tests/test_privacy.py). Departures from Flower's
adaptive strategy: the count is of unclipped updates (as the paper), and the
noise is scaled to ``C_t``, not ``C_{t+1}``. Assumptions, what is and is not private,
composition with compression and secure aggregation, measurements:
docs/explanation/methods.md (Privacy in detail), docs/howto/privacy.md.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from fedloom.accounting import Accountant
from fedloom.capabilities import aggregator_caps, compressor_caps, feedback_caps
from fedloom.config import ConfigError
from fedloom.ftrl import Correlated, make_correlated
from fedloom.rng import Purpose, torch_gen

__all__ = ["Accounting", "AdaptiveClip", "Privacy", "check_secure_aggregation", "clip_update",
           "epsilon_central", "epsilon_local", "l2_norm", "make_privacy", "poisson_rate",
           "resolve_noise", "solve_noise"]

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
def _accountant(kind: str, sampling: str, neighbours: str, *, used: bool = True) -> Accountant:
    """The accountant, its names checked; ``used``: its library is checked too (a run
    without privacy needs neither dp-accounting nor prv-accountant)."""
    try:
        acc = Accountant(kind, sampling, neighbours)
    except ValueError as e:
        raise ConfigError(f"privacy.accountant: {e}") from None
    try:
        if used:
            import dp_accounting  # noqa: F401
            if kind == "prv":
                import prv_accountant  # noqa: F401
    except ImportError as e:  # pragma: no cover (the privacy extra)
        raise ConfigError(f"privacy.accountant: {kind} needs {e.name} "
                          "(pip install 'fedloom[privacy]')") from None
    return acc


def epsilon_central(rounds: int, *, num_clients: int, cohort: int, noise_multiplier: float,
                    delta: float, accountant: str = "pld",
                    neighbours: str = "add_remove") -> float:
    """ε at ``delta`` after ``rounds`` rounds of the central mechanism, ``cohort`` of
    ``num_clients`` drawn without replacement each round (fedloom's sampler):
    :class:`fedloom.accounting.Accountant` ``(accountant, "fixed", neighbours)`` at
    ``q = cohort/num_clients``. Earlier versions reported ``accountant="rdp",
    neighbours="replace_one"`` (dp-accounting's SampledWithoutReplacementDpEvent)."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    acc = _accountant(accountant, "fixed", neighbours)
    return acc.epsilon(min(1.0, cohort / num_clients), noise_multiplier, rounds, delta)


def epsilon_local(participations: int, *, noise_multiplier: float, delta: float,
                  accountant: str = "pld") -> float:
    """ε at ``delta`` of one client's messages in local mode after it took part
    ``participations`` times: ``Gaussian(z/2)`` composed (any two inputs of a client
    are neighbours: the clipped update moves by up to 2C), by ``accountant``."""
    if participations <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    acc = _accountant(accountant, "poisson", "add_remove")
    return acc.epsilon(1.0, noise_multiplier / 2, participations, delta)


# ------------------------------------------------------------------ mechanism
@dataclass(frozen=True)
class AdaptiveClip:
    """Andrew et al. 2021: target quantile ``γ``, step ``η_C``, count noise ``σ_b``."""

    target_quantile: float = 0.5
    lr: float = 0.2
    count_stddev: float = 0.5


@dataclass(frozen=True)
class Accounting:
    """How ε is accounted: ``kind`` (rdp | pld | prv), ``neighbours`` (add_remove |
    replace_one), and the deployment accounted for (pfl's ``noise_scale``): ``cohort``
    clients of ``population`` a round (None: the run's own). The noise of the sum is
    then scaled by ``m̄/cohort``, so the mean carries the deployment's noise
    ``z·C/cohort`` and ε is that of rate ``cohort/population``. ``poisson_rate``: the
    cohort is Poisson-sampled at this q (``cohort.sampling: poisson``; None: fixed-size)."""

    kind: str = "pld"
    neighbours: str = "add_remove"
    population: int | None = None
    cohort: int | None = None
    poisson_rate: float | None = None

    @property
    def sampling(self) -> str:
        """The accountant's sampling: ``poisson`` or ``fixed``."""
        return "fixed" if self.poisson_rate is None else "poisson"


class Privacy:
    """The DP mechanism of a run (module docstring). ``mode="none"`` does nothing."""

    def __init__(self, mode: str, *, clip: float, noise_multiplier: float, delta: float,
                 cohort_size: float, num_clients: int, seed: int,
                 target_epsilon: float | None = None,
                 adaptive: AdaptiveClip | None = None,
                 accounting: Accounting = Accounting(),
                 correlated: Correlated | None = None) -> None:
        if mode not in ("none", "central", "local"):
            raise ConfigError(f"privacy.mode: must be none, central or local, got {mode!r}")
        if mode == "local" and adaptive is not None:
            raise ConfigError("privacy.adaptive_clip.enabled: adaptive clipping is central-mode "
                              "only (the clipped count is a server-side release)")
        self.mode, self.clip, self.z, self.delta = mode, float(clip), float(noise_multiplier), delta
        self.cohort_size, self.num_clients, self.seed = cohort_size, num_clients, seed
        self.target_epsilon, self.adaptive = target_epsilon, adaptive
        self.accounting = accounting
        # privacy.mechanism tree | bandmf: noise correlated across rounds (fedloom.ftrl)
        self.correlated = correlated
        # fixed: a cohort of m̄ drawn without replacement; poisson: m̄ = qN, expected
        self.accountant = _accountant(accounting.kind, accounting.sampling,
                                      accounting.neighbours, used=mode != "none")
        self.rate, self.noise_scale = _rate(mode, cohort_size, num_clients, accounting)
        self.sigma = self.z
        if adaptive is not None and self.z > 0:
            if not 2 * adaptive.count_stddev > self.z:
                raise ConfigError(
                    f"privacy.adaptive_clip.count_stddev: must be > noise_multiplier/2 "
                    f"({self.z / 2:g}) for the update's noise to be finite, got "
                    f"{adaptive.count_stddev:g}")
            # Andrew et al., Theorem 1: the update and the count together cost z.
            self.sigma = (self.z ** -2 - (2 * adaptive.count_stddev) ** -2) ** -0.5

    def record(self) -> dict[str, Any]:
        """What the ε reported is of, for the run's summary."""
        if self.local:
            return {"accountant": self.accounting.kind, "unit": "a client's messages",
                    "neighbours": "any two inputs of a client (Gaussian, sensitivity 2C)",
                    "composition": "the most rounds one client took part in"}
        poisson = self.accounting.poisson_rate is not None
        out: dict[str, Any] = {
            "accountant": self.accounting.kind, "neighbours": self.accounting.neighbours,
            "sampling": "poisson" if poisson else "fixed-size, without replacement",
            "rate": self.rate}
        if poisson:  # DP-FedAvg's fixed denominator: the expected cohort qN
            out["denominator"] = self.cohort_size
        if self.correlated is not None:
            out.update(self.correlated.record(self.correlated.rounds))
        if self.accounting.population is not None or self.accounting.cohort is not None:
            # a deployment accounted for: its population and cohort, the noise's scale
            out.update(population=self.accounting.population or self.num_clients,
                       cohort=self.accounting.cohort or self.cohort_size,
                       noise_scale=self.noise_scale)
        return out

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def central(self) -> bool:
        return self.mode == "central"

    @property
    def local(self) -> bool:
        return self.mode == "local"

    @property
    def groups(self) -> int:
        """The participation groups the sampler draws from (``privacy.ftrl.groups``)."""
        return self.correlated.groups if self.correlated is not None else 1

    def init(self) -> dict[str, Any]:
        """The mechanism's state before round 1."""
        if self.central:
            return {"clip": self.clip, **(self.correlated.init() if self.correlated else {})}
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
            if self.correlated is not None:
                self.correlated.check(state)
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
            return self._central_epsilon(rounds)
        if self.local:
            part = state["participation"]
            return epsilon_local(int(part.max()) if part.numel() else 0,
                                 noise_multiplier=self.z, delta=self.delta,
                                 accountant=self.accounting.kind)
        return 0.0

    def _central_epsilon(self, rounds: int) -> float:
        if rounds <= 0:
            return 0.0
        if self.z <= 0:
            return math.inf
        if self.correlated is not None:
            return self.correlated.epsilon(rounds, self.z, self.delta, self.accounting.kind)
        return self.accountant.epsilon(self.rate, self.z, rounds, self.delta)

    def planned_epsilon(self, rounds: int) -> float:
        """ε after ``rounds`` rounds, before any ran (local: a client in every one)."""
        if self.local:
            return epsilon_local(rounds, noise_multiplier=self.z, delta=self.delta,
                                 accountant=self.accounting.kind)
        return self._central_epsilon(rounds) if self.central else 0.0

    def next_epsilon(self, state: dict[str, Any], rounds: int) -> float:
        """ε after one more round (local: a client that took part most so far
        takes part again, the worst case)."""
        if self.local:
            part = state["participation"]
            return epsilon_local((int(part.max()) if part.numel() else 0) + 1,
                                 noise_multiplier=self.z, delta=self.delta,
                                 accountant=self.accounting.kind)
        return self.epsilon(state, rounds + 1)

    def stop_reason(self, state: dict[str, Any], rounds: int,
                    planned: int | None = None) -> str | None:
        """Why round ``rounds + 1`` must not run (``privacy.target_epsilon``), or None.
        ``planned``: the run's rounds; the last round within the target (local: the
        most participations) is then found once (:func:`_affordable`), not by a new ε
        every round."""
        if not self.enabled or self.target_epsilon is None:
            return None
        if planned is not None:
            spent = rounds if self.central else _most(state)
            if spent < _affordable(self, planned):
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
    def release(self, total: torch.Tensor, state: dict[str, Any], round: int,
                new_state: dict[str, Any] | None = None) -> torch.Tensor:
        """Central mode: ``(total + N(0, σ_Δ² C_t² I)) / m̄`` in float64, for ``total``
        the sum of the clipped updates (here, or a secure-aggregation sum); under
        ``privacy.mechanism`` tree | bandmf the noise is DP-FTRL's, its state put in
        ``new_state``."""
        d = total.numel()
        if self.correlated is None:
            noise = _unit_noise_of(self.seed, d, round)
        else:
            if new_state is None:
                raise ValueError("privacy.mechanism: the correlated noise needs its state")
            noise, step = self.correlated.noise(
                state, round, d, lambda t: _unit_noise_of(self.seed, d, t))
            new_state.update(step)
        # noise_scale: the deployment's noise on the mean (Accounting)
        scale = self.sigma * float(state["clip"]) * self.noise_scale
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
        new_state = dict(state)
        agg = self.release(total, state, round, new_state).to(rows.dtype)
        metrics = {"dp_clip": c, "dp_clipped": float(clipped)}
        if self.adaptive is not None:
            a = self.adaptive
            g = torch_gen(self.seed, round, -1, Purpose.DP_COUNT)
            noisy = (below + a.count_stddev * self.noise_scale
                     * float(torch.randn(1, generator=g, dtype=torch.float64)))
            # Clamped to [0, 1] as TF Privacy's QuantileEstimatorQuery (post-processing).
            frac = min(1.0, max(0.0, noisy / self.cohort_size))
            new_state["clip"] = c * math.exp(-a.lr * (frac - a.target_quantile))
            metrics["dp_unclipped_fraction"] = frac
        return agg, new_state, metrics


def _unit_noise_of(seed: int, d: int, round: int) -> torch.Tensor:
    """Round ``round``'s ``N(0, I_d)`` from ``(seed, round, -1, "dp-noise")``."""
    gen = torch_gen(seed, round, -1, Purpose.DP_NOISE)
    return torch.randn(d, generator=gen, dtype=torch.float64)


@functools.lru_cache(maxsize=16)
def _affordable(privacy: Privacy, planned: int) -> int:
    """The largest ``T ≤ planned`` with ``ε(T) ≤ target_epsilon``, ``T`` the rounds
    (central) or a client's participations (local: :meth:`Privacy.planned_epsilon`).
    ε grows with ``T`` (``T+1`` releases post-process to ``T``, and the accountants'
    bounds compose so), so bisection on ``[0, planned]`` finds the ``T`` before the first
    one over the target, which a check of every round finds, from ``ε(planned)`` and
    about ``log2(planned)`` others (a PLD over 2,000 rounds costs seconds) instead of
    one a round; the same points from any round, so a resumed run stops where the
    uninterrupted one does."""
    target = privacy.target_epsilon
    assert target is not None
    if privacy.planned_epsilon(planned) <= target:
        return planned
    lo, hi = 0, planned  # ε(lo) ≤ target < ε(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if privacy.planned_epsilon(mid) <= target else (lo, mid)
    return lo


def _most(state: dict[str, Any]) -> int:
    """Local mode: the most messages one client has sent."""
    part = state["participation"]
    return int(part.max()) if part.numel() else 0


def _rate(mode: str, cohort_size: float, num_clients: int,
          accounting: Accounting) -> tuple[float, float]:
    """The sampling rate accounted for and the scale of the simulated noise (1, or
    ``m̄/accounting.cohort``: pfl's noise_scale); Poisson's q itself where no
    deployment is accounted for."""
    if mode == "local":
        if accounting.population is not None or accounting.cohort is not None:
            raise ConfigError("privacy.accounting_cohort: central mode only (a client's "
                              "local noise is its own, whatever the cohort)")
        return 1.0, 1.0
    if (accounting.poisson_rate is not None and accounting.population is None
            and accounting.cohort is None):
        return accounting.poisson_rate, 1.0
    population = accounting.population or num_clients
    cohort = accounting.cohort or cohort_size
    if cohort < cohort_size:
        raise ConfigError(f"privacy.accounting_cohort: must be >= cohort.size ({cohort_size}), "
                          f"the simulated cohort, got {cohort}")
    if population < cohort:
        raise ConfigError(f"privacy.accounting_population: must be >= the cohort accounted "
                          f"for ({cohort}), got {population}")
    return min(1.0, cohort / population), cohort_size / cohort


def poisson_rate(cohort: Any, num_clients: int) -> float | None:
    """The ``cohort`` section's Poisson rate q over ``num_clients`` clients: ``cohort.rate``,
    else ``cohort.size / num_clients`` (at most 1); None under ``sampling: fixed``."""
    if cohort.sampling != "poisson":
        return None
    return float(cohort.rate) if cohort.rate is not None else min(1.0, cohort.size / num_clients)


def _accounting_of(cfg: Any, num_clients: int) -> Accounting:
    p = cfg.privacy
    return Accounting(p.accountant, p.neighbours, p.accounting_population, p.accounting_cohort,
                      poisson_rate(cfg.cohort, num_clients))


def _denominator(cfg: Any, num_clients: int) -> float:
    """DP-FedAvg's fixed denominator m̄: ``cohort.size``, or the expected cohort ``qN``
    under Poisson sampling (McMahan et al. 2018, Algorithm 1)."""
    q = poisson_rate(cfg.cohort, num_clients)
    groups = cfg.privacy.ftrl.groups if cfg.privacy.mechanism != "dp_fedavg" else 1
    return cfg.cohort.size if q is None else q * num_clients / groups


def solve_noise(cfg: Any, num_clients: int) -> float:
    """``privacy.noise_multiplier: auto``: the z for which ``cfg.rounds`` rounds spend
    at most ``privacy.target_epsilon`` at ``privacy.delta`` (central: the run's rate;
    local: a client in every round), by :meth:`fedloom.accounting.Accountant.noise`."""
    p = cfg.privacy
    if p.target_epsilon is None:
        raise ConfigError("privacy.noise_multiplier: auto solves for privacy.target_epsilon; "
                          "give it, or a number")
    acct = _accounting_of(cfg, num_clients)
    rate, _ = _rate(p.mode, _denominator(cfg, num_clients), num_clients, acct)
    try:
        if p.mode == "local":  # Gaussian(z/2), composed over the rounds
            z = 2 * _accountant(acct.kind, "poisson", "add_remove").noise(
                1.0, cfg.rounds, p.target_epsilon, p.delta)
        else:
            ftrl = make_correlated(cfg, num_clients)
            z = (ftrl.solve(cfg.rounds, p.target_epsilon, p.delta, acct.kind) if ftrl else
                 _accountant(acct.kind, acct.sampling, acct.neighbours).noise(
                     rate, cfg.rounds, p.target_epsilon, p.delta))
    except ValueError as e:
        raise ConfigError(f"privacy.target_epsilon: {e}") from None
    log.info("privacy.noise_multiplier: auto -> %.6g for epsilon <= %g at delta=%g over %d "
             "rounds (%s, %s, rate %.4g)", z, p.target_epsilon, p.delta, cfg.rounds,
             acct.kind, acct.neighbours if p.mode == "central" else "local", rate)
    return z


def resolve_noise(cfg: Any) -> Any:
    """``cfg`` with ``privacy.noise_multiplier: auto`` solved (:func:`solve_noise`, for
    ``data.num_clients`` clients or ``privacy.accounting_population``) and
    ``privacy.max_epsilon`` set to the target where not given: the run directory's
    config.yaml holds the number, and a run on data of fewer clients, whose ε would
    be over the target, refuses to start (:func:`make_privacy`)."""
    p = cfg.privacy
    if p.mode == "none" or p.noise_multiplier != "auto":
        return cfg
    z = solve_noise(cfg, cfg.data.num_clients)
    cap = p.max_epsilon if p.max_epsilon is not None else p.target_epsilon
    return dataclasses.replace(cfg, privacy=dataclasses.replace(
        p, noise_multiplier=z, max_epsilon=cap))


def make_privacy(cfg: Any, num_clients: int) -> Privacy:
    """The mechanism of a :class:`~fedloom.config.Config` (``cfg.privacy``); with
    ``privacy.max_epsilon``, refuses in one line a run whose ``cfg.rounds`` rounds
    would spend more."""
    p = cfg.privacy
    a = p.adaptive_clip
    acct = _accounting_of(cfg, num_clients)
    z = p.noise_multiplier
    if z == "auto":  # a config not resolved by fedloom.engine.build
        z = solve_noise(cfg, num_clients) if p.mode != "none" else 0.0
    adaptive = None
    if p.mode != "none" and a.enabled:
        # the deployment's count noise (σ_b = its cohort / 20), scaled as the update's
        sd = (a.count_stddev if a.count_stddev is not None
              else (acct.cohort or _denominator(cfg, num_clients)) / 20)
        adaptive = AdaptiveClip(a.target_quantile, a.lr, sd)
    priv = Privacy(p.mode, clip=p.clip, noise_multiplier=z, delta=p.delta,
                   cohort_size=_denominator(cfg, num_clients), num_clients=num_clients,
                   seed=cfg.seed,
                   target_epsilon=p.target_epsilon, adaptive=adaptive, accounting=acct,
                   correlated=make_correlated(cfg, num_clients))
    if p.max_epsilon is not None and priv.enabled:
        planned = priv.planned_epsilon(cfg.rounds)
        if planned > p.max_epsilon:
            raise ConfigError(
                f"privacy.max_epsilon: {cfg.rounds} rounds would spend epsilon={planned:.4g} "
                f"at delta={p.delta:g} ({acct.kind}, rate {priv.rate:.4g} of "
                f"{acct.population or num_clients} "
                f"clients), over {p.max_epsilon:g}: raise the noise or run fewer rounds")
    return priv


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
