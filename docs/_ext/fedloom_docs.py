"""The site's generated reference pages, made while Sphinx reads them.

A page listed in ``GENERATED`` is a stub in the repository; its text is replaced
(``source-read``) by what the command it documents prints now: the algorithm
reference (``fedloom algorithms --markdown``), the JSON Schema (``fedloom schema``)
and each command's ``--help`` from the CLI's own parser. The config reference
(``reference/config``) is hand-written prose around one marker line, replaced by
every key of the config's dataclasses with its type, default, bounds and the
comment written at it in the source. Nothing is written to the source tree, so a
build cannot leave a stale copy.

Docstrings and comments are reST; where they land in a Markdown page their roles
(``:mod:`x```) become MyST's (``{mod}`x```). Names that one docstring documents
together (``a, b: text``) keep one paragraph: napoleon would repeat it under each.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import json
import os
import re
import tokenize
import types
import typing
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
        if node["items"].get("properties"):  # rows of a section of their own
            return "list of rows (their keys below)"
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
    if node.get("exclusiveMaximum") is not None:
        parts.append(f"< {node['exclusiveMaximum']}")
    return ", ".join(parts)


def _section(node: dict[str, Any]) -> dict[str, Any] | None:
    """The object a key's node holds (a section, or one written ``{name, options}``
    whose shorthand is a string), else None."""
    if node.get("type") == "object" and node.get("properties"):
        return node
    return next((n for n in node.get("anyOf", [])
                 if n.get("type") == "object" and n.get("properties")), None)


def _walk(props: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every key of the schema, dotted, in the dataclasses' order; a list of rows
    (``system.classes``) is followed by its row, ``system.classes[]``, and its keys."""
    for key, node in props.items():
        name = f"{prefix}{key}"
        yield name, node
        obj = _section(node)
        if obj is not None:
            yield from _walk(obj["properties"], f"{name}.")
        items = node.get("items")
        if node.get("type") == "array" and isinstance(items, dict) and _section(items):
            yield f"{name}[]", items
            yield from _walk(items["properties"], f"{name}[].")


# A reST role (``:mod:`x```, ``:py:class:`~x```) in MyST's spelling ({mod}`x`).
_ROLE = re.compile(r":(?:py:)?(mod|class|func|meth|attr|data|exc|obj):`")


def _myst(text: str) -> str:
    """reST text (a docstring, a comment) as Markdown: roles in MyST's spelling; ``$``
    and ``*`` outside code are characters, not math or emphasis, and ``""`` (the empty
    string) is code, not a pair of typographic quotes."""
    parts = _ROLE.sub(r"{\1}`", text.replace("``", "`")).split("`")
    return "`".join(p.replace("$", "\\$").replace("*", "\\*").replace('""', '`""`')
                    if k % 2 == 0 else p for k, p in enumerate(parts))


def _cell(text: str) -> str:
    # one line: the schema's descriptions and the comments hold newlines
    return " ".join(_myst(str(text)).replace("|", "\\|").split())


