"""DP-FTRL: noise correlated across rounds, by a binary tree or a banded matrix.

The server releases, each round t (0-based), ``g̃_t = x_t + σC·w_t`` for ``x_t`` the
sum of the clipped updates: DP-FedAvg draws ``w_t ~ N(0, I)`` afresh; here the
noise is ``w = C⁻¹z`` for a lower-triangular ``C`` (the matrix mechanism: the
prefix sums ``A g̃ = B(Cx + z)`` with ``B = AC⁻¹``), so the server optimizer after
it (sgd: FTRL on the prefix sums; momentum: the paper's FTRLM) post-processes
``Cx + z``. ``tree`` (Kairouz, McMahan, Song, Thakkar, Thakurta & Xu, ICML 2021):
the plain binary tree over each segment of ``restart_every`` rounds, ``w_t =
n_t − n_{t−1}`` with ``n_p`` the sum of the noises of the dyadic nodes that make
up [1, p]; not Honaker's estimator. ``bandmf`` (Choquette-Choo, Ganesh, McKenna,
McMahan, Rush, Thakurta & Xu, NeurIPS 2023): ``C`` b-banded, ``CᵀC = X*`` the
minimiser of ``tr(AᵀA X⁻¹)`` over ``diag X = 1``, ``X_ij = 0`` for ``|i−j| ≥ b``
(their Eq. 6), ``w_t`` by forward substitution (their Algorithm 9).

Participation: clients split into ``groups`` by ``id mod groups``, round t draws
from group ``t mod groups`` (b-min-separation; the sampler enforces it). Accounting
(add/remove): tree, the Gaussian of sensitivity ``√s·C`` for ``s`` the most node
memberships of one client's rounds (no amplification); bandmf, ``k = ⌈t/groups⌉``
Gaussians, Poisson-sampled at q within the group when ``cohort.sampling: poisson``
(the paper's b-min-separation amplification). Checked against pfl 0.6's
``BandedMatrixFactorizationMechanism`` (tests/test_ftrl_reference.py: X* within
2.4e-4, C⁻¹z 4.1e-7, ε 4e-9). Departure: pfl's C = cholesky(X) has unit rows, ours
unit columns, as jax_privacy's column-normalized banded (read, not run); docs/howto/privacy.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fedloom.accounting import Accountant
from fedloom.config import ConfigError
from fedloom.rng import Purpose, torch_gen

__all__ = ["MECHANISMS", "BandMF", "Correlated", "Tree", "banded_gram", "column_factor",
           "make_correlated", "tree_nodes", "tree_sensitivity2"]

MECHANISMS: tuple[str, ...] = ("dp_fedavg", "tree", "bandmf")
GRAD_TOL = 1e-6     # banded_gram stops when the largest free gradient entry is below this
MAX_ITER = 20_000


# ------------------------------------------------------------------ the matrices
def prefix_gram(n: int) -> np.ndarray:
    """``AᵀA`` for the prefix-sum workload ``A = tril(1)``: ``(AᵀA)_ij = n − max(i, j)``."""
    i = np.arange(n)
    return (n - np.maximum(i[:, None], i[None, :])).astype(np.float64)


def _loss_grad(x: np.ndarray, m: np.ndarray) -> tuple[float, np.ndarray] | None:
    """``tr(M X⁻¹)`` and its gradient ``−X⁻¹MX⁻¹``; None where ``X`` is not positive
    definite (the line search then shortens the step)."""
    try:
        low = np.linalg.cholesky(x)
    except np.linalg.LinAlgError:
        return None
    inv_low = np.linalg.inv(low)  # X⁻¹ = L⁻ᵀL⁻¹
    h = inv_low.T @ (inv_low @ m)  # X⁻¹M
    loss = float(np.trace(h))
    if not math.isfinite(loss):
        return None
    return loss, -(h @ (inv_low.T @ inv_low))


def banded_gram(n: int, bands: int, *, tol: float = GRAD_TOL, max_iter: int = MAX_ITER,
                workload_gram: np.ndarray | None = None) -> np.ndarray:
    """``X* = argmin tr(AᵀA X⁻¹)`` over symmetric positive definite ``X`` with
    ``diag X = 1`` and ``X_ij = 0`` for ``|i − j| ≥ bands`` (Choquette-Choo et al.
    2023, Eq. 6; ``A`` the prefix sums unless ``workload_gram`` gives ``AᵀA``).

    Convex in ``X`` (``X ↦ tr(MX⁻¹)`` is convex on the positive definite cone, strictly
    for ``M ≻ 0``), so the minimiser is unique: L-BFGS (memory 10, Armijo backtracking
    that halves the step until ``X`` stays positive definite and the loss drops) from
    ``I`` on the free entries, until the largest free entry of the gradient ``−X⁻¹MX⁻¹``
    is below ``tol`` (pfl stops at 1e-3). ``O(n³)`` an iteration, a few hundred of
    them (n = 200, b = 8: 200). A ``ValueError`` names a bad argument, or a search
    that did not converge."""
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"n: must be an integer >= 1, got {n!r}")
    if not (isinstance(bands, int) and 1 <= bands):
        raise ValueError(f"bands: must be an integer >= 1, got {bands!r}")
    bands = min(bands, n)
    m = prefix_gram(n) if workload_gram is None else np.asarray(workload_gram, np.float64)
    iu = [(np.arange(n - k), np.arange(k, n)) for k in range(1, bands)]
    if not iu:
        return np.eye(n)

    def unpack(v: np.ndarray) -> np.ndarray:
        x, at = np.eye(n), 0
        for r, c in iu:
            x[r, c] = x[c, r] = v[at:at + len(r)]
            at += len(r)
        return x

    def pack(g: np.ndarray) -> np.ndarray:  # d/dv of a symmetric pair: twice the entry
        return np.concatenate([2 * g[r, c] for r, c in iu])

    v = np.zeros(sum(len(r) for r, _ in iu))
    out = _loss_grad(unpack(v), m)
    assert out is not None  # I is positive definite
    loss, g = out[0], pack(out[1])
    hist: list[tuple[np.ndarray, np.ndarray]] = []
    for _ in range(max_iter):
        if np.abs(g).max() / 2 <= tol:
            return unpack(v)
        d = _direction(g, hist)
        step, new = 1.0, None
        for _ in range(60):
            cand = v + step * d
            got = _loss_grad(unpack(cand), m)
            if got is not None and got[0] <= loss + 1e-4 * step * float(g @ d):
                new = (cand, got[0], pack(got[1]))
                break
            step /= 2
        if new is None:
            break
        s, y = new[0] - v, new[2] - g
        if float(s @ y) > 1e-300:
            hist = [*hist[-9:], (s, y)]
        v, loss, g = new
    if np.abs(g).max() / 2 <= max(tol * 100, 1e-4):  # the line search stalls at precision
        return unpack(v)
    raise ValueError(f"bands: the factorization of {n} rounds did not converge "
                     f"(gradient {np.abs(g).max() / 2:.3g})")


def _direction(g: np.ndarray, hist: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """L-BFGS's two-loop recursion: ``−H g`` for the inverse-Hessian estimate ``H``."""
    q, alphas = g.copy(), []
    for s, y in reversed(hist):
        a = float(s @ q) / float(s @ y)
        alphas.append(a)
        q -= a * y
    if hist:
        s, y = hist[-1]
        q *= float(s @ y) / float(y @ y)
    else:
        q /= max(1.0, float(np.abs(g).max()))
    for (s, y), a in zip(hist, reversed(alphas), strict=True):
        q += (a - float(y @ q) / float(s @ y)) * s
    return -q


