"""The event-driven round modes (fedloom.engine.events): FedAsync and FedBuff on
the simulated clock, through the synchronous round's own objects."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import fedloom
from conftest import TINY, stop_and_resume
from fedloom.config import ConfigError, SystemConfig, load_config
from fedloom.engine.events import staleness_weight
from fedloom.engine.experiment import Experiment

DEVICES = {"profile": "uniform", "speed": [50, 500], "up_bps": [1e5, 1e6], "down_bps": 1e7}


def _cfg(mode: str, **system) -> dict:
    cfg = copy.deepcopy(TINY)
    cfg["rounds"] = 5
    cfg["server"] = {"lr": 1.0}
    cfg["system"] = {**DEVICES, "mode": mode, "concurrency": 4, "buffer": 2, **system}
    return cfg


def test_staleness_weights():
    """FedAsync's s(τ): constant 1; polynomial (1+τ)^-a; hinge 1 up to b, then
    1/(a(τ−b)+1)."""
    c = SystemConfig(staleness="constant")
    p = SystemConfig(staleness="polynomial", staleness_a=0.5)
    h = SystemConfig(staleness="hinge", staleness_a=2.0, staleness_b=3.0)
    assert [staleness_weight(c, t) for t in (0, 5)] == [1.0, 1.0]
    assert staleness_weight(p, 0) == 1.0 and staleness_weight(p, 3) == pytest.approx(0.5)
    assert [staleness_weight(h, t) for t in (0, 3, 4, 5)] == pytest.approx([1, 1, 1 / 3, 1 / 5])


@pytest.mark.parametrize("mode", ["async", "buffered"])
def test_deterministic_and_resumed_bit_identically(mode, tmp_path):
    cfg = _cfg(mode)
    ref, resumed = stop_and_resume(cfg, ["checkpoint.every=1"], tmp_path / "run")
    again = fedloom.run(_cfg(mode))
    assert again.summary["model_sha256"] == ref.summary["model_sha256"]
    assert resumed.summary["model_sha256"] == ref.summary["model_sha256"]
    assert [m["sim_time_s"] for m in resumed.metrics[-3:]] == [
        m["sim_time_s"] for m in ref.metrics[-3:]]


@pytest.mark.parametrize("mode, k", [("async", 1), ("buffered", 2)])
def test_steps_take_k_arrivals_in_time_order_and_no_client_twice(mode, k):
    exp = Experiment.from_config(load_config(_cfg(mode)))
    st = exp.init()
    clock = 0.0
    for _ in range(6):
        st, m = exp.round(st)
        assert m["cohort_size"] == k
        assert m["sim_time_s"] >= clock  # the clock never runs back
        clock = m["sim_time_s"]
        flight = st.events["flight"]
        clients = [int(f[2]) for f in flight]
        assert len(flight) == 4 and len(set(clients)) == 4  # concurrency, none twice
        assert all(f[0] >= clock for f in flight)  # nobody in flight has arrived yet
        # only the versions someone in flight started from are kept
        assert set(st.events["versions"]) == {str(int(f[3])) for f in flight}
    exp.close()


class Spy:
    """FedAvg that keeps the rows it was given."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []

    def init(self, layout):
        return None

    def __call__(self, updates, weights, state, *, info=None):
        self.rows.append(updates.clone())
        p = weights.to(updates.dtype) / weights.sum()
        return (p[:, None] * updates).sum(0), state, {}


def test_fedasync_row_is_the_mixing_rule():
    """FedAsync: w ← (1 − α s(τ)) w + α s(τ) w_k, i.e. the row s(τ)(w_t − w_v + Δ_k),
    Δ_k the client's update from w_v, retrained here from its dispatch version."""
    cfg = load_config(_cfg("async", staleness="polynomial", staleness_a=0.5), ["dtype=float64"])
    spy = Spy()
    exp = Experiment.from_config(cfg, components=fedloom.Components(aggregator=spy))
    st = exp.init()
    seen_stale = False
    for _ in range(6):
        before = st
        st, _ = exp.round(before)
        ev = before.events or {}
        if not ev:
            continue
        first = min(ev["flight"])  # the arrival this step took
        k, v = int(first[2]), int(first[3])
        ver = ev["versions"][str(v)]
        at_v = dataclasses.replace(before, next_round=v, w=ver["w"],
                                   feedback_state=ver["feedback"], method_state=ver["method"],
                                   buffers=ver["buffers"])
        plan = exp.plan_round(at_v, cohort=torch.tensor([k]))
        (res,) = exp.backend.train_cohort(plan.jobs)
        tau = before.next_round - v
        s = (1 + tau) ** -0.5
        # the update as the server decodes it from the wire (float32 on the wire)
        sent = exp.uplink.decode(exp.uplink.encode(res.update), res.update.numel())
        want = ((before.w - ver["w"]) + sent.to(torch.float64)) * s
        assert torch.allclose(spy.rows[-1][0], want, rtol=0, atol=1e-12)
        # server.lr = α = 1: the new model is w_t − row
        assert torch.allclose(st.w, before.w - spy.rows[-1][0], rtol=0, atol=1e-12)
        seen_stale |= tau > 0
    assert seen_stale  # the check covered a stale arrival
    exp.close()


