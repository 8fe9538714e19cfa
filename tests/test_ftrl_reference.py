"""fedloom.ftrl's BandMF against pfl 0.6's ``BandedMatrixFactorizationMechanism``
(tests/data/ftrl_reference.json, written by benchmarks/ftrl_reference.py in the peer
venv): the optimal banded Gram matrix, the online C⁻¹z, the noise multiplier for a
target ε and the ε at a given z, on (T, s, q) = (16, 4, 0.1), (32, 8, 0.05), (48, 5, 1),
with pfl's s − 1 bands. And the departure: pfl's C = cholesky(X) has unit rows, so its
columns (a participation's sensitivity) exceed 1, where fedloom's have norm 1."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedloom.ftrl import BandMF, Correlated, _loss_grad, banded_gram, column_factor, prefix_gram

REFERENCE = json.loads((Path(__file__).parent / "data" / "ftrl_reference.json").read_text())
ROWS = REFERENCE["rows"]


def _id(r: dict) -> str:
    return f"T{r['T']}-s{r['min_separation']}-q{r['q']}"


@pytest.mark.parametrize("row", ROWS, ids=_id)
def test_the_gram_matrix_is_pfls_optimum(row):
    """Our X* = banded_gram(T, s − 1) against pfl's X = CCᵀ: within 5e-4 (max abs;
    measured 1.2e-4, 7.6e-5, 2.4e-4 on the three rows: pfl stops its L-BFGS at
    max|dX| ≤ 1e-3 in float32, ours at 1e-6 in float64), and our loss tr(AᵀAX⁻¹) is at
    or below pfl's (the problem is convex: both approach the one minimiser)."""
    steps, bands = row["T"], row["bands"]
    c_pfl = np.array(row["C"])
    x_pfl = c_pfl @ c_pfl.T
    x = banded_gram(steps, bands)
    assert np.abs(x - x_pfl).max() < 5e-4
    m = prefix_gram(steps)
    assert _loss_grad(x, m)[0] <= _loss_grad(x_pfl, m)[0] * (1 + 1e-12)


@pytest.mark.parametrize("row", ROWS, ids=_id)
def test_the_online_inverse_is_pfls_forward_substitution(row):
    """BandMF.step on pfl's own C and the fixed noise gives pfl's ForwardSubstitution
    output within 1e-6 (max abs; measured 4.1e-7: pfl holds C and the noise in
    float32)."""
    steps, bands = row["T"], row["bands"]
    z = torch.tensor(row["noise"], dtype=torch.float64)
    band = BandMF.__new__(BandMF)
    band.rounds, band.bands, band.c = steps, bands, np.array(row["C"])
    past = torch.zeros(0, z.shape[1], dtype=torch.float64)
    out = []
    for t in range(steps):
        w = band.step(t, z[t], past)
        out.append(w)
        past = torch.cat([past, w[None]])[-(bands - 1):]
    assert np.abs(torch.stack(out).numpy() - np.array(row["C_inv_noise"])).max() < 1e-6


@pytest.mark.parametrize("row", ROWS, ids=_id)
def test_the_noise_and_epsilon_are_pfls(row):
    """ε at z over ⌈T/s⌉ Poisson-sampled Gaussians (q < 1) or Gaussians (q = 1) equals
    pfl's PLD to 1e-6 relative (measured 4e-9), and the noise pfl's mechanism takes for
    its target ε spends that ε by our accountant to 2e-3 relative (pfl's bisection on δ
    stops at 1e-3; our calibration of the same rows, test_ftrl.py, is 0.05 % above)."""
    steps, sep, q = row["T"], row["min_separation"], row["q"]
    mech = Correlated("bandmf", rounds=steps, seed=0, groups=sep, bands=row["bands"],
                      rate=q if q < 1 else None)
    assert mech.participations(steps) == row["compositions"]
    eps = mech.epsilon(steps, row["z"], row["delta"], "pld")
    assert eps == pytest.approx(row["epsilon_at_z"], rel=1e-6)
    spent = mech.epsilon(steps, row["noise_multiplier"], row["delta"], "pld")
    assert spent == pytest.approx(row["epsilon"], rel=2e-3)


@pytest.mark.parametrize("row", ROWS, ids=_id)
def test_pfls_columns_exceed_one_where_ours_are_one(row):
    """pfl takes C = cholesky(X): CCᵀ = X, rows of norm 1; the sensitivity of one
    participation in round i is ‖C e_i‖, which reaches 1.30, 1.69, 1.50 on the three
    rows (so a client in the worst round gets z/1.69 of the noise pfl accounts for).
    Ours, CᵀC = X: every column has norm 1."""
    c_pfl = np.array(row["C"])
    assert np.linalg.norm(c_pfl, axis=1) == pytest.approx(1, abs=1e-5)
    assert np.linalg.norm(c_pfl, axis=0).max() == pytest.approx(row["column_norm_max"])
    assert row["column_norm_max"] > 1.25
    ours = column_factor(banded_gram(row["T"], row["bands"]))
    assert np.abs(np.linalg.norm(ours, axis=0) - 1).max() < 1e-12
    assert math.isclose(np.abs(ours.T @ ours - c_pfl @ c_pfl.T).max(), 0, abs_tol=5e-4)
