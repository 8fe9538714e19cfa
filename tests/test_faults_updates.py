"""Faults in client updates and aggregates: nothing non-finite, absurd or undecodable
reaches the model, the run goes on, and every rejection is counted.

Injection: a wrapped backend changes one client's dense update after training (as
``tests/test_engine.py`` does), a wrapped compressor damages one client's payload,
and fake aggregators are registered for the test only (``monkeypatch`` on the
registry, so the aggregator property suite never sees them).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import pytest
import torch

import fedloom
from conftest import stop_and_resume
from fedloom import registry
from fedloom.aggregate.base import Stateless
from fedloom.compress import PayloadError
from fedloom.config import ConfigError, load_config
from fedloom.engine.experiment import Experiment
from fedloom.engine.runstate import RunState, model_sha256
from fedloom.engine.stages.screen import clip_rows, screen_updates
from fedloom.engine.stages.screen import row_norms as _row_norms

HUGE = 1e30


# ----------------------------------------------------------------- fake aggregators
class _FaultOnRound:
    """The weighted mean with a tensor state that counts its calls; on round
    ``bad_round`` it returns ``direction`` (or raises ``error``) and a changed state."""

    def __init__(self, bad_round: int = 1, kind: str = "nan") -> None:
        self.bad_round, self.kind = bad_round, kind

    def init(self, layout):
        return {"calls": torch.zeros(1, dtype=torch.float64)}

    def __call__(self, updates, weights, state, *, info=None):
        p = weights.to(updates.dtype) / weights.sum()
        agg = p @ updates
        new_state = {"calls": state["calls"] + 1}
        if info.round == self.bad_round:
            if self.kind == "nan":
                agg = agg.clone()
                agg[3] = float("nan")
            elif self.kind == "linalg":
                raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
            elif self.kind == "huge":  # finite, but its server step overflows float32
                agg = torch.full_like(agg, 1e38)
        return agg, new_state, {}


@pytest.fixture
def fault_aggregators(monkeypatch):
    """Registers ``fault_nan``, ``fault_linalg`` and ``fault_huge`` for one test."""
    registry.available("aggregator")  # load the real ones first
    for kind in ("nan", "linalg", "huge"):
        monkeypatch.setitem(registry._REGISTRY["aggregator"], f"fault_{kind}",
                            lambda bad_round=1, kind=kind: _FaultOnRound(bad_round, kind))


def _injecting(exp: Experiment, pos: int, fn):
    """Wrap ``exp``'s backend: apply ``fn`` to the update of cohort position ``pos``."""
    inner = exp.backend

    class Wrapped:
        def train_cohort(self, jobs):
            res = inner.train_cohort(jobs)
            fn(res[pos].update)
            return res

    exp.backend = Wrapped()


def _dropping(exp: Experiment, pos: int):
    """Wrap ``exp``'s backend: cohort position ``pos`` never reports (a dead worker)."""
    inner = exp.backend

    class Wrapped:
        def train_cohort(self, jobs):
            res = inner.train_cohort(jobs)
            res[pos] = None
            return res

    exp.backend = Wrapped()


def _store_arrays(exp: Experiment, st: RunState) -> dict[str, torch.Tensor]:
    return {f: st.clients.gather(f, torch.arange(exp.fed.num_clients)).clone()
            for f in st.clients.fields}


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    else:
        assert a == b