@pytest.mark.parametrize("backend", ["lockstep", "vmap", "process"])
def test_batched_backends_run_the_same_steps(backend):
    ref = fedloom.run(_cfg("buffered"), ["dtype=float64"])
    got = fedloom.run(_cfg("buffered"), ["dtype=float64", f"backend.name={backend}"])
    assert got.summary["model_sha256"] == ref.summary["model_sha256"]


@pytest.mark.parametrize("overrides, field", [
    (["system.profile=off", "system.speed=0", "system.up_bps=0", "system.down_bps=0"],
     "system.profile"),
    (["system.deadline_s=5"], "system.deadline_s"),
    (["system.availability=0.5"], "system.availability"),
    (["system.concurrency=10"], "system.concurrency"),  # 10 + 2 − 1 > 10 clients
    (["compression.feedback=scafcom"], "compression.feedback.name"),
    (["privacy.mode=central", "privacy.noise_multiplier=1.0"], "privacy.mode"),
])
def test_refused_combinations_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=rf"^{field.replace('.', '[.]')}: "):
        Experiment.from_config(load_config(_cfg("buffered"), overrides))


def _rows(exp, st):
    ids = list(range(exp.fed.num_clients))
    return {f: st.clients.gather(f, ids).clone() for f in st.clients.fields}


def test_state_rows_change_only_for_accepted_arrivals():
    """Error-feedback residuals under staleness: a step writes the rows of the clients
    it took (accepted) and of no one else — not of those still in flight."""
    exp = Experiment.from_config(load_config(_cfg("buffered"), [
        "compression.name=topk", "compression.options={ratio: 0.1}",
        "compression.feedback=ef"]))
    st = exp.init()
    assert st.clients.fields  # the policy keeps a residual row a client
    for _ in range(5):
        before = _rows(exp, st)
        ev = st.events
        st, m = exp.round(st)
        after = _rows(exp, st)
        changed = {k for f in before for k in range(exp.fed.num_clients)
                   if not torch.equal(before[f][k], after[f][k])}
        # in flight through the whole step: the same dispatch (order number) before and after
        stayed = ({(int(f[1]), int(f[2])) for f in (ev or {}).get("flight", [])}
                  & {(int(f[1]), int(f[2])) for f in st.events["flight"]})
        assert m["rejected_updates"] == 0
        assert not changed & {k for _, k in stayed}
        assert 1 <= len(changed) <= 2  # the step's K = 2 arrivals
    exp.close()


def test_a_rejected_arrival_changes_nothing_but_the_clock():
    exp = Experiment.from_config(load_config(_cfg("buffered"), [
        "compression.name=topk", "compression.options={ratio: 0.1}",
        "compression.feedback=ef", "server.max_update_norm=1e-12"]))
    st = exp.init()
    w0, rows0 = st.w.clone(), _rows(exp, st)
    for _ in range(3):
        st, m = exp.round(st)
        assert m["rejected_updates"] == 2 and m["rejected_rounds"] == 0
    assert torch.equal(st.w, w0) and st.sim_time_s > 0
    assert all(torch.equal(rows0[f], v) for f, v in _rows(exp, st).items())
    exp.close()


@pytest.mark.parametrize("overrides", [
    ["client.method=scaffold"],                                  # control variates
    ["compression.name=topk", "compression.options={ratio: 0.1}",
     "compression.feedback=flare"],                              # FLARE's accumulators
    ["client.method=ditto"],                                     # personal models
], ids=["scaffold", "flare", "ditto"])
def test_per_client_state_under_staleness_resumes_bit_identically(overrides, tmp_path):
    """The state a client keeps (SCAFFOLD's c_k and the server's c, FLARE's
    accumulator, Ditto's personal model) read at its job and written at its arrival: a
    buffered run with it is deterministic and resumes bit-identically mid-run."""
    cfg = _cfg("buffered")
    ref, resumed = stop_and_resume(cfg, [*overrides, "checkpoint.every=1"], tmp_path / "run")
    assert resumed.summary["model_sha256"] == ref.summary["model_sha256"]
    assert all(m["rejected_updates"] == 0 for m in ref.metrics)
    exp = Experiment.from_config(load_config(cfg, overrides))
    st = exp.init()
    for _ in range(3):
        st, _ = exp.round(st)
    # only the clients that arrived have rows: at most 3 steps × K = 2 of them
    assert st.clients.fields  # each case keeps rows per client
    rows = st.clients.gather(st.clients.fields[0], list(range(exp.fed.num_clients)))
    written = int((rows != 0).any(dim=1).sum())
    assert 1 <= written <= 6
    exp.close()
