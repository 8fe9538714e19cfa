"""The published-setting configs (configs/published/): each loads and validates, and each
suite's every (setting, method) config validates with its overrides. They are GPU-sized
and read data this machine does not have; running them is an experiment, not a test."""

from __future__ import annotations

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