# ------------------------------------------------------------- rejected rounds (#12)
@pytest.mark.parametrize("kind", ["nan", "linalg", "huge"])
def test_bad_aggregate_skips_the_step_and_keeps_all_state(tiny, fault_aggregators, kind):
    # A momentum or adam server (optimizer state), EF over Top-k (residual rows in the store),
    # SCAFFOLD (control-variate rows and server state): every kind of state a step
    # writes. Round index 1 (the second round) is the bad one.
    # "huge": adam's second moment of a 1e38 direction overflows float32 (its step
    # m / (√v + τ) is then 0: finite, but the state it leaves is not).
    server = (["server.optimizer=adam", "server.lr=0.01"] if kind == "huge"
              else ["server.optimizer=momentum"])
    cfg = load_config(tiny, [f"aggregator.name=fault_{kind}", *server,
                             "compression.name=topk", "compression.options.ratio=0.1",
                             "compression.feedback=ef", "client.method=scaffold"])
    exp = Experiment.from_config(cfg)
    st1, m1 = exp.round(exp.init())
    assert m1["rejected_rounds"] == 0
    before, rows_before = exp.checkpoint_state(st1), _store_arrays(exp, st1)
    st2, m2 = exp.round(st1)
    assert m2["rejected_rounds"] == 1 and m2["rejected_rounds_total"] == 1
    assert m2["rejected_updates"] == 0  # the clients were fine; the aggregate was not
    assert isinstance(m2["rejected_round_reason"], str)
    after = exp.checkpoint_state(st2)
    for key in ("w", "opt_state", "agg_state", "method_state", "feedback_state"):
        _assert_same(after[key], before[key])
    _assert_same(_store_arrays(exp, st2), rows_before)
    assert after["next_round"] == 2 and after["totals"]["rejected_rounds"] == 1
    # the bytes of the round were sent all the same
    assert after["totals"]["uplink_bytes"] == before["totals"]["uplink_bytes"] + m2[
        "uplink_bytes"] > before["totals"]["uplink_bytes"]
    # the run goes on: the next round steps again
    st3, m3 = exp.round(st2)
    assert m3["rejected_rounds"] == 0 and torch.isfinite(st3.w).all()
    assert not torch.equal(st3.w, st2.w)
    assert float(st3.agg_state["calls"]) == float(st1.agg_state["calls"]) + 1


@pytest.mark.parametrize("kind", ["nan", "linalg"])
def test_bad_aggregate_run_continues_and_is_counted(tiny, fault_aggregators, kind):
    shas = []
    res = fedloom.run(tiny, [f"aggregator.name=fault_{kind}"],
                      callbacks=[lambda st, m: shas.append(model_sha256(st.w))])
    assert [m["rejected_rounds"] for m in res.metrics] == [0, 1, 0]
    assert shas[1] == shas[0] != shas[2]  # round 2 left the model as round 1 made it
    assert res.summary["rejected_rounds_total"] == 1
    assert "rejected_round_reason" not in res.summary
    assert torch.isfinite(res.w).all()


def test_resume_through_a_rejected_round_is_bit_identical(tiny, fault_aggregators, tmp_path):
    ov = ["aggregator.name=fault_nan", "aggregator.options.bad_round=2", "rounds=4",
          "checkpoint.every=1", "compression.name=topk", "compression.options.ratio=0.1",
          "compression.feedback=ef", "server.optimizer=adam", "server.lr=0.01"]
    ref, res = stop_and_resume(tiny, ov, tmp_path / "r", stop_after=3)
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    assert res.summary["rejected_rounds_total"] == ref.summary["rejected_rounds_total"] == 1


# ------------------------------------------------------- hostile client updates (#13)
SETTINGS = {
    "fedavg": [],
    "craft": ["aggregator.name=craft"],
    "sign": ["compression.name=sign"],
    "qsgd": ["compression.name=qsgd"],
}


