"""System model (fedloom.system): simulated time, deadlines, availability, dropouts."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

import fedloom
from conftest import stop_and_resume
from fedloom.client.sgd import LocalSGD
from fedloom.config import ConfigError, SystemConfig, load_config
from fedloom.engine.experiment import Experiment
from fedloom.job import local_job
from fedloom.system import (
    Device,
    System,
    client_time,
    read_devices,
    samples_for_steps,
    steps_within,
)

# The dense payload of the 3-client example: an 8-byte header, d = 64·16 + 16 + 16·10 + 10
# = 1210 float32 values (4840 bytes) and the 4-byte CRC-32C trailer = 4852 bytes, the same
# both ways (the broadcast and the identity uplink share the format); 8·4852 = 38816 bits.
P = 4852
BITS = 8 * P

# client 0: latency 0.5, down 1 s, 32 samples at 32/s = 1 s, up 2 s   → t0 = 5.0
# client 1: latency 0.1, down 0.25 s, 32 samples at 16/s = 2 s, up 1 s → t1 = 3.45
# client 2: no latency, down 0.5 s, 32 samples at 64/s = 0.5 s, up 0.5 s → t2 = 1.5
DEVICES = f"""client,speed,up_bps,down_bps,latency
0,32,{BITS / 2},{BITS},0.5
1,16,{BITS},{BITS * 4},0.1
2,64,{BITS * 2},{BITS * 2},0
"""
T = [5.0, 3.45, 1.5]


def three(tmp_path, **system) -> dict:
    path = tmp_path / "devices.csv"
    path.write_text(DEVICES)
    return {
        "seed": 1, "rounds": 2,
        "data": {"name": "digits", "num_clients": 3, "partition": {"name": "iid"}},
        "model": {"name": "mlp", "options": {"hidden": [16]}},
        "cohort": {"size": 3},
        # 2 steps of 16 samples each: 32 samples per client (479 samples each)
        "client": {"lr": 0.1, "batch_size": 16, "steps": 2},
        "checkpoint": {"every": 0},
        "system": {"profile": "csv", "path": str(path), **system},
    }


def test_samples_and_steps_golden_and_inverse():
    # n = 10, B = 4: batches 4, 4, 2 per epoch; 4 steps = one epoch (10) + one batch (4)
    assert samples_for_steps(4, 10, 4) == 14
    assert samples_for_steps(3, 10, 4) == 10
    assert samples_for_steps(2, 3, 16) == 6  # n < B: every step is the whole client
    assert steps_within(13, 10, 4, 100) == 3
    assert steps_within(14, 10, 4, 100) == 4
    assert steps_within(math.inf, 10, 4, 7) == 7
    rng = np.random.default_rng(0)
    for _ in range(300):
        n, b = int(rng.integers(1, 60)), int(rng.integers(1, 20))
        s = int(rng.integers(0, 40))
        x = samples_for_steps(s, n, b)
        assert steps_within(x, n, b, 10_000) == s        # the inverse on the grid
        assert steps_within(x - 1, n, b, 10_000) == max(0, s - 1) or s == 0
        assert samples_for_steps(s + 1, n, b) > x        # strictly increasing


def test_client_time_formula():
    dev = Device(speed=32, up_bps=BITS / 2, down_bps=BITS, latency_s=0.5)
    assert client_time(dev, P, 32, P) == 5.0
    # a rate of 0 is a term that takes no time
    assert client_time(Device(0, 0, 0, 0.25), P, 32, P) == 0.5


def test_client_time_agrees_with_fedscales_formula():
    # FedScale's get_completion_time: 3·B·s·c/1000 s of compute (c ms/sample of inference)
    # + (up + down)/bandwidth; the same device here: v = 1000/(3c) samples/s, both links
    # at the bandwidth, no latency. Equal when n is a multiple of B (no short batch).
    for c, b, s, n, up, down, bw in ((5.0, 32, 20, 640, 1e5, 8e5, 1e6),
                                      (0.7, 10, 7, 30, 3e3, 3e3, 2e4)):
        fedscale = 3 * b * s * c / 1000 + (up + down) / bw
        mine = client_time(Device(1000 / (3 * c), 8 * bw, 8 * bw, 0.0), int(down),
                           samples_for_steps(s, n, b), int(up))
        assert mine == pytest.approx(fedscale, rel=1e-12)


def test_three_clients_simulated_time_is_hand_computed(tmp_path):
    res = fedloom.run(three(tmp_path), [])
    exp = Experiment.from_config(load_config(three(tmp_path)))
    assert exp.around.downlink_size == P
    sysm = exp.system
    assert sysm is not None
    for k, t in enumerate(T):
        assert client_time(sysm.device(k), P, 32, P) == pytest.approx(t, rel=1e-12)
    m1, m2 = res.metrics
    assert m1["uplink_bytes"] == 3 * P and m1["downlink_bytes"] == 3 * P
    assert m1["sim_round_s"] == 5.0          # the slowest client, t0
    assert m2["sim_time_s"] == 10.0           # two equal rounds
    assert res.summary["sim_time_s"] == 10.0
    assert m1["local_steps_mean"] == 2.0


def test_timing_alone_changes_no_bit(tmp_path):
    plain = copy.deepcopy(three(tmp_path))
    del plain["system"]
    assert (fedloom.run(plain, []).summary["model_sha256"]
            == fedloom.run(three(tmp_path), []).summary["model_sha256"])


def test_deadline_drop(tmp_path):
    cfg = three(tmp_path, deadline_s=4.0, late="drop")
    cfg["client"]["method"] = "scaffold"  # a per-client state row to watch
    res = fedloom.run(cfg, ["rounds=1"])
    m = res.metrics[0]
    assert m["late_clients"] == 1 and m["dropped_client_ids"] == [0]
    assert m["sim_round_s"] == 4.0            # the server waited until the deadline
    assert m["uplink_bytes"] == 2 * P         # client 0's late payload is not counted
    exp = Experiment.from_config(load_config(cfg, ["rounds=1"]))
    st, _ = exp.round(exp.init())
    control = st.clients.gather("control", torch.arange(3))
    assert bool((control[0] == 0).all())      # the late client's state is untouched
    assert bool((control[1] != 0).any()) and bool((control[2] != 0).any())


def test_deadline_partial_cuts_steps_and_fednova_sees_them(tmp_path):
    # deadline 4.5: client 0 has 4.5 − 2·0.5 − 1 (down) − 2 (expected up: the dense
    # payload, exact) = 0.5 s of compute = 16 samples at 32/s = 1 step of 16 (of 2).
    # Clients 1 and 2 fit with both steps (3.45 s, 1.5 s).
    cfg = three(tmp_path, deadline_s=4.5, late="partial")
    cfg["aggregator"] = {"name": "fednova"}
    res = fedloom.run(cfg, ["rounds=1"])
    m = res.metrics[0]
    assert m["cut_clients"] == 1 and m["late_clients"] == 0 and m["dropped_clients"] == 0
    assert m["local_steps_mean"] == pytest.approx(5 / 3)
    assert m["sim_round_s"] == 4.5            # 0.5 + 1 + 16/32 + 0.5 + 2
    n = [479, 479, 479]
    assert m["fednova_tau_eff"] == pytest.approx((n[0] * 1 + n[1] * 2 + n[2] * 2) / sum(n))
    # vmap lock-step: the cut client is masked after its step; same model
    vm = fedloom.run(cfg, ["rounds=1", "backend=vmap"])
    assert vm.metrics[0]["fednova_tau_eff"] == m["fednova_tau_eff"]
    assert torch.allclose(vm.w, res.w, atol=1e-6)
    # a deadline with no room for one step drops the client (and the round waits)
    tight = fedloom.run(three(tmp_path, deadline_s=4.0, late="partial"), ["rounds=1"])
    assert tight.metrics[0]["late_clients"] == 1
    assert tight.metrics[0]["dropped_client_ids"] == [0]
    assert tight.metrics[0]["sim_round_s"] == 4.0


def test_max_steps_runs_the_first_steps_exactly():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(5, 3))
    from fedloom.params import Layout

    layout = Layout.from_module(module)
    x, y = torch.randn(40, 5), torch.randint(0, 3, (40,))
    w = layout.flatten(module)
    job = local_job(0, 0, w, 0.1, x, y, gen_seed=7)
    full = LocalSGD(module, layout, batch_size=8, steps=5, momentum=0.9)
    one = LocalSGD(module, layout, batch_size=8, steps=3, momentum=0.9)
    cut = full.run(local_job(0, 0, w, 0.1, x, y, gen_seed=7, max_steps=3))
    ref = one.run(job)
    assert cut.steps == 3
    assert torch.equal(cut.update, ref.update)


def test_unavailable_clients_are_never_sampled():
    for pattern, extra in (("none", {}), ("sine", {"amplitude": 0.5}),
                           ("onoff", {"on_fraction": 0.3})):
        cfg = SystemConfig(availability=0.6, pattern=pattern, period=8, **extra)
        sysm = System(cfg, seed=5, num_clients=40, batch_size=8, cohort_size=10)
        seen = 0
        for r in range(30):
            avail = sysm.available(r)
            gen = np.random.default_rng(r)
            cohort = sysm.sample(r, gen, 10).numpy()
            assert avail[cohort].all()
            assert len(set(cohort.tolist())) == len(cohort) == min(10, int(avail.sum()))
            seen += int(avail.sum())
            if pattern == "onoff":  # off clients are never available
                off = [k for k in range(40) if sysm.p_available(r, k) == 0]
                assert not avail[off].any()
        assert 0 < seen < 30 * 40
    # the probability is what it says (seeded; 200 clients × 100 rounds, σ ≈ 0.0032)
    sysm = System(SystemConfig(availability=0.3), seed=1, num_clients=200, batch_size=8,
                  cohort_size=10)
    frac = np.mean([sysm.available(r).mean() for r in range(100)])
    assert abs(frac - 0.3) < 0.02


def test_short_cohort_takes_all_available_and_counts_it(tiny):
    res = fedloom.run(tiny, ["system.availability=0.2", "rounds=4"])
    exp = Experiment.from_config(load_config(tiny, ["system.availability=0.2", "rounds=4"]))
    for r, m in enumerate(res.metrics):
        avail = exp.system.available(r)
        cohort = exp.sample_cohort(r).numpy()
        assert avail[cohort].all()
        assert m["available_clients"] == int(avail.sum())
        assert m["cohort_size"] == min(4, int(avail.sum()))
        assert m["cohort_short"] == int(avail.sum() < 4)
    assert any(m["cohort_short"] for m in res.metrics)
    # a round with nobody available has no training loss, and is no divergence
    empty = fedloom.run(tiny, ["system.availability=0.05", "rounds=4"])
    assert any(m["cohort_size"] == 0 for m in empty.metrics)
    assert "warnings" not in empty.summary


def test_mid_round_dropout_leaves_state_and_is_counted(tiny):
    ov = ["system.dropout=0.3", "rounds=1", "compression.name=topk",
          "compression.options.ratio=0.1", "compression.feedback=ef"]
    exp = Experiment.from_config(load_config(tiny, ov))
    cohort = exp.sample_cohort(0)
    st, m = exp.round(exp.init())
    gone = m.get("dropped_client_ids", [])
    assert m["dropout_clients"] == len(gone) and 0 < len(gone) < len(cohort)
    res_rows = st.clients.gather("fb.residual", cohort)
    for i, k in enumerate(cohort.tolist()):
        assert bool((res_rows[i] == 0).all()) == (k in gone)


def test_resume_keeps_the_simulated_clock(tmp_path):
    cfg = three(tmp_path, deadline_s=4.5, late="partial", availability=0.8, dropout=0.2)
    cfg["data"]["num_clients"] = 3
    cfg["client"]["steps"] = None
    cfg["client"]["epochs"] = 1
    cfg["client"]["batch_size"] = 64
    cfg["system"] = {"profile": "lognormal", "speed": [300, 1.0], "up_bps": [3e4, 0.5],
                     "down_bps": 1e6, "latency_s": 0.1, "deadline_s": 2.0,
                     "late": "partial", "availability": 0.8, "dropout": 0.2}
    cfg["checkpoint"] = {"every": 1}
    ref, res = stop_and_resume(cfg, ["rounds=5"], tmp_path / "run", stop_after=2)
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    assert [m["sim_time_s"] for m in res.metrics] == [m["sim_time_s"] for m in ref.metrics]
    assert res.summary["sim_time_s"] == ref.summary["sim_time_s"] > 0
    assert any(m.get("cut_clients") for m in ref.metrics)


def test_system_off_is_bit_identical_to_no_section(tiny):
    """A run with the section off, and one that only times (no dropout, no deadline),
    end with the model of a run without the section, bit for bit. Both sides are
    computed here, at one pinned thread (float32 reductions split over more threads
    round differently), so the check holds on any CPU."""
    tiny = {**tiny, "backend": {"name": "sequential", "threads": 1}}
    before = fedloom.run(tiny).summary["model_sha256"]
    off = {**tiny, "system": {"profile": "off", "availability": 1.0, "dropout": 0.0}}
    res = fedloom.run(off)
    assert res.summary["model_sha256"] == before
    assert not any(k.startswith("sim_") for k in res.summary)
    # timing alone observes: the same bits, plus the clock
    timed = fedloom.run(tiny, ["system.profile=lognormal", "system.speed=[100,1]",
                               "system.up_bps=1e6"])
    assert timed.summary["model_sha256"] == before
    assert timed.summary["sim_time_s"] > 0


def test_devices_are_drawn_per_client():
    cfg = SystemConfig(profile="lognormal", speed=[100.0, 1.0], up_bps=[1e6, 0.5],
                       latency_s=0.05)
    small = System(cfg, seed=2, num_clients=10, batch_size=8, cohort_size=2)
    big = System(cfg, seed=2, num_clients=2000, batch_size=8, cohort_size=2)
    assert all(small.device(k) == big.device(k) for k in range(10))
    speeds = np.array([big.device(k).speed for k in range(2000)])
    assert abs(np.median(speeds) / 100 - 1) < 0.1
    assert abs(np.std(np.log(speeds)) - 1.0) < 0.05
    assert {big.device(k).down_bps for k in range(50)} == {0.0}   # not modelled
    assert {big.device(k).latency_s for k in range(50)} == {0.05}
    uni = System(SystemConfig(profile="uniform", speed=[10.0, 20.0]), seed=0,
                 num_clients=500, batch_size=8, cohort_size=2)
    s = np.array([uni.device(k).speed for k in range(500)])
    assert s.min() >= 10 and s.max() <= 20 and abs(s.mean() - 15) < 0.5
    classes = SystemConfig(profile="classes", classes=[
        {"name": "phone", "p": 0.25, "speed": 10.0, "up_bps": 1e5},
        {"name": "laptop", "p": 0.75, "speed": 100.0, "up_bps": 1e7}])
    cfg_c = load_config({"system": {"profile": "classes", "classes": classes.classes}}).system
    cl = System(cfg_c, seed=0, num_clients=2000, batch_size=8, cohort_size=2)
    phones = np.mean([cl.device(k).speed == 10.0 for k in range(2000)])
    assert abs(phones - 0.25) < 0.03


@pytest.mark.parametrize("system, field", [
    ({"profile": "uniform", "speed": [20, 10]}, "system.speed: low 20 is above high 10"),
    ({"profile": "uniform", "up_bps": [0, 10]}, "system.up_bps: low must be > 0"),
    ({"profile": "lognormal", "speed": [1, 2, 3]}, "system.speed: one number"),
    ({"deadline_s": 3.0}, "system.deadline_s: needs a system.profile"),
    ({"speed": 10}, "system.speed: not used (system.profile is off)"),
    ({"profile": "classes"}, "system.classes: profile classes needs"),
    ({"profile": "classes", "classes": [{"p": 0.5}]}, "system.classes: the probabilities"),
    ({"profile": "csv"}, "system.path: profile csv needs"),
    ({"availability": 0.0}, "system.availability: must be > 0"),
])
def test_bad_system_config_one_line(system, field):
    with pytest.raises(ConfigError) as e:
        load_config({"system": system})
    assert str(e.value).startswith(field) and "\n" not in str(e.value)


def test_bad_device_file_names_file_and_line(tmp_path):
    p = tmp_path / "d.csv"
    for text, want in (
        ("client,speed\n0,1\n", "the header must name"),
        ("client,speed,up_bps,down_bps,latency\n0,1,1,1,x\n", "line 2: not a number"),
        ("client,speed,up_bps,down_bps,latency\n0,1,1,1,0\n0,1,1,1,0\n", "line 3: client 0 "
         "appears twice"),
        ("client,speed,up_bps,down_bps,latency\n5,1,1,1,0\n", "line 2: client 5 is not"),
        ("client,speed,up_bps,down_bps,latency\n0,-1,1,1,0\n", "line 2: speed, bandwidths"),
        ("client,speed,up_bps,down_bps,latency\n0,1,1,1,0\n", "no row for clients [1]"),
    ):
        p.write_text(text)
        with pytest.raises(ConfigError, match=want.replace("[", r"\[").replace("]", r"\]")):
            read_devices(p, 2)
    with pytest.raises(ConfigError, match="file not found"):
        read_devices(tmp_path / "none.csv", 2)


def test_flower_refuses_the_simulated_clock(tiny):
    pytest.importorskip("flwr")
    from fedloom.integrations.flower import FedloomStrategy

    with pytest.raises(ConfigError, match=r"^system\.profile: simulated devices"):
        FedloomStrategy(tiny, ["system.profile=lognormal", "system.speed=100"])
    with pytest.raises(ConfigError, match=r"^system\.profile: simulated devices"):
        FedloomStrategy(tiny, ["system.dropout=0.1"])
    FedloomStrategy(tiny, ["system.availability=0.5"])  # cohort sampling applies there


def test_sweep_page_reads_the_simulated_clock(tmp_path):
    from fedloom.report.sweep import _time_plot, _timed, _to_target

    def run(accs, dt):  # evaluations every round, dt simulated seconds a round
        return {"_metrics": [{"round": r + 1, "test_acc": a, "uplink_bytes_total": 1e6 * (r + 1),
                              "sim_time_s": dt * (r + 1)} for r, a in enumerate(accs)]}

    runs = [run([0.2, 0.6, 0.8], 1800.0), run([0.3, 0.5, 0.9], 3600.0)]
    assert _timed({"m": {"runs": runs}})
    # 0.55 is first reached at round 2 (60 min) and round 3 (180 min): mean 120 min
    assert _to_target(runs, 0.55, timed=True) == ["2", "2.5", "120.0"]
    assert _to_target(runs, 0.95, timed=True) == ["not reached", "–", "–"]
    pytest.importorskip("matplotlib")
    assert _time_plot(tmp_path / "t.png", "x", {"m": runs})
    assert (tmp_path / "t.png").stat().st_size > 0
