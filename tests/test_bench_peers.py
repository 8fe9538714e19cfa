"""The peers section of ``make bench`` (benchmarks/peers.py): what fedloom hands the
peers (data, initial parameters, cohorts, sample orders) is enough to replay its
round exactly, the pfl CNN is the benchmark's, and the report and goals follow the
figures. No peer is installed here."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import peer_common  # noqa: E402
import peers  # noqa: E402

from fedloom.config import ModelConfig, load_config  # noqa: E402
from fedloom.engine.experiment import Experiment  # noqa: E402
from fedloom.models import build_model  # noqa: E402
from fedloom.rng import Purpose, derive_seed  # noqa: E402

TOY = {"model": "mlp", "hidden": 16, "in_shape": [784], "classes": 10, "lr": 0.05,
       "batch": 32, "epochs": 1, "data": "reference", "clients": 6, "samples": 40,
       "per_round": 3}


@pytest.fixture(scope="module")
def toy_spec(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec")
    spec = peers.export_spec(TOY, folder, rounds=2)
    return folder, spec


@pytest.fixture
def one_thread():
    """One intra-op thread (two spin-wait on a machine busy with other jobs), as
    fedloom's ``backend.threads=1`` sets it process-wide; then put back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _experiment(folder: Path, spec: dict) -> Experiment:
    from peer_fedloom import dataset, fedloom_config

    x, y = np.load(folder / "x.npy"), np.load(folder / "y.npy")
    return Experiment.from_config(load_config(fedloom_config(spec), ["backend=sequential",
                                                         "backend.threads=1"]),
                      data=dataset(spec, x, y))


def test_export_is_fedloom_own_run(toy_spec, one_thread):
    folder, _ = toy_spec
    saved = torch.load(folder / "spec.pt", weights_only=True)
    assert saved["cohorts"].shape == (2, 3) and saved["perms"].shape == (2, 3, 40)
    exp = _experiment(folder, saved)
    st = exp.init()
    assert torch.equal(torch.cat([t.reshape(-1) for t in saved["init"]]), st.w)
    for r in range(2):
        assert torch.equal(saved["cohorts"][r], exp.sample_cohort(r))
        for pos, k in enumerate(saved["cohorts"][r].tolist()):
            # the sample order is the one fedloom's trainer batches by
            gen = torch.Generator()
            gen.manual_seed(derive_seed(0, r, k, Purpose.BATCH))
            batches = exp.trainer.batch_indices(40, gen)
            assert [len(b) for b in batches] == [32, 8]
            assert torch.equal(torch.cat(batches), saved["perms"][r][pos])
            assert sorted(saved["perms"][r][pos].tolist()) == list(range(40))
    # client k owns rows k·n … (k+1)·n − 1: the reference workload's samples of client k
    import workload

    x = np.load(folder / "x.npy")
    assert np.array_equal(x[80:120], workload.client_arrays(2, 40)[0].numpy())
    exp.close()


def test_plain_replay_of_the_spec_matches_fedloom_round(toy_spec, one_thread):
    """What each peer does with the spec (FedAvg of SGD on the given batches from the
    given start), in plain PyTorch, gives fedloom's round to float32 rounding."""
    folder, _ = toy_spec
    spec, x, y = peer_common.load_spec(folder)
    start = peer_common.build_model(spec)
    acc = torch.zeros_like(peer_common.flat(start))
    for pos in range(spec["per_round"]):
        model = peer_common.build_model(spec)
        xs, ys = peer_common.ordered(spec, x, y, 0, pos)
        for s in range(0, len(ys), spec["batch"]):
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(xs[s:s + spec["batch"]]),
                                              ys[s:s + spec["batch"]]).backward()
            with torch.no_grad():  # torch.optim.SGD's step without momentum (its first
                for p in model.parameters():  # construction imports torch._dynamo)
                    p.add_(p.grad, alpha=-spec["lr"])
        acc += peer_common.flat(model) / spec["per_round"]
    exp = _experiment(folder, spec)
    st, _ = exp.round(exp.init())
    assert not torch.equal(st.w, peer_common.flat(start))  # the round moved the model
    torch.testing.assert_close(st.w, acc, rtol=1e-5, atol=1e-6)
    exp.close()


