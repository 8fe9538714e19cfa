"""The wheel as a user gets it: built from the tree, installed into a fresh virtual
environment, and ``fedloom run quickstart`` from a folder outside the repository
(the shipped config found inside the package, not through ``configs/``).

Building is ``pip wheel --no-deps --no-build-isolation`` (about 2 s; ``python -m build``
makes a fresh environment and downloads setuptools). The new environment gets the
test environment's site-packages through a ``.pth`` line, so torch and the data
packages are not installed again; a path-only ``.pth`` line does not run the
editable install's finder, so ``fedloom`` comes from the wheel (asserted).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]



def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # our own deprecation warnings (and every other at import) fail the run
    env["PYTHONWARNINGS"] = "error::DeprecationWarning:fedloom"
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_a_shipped_config_is_found_by_name_from_any_folder(tmp_path, monkeypatch):
    """The fast half (make test): ``quickstart`` names the config inside the package,
    from a folder without ``configs/``; a file of that name in the folder wins."""
    from fedloom.config import load_config

    monkeypatch.chdir(tmp_path)
    cfg = load_config("quickstart", ["rounds=2"])
    assert cfg.name == "quickstart" and cfg.rounds == 2
    assert (ROOT / "src" / "fedloom" / "configs" / "quickstart.yaml").is_file()
    (tmp_path / "quickstart").write_text("name: mine\nrounds: 1\n")
    assert load_config("quickstart").name == "mine"


# about 15 s idle (most of it the run), 45 s on a loaded 2-core machine: `make test-all`
@pytest.mark.slow
def test_wheel_installs_and_runs_the_quickstart_outside_the_repository(tmp_path):
    wheels = tmp_path / "wheels"
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                  "--no-build-isolation", "--no-index", "-w", str(wheels), str(ROOT)], tmp_path)
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("fedloom-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "fedloom/configs/quickstart.yaml" in names and "fedloom/py.typed" in names
    meta = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "_host_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    inst = _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                 "--no-deps", "--no-index", str(wheel)], tmp_path)
    assert inst.returncode == 0, inst.stderr

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run([str(py), "-c", "import fedloom; print(fedloom.__file__)"], elsewhere)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(Path(purelib))
    run = _run([str(venv / "bin" / "fedloom"), "run", "quickstart", "rounds=2",
                "data.num_clients=20", "cohort.size=2", "logging.plots=false",
                "checkpoint.every=0", "--out", "r"], elsewhere)
    assert run.returncode == 0, run.stderr
    assert (elsewhere / "r" / "summary.json").is_file()
    assert "Warning" not in run.stderr, run.stderr