@pytest.mark.parametrize("where", ["one", "all"])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_huge_update_rejected_model_equals_the_run_without_that_client(tiny, setting, where):
    # 1e30 in one coordinate (a parameter the other clients never move) or in all.
    def blow(u):
        if where == "one":
            u[-1] = HUGE
        else:
            u.mul_(HUGE)

    cfg = load_config(tiny, ["rounds=1", *SETTINGS[setting]])
    exp = Experiment.from_config(cfg)
    _injecting(exp, 1, blow)
    new, m = exp.round(exp.init())
    cohort = exp.sample_cohort(0)
    assert m["rejected_updates"] == 1 and m["rejected_clients"] == [int(cohort[1])]
    assert "max_norm_ratio" in m["rejected_reasons"][0]
    assert torch.isfinite(new.w).all()
    # Reference: the same round with that client absent (its worker died). The
    # aggregator sees the same rows in both, and each client's compressor draws
    # from its own (seed, round, client) generator: bit-identical.
    ref = Experiment.from_config(cfg)
    _dropping(ref, 1)
    want, _ = ref.round(ref.init())
    assert torch.equal(new.w, want.w)


@pytest.mark.parametrize("setting", ["sign", "qsgd"])
def test_nan_update_with_sign_or_qsgd_is_rejected_not_fatal(tiny, setting):
    def poison(u):
        u[5] = float("nan")

    cfg = load_config(tiny, ["rounds=1", *SETTINGS[setting]])
    exp = Experiment.from_config(cfg)
    _injecting(exp, 2, poison)
    new, m = exp.round(exp.init())
    assert m["rejected_updates"] == 1
    assert m["rejected_clients"] == [int(exp.sample_cohort(0)[2])]
    assert torch.isfinite(new.w).all()


class _FailingDecode:
    """A compressor wrapper whose decode of the ``bad``-th payload raises, or returns
    the vector times ``scale``."""

    def __init__(self, inner, bad: int, scale: float | None = None) -> None:
        self.inner, self.bad, self.scale, self.calls = inner, bad, scale, 0

    def encode(self, x, *, gen=None):
        return self.inner.encode(x, gen=gen)

    def decode(self, payload, d=None):
        i, self.calls = self.calls, self.calls + 1
        out = self.inner.decode(payload, d)
        if i == self.bad:
            if self.scale is None:
                raise PayloadError("qsgd payload: invalid norm nan or levels 16")
            return out * self.scale
        return out


def test_undecodable_payload_rejects_that_client_only(tiny):
    cfg = load_config(tiny, ["rounds=1", "compression.name=qsgd"])
    exp = Experiment.from_config(cfg)
    exp.algorithm = dataclasses.replace(
        exp.algorithm, compressor=_FailingDecode(exp.algorithm.compressor, bad=1))
    new, m = exp.round(exp.init())
    assert m["rejected_updates"] == 1 and m["rejected_clients"] == [int(exp.sample_cohort(0)[1])]
    assert "PayloadError" in m["rejected_reasons"][0]
    assert torch.isfinite(new.w).all() and m["cohort_size"] == tiny["cohort"]["size"]


def test_server_checks_the_decoded_rows_too(tiny):
    # The dense update is fine (the client-side check passes); what the server
    # decodes is 1e30 times it (a damaged or hostile payload).
    cfg = load_config(tiny, ["rounds=1", "compression.name=sign"])
    exp = Experiment.from_config(cfg)
    exp.algorithm = dataclasses.replace(
        exp.algorithm, compressor=_FailingDecode(exp.algorithm.compressor, bad=3, scale=HUGE))
    new, m = exp.round(exp.init())
    assert m["rejected_clients"] == [int(exp.sample_cohort(0)[3])]
    ref = Experiment.from_config(cfg)
    _dropping(ref, 3)
    want, _ = ref.round(ref.init())
    assert torch.equal(new.w, want.w)


def test_absolute_bound_and_default_never_trigger_on_a_normal_run(tiny):
    res = fedloom.run(tiny)
    assert res.summary["rejected_updates_total"] == 0
    # an absolute bound below every update's norm rejects every client, every round
    res = fedloom.run(tiny, ["server.max_update_norm=1e-12"])
    assert res.summary["rejected_updates_total"] == 3 * tiny["cohort"]["size"]
    assert torch.equal(res.w, Experiment.from_config(load_config(tiny)).init().w)
    assert "max_update_norm" in res.metrics[0]["rejected_reasons"][0]