def test_pfl_cnn_is_the_benchmark_cnn():
    m = build_model(ModelConfig(name="pfl_cnn"), (3, 32, 32), 10, 0)
    # conv 3x3 valid: 32→30→28, max-pool 2 → 14; 14·14·64 = 12,544 features
    expected = (3 * 9 * 32 + 32) + (32 * 9 * 64 + 64) + (12544 * 128 + 128) + (128 * 10 + 10)
    assert expected == 1_626_442 == sum(p.numel() for p in m.parameters())
    assert m(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert sum(isinstance(x, torch.nn.Dropout) for x in m.modules()) == 2
    # Glorot-uniform weights (bound √(6/(fan_in+fan_out))), PyTorch's default biases
    # (bound 1/√fan_in), as pfl's code after its xavier_uniform_ pass
    conv2 = m.features[2]
    fan_in, fan_out = 32 * 9, 64 * 9
    assert conv2.weight.abs().max() <= math.sqrt(6 / (fan_in + fan_out))
    assert conv2.weight.abs().max() > 0.9 * math.sqrt(6 / (fan_in + fan_out))
    assert 0 < conv2.bias.abs().max() <= 1 / math.sqrt(fan_in)
    again = build_model(ModelConfig(name="pfl_cnn"), (3, 32, 32), 10, 0)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), again.parameters(),
                                                 strict=True))
    with pytest.raises(ValueError, match="pfl_cnn"):
        build_model(ModelConfig(name="pfl_cnn"), (784,), 10, 0)


