"""The site's generated reference pages, made while Sphinx reads them.

A page listed in ``GENERATED`` is a stub in the repository; its text is replaced
(``source-read``) by what the command it documents prints now: the algorithm
reference (``fedloom algorithms --markdown``), the config schema (``fedloom
schema``) as a table of keys, and each command's ``--help`` from the CLI's own
parser. Nothing is written to the source tree, so a build cannot leave a stale copy.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def _algorithms() -> str:
    from fedloom.report.algorithms import render_markdown

    return render_markdown()


def _type(node: dict[str, Any]) -> str:
    if "enum" in node:
        return "one of " + ", ".join(f"`{v}`" for v in node["enum"])
    if "anyOf" in node:
        parts = [_type(n) for n in node["anyOf"] if n.get("type") != "object"]
        return " or ".join(p for p in parts if p)
    t = node.get("type", "")
    if t == "array" and isinstance(node.get("items"), dict):
        inner = _type(node["items"])
        return f"list of {inner}" if inner else "list"
    return t if isinstance(t, str) else " or ".join(t)


def _bounds(node: dict[str, Any]) -> str:
    parts = []
    if node.get("minimum") is not None:
        parts.append(f"≥ {node['minimum']}")
    if node.get("exclusiveMinimum") is not None:
        parts.append(f"> {node['exclusiveMinimum']}")
    # the schema's "no bound" (10⁹ on integers) is not worth stating
    if node.get("maximum") is not None and node["maximum"] < 1_000_000_000:
        parts.append(f"≤ {node['maximum']}")
    return ", ".join(parts)


def _walk(props: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    for key, node in props.items():
        name = f"{prefix}{key}"
        obj = node if node.get("type") == "object" else next(
            (n for n in node.get("anyOf", []) if n.get("type") == "object"), None)
        yield name, node
        if obj is not None and obj.get("properties"):
            yield from _walk(obj["properties"], f"{name}.")


def _cell(text: str) -> str:
    # one table row per key: the schema's descriptions hold reST literals and newlines
    return " ".join(str(text).replace("``", "`").replace("|", "\\|").split())


def _config_schema() -> str:
    from fedloom.schema import config_schema

    schema = config_schema()
    lines = [
        "# Config schema",
        "",
        "Every key of a config, generated from `fedloom schema` (the JSON Schema that "
        "editors use to complete and check configs) when this site was built. "
        "A dotted key is also a command-line override: "
        "`fedloom run CONFIG client.lr=0.05`. What the sections are for is on "
        "[The config](config.md).",
        "",
    ]
    # a definition list per top-level section (a table this wide would not fit the
    # page); the top level's plain keys first, then each section in the schema's order
    groups: dict[str, list[str]] = {"Top level": []}
    for name, node in _walk(schema["properties"]):
        top = name.split(".")[0]
        nested = "." in name or node.get("type") == "object" or any(
            n.get("type") == "object" for n in node.get("anyOf", []))
        facts = [_type(node)]
        if "default" in node:
            facts.append(f"default `{json.dumps(node['default'], ensure_ascii=False)}`")
        facts.append(_bounds(node))
        entry = [f"`{name}`", f": {_cell(' · '.join(f for f in facts if f))}"]
        if node.get("description"):
            entry += ["", f"  {_cell(node['description'])}"]
        groups.setdefault(f"`{top}`" if nested else "Top level", []).extend([*entry, ""])
    for title, entries in groups.items():
        lines += [f"## {title}", "", *entries]
    lines += ["", "## The JSON Schema", "",
              "`fedloom schema > fedloom.schema.json` prints it; a config that starts with "
              "`# yaml-language-server: $schema=fedloom.schema.json` gets its keys completed "
              "and checked as you type.", "",
              "```json", json.dumps(schema, indent=2, ensure_ascii=False), "```", ""]
    return "\n".join(lines)


def _cli() -> str:
    import argparse

    from fedloom.cli import build_parser

    # argparse wraps help at $COLUMNS: the same page on every machine
    os.environ["COLUMNS"] = "100"
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    lines = [
        "# Command line",
        "",
        "Each command's `--help`, generated from fedloom's own parser when this site was "
        "built. How to use them: [the command line](../howto/cli.md).",
        "",
        "```text",
        parser.format_help().rstrip(),
        "```",
        "",
    ]
    for name, p in sub.choices.items():
        lines += [f"## `fedloom {name}`", "", "```text", p.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


ROOT = Path(__file__).resolve().parents[2]


def _benchmarks() -> str:
    # benchmarks/results.md (`make bench`) as a page of the site; its link to the
    # deployment's page names that page's file beside it, here a page of its own
    text = (ROOT / "benchmarks" / "results.md").read_text(encoding="utf-8")
    return text.replace("](deploy.md)", "](deploy-benchmark.md)")


def _deploy_benchmark() -> str:
    # benchmarks/deploy.md starts at level 2 (it is written as a section): the page's title
    text = (ROOT / "benchmarks" / "deploy.md").read_text(encoding="utf-8")
    return "# Round time of a Flower deployment\n\n" + text


GENERATED: dict[str, Callable[[], str]] = {
    "reference/algorithms": _algorithms,
    "reference/schema": _config_schema,
    "reference/cli": _cli,
    "results/benchmarks": _benchmarks,
    "results/deploy-benchmark": _deploy_benchmark,
}

# |x| in a docstring is a norm or an absolute value, never a reST substitution
_BARS = re.compile(r"(?<![\\|`\w])\|([^|`\s][^|`]*?)\|(?![\w|_])")


def _docstring(app: Any, what: str, name: str, obj: Any, options: Any,
               lines: list[str]) -> None:
    for i, line in enumerate(lines):
        if line.lstrip().startswith(("+", "|", "=")):  # a table's rows keep their bars
            continue
        parts = line.split("``")  # the odd parts are inline literals: left as written
        lines[i] = "``".join(_BARS.sub(r"\\|\1\\|", s) if k % 2 == 0 else s
                             for k, s in enumerate(parts))


# The last entry of the results page's table of contents. The pages of the published
# suites (configs/published/*.yaml: results/*-published.md, GPU workloads) exist only
# where someone ran them: they join the contents after it, and none is not an error.
LAST_RESULT = "deploy-benchmark\n```"


def _published_results(source: str) -> str:
    extra = "".join(f"{p.stem}\n" for p in sorted((ROOT / "docs" / "results")
                                                  .glob("*-published.md")))
    if extra and LAST_RESULT not in source:
        raise ValueError(f"docs/results/index.md: no {LAST_RESULT!r} to add {extra!r} after")
    return source.replace(LAST_RESULT, LAST_RESULT[:-3] + extra + "```")


def _source_read(app: Any, docname: str, source: list[str]) -> None:
    make = GENERATED.get(docname)
    if make is not None:
        source[0] = make()
    elif docname == "results/index":
        source[0] = _published_results(source[0])


def setup(app: Any) -> dict[str, Any]:
    app.connect("source-read", _source_read)
    app.connect("autodoc-process-docstring", _docstring)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
