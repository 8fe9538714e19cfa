"""FLTrust (fedloom.aggregate.fltrust) and the server's reference update
(fedloom.engine.stages.reference): golden values derived by hand, a sign-flipping
attacker's trust 0, a scaled update normalised to ‖g_0‖, NaN and zero-trust cohorts
(rejected and counted), the root data's draw, resume, and the refusals in one line."""

import numpy as np
import pytest
import torch

from conftest import round_with_a_nan_client, stop_and_resume
from fedloom import CohortInfo, make_aggregator
from fedloom.aggregate.fltrust import trust_scores
from fedloom.config import ConfigError, load_config
from fedloom.engine.experiment import Experiment
from fedloom.engine.stages.reference import draw_root
from fedloom.rng import numpy_gen

F64 = torch.float64


def _call(rows, ref, weights=None):
    U = torch.tensor(rows, dtype=F64) if not isinstance(rows, torch.Tensor) else rows
    g0 = torch.tensor(ref, dtype=F64) if not isinstance(ref, torch.Tensor) else ref
    m = U.shape[0]
    info = CohortInfo(clients=torch.arange(m), round=0, num_clients=m, reference=g0)
    w = torch.ones(m, dtype=F64) if weights is None else weights
    return make_aggregator("fltrust", root_samples=10)(U, w, None, info=info)