def column_factor(x: np.ndarray) -> np.ndarray:
    """The lower-triangular ``C`` with ``CᵀC = X`` and a positive diagonal: ``C = J Lᵀ J``
    for ``L = cholesky(J X J)`` and ``J`` the reversal. Each column's norm is
    ``√X_ii`` (1 for :func:`banded_gram`: a participation moves ``Cx`` by at most the
    clip), and ``C`` is b-banded when ``X`` is (a banded Cholesky has no fill-in).
    pfl takes ``cholesky(X)`` itself, whose rows, not columns, have norm 1."""
    low = np.linalg.cholesky(x[::-1, ::-1])
    return np.ascontiguousarray(low.T[::-1, ::-1])


# ------------------------------------------------------------------ the tree
def tree_nodes(p: int) -> list[tuple[int, int]]:
    """The dyadic nodes ``(level, end)`` whose blocks make up ``[1, p]``: level l
    covers ``2^l`` positions ending at ``end`` (1-based), one per bit of ``p``."""
    out, at = [], 0
    for lev in reversed(range(p.bit_length())):
        if p >> lev & 1:
            at += 1 << lev
            out.append((lev, at))
    return out


@functools.lru_cache(maxsize=4096)
def tree_sensitivity2(rounds: int, groups: int, restart: int | None) -> int:
    """The most ``Σ_nodes c_node²`` over the groups, ``c_node`` the number of a group's
    rounds (``r ≡ g mod groups``, ``r < rounds``) in a node released by then: the
    squared L2 sensitivity (in units of the clip) of the tree's node sums, restarted
    every ``restart`` rounds (None: one tree). One participation: ``⌊log₂ rounds⌋ + 1``."""
    best = 0
    seg_len = restart or rounds
    for g in range(min(groups, rounds)):
        total = 0
        counts: dict[tuple[int, int, int], int] = {}
        for r in range(g, rounds, groups):
            seg, pos = divmod(r, seg_len)
            done = min(seg_len, rounds - seg * seg_len)  # positions released in the segment
            for lev in range(done.bit_length()):
                end = ((pos >> lev) + 1) << lev  # the level-l node holding position pos+1
                if end <= done:
                    key = (seg, lev, end)
                    counts[key] = counts.get(key, 0) + 1
        total = sum(c * c for c in counts.values())
        best = max(best, total)
    return best


