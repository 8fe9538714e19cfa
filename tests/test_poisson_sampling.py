"""Poisson client sampling (``cohort.sampling: poisson``): each client in each round with
probability q, independently; cohorts of any size (0 included) on every backend;
DP-FedAvg's fixed denominator qN and its accounting at rate q; bit-identical resume."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import fedloom
from conftest import TINY, stop_and_resume
from fedloom.config import ClientConfig, ConfigError, SystemConfig, load_config
from fedloom.engine.experiment import Experiment
from fedloom.engine.inputs import Schedule
from fedloom.privacy import make_privacy, resolve_noise
from fedloom.rng import Purpose, torch_gen
from fedloom.runtable import summary_rows
from fedloom.system import System

REFERENCE = json.loads((Path(__file__).parent / "data" / "privacy_reference.json").read_text())
POISSON = ["cohort.sampling=poisson"]
DP = ["privacy.mode=central", "privacy.noise_multiplier=1.0", "privacy.clip=1.0"]


def _inclusions(q: float, n: int, rounds: int, seed: int = 0) -> np.ndarray:
    """``[rounds, n]``: whether client k is in round r's Poisson cohort."""
    sched = Schedule(seed, rounds, 1, n, client=None, rate=q)
    out = np.zeros((rounds, n), dtype=bool)
    for r in range(rounds):
        out[r, sched.sample_cohort(r).numpy()] = True
    return out


def _within(count: int, trials: int, p: float, sds: float = 5.0) -> bool:
    """``count`` within ``sds`` binomial standard deviations of ``trials · p``."""
    return abs(count - trials * p) <= sds * math.sqrt(trials * p * (1 - p))


def test_each_client_is_included_at_rate_q_independently():
    """Over 400 rounds of 200 clients at q = 0.1: the inclusions number Bin(80,000, q)
    (5 sd), every client's Bin(400, q) (6 sd, 200 clients), a client in two consecutive
    rounds Bin(199 · 200, q²) and two clients together in a round Bin(400, q²)
    (independence over rounds and over clients)."""
    q, n, rounds = 0.1, 200, 400
    inc = _inclusions(q, n, rounds)
    assert _within(int(inc.sum()), n * rounds, q)
    assert all(_within(int(c), rounds, q, 6.0) for c in inc.sum(axis=0))
    assert _within(int((inc[1:] & inc[:-1]).sum()), (rounds - 1) * n, q * q)
    assert _within(int((inc[:, 0] & inc[:, 1]).sum()), rounds, q * q)
    sizes = inc.sum(axis=1)
    assert sizes.min() < n * q < sizes.max()  # the size varies around qN


def test_cohorts_are_a_function_of_seed_and_round():
    """Round r's cohort depends on (seed, r) only: the same in any order of rounds,
    another for another seed; q = 1 is every client."""
    a = _inclusions(0.3, 50, 20)
    sched = Schedule(0, 20, 1, 50, client=None, rate=0.3)
    for r in reversed(range(20)):
        assert np.array_equal(np.flatnonzero(a[r]), sched.sample_cohort(r).numpy())
    assert not np.array_equal(a, _inclusions(0.3, 50, 20, seed=1))
    assert _inclusions(1.0, 7, 3).all()


def test_under_availability_the_draw_is_among_the_available_clients():
    """Round r's cohort under ``system.availability`` is the available clients of the
    cohort drawn without it: a client's draw does not depend on who else is up."""
    n, q = 40, 0.3
    for seed in (0, 5):
        sysm = System(SystemConfig(availability=0.5), seed, n, 8, 10)
        with_avail = Schedule(seed, 12, 10, n, ClientConfig(), sysm, rate=q)
        plain = Schedule(seed, 12, 10, n, ClientConfig(), rate=q)
        for r in range(12):
            got = with_avail.sample_cohort(r).numpy()
            assert np.array_equal(got, np.intersect1d(plain.sample_cohort(r).numpy(),
                                                      sysm.available_ids(r)))


def test_availability_is_refused_under_central_dp_only(tiny):
    """The accountant's q is each client's inclusion probability in every round, which
    availability breaks: central mode refuses it in one line; local mode runs."""
    avail = [*POISSON, "system.availability=0.6"]
    with pytest.raises(ConfigError, match=r"^system\.availability: .*privacy\.mode=central"):
        fedloom.run(tiny, [*avail, *DP])
    res = fedloom.run(tiny, [*avail, *DP[1:], "privacy.mode=local"])
    assert all(m["cohort_size"] <= 10 for m in res.metrics)


def test_the_rate_defaults_to_size_over_n_and_is_refused_under_fixed(tiny):
    cfg = load_config(tiny, POISSON)
    assert cfg.cohort.sampling == "poisson" and cfg.cohort.rate is None
    res = fedloom.run(tiny, POISSON)
    assert [m["cohort_size"] for m in res.metrics] != [4, 4, 4]  # q = 4/10, sizes vary
    with pytest.raises(ConfigError, match=r"^cohort\.rate: .*poisson"):
        fedloom.run(tiny, ["cohort.rate=0.5"])
    rows = dict(summary_rows(res.summary, cfg))
    assert rows["cohort sampling"] == "poisson, rate cohort.size / N = 4/N"
    assert dict(summary_rows(res.summary, load_config(tiny, [*POISSON, "cohort.rate=0.25"]))
                )["cohort sampling"] == "poisson, rate 0.25"