# --------------------------------------------------------- the config reference
@functools.cache
def _parsed(path: str) -> tuple[ast.Module, dict[int, tuple[int, str]], list[str]]:
    """A source file's tree, its comments by line (column, text) and its lines."""
    text = Path(path).read_text(encoding="utf-8")
    comments = {t.start[0]: (t.start[1], t.string)
                for t in tokenize.generate_tokens(io.StringIO(text).readline)
                if t.type == tokenize.COMMENT}
    return ast.parse(text), comments, text.splitlines()


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in ``cls``'s source: the comment lines right above the
    field and the one beside it (a comment above a group of fields is the first's)."""
    path = inspect.getsourcefile(cls)
    assert path is not None, cls
    tree, comments, lines = _parsed(path)
    node = next(n for n in ast.walk(tree)
                if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    out = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above, row = [], stmt.lineno - 1
        while row in comments and not lines[row - 1][:comments[row][0]].strip():
            above.insert(0, comments[row][1])
            row -= 1
        end = stmt.end_lineno or stmt.lineno
        beside = [comments[r][1] for r in range(stmt.lineno, end + 1)
                  if r in comments and lines[r - 1][:comments[r][0]].strip()]
        text = " ".join(c.lstrip("#").strip() for c in above + beside)
        if text:
            out[stmt.target.id] = text
    return out


def _rows(tp: Any) -> tuple[type | None, str]:
    """The section class a field holds (itself, in a union, or a list of rows: ``[]``)."""
    if dataclasses.is_dataclass(tp):
        return typing.cast(type, tp), ""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        return typing.cast(type, args[0]), "[]"
    if origin in (typing.Union, types.UnionType):
        return next(((typing.cast(type, a), "") for a in args if dataclasses.is_dataclass(a)),
                    (None, ""))
    return None, ""


def _comments(cls: type, prefix: str = "") -> dict[str, str]:
    """The comment of every key under ``cls``, by dotted name."""
    own, hints, out = _field_comments(cls), typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        key = f"{prefix}{f.name}"
        if f.name in own:
            out[key] = own[f.name]
        inner, rows = _rows(hints[f.name])
        if inner is not None:
            out.update(_comments(inner, f"{key}{rows}."))
    return out


def _config_keys() -> str:
    """Every key of a config, a section to a heading: type, default, bounds, comment."""
    from fedloom.config import Config
    from fedloom.schema import config_schema

    notes = _comments(Config)
    sections: dict[str, list[str]] = {"": []}
    for name, node in _walk(config_schema()["properties"]):
        obj = _section(node)
        if obj is not None or name.endswith("[]"):
            about = [(obj or node).get("description", ""), notes.get(name, "")]
            sections[name] = [f"{_cell(t)}\n" for t in about if t]
            if obj is None:  # a list's row: its keys below
                continue
            if obj is not node and "short for" not in obj.get("description", ""):
                # written {name, options}: a string is its name
                sections[name].append(f"`{name.split('.')[-1]}: NAME` is short for "
                                      "`{name: NAME}`.\n")
            continue
        facts = [_type(node)]
        if "default" in node:
            facts.append(f"default `{json.dumps(node['default'], ensure_ascii=False)}`")
        facts.append(_bounds(node))
        entry = [f"`{name}`", f": {_cell(' · '.join(f for f in facts if f))}"]
        if name in notes:
            entry += ["", f"  {_cell(notes[name])}"]
        sections[name.rpartition(".")[0]] += [*entry, ""]
    lines = []
    for name, body in sections.items():
        level = "##" if "." not in name else "###"
        lines += [f"{level} {f'`{name}`' if name else 'Top level'}", "", *body, ""]
    return "\n".join(lines)


# The line of docs/reference/config.md that the keys replace.
CONFIG_KEYS = "<!-- the config's keys: generated when the site is built -->"


def _config_page(source: str) -> str:
    if CONFIG_KEYS not in source:
        raise ValueError(f"docs/reference/config.md: no {CONFIG_KEYS!r} line for the keys")
    return source.replace(CONFIG_KEYS, _config_keys())


def _config_schema() -> str:
    from fedloom.schema import config_schema

    # the descriptions are the sections' docstrings: a role shows as its target
    text = _ROLE.sub("`", json.dumps(config_schema(), indent=2, ensure_ascii=False))
    return "\n".join([
        "# Config schema",
        "",
        "`fedloom schema` prints the config's JSON Schema, generated from the dataclasses "
        "of `fedloom.config` (the same ones a config is checked against when it loads); "
        "below, as this site was built (the reST roles of its descriptions left out). "
        "Every key with its type, default, bounds and comment: [The config](config.md).",
        "",
        "`fedloom schema > fedloom.schema.json` writes it; a config that starts with "
        "`# yaml-language-server: $schema=fedloom.schema.json` gets its keys completed "
        "and checked as you type (VS Code's YAML extension, and other editors with a "
        "YAML language server).",
        "",
        "```json", text, "```", ""])


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


_PARAM = re.compile(r"^:param (\S+):(.*)$")


def _shared_params(app: Any, what: str, name: str, obj: Any, options: Any,
                   lines: list[str]) -> None:
    """Names documented together (``a, b, c: text`` in a docstring's Args), which
    napoleon has just written as ``:param a: text``, ``:param b: text``, …: the text
    stays under the first, led by every name, and each other points to it."""
    fields = []  # (first line, end, name, text)
    i = 0
    while i < len(lines):
        m = _PARAM.match(lines[i])
        j = i + 1
        if m is not None:
            while j < len(lines) and lines[j].startswith(" "):
                j += 1
            text = " ".join(" ".join([m.group(2), *lines[i + 1:j]]).split())
            fields.append((i, j, m.group(1), text))
        i = j
    groups: dict[str, list[str]] = {}
    for _, _, pname, text in fields:
        if text:
            groups.setdefault(text, []).append(pname)
    for start, end, pname, text in reversed(fields):  # from the end: indices stay valid
        names = groups.get(text, [])
        if len(names) < 2:
            continue
        if pname == names[0]:
            head = ", ".join(f"``{n}``" for n in names)
            lines[start] = f":param {pname}: {head}: {lines[start].split(':', 2)[2].strip()}"
        else:
            lines[start:end] = [f":param {pname}: see ``{names[0]}``."]


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
    elif docname == "reference/config":
        source[0] = _config_page(source[0])


def setup(app: Any) -> dict[str, Any]:
    app.connect("source-read", _source_read)
    app.connect("autodoc-process-docstring", _docstring)
    # after napoleon's (priority 500), which turns the Args section into :param: fields
    app.connect("autodoc-process-docstring", _shared_params, priority=600)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
