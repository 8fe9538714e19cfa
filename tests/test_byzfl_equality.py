"""The robust rules and pre-aggregation steps against ByzFL 0.0.11 (EPFL's Byzantine-FL
library, ``pip install --no-deps byzfl==0.0.11``; ``make .venv/.dev`` installs it) and
Bulyan against Flower 1.42's ``aggregate_bulyan`` (ByzFL has none).

ByzFL's package ``__init__`` imports its benchmark (torchvision, which this venv does
not carry): :func:`_byzfl` loads ``byzfl.aggregators`` alone under a bare package.
Every comparison runs on float64 NumPy rows (ByzFL converts torch input to float32) of
five kinds (:func:`_cohorts`): random, near-collinear (one direction, relative spread
1e-9), duplicated rows (three copies of one, two of another), huge (1e100 scale) and
``f`` at its limit (``2f + 1 = n``, or ``n = 4f + 3`` for Bulyan), n = 5 … 15, d = 40,
20 cohorts of each kind. Differences are ``max |ours − theirs| / max(1, max |x|)``
(relative to the rows' scale); the maximum measured over all kinds is in each test's
docstring, and each test fails above 1e-13.
"""

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from fedloom import make_aggregator
from fedloom.aggregate.bucketing import bucket_means
from fedloom.aggregate.nnm import nnm_mix
from fedloom.engine.stages.screen import clip_rows, row_norms

KINDS = ("random", "near_collinear", "duplicated", "huge", "f_limit")
TOL = 1e-13


def _byzfl():
    """``byzfl.aggregators`` without ``byzfl/__init__.py`` (which imports torchvision)."""
    if "byzfl" not in sys.modules:
        spec = importlib.util.find_spec("byzfl")
        assert spec is not None and spec.origin is not None, "make .venv/.dev installs byzfl"
        pkg = types.ModuleType("byzfl")
        pkg.__path__ = [str(Path(spec.origin).parent)]
        sys.modules["byzfl"] = pkg
    return importlib.import_module("byzfl.aggregators")


B = _byzfl()


def _cohorts(kind, seed, limit=lambda n: (n - 1) // 2, low=5):
    """20 cohorts ``(X, f)`` of ``kind``; ``limit(n)``: the largest ``f`` the rule takes."""
    rng = np.random.default_rng([seed, KINDS.index(kind)])
    out = []
    for _ in range(20):
        n, d = int(rng.integers(low, 16)), 40
        X = rng.normal(size=(n, d)) * rng.uniform(0.5, 50)
        if kind == "near_collinear":
            v = rng.normal(size=d) * 10
            X = v * (1 + 1e-9 * rng.normal(size=(n, 1))) + 1e-9 * rng.normal(size=(n, d))
        elif kind == "duplicated":
            X[1:3] = X[0]
            if n >= 5:
                X[4] = X[3]
        elif kind == "huge":
            X *= 1e100
        f = limit(n) if kind == "f_limit" else int(rng.integers(0, limit(n) + 1))
        out.append((X, f))
    return out


def _ours(name, X, **options):
    agg = make_aggregator(name, **options)
    out, _, _ = agg(torch.tensor(X), torch.ones(len(X), dtype=torch.float64), None)
    return out.numpy()


def _diff(a, b, X):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max()) / max(1.0, float(np.abs(X).max()))