@pytest.mark.parametrize(("extra", "field"), [
    (["cohort.selection=power_of_choice"], r"cohort\.selection\.name"),
    (["aggregator.name=afl", "cohort.size=10"], r"cohort\.sampling"),
    (["system.mode=async", "system.profile=lognormal"], r"cohort\.sampling")])
def test_refused_combinations(tiny, extra, field):
    """Poisson sampling takes the uniform selector's place: another selector, a rule
    that needs every client, an event-driven mode are one line each."""
    with pytest.raises(ConfigError, match=f"^{field}") as e:
        fedloom.run(tiny, [*POISSON, *extra])
    assert "\n" not in str(e.value)


def test_resume_is_bit_identical(tiny, tmp_path):
    """Stopped after round 2 and resumed: the uninterrupted run's cohorts and model."""
    cfg = copy.deepcopy(tiny)
    cfg["rounds"] = 4
    ref, res = stop_and_resume(cfg, [*POISSON, "cohort.rate=0.3"], tmp_path / "run")
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    assert ([m["cohort_size"] for m in res.metrics] == [m["cohort_size"] for m in ref.metrics])


BACKENDS = [pytest.param(["backend=vmap"], id="vmap"),
            pytest.param(["backend=vmap", "backend.options.chunk=2"], id="vmap-chunk2"),
            pytest.param(["backend=lockstep"], id="lockstep")]
RATES = {"0.3": lambda s: len(set(s)) > 1, "0.05": lambda s: {0, 1} <= set(s),
         "1.0": lambda s: set(s) == {10}}
PROCESS = ["backend=process", "backend.options.workers=2"]


def _same_as_sequential(backend: list[str], rate: str) -> None:
    """TINY over 4 rounds at ``rate``: the cohorts' sizes (of the kind ``RATES`` says)
    and the model (float64) of the sequential backend."""
    cfg = {**copy.deepcopy(TINY), "rounds": 4}
    over = ["dtype=float64", *POISSON, f"cohort.rate={rate}"]
    ref = fedloom.run(cfg, [*over, "backend=sequential"])
    res = fedloom.run(cfg, [*over, *backend])
    sizes = [m["cohort_size"] for m in res.metrics]
    assert sizes == [m["cohort_size"] for m in ref.metrics] and RATES[rate](sizes)
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]