class Tree:
    """The tree's noise: node ``(level, end)`` of the segment starting at round ``s0``
    draws ``N(0, I_d)`` from ``(seed, s0 + end − 1, level, "dp-tree")``; round t's
    noise is ``n_p − n_{p−1}`` at position ``p`` of its segment."""

    def __init__(self, seed: int, restart: int | None) -> None:
        self.seed, self.restart = seed, restart

    def position(self, r: int) -> tuple[int, int]:
        """(the segment's first round, round r's 1-based position in it)."""
        if self.restart is None:
            return 0, r + 1
        s0 = r - r % self.restart
        return s0, r - s0 + 1

    def prefix(self, s0: int, p: int, d: int) -> torch.Tensor:
        """``n_p``: the noise on the prefix sum of positions ``1..p`` of the segment."""
        out = torch.zeros(d, dtype=torch.float64)
        for lev, end in tree_nodes(p):
            gen = torch_gen(self.seed, s0 + end - 1, lev, Purpose.DP_TREE)
            out += torch.randn(d, generator=gen, dtype=torch.float64)
        return out


class BandMF:
    """``C`` of ``rounds`` rows with ``bands`` bands (:func:`banded_gram`,
    :func:`column_factor`) and its inverse applied online: ``w_t = (z_t −
    Σ_{j=1}^{b−1} C_{t,t−j} w_{t−j}) / C_{t,t}``."""

    def __init__(self, rounds: int, bands: int) -> None:
        self.rounds, self.bands = rounds, min(bands, rounds)
        self.c = _factor(rounds, self.bands)

    def step(self, r: int, z: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        """``w_r`` from ``z_r`` and ``past`` = ``[w_{r−b+1}, ..., w_{r−1}]`` (rows; fewer at
        the start)."""
        if r >= self.rounds:
            raise ValueError(f"privacy.ftrl: C was built for {self.rounds} rounds; round "
                             f"{r + 1} is past it")
        k = past.shape[0]
        row = torch.from_numpy(self.c[r, r - k:r].copy())
        acc = z - row @ past if k else z
        return acc / float(self.c[r, r])


@functools.lru_cache(maxsize=8)
def _factor(rounds: int, bands: int) -> np.ndarray:
    """C for (rounds, bands), built once a process (a resumed run builds the same)."""
    return column_factor(banded_gram(rounds, bands))


# ------------------------------------------------------------------ the mechanism
class Correlated:
    """The DP-FTRL mechanism of a run (module docstring): its noise state, its noise,
    and its ε. ``kind``: tree | bandmf; ``rate``: the Poisson rate within a group
    (None: every client of the group counts, no amplification)."""

    def __init__(self, kind: str, *, rounds: int, seed: int, groups: int = 1,
                 bands: int | None = None, restart: int | None = None,
                 rate: float | None = None) -> None:
        if kind not in ("tree", "bandmf"):
            raise ValueError(f"privacy.mechanism: tree or bandmf here, got {kind!r}")
        self.kind, self.rounds, self.seed, self.groups = kind, rounds, seed, groups
        self.restart, self.rate = restart, rate
        self.bands = (bands or groups) if kind == "bandmf" else 1
        if self.bands > groups:
            raise ValueError(f"privacy.ftrl.bands: at most privacy.ftrl.groups ({groups}): a "
                             "client's rounds must be at least b apart, got "
                             f"{self.bands}")
        self.tree = Tree(seed, restart) if kind == "tree" else None
        self._band: BandMF | None = None

    @property
    def band(self) -> BandMF:
        """The banded factor, built on first use (O(rounds³) an iteration)."""
        if self._band is None:
            self._band = BandMF(self.rounds, self.bands)
        return self._band

    def init(self) -> dict[str, Any]:
        """The noise state before round 1: the round it continues at and the past
        noise (tree: ``n_{p−1}``; bandmf: the last ``b − 1`` rows ``w``), sized at round 1."""
        return {"ftrl_round": 0, "ftrl_noise": torch.zeros(0, 0, dtype=torch.float64)}

    def check(self, state: dict[str, Any]) -> None:
        """A ``ValueError`` naming what in a checkpoint's state is not this mechanism's."""
        r, noise = state.get("ftrl_round"), state.get("ftrl_noise")
        if not (isinstance(r, int) and r >= 0):
            raise ValueError(f"privacy_state: ftrl_round {r!r} is not a round")
        if not (isinstance(noise, torch.Tensor) and noise.dtype == torch.float64
                and noise.dim() == 2 and bool(torch.isfinite(noise).all())):
            raise ValueError("privacy_state: ftrl_noise is not a finite float64 matrix")
        rows = 1 if self.kind == "tree" else self.bands - 1
        if noise.numel() and noise.shape[0] > rows:
            raise ValueError(f"privacy_state: ftrl_noise has {noise.shape[0]} rows, "
                             f"{self.kind} keeps {rows}")

    def noise(self, state: dict[str, Any], r: int, d: int, draw: Callable[[int], torch.Tensor]
              ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Round ``r``'s unit noise ``w_r`` (float64, ``[d]``) and the new state.
        ``draw(t)``: round t's ``z_t ~ N(0, I_d)`` (DP-FedAvg's draw). A state behind
        ``r`` (a round whose step was skipped kept the old state) is caught up, so
        ``w_r`` is the same whatever rounds were skipped."""
        at, past = int(state["ftrl_round"]), state["ftrl_noise"]
        if past.numel() and past.shape[1] != d:
            raise ValueError(f"privacy_state: ftrl_noise is of {past.shape[1]} values, the "
                             f"model of {d}")
        if at > r:
            raise ValueError(f"privacy_state: the noise is at round {at}, past round {r}")
        if self.tree is not None:
            s0, p = self.tree.position(r)
            prev = (past[0] if at == r and past.numel() and p > 1
                    else self.tree.prefix(s0, p - 1, d))
            cur = self.tree.prefix(s0, p, d)
            return cur - prev, {"ftrl_round": r + 1, "ftrl_noise": cur[None].clone()}
        rows = past if past.numel() else torch.zeros(0, d, dtype=torch.float64)
        keep = self.bands - 1
        for t in range(at, r + 1):
            w = self.band.step(t, draw(t), rows)
            rows = torch.cat([rows, w[None]])[-keep:] if keep else rows
        return w, {"ftrl_round": r + 1, "ftrl_noise": rows.clone()}

    # -------------------------------------------------------------- accounting
    def participations(self, rounds: int) -> int:
        """The most rounds of ``rounds`` one client can take part in: ⌈rounds/groups⌉."""
        return -(-rounds // self.groups)

    def sensitivity2(self, rounds: int) -> int:
        """Squared sensitivity of the release after ``rounds`` rounds, in clips²."""
        if self.kind == "tree":
            return tree_sensitivity2(rounds, self.groups, self.restart)
        return self.participations(rounds)

    def epsilon(self, rounds: int, z: float, delta: float, kind: str) -> float:
        """ε at ``delta`` after ``rounds`` rounds at noise multiplier ``z`` (per node,
        per z_t), by the accountant ``kind`` (add/remove)."""
        if rounds <= 0:
            return 0.0
        if z <= 0:
            return math.inf
        acc = Accountant(kind, "poisson", "add_remove")
        if self.kind == "bandmf" and self.rate is not None:
            return acc.epsilon(self.rate, z, self.participations(rounds), delta)
        # one Gaussian of sensitivity √s: multiplier z/√s
        return acc.epsilon(1.0, z / math.sqrt(self.sensitivity2(rounds)), 1, delta)

    def solve(self, rounds: int, eps: float, delta: float, kind: str) -> float:
        """The noise multiplier for ε ≤ ``eps`` after ``rounds`` rounds
        (:meth:`fedloom.accounting.Accountant.noise`)."""
        acc = Accountant(kind, "poisson", "add_remove")
        if self.kind == "bandmf" and self.rate is not None:
            return acc.noise(self.rate, self.participations(rounds), eps, delta)
        return acc.noise(1.0, 1, eps, delta) * math.sqrt(self.sensitivity2(rounds))

    def record(self, rounds: int) -> dict[str, Any]:
        """What the ε is of, for the run's summary."""
        out: dict[str, Any] = {
            "mechanism": self.kind, "groups": self.groups, "rate": self.rate,
            "sampling": ("poisson within round r's group" if self.rate is not None
                         else "any clients of round r's group (no amplification)"),
            "participation": f"client k in rounds r = k mod {self.groups} (+ multiples)",
            "max_participations": self.participations(rounds),
            "sensitivity_clips": math.sqrt(self.sensitivity2(rounds))}
        if self.kind == "bandmf":
            out.update(bands=self.bands, amplification="poisson within the group"
                       if self.rate is not None else "none")
        else:
            out.update(restart_every=self.restart, amplification="none")
        return out


def make_correlated(cfg: Any, num_clients: int) -> Correlated | None:
    """The DP-FTRL mechanism of ``cfg.privacy`` (None for ``dp_fedavg`` or no privacy);
    what it does not cover is refused in one line naming the field."""
    p = cfg.privacy
    if p.mode == "none":
        return None
    f = p.ftrl
    if p.mechanism == "dp_fedavg":
        if f.groups != 1:
            raise ConfigError("privacy.ftrl.groups: the participation groups of tree and "
                              "bandmf; DP-FedAvg's accountant samples from every client "
                              "(bandmf with bands 1 is DP-FedAvg's noise on groups)")
        return None
    why = _refusal(cfg, num_clients)
    if why is not None:
        raise ConfigError(why)
    rate = None
    if cfg.cohort.sampling == "poisson":
        rate = float(cfg.cohort.rate) if cfg.cohort.rate is not None else min(
            1.0, cfg.cohort.size / num_clients)
    try:
        return Correlated(p.mechanism, rounds=cfg.rounds, seed=cfg.seed, groups=f.groups,
                          bands=f.bands, restart=f.restart_every, rate=rate)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _refusal(cfg: Any, num_clients: int) -> str | None:
    """Why ``privacy.mechanism`` tree | bandmf cannot account for this run, or None."""
    p, f, m = cfg.privacy, cfg.privacy.ftrl, cfg.privacy.mechanism
    if p.mode != "central":
        return f"privacy.mechanism: {m} is a server-side mechanism (privacy.mode: central)"
    if p.adaptive_clip.enabled:
        return (f"privacy.adaptive_clip.enabled: {m}'s noise is correlated across rounds at "
                "one clip; adaptive clipping changes it every round")
    if p.neighbours != "add_remove":
        return f"privacy.neighbours: {m} is accounted under add_remove only"
    if p.accounting_population is not None or p.accounting_cohort is not None:
        return (f"privacy.accounting_cohort: {m} accounts for the run's own groups "
                "(no deployment's cohort)")
    if cfg.server.secure_aggregation:
        return (f"server.secure_aggregation: {m}'s noise state lives on the server, which "
                "a sum-only server does not run")
    if cfg.cohort.selection.name != "uniform":
        return (f"cohort.selection.name: {m}'s participation is uniform within a group; "
                f"{cfg.cohort.selection.name} is not")
    if f.groups > num_clients:
        return (f"privacy.ftrl.groups: at most the {num_clients} clients, got {f.groups}")
    if cfg.cohort.sampling == "fixed" and cfg.cohort.size > num_clients // f.groups:
        return (f"cohort.size: at most a participation group's {num_clients // f.groups} "
                f"clients (privacy.ftrl.groups={f.groups} of {num_clients}), got "
                f"{cfg.cohort.size}")
    if m == "tree" and f.bands is not None:
        return "privacy.ftrl.bands: bandmf's; the tree has none"
    if m == "bandmf" and f.restart_every is not None:
        return "privacy.ftrl.restart_every: the tree's; bandmf has none"
    if cfg.cohort.sampling == "poisson" and f.groups > 1 and cfg.cohort.rate is None:
        return ("cohort.rate: give the rate within a group under privacy.ftrl.groups > 1 "
                "(cohort.size / N would be the rate over every client)")
    return None