def test_screen_updates_rules():
    ok = torch.ones(2, dtype=torch.bool)
    # Two clients: the lower median is the smaller norm, so one huge update is
    # caught even in a cohort of two (the plain median, 5e29, would not catch it).
    assert list(screen_updates(torch.tensor([1.0, 1e30], dtype=torch.float64), ok,
                               max_norm=None, max_ratio=1e3)) == [1]
    norms = torch.tensor([0.0, 0.0, 0.0, 2.0, 3.0, 2500.0, 3001.0], dtype=torch.float64)
    ok = torch.tensor([True] * 6 + [False])
    # positive norms of the rows in: 2, 3, 2500 → lower median 3; 2500 > 1000 · 3? no
    assert screen_updates(norms, ok, max_norm=None, max_ratio=1e3) == {}
    # 2500 > 100 · 3 → rejected; the zero rows and the row already out are not judged
    assert list(screen_updates(norms, ok, max_norm=None, max_ratio=100.0)) == [5]
    assert list(screen_updates(norms, ok, max_norm=2.5, max_ratio=None)) == [4, 5]
    assert screen_updates(torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.bool),
                          max_norm=None, max_ratio=2.0) == {}


# ------------------------------------------------------------------ norm bounding
def test_clip_rows_bounds_the_norm_and_keeps_the_direction():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 50, generator=gen) * torch.tensor([1e-3, 0.5, 1, 2, 1e3, 1e30])[:, None]
    orig = rows.clone()
    norms = torch.linalg.vector_norm(rows.double(), dim=1)
    ok = torch.tensor([True, True, True, True, True, False])
    # norms (seed 0): 6.8e-3, 3.98, 6.44, 11.1, 6.2e3 and 6.3e30 (not ok): three above 5
    bound = 5.0
    n = clip_rows(rows, norms, ok, bound)
    assert n == int(((norms > bound) & ok).sum()) == 3
    after = torch.linalg.vector_norm(rows.double(), dim=1)
    for i in range(6):
        if not ok[i] or norms[i] <= bound:
            assert torch.equal(rows[i], orig[i])  # untouched, bit for bit
        else:
            # the bound up to float32 rounding, the same direction
            assert after[i] <= bound * (1 + 1e-6)
            assert math.isclose(float(after[i]), bound, rel_tol=1e-6)
            cos = float(rows[i].double() @ orig[i].double()) / float(after[i] * norms[i])
            assert cos > 1 - 1e-6


def test_clip_rows_exact_with_the_engines_float32_norms():
    # The engine's norms come from one float32 pass (relative error ~1e-6 at this d):
    # rows a few 1e-6 above the bound must still end at most at the bound.
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(8, 200_000, generator=gen)
    exact = torch.linalg.vector_norm(rows.double(), dim=1)
    rows *= ((1 + 3e-6 * torch.arange(8, dtype=torch.float64)) / exact).float()[:, None]
    norms = _row_norms(rows)
    clip_rows(rows, norms, torch.ones(8, dtype=torch.bool), 1.0)
    assert float(torch.linalg.vector_norm(rows.double(), dim=1).max()) <= 1 + 1e-6


class _Spy(Stateless):
    seen: ClassVar[list[torch.Tensor]] = []

    def __call__(self, updates, weights, state, *, info=None):
        _Spy.seen.append(torch.linalg.vector_norm(updates.double(), dim=1))
        return updates.mean(0), state, {}