@pytest.mark.parametrize("kind", KINDS)
def test_median_equals_byzfl(kind):
    """``median`` = ``byzfl.Median``: max difference 0 (both the mean of the middle two)."""
    for X, _ in _cohorts(kind, 0):
        assert _diff(_ours("median", X), B.Median()(X), X) <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_trimmed_mean_equals_byzfl(kind):
    """``trimmed_mean`` with ``trim = f`` (a count) = ``byzfl.TrMean(f)``: max 1.7e-16."""
    for X, f in _cohorts(kind, 1):
        assert _diff(_ours("trimmed_mean", X, trim=f), B.TrMean(f)(X), X) <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_krum_equals_byzfl_with_its_neighbour_count(kind):
    """``krum`` with ``neighbours: n-f-1`` = ``byzfl.Krum(f)``: max 2.0e-16 (the same row
    is selected, ByzFL's mean over the neighbours ranking as fedloom's sum; 0 but where
    copies of one row tie and share the place: their float64 mean)."""
    for X, f in _cohorts(kind, 2):
        assert _diff(_ours("krum", X, f=f, neighbours="n-f-1"), B.Krum(f)(X), X) <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_multi_krum_equals_byzfl_with_its_neighbour_count(kind):
    """``krum`` with ``multi = n − f``, ``neighbours: n-f-1`` = ``byzfl.MultiKrum(f)``:
    max 3.4e-16."""
    for X, f in _cohorts(kind, 3):
        ours = _ours("krum", X, f=f, multi=len(X) - f, neighbours="n-f-1")
        assert _diff(ours, B.MultiKrum(f)(X), X) <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_geometric_median_equals_byzfl(kind):
    """``geometric_median`` with ``start: zero, iterations: 3, nu: 0.1`` =
    ``byzfl.GeometricMedian(0.1, 3)``: max 7.0e-16 (both); with ``nu: 1e-6, iterations: 8`` and
    ByzFL's ``T = 8`` likewise."""
    for X, _ in _cohorts(kind, 4):
        ours = _ours("geometric_median", X, nu=0.1, iterations=3, start="zero")
        assert _diff(ours, B.GeometricMedian(0.1, 3)(X), X) <= TOL
        ours = _ours("geometric_median", X, nu=1e-6, iterations=8, start="zero")
        assert _diff(ours, B.GeometricMedian(1e-6, 8)(X), X) <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_centered_clipping_equals_byzfl_over_rounds(kind):
    """``centered_clipping`` (``tau``, ``iterations``) = ``byzfl.CenteredClipping(L, tau)``
    over three successive rounds (ByzFL's ``m`` against this rule's state; the rows move
    each round): max 1.7e-16; τ from below every distance to above all of them."""
    for X, _ in _cohorts(kind, 5):
        scale = float(np.abs(X).max())
        for tau, L in ((0.01 * scale, 1), (0.5 * scale, 3), (100.0 * scale, 2)):
            agg = make_aggregator("centered_clipping", tau=tau, iterations=L)
            ref = B.CenteredClipping(L=L, tau=float(tau))
            state = None
            for r in range(3):
                Y = X + r * 0.1 * scale
                out, state, _ = agg(torch.tensor(Y), torch.ones(len(Y), dtype=torch.float64),
                                    state)
                assert _diff(out.numpy(), ref(Y), X) <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_nnm_equals_byzfl(kind):
    """``nnm`` (the mixed rows) = ``byzfl.NNM(f)``: max 3.2e-16."""
    for X, f in _cohorts(kind, 6):
        assert _diff(nnm_mix(torch.tensor(X), f).numpy(), B.NNM(f)(X), X) <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_nnm_then_rule_equals_byzfl_composition(kind):
    """NNM then trimmed mean, median and Krum through ``server.pre_aggregation``'s chain =
    ByzFL's rule on ``byzfl.NNM(f)(X)``: max 3.8e-16. After NNM, rows whose neighbourhoods
    are mirror images tie exactly in Krum's score (two pairs of equal rows: each pair's
    score is twice the distance between them); there Krum shares the place (its stated
    departure) and ByzFL picks by position: such cohorts (12 to 17 of 20 a kind) are
    checked to be exact ties (ByzFL's pick has the best score) instead."""
    from fedloom.aggregate.nnm import NNM
    from fedloom.aggregate.pre import PreAggregated

    equal = 0
    for X, f in _cohorts(kind, 7):
        mixed = B.NNM(f)(X)
        n = len(X)
        ones = torch.ones(n, dtype=torch.float64)
        for rule, ref in ((make_aggregator("trimmed_mean", trim=f), B.TrMean(f)),
                          (make_aggregator("median"), B.Median())):
            out, _, _ = PreAggregated(rule, [NNM(f=f)])(torch.tensor(X), ones, None)
            assert _diff(out.numpy(), ref(mixed), X) <= TOL
        krum = PreAggregated(make_aggregator("krum", f=f, neighbours="n-f-1"), [NNM(f=f)])
        out, _, m = krum(torch.tensor(X), ones, None)
        theirs = B.Krum(f)(mixed)
        if m["krum_selected"] == 1.0:
            equal += 1
            assert _diff(out.numpy(), theirs, X) <= TOL
        else:  # ByzFL's pick has the best score too
            D = ((mixed[:, None] - mixed[None]) ** 2).sum(-1)
            score = np.sort(D, axis=1)[:, 1 : n - f].sum(1)
            pick = int(np.argmin(np.abs(mixed - theirs).max(1)))
            assert score[pick] <= score.min() * (1 + 1e-12) + 1e-300
    assert equal >= 3


