"""The worked example of docs/architecture.md runs as written.

The page's Python block is written to ``leaky_ef.py`` in a temporary
directory on ``sys.path`` and its YAML block is the compression section of a
tiny run. Properties (both sides computed here, one thread, so on any CPU):
at ``decay = 1`` the policy is EF (``u = g + 1·e``, the same operations as
the built-in's ``u = g + (1 − 0)·e``), so the model is the built-in EF's bit
for bit; at ``decay = 0`` it sends ``C(g + 0·e) = C(g)``, so the model is the
one without feedback; a run stopped after round 2 resumes to the
uninterrupted model (the engine checkpoints the plug-in's rows).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

import fedloom
from conftest import TINY, stop_and_resume

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.fixture
def leaky(tmp_path, monkeypatch):
    (code,) = _blocks("python")
    (tmp_path / "leaky_ef.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    (section,) = _blocks("yaml")
    cfg = copy.deepcopy(TINY)
    cfg["backend"] = {"name": "sequential", "threads": 1}
    cfg.update(yaml.safe_load(section))
    return cfg


def _sha(cfg, overrides=()):
    return fedloom.run(cfg, list(overrides)).summary["model_sha256"]


def test_the_page_names_what_it_tests(leaky):
    assert leaky["compression"]["feedback"]["name"] == "leaky_ef:leaky_ef"
    res = fedloom.run(leaky)
    assert res.summary["rounds"] == TINY["rounds"]
    # the plug-in's per-client rows are kept by the engine and reported
    assert all(m["residual_norm"] > 0 for m in res.metrics)


def test_decay_one_is_error_feedback(leaky):
    assert (_sha(leaky, ["compression.feedback.options={decay: 1.0}"])
            == _sha(leaky, ["compression.feedback=ef"]))  # another policy: no options


def test_decay_zero_is_no_feedback(leaky):
    assert (_sha(leaky, ["compression.feedback.options={decay: 0.0}"])
            == _sha(leaky, ["compression.feedback=none"]))
    assert _sha(leaky) != _sha(leaky, ["compression.feedback=none"])


def test_bad_option_is_one_line(leaky):
    with pytest.raises(fedloom.ConfigError, match=r"decay: must be in \[0, 1\]"):
        fedloom.run(leaky, ["compression.feedback.options={decay: 2.0}"])


def test_resume_keeps_the_plugins_rows(leaky, tmp_path):
    leaky["checkpoint"] = {"every": 1}
    ref, res = stop_and_resume(leaky, [], tmp_path / "run", stop_after=2)
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
