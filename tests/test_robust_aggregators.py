"""Median, trimmed mean and Krum: golden values (derivations beside them), the
stated choices (unweighted, small-cohort caps, ties) and option errors. The
shared properties are in test_aggregator_properties.py."""

import pytest
import torch

from fedloom import CohortInfo, Layout, make_aggregator


def _agg(name, rows, weights=None, info=None, **options):
    U = torch.tensor(rows, dtype=torch.float64)
    n = torch.ones(U.shape[0], dtype=torch.float64) if weights is None else torch.tensor(
        weights, dtype=torch.float64)
    agg = make_aggregator(name, **options)
    out, _, metrics = agg(U, n, agg.init(Layout.flat(U.shape[1])), info=info)
    return out.tolist(), metrics


def test_median_odd_and_even():
    # column 0: {1, 3, 2} → 2; column 1: {5, −2, 0} → 0
    assert _agg("median", [[1, 5], [3, -2], [2, 0]])[0] == [2, 0]
    # even m: the mean of the two middle values, (2 + 4)/2 = 3 (torch.median would give 2)
    assert _agg("median", [[1], [4], [2], [10]])[0] == [3]


def test_trimmed_mean_golden_and_caps():
    rows = [[1], [2], [3], [100], [-50]]
    # b = 1 per side: sorted −50, 1, 2, 3, 100 → mean(1, 2, 3) = 2
    assert _agg("trimmed_mean", rows, trim=1)[0] == [2]
    assert _agg("trimmed_mean", rows, trim=0.2)[0] == [2]          # b = int(0.2·5) = 1
    assert _agg("trimmed_mean", rows, trim=0)[0] == [11.2]         # plain mean, 56/5
    # the count is capped at ⌊(m − 1)/2⌋: 5 per side on m = 3 → b = 1, the median
    out, metrics = _agg("trimmed_mean", [[1], [7], [2]], trim=5)
    assert out == [2] and metrics["trimmed_per_side"] == 1.0


def test_krum_golden_scores():
    # 1-d points 0, 1, 3, 10, f = 0 → k = n − f − 2 = 2 nearest:
    # s(0) = 1 + 9 = 10, s(1) = 1 + 4 = 5, s(3) = 4 + 9 = 13, s(10) = 49 + 64 = 113
    info = CohortInfo(clients=torch.tensor([40, 41, 42, 43]), round=0, num_clients=50)
    out, metrics = _agg("krum", [[0], [1], [3], [10]], info=info)
    assert out == [1] and metrics["krum_best_client"] == 41.0
    assert metrics["krum_best_score"] == 5.0 and metrics["krum_neighbours"] == 2.0
    # Multi-Krum m' = 2: the two best, 1 and 0 → 0.5
    assert _agg("krum", [[0], [1], [3], [10]], multi=2)[0] == [0.5]


def test_krum_ties_are_shared_not_decided_by_position():
    # f = 1, n = 4 → k = 1: s(0) = s(1) = s(2) = 1, s(10) = 64: the three tie → mean 1
    out, metrics = _agg("krum", [[0], [1], [2], [10]], f=1)
    assert out == [1] and metrics["krum_selected"] == 3.0
    # n = 2: both scores are the distance between them → their mean
    assert _agg("krum", [[0, 2], [4, 6]])[0] == [2, 4]
    # one update: itself
    assert _agg("krum", [[3, -1]])[0] == [3, -1]


def test_krum_never_selects_far_attackers():
    gen = torch.Generator().manual_seed(0)
    honest = 1.0 + 0.1 * torch.randn(7, 20, generator=gen, dtype=torch.float64)
    rows = torch.cat([honest, -10 * honest[:2]])
    out, _ = _agg("krum", rows.tolist(), f=2)
    assert any(torch.equal(torch.tensor(out, dtype=torch.float64), h) for h in honest)


@pytest.mark.parametrize("name", ["median", "trimmed_mean", "krum"])
def test_unweighted_by_choice(name):
    """A client's claimed sample count does not buy it influence."""
    rows = [[0.0, 1.0], [1.0, 3.0], [2.0, 2.0], [50.0, -40.0]]
    assert _agg(name, rows, [1, 1, 1, 1])[0] == _agg(name, rows, [1, 1, 1, 10**6])[0]


@pytest.mark.parametrize(("name", "option", "value"), [
    ("trimmed_mean", "trim", 0.5), ("trimmed_mean", "trim", -1), ("trimmed_mean", "trim", "x"),
    ("krum", "f", -1), ("krum", "multi", 0), ("krum", "f", 1.5), ("median", "chunk", 0),
])
def test_bad_options_name_the_option(name, option, value):
    with pytest.raises(ValueError, match=rf"aggregator\.options\.{option}"):
        make_aggregator(name, **{option: value})


@pytest.mark.parametrize("name", ["median", "trimmed_mean", "krum"])
def test_chunked_columns_equal_one_chunk(name):
    gen = torch.Generator().manual_seed(1)
    U = torch.randn(9, 103, generator=gen)
    n = torch.ones(9)
    a, _, _ = make_aggregator(name, chunk=7)(U, n, None)
    b, _, _ = make_aggregator(name)(U, n, None)
    assert torch.equal(a, b) and a.dtype == torch.float32
