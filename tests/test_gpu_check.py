"""``benchmarks/gpu_check.py``: the GPU check's CPU smoke run reports every step
(figures or a stated reason), its goals are judged from the figures, and a run
that cannot be the real check writes nothing where the GPU results go."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS = {"pytest_cuda", "quickstart", "round_time", "resnet", "pfl_cifar10", "aggregation",
         "llm"}


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks/gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _gpu_results() -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (ROOT / "benchmarks").glob("gpu_results*")}


@pytest.mark.slow
def test_quick_cpu_run_reports_every_step(tmp_path):
    before = _gpu_results()
    # The step budgets are the GPU check's (a lent machine's minutes); a slow or loaded
    # CPU must not turn them into failures of this smoke test, hence a budget no CPU
    # run of --quick reaches (it checks that every step runs, not how fast)
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu_check.py"), "--device",
                          "cpu", "--quick", "--budget-s", "3000", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=3300, check=False, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _gpu_results() == before  # the smoke run wrote only into --out
    # CPU figures are never named as the GPU results
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_results-smoke.json",
                                                          "gpu_results-smoke.md"]
    got = json.loads((tmp_path / "gpu_results-smoke.json").read_text())
    assert got["command"] == "python benchmarks/gpu_check.py --device cpu --quick --budget-s 3000"
    steps = got["steps"]
    assert set(steps) == STEPS
    for name, rec in steps.items():
        assert rec["status"] in ("ok", "partial", "not available"), (name, rec)
        assert rec["status"] == "ok" or rec["reason"], name
        assert rec["seconds"] > 0 and rec["peak_device_mb"] > 0
    # 1: nothing is marked cuda that runs without CUDA
    p = steps["pytest_cuda"]
    assert p["failed"] == p["errors"] == p["passed"] == 0 and p["summary"]
    # 2: the same config twice gives the same model; CPU against CPU differs by nothing
    q = steps["quickstart"]
    assert q["same_sha"] and len(q["model_sha256"][0]) == 64
    assert {k: v["max_abs_diff"] for k, v in q["cpu_vs_device_after_3_rounds"].items()} == {
        "float32": 0.0, "float64": 0.0}
    # 3: both backends at every cohort size; Flower's absence is stated, not blank
    for row in steps["round_time"]["per_round"].values():
        assert min(row[b]["round_s"] for b in ("sequential", "vmap", "vmap_whole")) > 0
        assert row["vmap_best_s"] == min(row["vmap"]["round_s"], row["vmap_whole"]["round_s"])
    assert all(v.get("not_run") for v in steps["round_time"]["flower"].values())
    # 4: ResNet with BatchNorm and GroupNorm, both backends
    for norm in ("batch", "group"):
        row = steps["resnet"]["results"][norm]
        assert min(row[b]["round_s"] for b in ("sequential", "vmap", "vmap_whole")) > 0
    # 5: pfl's CIFAR-10 workload on fedloom's backends (vmap refuses dropout, saying why)
    pc = steps["pfl_cifar10"]
    assert pc["per_round"] == 5 and pc["model"] == "pfl_cnn" and pc["pfl"]["not_run"]
    row = pc["results"]
    assert row["sequential"]["round_s"] > 0 and row["lockstep"]["round_s"] > 0
    assert row["sequential"]["num_parameters"] == 1_626_442  # pfl's simple_cnn on 3×32×32
    for b in ("vmap", "vmap_whole"):
        assert row[b].get("round_s", 0) > 0 or "dropout" in row[b]["error"]
    assert row["fastest_s"] == min(r["round_s"] for r in row.values()
                                   if isinstance(r, dict) and "round_s" in r)
    # 6: CRAFT's constraints hold
    for row in steps["aggregation"]["results"].values():
        assert row["craft"]["max_violation"] <= 1e-6 and row["fedavg"]["seconds"] > 0
    # 7: a peak for every step
    assert set(got["peak_memory"]) == STEPS
    goals = {g["goal"]: g for g in got["goals"]}
    assert len(goals) == 6
    for g in goals.values():
        assert g["met"] is True or g["why"], g
    md = (tmp_path / "gpu_results-smoke.md").read_text()
    assert md.startswith("# GPU check — smoke run (not GPU results)")
    assert "## Goals" in md and "## 6. Aggregation" in md
    assert "## 5. pfl-research's CIFAR-10 benchmark workload" in md


def _res(seq, vmap, flower, big, craft, fedavg, violation):
    """A results record with the figures the goals read (--quick's cohort keys)."""
    per = {"2": {}, "5": {"sequential": {"round_s": seq}, "vmap_best_s": vmap,
                          "vmap_best": "vmap_whole"},
           "20": {"vmap_best_s": big, "vmap_best": "vmap"}}
    return {"steps": {
        "round_time": {"steps_per_client": 2, "per_round": per,
                       "flower": {"5": {"round_s": flower} if flower else
                                  {"error": "ImportError: no module named flwr"}}},
        "aggregation": {"tf32_matmul": False, "results": {
            "m=10": {"craft": {"max_violation": violation / 10}},
            "m=100": {"craft": {"seconds": craft, "max_violation": violation},
                      "fedavg": {"seconds": fedavg}, "craft_over_fedavg": craft / fedavg,
                      "gram_gflop": 1.0}}}}}


def test_goals_are_judged_from_the_figures():
    goals = _module().goals
    g = goals(_res(seq=2.0, vmap=0.1, flower=None, big=1.5, craft=0.025, fedavg=0.01,
                   violation=2e-6))
    by = {x["goal"].split(" at ")[0].split(" (")[0]: x for x in g}
    ten = by["vmap ≥ 10× sequential"]
    assert ten["met"] is True and ten["value"] == pytest.approx(20.0)
    assert ten["by"] == "2.00× the target" and ten["note"] == "vmap: vmap_whole"
    flower = by["vmap ≥ 20× Flower's simulation"]
    assert flower["met"] is None and "no module named flwr" in flower["why"]
    big = by["20 clients/round in < 1 s"]
    assert big["met"] is False and big["by"] == "1.50× short" and "lock-steps" in big["why"]
    craft = by["CRAFT ≤ 3× FedAvg"]
    assert craft["met"] is True and craft["value"] == pytest.approx(2.5)
    err = by["CRAFT constraint error ≤ 1e-6"]
    assert err["met"] is False and err["value"] == 2e-6  # the worse of m = 10 and 100
    g = goals(_res(seq=0.5, vmap=0.1, flower=3.0, big=0.5, craft=0.04, fedavg=0.01,
                   violation=1e-8))
    by = {x["goal"].split(" at ")[0].split(" (")[0]: x for x in g}
    assert by["vmap ≥ 10× sequential"]["met"] is False
    assert by["vmap ≥ 20× Flower's simulation"]["met"] is True
    assert by["20 clients/round in < 1 s"]["met"] is True
    assert by["CRAFT ≤ 3× FedAvg"]["met"] is False
    assert by["CRAFT constraint error ≤ 1e-6"]["met"] is True


def test_pfl_goal_is_judged_from_pfl_and_the_fastest_backend():
    goals = _module().goals
    step = {"per_round": 50, "results": {"fastest_s": 0.2, "fastest": "lockstep"},
            "pfl": {"round_s": 1.4}}
    g = next(x for x in goals({"steps": {"pfl_cifar10": step}}) if "pfl" in x["goal"])
    assert g["met"] is True and g["value"] == pytest.approx(7.0) and g["note"].endswith(
        "lockstep")
    step["pfl"] = {"round_s": 0.6}
    g = next(x for x in goals({"steps": {"pfl_cifar10": step}}) if "pfl" in x["goal"])
    assert g["met"] is False and g["by"] == "1.67× short" and "0.200 s" in g["why"]
    step["pfl"] = {"not_run": "pfl does not travel"}
    g = next(x for x in goals({"steps": {"pfl_cifar10": step}}) if "pfl" in x["goal"])
    assert g["met"] is None and "pfl does not travel" in g["why"]


def test_spent_budget_skips_steps_with_a_reason(tmp_path):
    mod = _module()
    assert mod.main(["--device", "cpu", "--quick", "--budget-s", "4", "--out",
                     str(tmp_path)]) == 0
    got = json.loads((tmp_path / "gpu_results-smoke.json").read_text())
    assert set(got["steps"]) == STEPS
    for rec in got["steps"].values():
        assert rec["status"] == "skipped" and "--budget-s" in rec["reason"]
    assert all(g["met"] is None and g["why"].startswith("not measured") for g in got["goals"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_exits_2_and_writes_nothing(tmp_path, capsys):
    assert _module().main(["--device", "cuda", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpu_check: --device cuda: CUDA is not available")
    assert not (tmp_path / "out").exists()


def test_a_step_past_its_budget_keeps_its_figures_and_its_child_is_killed(tmp_path):
    """The step's alarm stops it mid-measurement: what it recorded stays, the status
    says partial and why, and the child process it was waiting on is gone."""
    import argparse
    import os

    mod = _module()
    args = argparse.Namespace(budget_s=8.5, quick=True, out=str(tmp_path))
    ck = mod.Check(args, torch.device("cpu"))
    started: list[int] = []

    class Children(set):
        """The children run_child starts, as it starts them: on a loaded machine the
        budget can end before the child has run a line of its own."""

        def add(self, pid):
            started.append(pid)
            super().add(pid)

    ck.children = Children()

    def slow(ck, rec):
        rec["first"] = 1.5
        ck.run_child([sys.executable, "-c", "import time; time.sleep(600)"], 600)

    ck.step("resnet", slow)  # budget: 8.5 s less the 5 s kept back for the report
    rec = json.loads(ck.json_path.read_text())["steps"]["resnet"]
    assert rec["status"] == "partial" and rec["first"] == 1.5
    assert rec["reason"].startswith("stopped at its time budget of ")
    # stopped at its budget, not at the child's end (600 s); a ceiling for a busy machine
    assert rec["seconds"] < 120 and not ck.children and len(started) == 1
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(started[0], 0)


def test_the_llm_step_measures_each_variant_at_toy_size(tmp_path):
    """Step 7 on the CPU at --quick sizes: tokens per second and peak memory of the
    four variants (base float32 / bfloat16, checkpointing off / on), one model size."""
    import argparse

    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    mod = _module()
    ck = mod.Check(argparse.Namespace(budget_s=300.0, quick=True, out=str(tmp_path)),
                   torch.device("cpu"))
    ck.step("llm", mod.step_llm)
    rec = json.loads(ck.json_path.read_text())["steps"]["llm"]
    assert rec["status"] == "ok", rec.get("reason")
    assert set(rec["results"]) == set(mod.LLM_VARIANTS)
    rows = rec["results"].values()
    assert all(r["tokens_per_s"] > 0 and r["peak_device_mb"] > 0 for r in rows)
    # rank-8 adapters on q_proj [32→32] and v_proj [32→16] of 2 layers
    assert {(r["num_parameters"], r["trainable"]) for r in rows} == {
        (next(iter(rows))["num_parameters"], 2 * (8 * 32 + 32 * 8 + 8 * 32 + 16 * 8))}
    assert "## 7. LoRA on a causal LM" in ck.md_path.read_text()


@pytest.mark.slow  # three FLARE/EC/EF21 runs in a subprocess: make test-all
def test_repro_flare_fc_runs_every_method_beside_the_public_logs(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu_check.py"), "--device",
                          "cpu", "--quick", "--only", "repro_flare_fc", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, check=False, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads((tmp_path / "gpu_results-smoke.json").read_text())
    step = rep["steps"]["repro_flare_fc"]
    assert step["status"] == "ok" and step["config"] == "configs/published/flare-mnist-fc.yaml"
    assert set(step["runs"]) == {"FLARE", "EC", "EF21"}
    for name, row in step["runs"].items():
        assert 0 <= row["final_test_acc"] <= 100
        assert row["public_final_acc"] == {"FLARE": 86.2, "EC": 59.6, "EF21": 58.7}[name]
    assert "FLARE's public MNIST FC" in (tmp_path / "gpu_results-smoke.md").read_text()