@pytest.mark.parametrize("kind", KINDS)
def test_bucketing_equals_byzfl_on_its_permutation(kind):
    """``bucket_means`` on the permutation ByzFL draws (NumPy's global generator, seeded
    here and drawn again for fedloom) = ``byzfl.Bucketing(s)``: max 2.7e-16, s = 1 … 4,
    incomplete last buckets included."""
    # ByzFL draws from NumPy's legacy global generator: seeded here, left as found
    saved = np.random.get_state()  # noqa: NPY002
    try:
        for i, (X, _) in enumerate(_cohorts(kind, 8)):
            for s in (1, 2, 3, 4):
                np.random.seed(1000 * i + s)  # noqa: NPY002
                perm = torch.from_numpy(np.random.permutation(len(X)))  # noqa: NPY002
                np.random.seed(1000 * i + s)  # noqa: NPY002
                ref = B.Bucketing(s)(X.copy())
                assert _diff(bucket_means(torch.tensor(X), perm, s).numpy(), ref, X) <= TOL
    finally:
        np.random.set_state(saved)  # noqa: NPY002


@pytest.mark.parametrize("kind", KINDS)
def test_server_clip_norm_equals_byzfl_clipping(kind):
    """``server.clip_norm`` (:func:`clip_rows`, norm bounding before any rule) =
    ``byzfl.Clipping(c)`` row by row: max 4.3e-16, c from below every norm to above."""
    for X, _ in _cohorts(kind, 9):
        norms = np.linalg.norm(X, axis=1)
        for c in (0.5 * norms.min(), float(np.median(norms)), 2.0 * norms.max()):
            rows = torch.tensor(X)
            clip_rows(rows, row_norms(rows), torch.ones(len(X), dtype=torch.bool), float(c))
            assert _diff(rows.numpy(), B.Clipping(float(c))(X.copy()), X) <= TOL


def _flower_bulyan(X, f):
    """Flower's Bulyan and, per column, whether its ``β`` closest values were a choice
    among values tied at the ``β``-th distance from the median."""
    from flwr.server.strategy.aggregate import (
        _find_reference_weights,
        aggregate_bulyan,
        aggregate_krum,
    )

    results = [([row.copy()], i) for i, row in enumerate(X)]
    out = aggregate_bulyan(list(results), f, aggregate_krum, to_keep=0)[0]
    chosen = []  # Flower's selection again, to find its ties
    for _ in range(len(X) - 2 * f):
        best = aggregate_krum(results, f, 0)
        chosen.append(results.pop(_find_reference_weights(best, [w for w, _ in results]))[1])
    S = X[chosen]
    beta = len(X) - 4 * f
    dist = np.sort(np.abs(S - np.median(S, axis=0)), axis=0)
    tied = (dist[beta - 1] == dist[beta]) if beta < len(S) else np.zeros(X.shape[1], bool)
    return out, tied


@pytest.mark.parametrize("kind", KINDS)
def test_bulyan_equals_flower(kind):
    """``bulyan`` = Flower 1.42's ``aggregate_bulyan`` with ``aggregate_krum``: max
    3.4e-16; ``f`` up to its limit ``n = 4f + 3`` (n = 3 … 15). Columns whose ``β``
    closest values are a choice among values tied at the ``β``-th distance (a
    duplicated row with an even ``θ``: Flower's ``argpartition`` picks, this rule shares;
    only the duplicated kind has them) are left out here; the shared tie is a golden value
    in tests/test_defences.py."""
    for X, f in _cohorts(kind, 10, limit=lambda n: (n - 3) // 4, low=3):
        ours = _ours("bulyan", X, f=f)
        theirs, tied = _flower_bulyan(X, f)
        assert kind == "duplicated" or not tied.any()
        assert _diff(ours[~tied], theirs[~tied], X) <= TOL