@pytest.mark.parametrize("rate", list(RATES), ids=["some", "empty-and-one", "all"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_backends_run_variable_cohorts_to_the_sequential_bits(backend, rate):
    """Cohorts of 0 to N clients (chunked by 2 too) give the sequential backend's model
    in float64, as fixed-size cohorts do (tests/test_vmap.py, test_lockstep*.py)."""
    _same_as_sequential(backend, rate)


def test_process_backend_runs_empty_and_one_client_cohorts_to_the_sequential_bits():
    """Two workers, rounds of 0 and 1 clients (one worker idle, then both)."""
    _same_as_sequential(PROCESS, "0.05")


@pytest.mark.slow
def test_ray_runs_variable_cohorts_to_the_sequential_bits():
    """Two Ray workers (9-12 s here, the cluster's start included: marked slow)."""
    pytest.importorskip("ray")
    _same_as_sequential(["backend=ray", "backend.options.workers=2"], "0.05")


def _empty_first_round(extra: list[str]) -> tuple[fedloom.Result, torch.Tensor]:
    """One round of TINY (seed 3) at q = 0.01, in which nobody is drawn (asserted), and
    the run's starting model."""
    cfg = {**copy.deepcopy(TINY), "rounds": 1}
    over = ["dtype=float64", *POISSON, "cohort.rate=0.01", *extra]
    res = fedloom.run(cfg, over)
    assert res.metrics[0]["cohort_size"] == 0
    exp = Experiment.from_config(load_config(cfg, over))
    try:
        return res, exp.init().w
    finally:
        exp.close()


def test_an_empty_round_without_privacy_leaves_the_model():
    """Nobody reported: no step (not a rejected round), the starting model, nothing sent."""
    res, w0 = _empty_first_round([])
    m = res.metrics[0]
    assert m["rejected_rounds"] == 0 and m["uplink_bytes"] == 0
    assert torch.equal(res.w, w0)


def test_an_empty_round_under_dp_releases_the_noise_over_the_fixed_denominator():
    """DP-FedAvg (McMahan et al. 2018, Algorithm 1) with nobody sampled: the server adds
    N(0, z²C²I) to the zero sum and divides by the expected cohort qN = 0.1 (not by the
    0 drawn), and the server's step (SGD, lr 1) applies that mean: ``w_1 = w_0 − Δ``,
    Δ the pseudo-gradient (the mean of ``w − w_k``)."""
    res, w0 = _empty_first_round(DP)
    gen = torch_gen(3, 0, -1, Purpose.DP_NOISE)
    noise = torch.randn(w0.numel(), generator=gen, dtype=torch.float64)
    expect = 1.0 * 1.0 * noise / (0.01 * 10)  # z · C · ξ / (qN)
    assert torch.allclose(w0 - res.w, expect, rtol=1e-9, atol=1e-12)
    rec = res.summary["dp_accounting"]
    assert rec["sampling"] == "poisson" and rec["rate"] == 0.01
    assert rec["denominator"] == pytest.approx(0.1)


def test_epsilon_at_the_issues_example_is_pfls_poisson_pld(tiny):
    """N = 10,000, q = 0.01 (cohort.rate, or cohort.size 100 / N), z = 1, T = 2,000,
    δ = 1e-6: ε by PLD is pfl's (tests/data/privacy_reference.json), about 2.955, where
    fixed-size sampling of the same 100 reports 20.6 (docs/howto/privacy.md)."""
    row = next(e for e in REFERENCE["epsilon"]
               if (e["q"], e["z"], e["T"], e["delta"]) == (0.01, 1.0, 2000, 1e-6))
    base = [*DP, "privacy.delta=1e-6", "rounds=2000", "data.num_clients=10000"]
    for extra in (["cohort.rate=0.01"], ["cohort.size=100"]):
        cfg = load_config(tiny, [*base, *POISSON, *extra])
        priv = make_privacy(cfg, 10_000)
        assert priv.record()["sampling"] == "poisson" and priv.rate == 0.01
        assert priv.cohort_size == pytest.approx(100)
        assert priv.planned_epsilon(2000) == pytest.approx(row["pfl_pld"], abs=1e-6)


def test_noise_auto_solves_on_the_poisson_accountant(tiny):
    """``noise_multiplier: auto`` for ε = 3 at q = 0.01 (cohort.rate), T = 2,000,
    δ = 1e-6 by RDP: pfl's and Opacus's RDP noise for Poisson sampling to 1 %
    (the reference JSON); fixed-size sampling would need about twice as much."""
    row = next(e for e in REFERENCE["noise"]
               if (e["q"], e["T"], e["epsilon"], e["delta"]) == (0.01, 2000, 3.0, 1e-6))
    cfg = load_config(tiny, [*POISSON, "cohort.rate=0.01", "privacy.mode=central",
                             "privacy.noise_multiplier=auto", "privacy.target_epsilon=3",
                             "privacy.delta=1e-6", "privacy.accountant=rdp", "rounds=2000",
                             "data.num_clients=10000"])
    z = resolve_noise(cfg).privacy.noise_multiplier
    assert z == pytest.approx(row["pfl_rdp"], rel=0.01)
    assert z == pytest.approx(row["opacus_rdp"], rel=0.01)


def test_secagg_on_flower_refuses_poisson_sampling(tiny):
    """Flower's SecAgg+ path skips a round nobody reported to (no masked sum to noise):
    Poisson sampling, whose empty rounds must release noise, is refused in one line."""
    pytest.importorskip("flwr")
    from fedloom.integrations.secagg import check_secagg_scope

    with pytest.raises(ConfigError, match=r"^cohort\.sampling: poisson is not wired to SecAgg"):
        check_secagg_scope(load_config(tiny, ["server.secure_aggregation=true", *POISSON]))


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_flowers_strategy_runs_poisson_cohorts_to_the_engines_model():
    """Flower's simulation runtime (6 nodes, q = 0.2, seed 4: cohorts of 2, 0, 1, 2),
    without and with central DP: the engine's model, the empty round included (30 s
    each here, the Ray cluster's start included)."""
    pytest.importorskip("flwr")
    pytest.importorskip("ray")
    from conftest import FLOWER_NODE_TIMEOUT_S, flower_simulation
    from fedloom.config import config_to_dict
    from fedloom.integrations.flower import FedloomStrategy, client_app, server_app

    base = {"name": "flower", "seed": 4, "rounds": 4, "dtype": "float64",
            "data": {"name": "synthetic", "num_clients": 6, "partition": {"name": "natural"},
                     "max_samples": 4000},
            "model": {"name": "mlp", "options": {"hidden": [10]}},
            "cohort": {"size": 3, "sampling": "poisson", "rate": 0.2},
            "client": {"lr": 0.05, "batch_size": 16, "epochs": 1}, "checkpoint": {"every": 0}}
    for over in ([], ["privacy.mode=central", "privacy.clip=0.5",
                      "privacy.noise_multiplier=0.2"]):
        cfg = config_to_dict(load_config(base, over))
        ref = fedloom.run(cfg)
        assert [m["cohort_size"] for m in ref.metrics] == [2, 0, 1, 2]
        strategy = FedloomStrategy(cfg, node_timeout=FLOWER_NODE_TIMEOUT_S)
        flower_simulation(server_app(strategy), client_app(cfg), 6)
        assert [m["cohort_size"] for m in strategy.history] == [2, 0, 1, 2]
        assert torch.allclose(strategy.state.w, ref.w, rtol=0, atol=1e-12)