def test_golden_values():
    # g_0 = (3, 4), ‖g_0‖ = 5. cos((1, 0), g_0) = 3/5, cos((0, 2), g_0) = 4/5,
    # cos((-1, 0), g_0) = -3/5 → 0. Each row rescaled to norm 5: (5, 0), (0, 5).
    # direction = (0.6·(5, 0) + 0.8·(0, 5)) / 1.4 = (3, 4)/1.4
    out, _, m = _call([[1.0, 0.0], [0.0, 2.0], [-1.0, 0.0]], [3.0, 4.0])
    assert torch.allclose(out, torch.tensor([3 / 1.4, 4 / 1.4], dtype=F64), rtol=0, atol=1e-15)
    assert m["fltrust_trusted"] == 2.0 and m["fltrust_reference_norm"] == 5.0
    assert m["fltrust_trust_mean"] == pytest.approx(1.4 / 3, abs=1e-15)
    # g_0 = (0, 0, 2): cos((1, 1, 1)) = 1/√3, cos((0, 0, 7)) = 1, cos((4, 0, 0)) = 0
    # direction = 2 · (1/√3 · (1,1,1)/√3 + 1 · (0,0,1)) / (1/√3 + 1)
    #           = 2 · (1/3, 1/3, 4/3) / (1 + 1/√3); the zero row has trust 0
    out, _, m = _call([[1.0, 1.0, 1.0], [0.0, 0.0, 7.0], [4.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
                      [0.0, 0.0, 2.0])
    want = 2 * torch.tensor([1 / 3, 1 / 3, 4 / 3], dtype=F64) / (1 + 1 / 3**0.5)
    assert torch.allclose(out, want, rtol=0, atol=1e-15) and m["fltrust_trusted"] == 2.0


def test_unweighted_and_permutation_invariant():
    gen = torch.Generator().manual_seed(1)
    U, g0 = torch.randn(7, 40, generator=gen, dtype=F64), torch.randn(40, generator=gen, dtype=F64)
    a, _, _ = _call(U, g0)
    b, _, _ = _call(U, g0, weights=torch.arange(1, 8, dtype=F64))  # sample counts ignored
    perm = torch.tensor([6, 2, 0, 5, 1, 4, 3])
    c, _, _ = _call(U[perm], g0)
    assert torch.equal(a, b) and torch.allclose(a, c, rtol=0, atol=1e-15)


def test_sign_flipping_attacker_gets_trust_zero_and_no_say():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(50, generator=gen, dtype=F64)
    honest = base + 0.3 * torch.randn(6, 50, generator=gen, dtype=F64)
    g0 = base + 0.3 * torch.randn(50, generator=gen, dtype=F64)
    bad = -10.0 * honest[:2]  # fedloom's sign_flip: −s · own update
    ts = trust_scores(torch.cat([honest, bad]), g0)
    assert bool((ts[:6] > 0).all()) and ts[6:].tolist() == [0.0, 0.0]
    with_bad, _, m = _call(torch.cat([honest, bad]), g0)
    without, _, _ = _call(honest, g0)
    assert m["fltrust_trusted"] == 6.0
    assert torch.allclose(with_bad, without, rtol=0, atol=1e-15)


def test_scaled_update_is_normalised_to_the_reference_norm():
    gen = torch.Generator().manual_seed(2)
    U, g0 = torch.randn(5, 30, generator=gen, dtype=F64), torch.randn(30, generator=gen, dtype=F64)
    U[0] = U[0].abs() * g0.sign()  # a row trusted for sure
    a, _, _ = _call(U, g0)
    for s in (1e6, 1e-200, 1e300):  # a scaling attack (and a vanishing update)
        V = U.clone()
        V[0] = s * V[0]
        b, _, _ = _call(V, g0)
        assert torch.allclose(a, b, rtol=1e-14, atol=0)
    # the direction is a convex combination of vectors of norm ‖g_0‖
    assert float(a.norm()) <= float(g0.norm()) * (1 + 1e-15)
    huge, _, _ = _call(U * 1e300, g0 * 1e300)
    assert torch.isfinite(huge).all() and torch.allclose(huge / 1e300, a, rtol=1e-13, atol=0)


def test_ill_posed_cohorts_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^fltrust: an update is not finite$"):
        _call([[1.0, float("nan")], [1.0, 1.0]], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"^fltrust: every update has trust score 0 .*no update"):
        _call([[-1.0, 0.0], [0.0, -1.0], [0.0, 0.0]], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"^fltrust: the server's reference update is zero"):
        _call([[1.0, 0.0]], [0.0, 0.0])
    with pytest.raises(ValueError, match=r"^fltrust: the server's reference update is not fin"):
        _call([[1.0, 0.0]], [float("inf"), 0.0])
    with pytest.raises(ValueError, match=r"^fltrust: needs the server's reference update"):
        make_aggregator("fltrust")(torch.ones(2, 3, dtype=F64), torch.ones(2, dtype=F64), None)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=r"^aggregator\.options\.root_samples: must be"):
            make_aggregator("fltrust", root_samples=bad)


def test_root_draw_is_uniform_distinct_seeded_and_bounded():
    parts = [np.arange(0, 10), np.arange(20, 25), np.array([], dtype=np.int64)]
    x, y = torch.arange(30.0)[:, None], torch.arange(30)
    a = draw_root(8, parts, x, y, seed=5)
    assert a is not None and len(set(a.y.tolist())) == 8
    assert set(a.y.tolist()) <= set(range(10)) | set(range(20, 25))  # clients' samples only
    again = draw_root(8, parts, x, y, seed=5)
    assert again is not None and torch.equal(a.x, again.x)
    other = draw_root(8, parts, x, y, seed=6)
    assert other is not None and not torch.equal(a.y, other.y)
    assert draw_root(0, parts, x, y, seed=5) is None
    whole = draw_root(15, parts, x, y, seed=5)
    assert whole is not None and sorted(whole.y.tolist()) == [*range(10), *range(20, 25)]
    with pytest.raises(ConfigError, match=r"^aggregator\.options\.root_samples: 16 is more "
                                          r"than the 15 training samples the clients hold$"):
        draw_root(16, parts, x, y, seed=5)


def _fltrust(tiny, root=30):
    tiny["aggregator"] = {"name": "fltrust", "options": {"root_samples": root}}
    return tiny


def test_run_computes_the_reference_and_resumes_bit_identical(tiny, tmp_path):
    ref, res = stop_and_resume(_fltrust(tiny), ["rounds=2"], tmp_path / "r", stop_after=1)
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    norms = [m["fltrust_reference_norm"] for m in ref.metrics]
    assert all(n > 0 for n in norms) and len(set(norms)) == len(norms)  # a new g_0 each round


def test_reference_is_local_sgd_on_clean_root_data(tiny, monkeypatch):
    # the root samples are drawn before an attacker poisons its own: label flipping on
    # every client leaves them as the data gives them
    from fedloom.engine import binding

    seen = {}
    draw = binding.draw_root

    def spy(k, parts, x, y, seed, **kw):
        seen["y"] = y.clone()
        return draw(k, parts, x, y, seed, **kw)

    monkeypatch.setattr(binding, "draw_root", spy)
    cfg = load_config(_fltrust(tiny), ["attack.name=label_flip", "attack.fraction=0.5"])
    exp = Experiment.from_config(cfg)
    root = exp.around.root
    assert root is not None and root.x.shape[0] == 30
    assert not torch.equal(exp.clients.y, seen["y"])  # the attackers' labels were flipped
    # the root samples: 30 of the clients' training samples by (seed, "root"), with the
    # labels before poisoning; some of them are attackers' samples whose labels flipped
    pool = np.unique(np.concatenate(exp.clients.fed.train))
    pick = np.sort(numpy_gen(cfg.seed, purpose="root").choice(pool.size, 30, replace=False))
    idx = torch.from_numpy(pool[pick])
    assert torch.equal(root.x, exp.clients.x[idx]) and torch.equal(root.y, seen["y"][idx])
    assert bool((exp.clients.y[idx] != root.y).any())


def test_nan_client_rejected_and_counted_before_the_rule(tiny):
    exp = Experiment.from_config(load_config(_fltrust(tiny), ["rounds=1"]))
    _, m = round_with_a_nan_client(exp)  # cohort position 1 sends a NaN
    assert m["fltrust_trusted"] <= 3.0


def test_no_trust_anywhere_applies_no_update_and_is_counted(tiny):
    exp = Experiment.from_config(load_config(_fltrust(tiny), ["rounds=1"]))
    inner = exp.backend

    class Silent:  # every client sends a zero update: no cosine is positive
        def train_cohort(self, jobs):
            res = inner.train_cohort(jobs)
            for r in res:
                r.update.zero_()
            return res

    exp.backend = Silent()
    st = exp.init()
    new, m = exp.round(st.copy())
    assert m["rejected_rounds"] == 1 and m["rejected_updates"] == 0
    assert torch.equal(new.w, st.w)


@pytest.mark.parametrize(("over", "msg"), [
    (["server.secure_aggregation=true"], r"^aggregator\.name: fltrust is not a sum"),
    (["privacy.mode=central", "privacy.noise_multiplier=1.0"],
     r"^aggregator\.name: fltrust is not the plain mean"),
    (["aggregator.options.root_samples=100000"],
     r"^aggregator\.options\.root_samples: 100000 is more than the \d+ training samples"),
])
def test_refusals_in_one_line(tiny, over, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        Experiment.from_config(load_config(_fltrust(tiny), over))
    assert "\n" not in str(e.value)


def test_a_population_generated_on_demand_has_no_root_data():
    cfg = {"seed": 1, "rounds": 1, "dtype": "float64",
           "data": {"name": "synthetic-population", "num_clients": 10**6,
                    "partition": {"name": "natural"},
                    "options": {"dim": 3, "classes": 3, "max_size": 70, "test_users": 4}},
           "model": {"name": "mlp", "options": {"hidden": []}},
           "cohort": {"size": 8}, "client": {"lr": 0.05, "batch_size": 16, "steps": 2},
           "aggregator": {"name": "fltrust", "options": {"root_samples": 10}}}
    with pytest.raises(ConfigError, match=r"^aggregator\.options\.root_samples: a population "
                                          r"generated on demand stores no samples") as e:
        Experiment.from_config(load_config(cfg))
    assert "\n" not in str(e.value)
