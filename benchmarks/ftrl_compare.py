"""The noise each central mechanism puts on the model at the same ε: DP-FedAvg
(Poisson over every client), the tree and BandMF (fedloom.ftrl) on participation
groups, each with its noise multiplier solved for ε at δ by PLD, and the standard
deviation of the noise on the prefix sum after t rounds (per coordinate, in clips:
what the server's SGD adds to the model, times the learning rate over the denominator)::

    python benchmarks/ftrl_compare.py     # the table in docs/howto/privacy.md (DP-FTRL)

N = 1,000 clients, T = 200 rounds, an expected cohort of 50, ε = 4 at δ = 1e-6
(about 5 minutes: the PLD calibrations and three factorizations of 200 rounds).
"""

from __future__ import annotations

import time

import numpy as np

from fedloom.accounting import Accountant
from fedloom.ftrl import Correlated

N, T, COHORT, EPS, DELTA = 1000, 200, 50, 4.0, 1e-6


def prefix_sd(kind: str, mech: Correlated | None, z: float) -> np.ndarray:
    """sd of the noise on the prefix sum after t = 1..T rounds, in clips."""
    t = np.arange(1, T + 1)
    if mech is None:
        return z * np.sqrt(t)
    if kind == "tree":  # the finished trees' totals stay in the model
        seg = mech.restart or T
        done, pos = (t - 1) // seg, (t - 1) % seg + 1
        return z * np.sqrt(done * bin(seg).count("1") + np.array([bin(p).count("1") for p in pos]))
    c = mech.band.c
    b = np.tril(np.ones((T, T))) @ np.linalg.inv(c)  # B = A C⁻¹: the prefix sums' noise
    return z * np.sqrt((b ** 2).sum(axis=1))


def main() -> None:
    rows = []
    q = COHORT / N
    z = Accountant("pld").noise(q, T, EPS, DELTA)
    rows.append(("dp_fedavg, Poisson q = 0.05", z, prefix_sd("dp_fedavg", None, z)))
    for kind, groups, rate, bands, restart in (
            ("tree", 20, None, None, None), ("tree", 20, None, None, 20),
            ("bandmf", 20, None, 20, None), ("bandmf", 10, 0.5, 10, None),
            ("bandmf", 10, 0.5, 4, None)):
        mech = Correlated(kind, rounds=T, seed=0, groups=groups, bands=bands,
                          restart=restart, rate=rate)
        z = mech.solve(T, EPS, DELTA, "pld")
        name = (f"{kind}, {groups} groups" + (f", Poisson {rate} within" if rate else "")
                + (f", {bands} bands" if bands else "")
                + (f", restart every {restart}" if restart else ""))
        rows.append((name, z, prefix_sd(kind, mech, z)))
    print(f"N={N}, T={T}, expected cohort {COHORT}, eps={EPS} at delta={DELTA:g} (PLD)\n")
    print("| mechanism | z | sd at t = T | mean sd over t | sd / DP-FedAvg's at T |")
    print("|---|---|---|---|---|")
    base = rows[0][2][-1]
    for name, z, sd in rows:
        print(f"| {name} | {z:.3f} | {sd[-1]:.2f} | {sd.mean():.2f} | {sd[-1] / base:.2f} |")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"\n({time.perf_counter() - t0:.0f} s)")
