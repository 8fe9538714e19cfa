"""The package's layers (pyproject ``[tool.importlinter]``) hold, and they bite.

``make test`` runs ``lint-imports`` on the package; here the same contracts
are run on a copy of the package with one upward import added (the registry,
at the bottom, importing the config above it: the cycle the layers replaced),
and must fail naming that import. So a contract that silently stopped
checking (a renamed package, a layer left out) fails this test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed")


def _lint(src: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the repository's contracts on the package under ``src``."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    lines = ["[importlinter]", f"root_package = {conf['root_package']}",
             f"exclude_type_checking_imports = {conf['exclude_type_checking_imports']}"]
    for i, c in enumerate(conf["contracts"]):
        lines += ["", f"[importlinter:contract:{i}]", f"name = {c['name']}", f"type = {c['type']}"]
        key = "layers" if c["type"] == "layers" else "modules"
        lines += [f"{key} =", *(f"    {v}" for v in c[key])]
        if c.get("ignore_imports"):  # e.g. an old import path that re-exports a moved package
            lines += ["ignore_imports =", *(f"    {v}" for v in c["ignore_imports"])]
    ini = tmp_path / "contracts.ini"
    ini.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([str(LINT), "--config", str(ini), "--no-cache"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)


def test_contracts_hold_on_the_package(tmp_path):
    out = _lint(ROOT / "src", tmp_path)
    assert out.returncode == 0, out.stdout[-2000:]
    assert "2 kept, 0 broken" in out.stdout


def test_an_upward_import_breaks_the_layers(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "fedloom", src / "fedloom",
                    ignore=shutil.ignore_patterns("__pycache__"))
    reg = src / "fedloom" / "registry.py"
    reg.write_text(reg.read_text() + "\nfrom fedloom.config import ConfigError  # noqa\n")
    out = _lint(src, tmp_path)
    assert out.returncode != 0
    assert "fedloom.registry -> fedloom.config" in out.stdout
    assert "BROKEN" in out.stdout


def test_the_algorithm_packages_stay_independent(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "fedloom", src / "fedloom",
                    ignore=shutil.ignore_patterns("__pycache__"))
    sc = src / "fedloom" / "client" / "scaffold.py"
    sc.write_text(sc.read_text() + "\nfrom fedloom.compress.feedback import NoFeedback  # noqa\n")
    out = _lint(src, tmp_path)
    assert out.returncode != 0
    assert "fedloom.client.scaffold -> fedloom.compress.feedback" in out.stdout
