"""The table ``fedloom run`` prints at the end shows what the run's mode measured."""

from __future__ import annotations

import fedloom
from conftest import TINY
from fedloom.config import load_config
from fedloom.runtable import summary_rows as _summary_rows


def _rows(overrides: list[str]) -> dict[str, str]:
    cfg = load_config(TINY, [*overrides, "rounds=2"])
    res = fedloom.run(cfg)
    return dict(_summary_rows(res.summary, cfg))


def test_a_plain_run_shows_no_mode_rows():
    rows = _rows([])
    assert not {"selector", "simulated time", "staleness mean / max (last round)",
                "training tokens/s", "peak memory (RSS)"} & set(rows)


def test_an_async_run_shows_its_simulated_time_and_staleness():
    rows = _rows(["system.mode=async", "system.profile=lognormal"])
    assert rows["simulated time"].endswith(" s") and float(rows["simulated time"][:-2]) >= 0
    mean, top = rows["staleness mean / max (last round)"].split(" / ")
    assert 0 <= float(mean) <= float(top)


def test_a_selector_is_named():
    assert _rows(["cohort.selection=power_of_choice"])["selector"] == "power_of_choice"


def test_a_language_models_tokens_and_memory():
    """The rows read the summary's keys (a causal LM's run writes them: tests/test_llm.py)."""
    cfg = load_config(TINY, [])
    s = dict(fedloom.run(cfg, ["rounds=1"]).summary)
    s.update(train_tokens_per_s=1234.56, train_tokens_total=98765, peak_rss_mb=812.4)
    rows = dict(_summary_rows(s, cfg))
    assert rows["training tokens/s"] == "1,234.6 (98,765 tokens)"
    assert rows["peak memory (RSS)"] == "812 MB"