def test_peer_cnn_takes_fedloom_parameters():
    spec = {"model": "pfl_cnn", "in_shape": [3, 32, 32], "classes": 10}
    ours = build_model(ModelConfig(name="pfl_cnn"), (3, 32, 32), 10, 1).eval()
    spec["init"] = [p.detach().clone() for p in ours.parameters()]
    theirs = peer_common.build_model(spec).eval()
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(theirs(x), ours(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"spec\.pt"):
        peer_common.load_flat(theirs, spec["init"][:-1])


def test_quick_never_installs(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "VENVS", tmp_path)
    py, why = peers.ensure_venv("pfl", quick=True)
    assert py is None and "\n" not in why and "pfl" in why and "--quick" in why
    assert not any(tmp_path.iterdir())


def _section() -> dict:
    def fw(t: float, launch: float) -> dict:
        return {"round_s": t, "rounds_s": [t, t], "launch_s": launch}

    return {"load_before": [6.0, 5, 5], "load_after": [7.5, 6, 5], "repeats": 2,
            "skipped": {"flgo": "peers: flgo skipped: no venv"},
            "workloads": {"reference/10": {
                "model": "mlp", "clients": 100, "samples": 600, "per_round": 10,
                "batch": 32, "lr": 0.05, "data": "synthetic", "rounds": 3,
                "frameworks": {"fedloom:sequential": fw(0.2, 3.0),
                               "fedloom:lockstep": fw(0.1, 3.1),
                               "pfl": fw(0.4, 9.0)},
                "equivalence": {"rounds": 3, "dropout": False,
                                "fedloom:lockstep": {"max_abs_diff": 0.0, "relative": 0.0},
                                "pfl": {"max_abs_diff": 2e-8, "relative": 1e-7}}}}}


def test_goals_follow_the_figures():
    rows = {g: (got, met, why) for g, got, met, why in peers.goals(_section())}
    got, met, _ = rows["round time ≥ 1.5× pfl (reference/10 clients/round)"]
    assert got == "4.00×" and met  # 0.4 s / fedloom's best, lockstep's 0.1 s
    got, met, why = rows["round time ≥ 1.5× flgo (reference/10 clients/round)"]
    assert got == "—" and not met and why == "peers: flgo skipped: no venv"
    slow = _section()
    slow["workloads"]["reference/10"]["frameworks"]["pfl"]["round_s"] = 0.12
    got, met, why = {g: (a, b, c) for g, a, b, c in peers.goals(slow)}[
        "round time ≥ 1.5× pfl (reference/10 clients/round)"]
    assert got == "1.20×" and not met and "0.080 s" in why  # 0.12 / 1.5


def test_markdown_reports_every_framework():
    md = "\n".join(peers.markdown(_section()))
    assert "| fedloom:lockstep | 0.100 | 1.00× | 3.1 |" in md
    assert "| pfl | 0.400 | 4.00× | 9.0 |" in md
    assert "peers: flgo skipped: no venv" in md
    assert "pfl 2.0e-08" in md and "7.5" in md  # equivalence and the load after


def test_cli_names_a_framework_it_lacks(capsys):
    argv = ["--workload", "reference/10", "--frameworks", "fedloom:sequential,nope"]
    assert peers.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("--frameworks: nope not available") and "\n" not in err


def test_both_core_modes_are_listed_where_they_apply(monkeypatch):
    monkeypatch.setattr(peers, "flower_reason", lambda: None)
    wl = peers.workloads(False)
    have = {"pfl": Path("/venv/pfl/bin/python"), "flgo": Path("/venv/flgo/bin/python")}
    names = [n for n, _ in peers.framework_commands(wl["reference/10"], have, quick=False)]
    assert {"fedloom:process+lockstep", "flgo:parallel2", "pfl:torchrun2", "flower"} <= set(names)
    cmd = dict(peers.framework_commands(wl["reference/10"], have, quick=False))["pfl:torchrun2"]
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"] and "2" in cmd
    # pfl hands worker r users r, r + 2, …: a cohort that does not split evenly is not run
    odd = {**wl["reference/10"], "per_round": 5}
    assert "pfl:torchrun2" not in dict(peers.framework_commands(odd, have, quick=False))
    quick = [n for n, _ in peers.framework_commands(peers.workloads(True)["reference/5"], have,
                                                    quick=True)]
    assert quick == ["fedloom:sequential", "plain_torch", "pfl", "flgo"]
    monkeypatch.setattr(peers, "flower_reason", lambda: "peers: flower skipped: no flwr")
    assert "flower" not in dict(peers.framework_commands(wl["reference/10"], have, quick=False))


def test_flower_runs_after_the_others_alone(monkeypatch, tmp_path):
    calls = []

    def fake(fws, folder, rounds, final=True):
        calls.append([n for n, _ in fws])
        return {n: {"round_s": 1.0} for n, _ in fws}

    monkeypatch.setattr(peers, "run_frameworks", fake)
    fws = [("fedloom:sequential", []), ("flower", []), ("pfl", [])]
    res = peers.run_interleaved_then_alone(fws, tmp_path, 3)
    assert calls == [["fedloom:sequential", "pfl"], ["flower"]] and set(res) == {
        "fedloom:sequential", "flower", "pfl"}


def test_a_peers_fastest_mode_is_the_one_its_goal_compares_with():
    sec = _section()
    sec["workloads"]["reference/10"]["frameworks"]["pfl:torchrun2"] = {
        "round_s": 0.3, "rounds_s": [0.3], "launch_s": 9.0}
    got, met, why = {g: (a, b, c) for g, a, b, c in peers.goals(sec)}[
        "round time ≥ 1.5× pfl (reference/10 clients/round)"]
    assert got == "3.00×" and met and "pfl:torchrun2's 0.300 s" in why


def test_the_two_process_floor_trains_the_same_round(toy_spec, tmp_path):
    """``peer_torch.py --procs 2`` (the measured floor of two cores) splits the cohort
    over two processes and sums their partial averages: the model of one process to
    float32 rounding (the MLP has no dropout), and each round reported to the driver."""
    import json
    import subprocess
    import sys

    folder, _ = toy_spec
    finals = []
    for procs in (1, 2):
        out = tmp_path / f"w{procs}.pt"
        run = subprocess.run([sys.executable, str(Path(peers.__file__).parent / "peer_torch.py"),
                              "--spec", str(folder), "--final", str(out), "--threads", "1",
                              "--procs", str(procs)], input="go\n", capture_output=True,
                             text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        assert [json.loads(s)["round"] for s in run.stdout.splitlines()] == [1, 2]
        finals.append(torch.load(out, weights_only=True))
    start = torch.cat([t.reshape(-1) for t in torch.load(folder / "spec.pt",
                                                         weights_only=True)["init"]])
    assert not torch.equal(finals[0], start)
    torch.testing.assert_close(finals[1], finals[0], rtol=1e-5, atol=1e-6)
