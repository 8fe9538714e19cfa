"""The published-setting configs (configs/published/): each loads and validates, and each
suite's every (setting, method) config validates with its overrides. They are GPU-sized
and read data this machine does not have; running them is an experiment, not a test."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from fedloom.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs" / "published").glob("*-*.yaml"))
SUITES = sorted(p for p in (ROOT / "configs" / "published").glob("*.yaml") if "-" not in p.stem)


def test_there_is_a_suite_and_configs_per_paper() -> None:
    assert {p.stem for p in SUITES} == {"craft", "sapef", "flare"}
    assert len(CONFIGS) >= 7


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_validates(path: Path) -> None:
    cfg = load_config(path)
    # every remaining difference from the public code is stated in the file's comment
    assert "Remaining difference" in path.read_text() or "public" in path.read_text()
    assert cfg.rounds >= 200


@pytest.mark.parametrize("suite", SUITES, ids=lambda p: p.stem)
def test_every_setting_and_method_validates(suite: Path) -> None:
    raw = yaml.safe_load(suite.read_text())
    for sname, setting in raw["settings"].items():
        for mname, method in raw["methods"].items():
            ov = method if isinstance(method, list) else method["overrides"]
            only = None if isinstance(method, list) else method.get("settings")
            if only is not None and sname not in only:
                continue
            cfg = load_config(ROOT / setting["config"], [*setting.get("overrides", []), *ov])
            assert cfg.rounds > 0, (sname, mname)


def test_a_published_suite_without_its_data_says_so_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from fedloom.cli import main

    monkeypatch.setenv("FEDLOOM_DATA", str(tmp_path / "empty"))
    monkeypatch.chdir(ROOT)
    suite = tmp_path / "s.yaml"
    suite.write_text(yaml.safe_dump({
        "name": "x", "out": str(tmp_path / "runs"), "seeds": [1],
        "settings": {"cifar10": {"config": str(ROOT / "configs/published/craft-cifar10.yaml")},
                     "cifar100": {"config": str(ROOT / "configs/published/craft-cifar100.yaml")}},
        "methods": {"FedAvg": []}}))
    assert main(["sweep", str(suite)]) == 2
    cap = capsys.readouterr()
    assert "setting cifar10: skipped, its data is missing" in cap.out
    assert cap.err.strip().count("\n") == 0 and "no setting's data is here" in cap.err
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------ the cross-device benchmarks' settings
CROSS = sorted((ROOT / "configs" / "published").glob("*/*.yaml"))
# each published config, two rounds on tiny files in its data's layout, with a tiny model;
# privacy.accountant=rdp: PLD's discretisation at two rounds of small noise takes a minute
# and a half here (the published accountant, PLD, is what the configs load with)
_TINY_LM = ["model.options.embed=8", "model.options.heads=2", "model.options.ff=16",
            "model.options.layers=1"]
TINY = {
    "pfl/stackoverflow": ["privacy.accountant=rdp", *_TINY_LM],
    "pfl/flair": ["privacy.accountant=rdp", "data.options.image_size=32",
                  "model.options.width=8"],
    "fedscale/openimage": ["data.options.image_size=8", "data.options.min_client_samples=1",
                           "model.options.width=4", "client.steps=2"],
    "fedscale/reddit": ["data.options.min_client_samples=1", "data.options.seq_len=4",
                        "client.steps=2", *_TINY_LM],
}


def test_the_cross_device_configs_are_there() -> None:
    assert {f"{p.parent.name}/{p.stem}" for p in CROSS} == set(TINY)


@pytest.mark.parametrize("path", CROSS, ids=lambda p: f"{p.parent.name}-{p.stem}")
def test_cross_device_config_states_its_sources_and_changes(path: Path) -> None:
    cfg = load_config(path)
    text = path.read_text()
    assert "Changes made to fit this machine" in text and "Where each setting comes from" in text
    assert cfg.rounds >= 1000 and cfg.eval.every in (20, 30)
    if cfg.privacy.mode == "central":  # pfl's private settings: PLD, Poisson, a deployment
        assert cfg.privacy.accountant == "pld" and cfg.cohort.sampling == "poisson"
        assert cfg.privacy.accounting_cohort == 5000 and cfg.privacy.target_epsilon == 2.0


@pytest.mark.parametrize("name", sorted(TINY))
def test_cross_device_config_runs_two_rounds_on_tiny_files(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from crossdevice_files import (
        write_flair,
        write_openimage,
        write_pfl_stackoverflow,
        write_reddit,
    )
    from fedloom import run

    monkeypatch.setenv("FEDLOOM_CACHE", str(tmp_path / "cache"))
    {"pfl/stackoverflow": write_pfl_stackoverflow, "pfl/flair": lambda r: write_flair(r, 32),
     "fedscale/openimage": write_openimage, "fedscale/reddit": write_reddit}[name](tmp_path)
    cfg = load_config(ROOT / "configs" / "published" / f"{name}.yaml",
                      [f"data.options.root={tmp_path}", "data.num_clients=3", "rounds=2",
                       "cohort.size=2", "eval.every=1", "checkpoint.every=0",
                       "logging.plots=false", *TINY[name]])
    run(cfg, out=str(tmp_path / "run"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["rounds"] == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows if "test_loss" in r] == [1, 2]
    assert all(math.isfinite(r["test_loss"]) for r in rows if "test_loss" in r)
    if cfg.privacy.mode == "central":
        assert 0 < summary["dp_epsilon"] <= cfg.privacy.target_epsilon