@pytest.mark.parametrize("setting", [[], ["compression.name=qsgd"], ["aggregator.name=craft"]])
def test_clip_norm_in_the_engine_composes(tiny, monkeypatch, setting):
    registry.available("aggregator")
    monkeypatch.setitem(registry._REGISTRY["aggregator"], "fault_spy", _Spy)
    bound = 1e-3  # far below every update's norm here: every row is clipped
    if not setting or "qsgd" in setting[0]:
        _Spy.seen = []
        res = fedloom.run(tiny, ["aggregator.name=fault_spy", f"server.clip_norm={bound}",
                                 *setting])
        # the first two calls are the check at the door, on synthetic rows
        # (fedloom.aggregate.checks), before round 1
        assert all(float(n.max()) <= bound * (1 + 1e-6) for n in _Spy.seen[2:])
        assert len(_Spy.seen) == 2 + 3
    else:
        res = fedloom.run(tiny, [f"server.clip_norm={bound}", *setting])
    m = tiny["cohort"]["size"]
    assert [x["clipped_updates"] for x in res.metrics] == [m, m, m]
    assert res.summary["clipped_updates_total"] == 3 * m
    assert torch.isfinite(res.w).all()


@pytest.mark.parametrize("override, msg", [
    ("server.clip_norm=0", "server.clip_norm: must be > 0"),
    ("server.max_update_norm=-1", "server.max_update_norm: must be > 0"),
    ("server.max_norm_ratio=1", "server.max_norm_ratio: must be > 1"),
    ("server.max_norm_ratio=lots", "server.max_norm_ratio: must be"),
])
def test_bound_settings_validated(tiny, override, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(tiny, [override])
    cfg = load_config(tiny, ["server.max_norm_ratio=null", "server.clip_norm=null"])
    assert cfg.server.max_norm_ratio is None and cfg.server.clip_norm is None


def test_cli_summary_shows_clipped_updates(tiny, tmp_path, capsys):
    """The CLI's closing table names clipped updates when norm bounding acted (every
    honest update of this run is longer than 1e-9)."""
    import yaml

    from fedloom import cli

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny))
    rc = cli.main(["run", str(cfg), "rounds=1", "server.clip_norm=1e-9", "--quiet",
                   "--out", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert rc == 0
    line = next(x for x in out.splitlines() if x.startswith("clipped updates"))
    assert int(line.split()[-1]) == tiny["cohort"]["size"]
    assert "rejected rounds" not in out  # shown only when a step was skipped


# ------------------------------------------- absurd numbers beside the update (#36, 7)
@pytest.mark.parametrize("aggregator,field,value", [
    ("fednova", "steps", float("nan")),
    ("fednova", "steps", float("inf")),
    ("fednova", "steps", 10**30),
    ("fedavg", "num_samples", 10**39),
    ("fedavg", "num_samples", 1e300),
    ("fedavg", "num_samples", float("nan")),
    ("afl", "start_loss", float("nan")),
    ("afl", "start_loss", float("inf")),
    ("qfedavg", "start_loss", float("nan")),
])
def test_absurd_client_numbers_are_rejected_and_the_round_goes_on(tiny, aggregator, field,
                                                                  value):
    """A client (a deployed one, a broken plug-in method) reports a step count, sample
    count or start loss no client has: receive rejects it, with its reason, before
    aggregation; the round steps with the rest, to the model of the same round
    without that client."""
    def report(res):
        setattr(res, field, value)

    every = ["cohort.size=10"] if aggregator == "afl" else []  # AFL: the whole federation
    cfg = load_config(tiny, ["rounds=1", f"aggregator.name={aggregator}", *every])
    exp = Experiment.from_config(cfg)
    inner = exp.backend

    class Wrapped:
        def train_cohort(self, jobs):
            res = inner.train_cohort(jobs)
            report(res[1])
            return res

    exp.backend = Wrapped()
    start = exp.init()
    new, m = exp.round(start)
    assert m["rejected_updates"] == 1
    assert m["rejected_clients"] == [int(exp.sample_cohort(0)[1])]
    assert field in m["rejected_reasons"][0]
    assert torch.isfinite(new.w).all() and not torch.equal(new.w, start.w)
    ref = Experiment.from_config(cfg)
    _dropping(ref, 1)
    want, _ = ref.round(ref.init())
    assert torch.equal(new.w, want.w)
