"""The site's algorithm reference is generated from the registry when the site is built."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fedloom.cli import main
from fedloom.report.algorithms import FIELDS, entries, parse_reference, render_markdown

EXT = Path(__file__).resolve().parents[1] / "docs" / "_ext" / "fedloom_docs.py"


def test_the_site_page_is_generated_from_the_registry():
    # no copy is committed: the page's stub is replaced by render_markdown() at build time
    spec = importlib.util.spec_from_file_location("fedloom_docs", EXT)
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    source = ["stub"]
    ext._source_read(None, "reference/algorithms", source)
    assert source[0] == render_markdown()
    assert not (EXT.parents[1] / "algorithms.md").exists()


def test_every_builtin_names_paper_code_and_departures():
    items = entries()
    kinds = {e.kind for e in items}
    assert {"aggregator", "compressor", "feedback", "method", "planner", "metric",
            "partitioner", "server_optimizer", "attack"} <= kinds
    missing = [f"{e.kind} {e.name}: {k}" for e in items for k in FIELDS[:3]
               if not e.reference.get(k)]
    assert not missing, missing
    assert all(e.origin == "fedloom" for e in items)  # plug-ins never enter the file


def test_options_come_from_the_factory_signature():
    by = {(e.kind, e.name): {o.name: o for o in e.options} for e in entries()}
    craft = by["aggregator", "craft"]
    assert craft["groups"].default == "'layer'" and "Literal" in craft["groups"].type
    assert by["feedback", "sapef"]["alpha"].default == "0.85"
    assert set(by["feedback", "flare"]) == {"tau", "tau_decay", "penalty_steps", "penalty"}
    assert "layout" not in by["compressor", "topk"]       # passed by the engine
    assert set(by["partitioner", "dirichlet"]) == {"alpha", "min_samples", "max_tries",
                                                   "min_policy", "balance"}
    assert set(by["server_optimizer", "adam"]) == {"lr", "beta1", "beta2", "eps"}
    assert by["metric", "mismatch"]["alpha"].default == "1.0"


def test_reference_block_parsing():
    doc = """Summary line.

    Reference:
        paper: A & B, "Title
            continued", 2020.
        code: owner/repo.
        departures: one;
            two.

    Args:
        x: not part of it.
    """
    assert parse_reference(doc) == {"paper": 'A & B, "Title continued", 2020.',
                                    "code": "owner/repo.", "departures": "one; two."}
    assert parse_reference("No block.") == {} and parse_reference(None) == {}


def test_cli_prints_the_reference(capsys):
    assert main(["algorithms", "--markdown"]) == 0
    assert capsys.readouterr().out == render_markdown()
    assert main(["algorithms"]) == 0
    listing = capsys.readouterr().out
    assert "feedback         sapef          alpha=0.85, alpha_schedule='constant'" in listing
