"""docs/algorithms.md is generated from the registry and kept current."""

from __future__ import annotations

from pathlib import Path

from fedloom.cli import main
from fedloom.report.algorithms import COMMAND, FIELDS, entries, parse_reference, render_markdown

DOC = Path(__file__).resolve().parents[1] / "docs" / "algorithms.md"


def test_checked_in_reference_is_current():
    text = render_markdown()
    if not DOC.exists() or DOC.read_text(encoding="utf-8") != text:
        raise AssertionError(f"docs/algorithms.md is stale: run `{COMMAND}`")


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
