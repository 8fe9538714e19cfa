"""The reference of every built-in algorithm, generated from the registry.

``fedloom algorithms --markdown`` (or ``python -m fedloom.report.algorithms``)
prints the site's algorithm reference (``docs/reference/algorithms.md``, made
from this module when the site is built; no copy is committed): for each kind
and name, the config field that picks it, its options with types and defaults
(read from the factory's signature), and the ``Reference:`` block of its docstring::

    Reference:
        paper: the publication (authors, title, venue/arXiv).
        code: the public implementation it was checked against, or "none".
        departures: every way it differs from the paper or that code.
        measured: the numerical comparison with the public code (optional).

Only built-ins are listed (an installed plug-in does not change the page);
``fedloom algorithms`` without ``--markdown`` lists plug-ins too.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedloom.registry import available, get, option_types, origin

__all__ = ["Entry", "entries", "parse_reference", "render_markdown", "render_text"]

COMMAND = "fedloom algorithms --markdown"

# kind, heading, the field that names it, where its options go
KINDS: tuple[tuple[str, str, str, str], ...] = (
    ("aggregator", "Aggregators", "aggregator.name", "aggregator.options.OPTION"),
    ("server_optimizer", "Server optimizers", "server.optimizer.name",
     "server.optimizer.options.OPTION (the step size: server.lr)"),
    ("compressor", "Compressors", "compression.name", "compression.options.OPTION"),
    ("feedback", "Error feedback", "compression.feedback.name",
     "compression.feedback.options.OPTION"),
    ("planner", "Round planners", "compression.adaptive.name",
     "compression.adaptive.options.OPTION"),
    ("method", "Local methods", "client.method.name", "client.method.options.OPTION"),
    ("metric", "Client metrics", "metrics.hooks (or metrics.NAME: true)",
     "metrics.NAME_OPTION (or metrics.options.NAME.OPTION)"),
    ("partitioner", "Partitioners", "data.partition.name", "data.partition.options.OPTION"),
    ("attack", "Attacks", "attack.name", "attack.options.OPTION"),
    ("selector", "Client selectors", "cohort.selection.name",
     "cohort.selection.options.OPTION"),
    ("preaggregator", "Pre-aggregation steps", "server.pre_aggregation[i].name",
     "server.pre_aggregation[i].options.OPTION"),
)
# Arguments the engine passes itself: not options.
CONTEXT = frozenset({"self", "layout"})
CONTEXT_OF = {"partitioner": frozenset({"labels", "num_clients", "rng", "groups"}),
              "preaggregator": frozenset({"seed"})}
FIELDS = ("paper", "code", "departures", "measured")


@dataclass(frozen=True)
class Option:
    name: str
    type: str
    default: str


@dataclass(frozen=True)
class Entry:
    kind: str
    name: str
    source: str                 # module.qualname of the factory
    summary: str                # first line of its docstring
    options: tuple[Option, ...]
    reference: dict[str, str]   # paper, code, departures, measured (those given)
    origin: str


def _type_text(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty:
        return ""
    if isinstance(annotation, str):  # postponed annotations: keep the source text
        return annotation.replace("typing.", "")
    text = inspect.formatannotation(annotation)
    return text.replace("typing.", "")


def _options(factory: Callable[..., Any], kind: str) -> tuple[Option, ...]:
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # pragma: no cover (builtins)
        return ()
    out = []
    skip = CONTEXT | CONTEXT_OF.get(kind, frozenset())
    types = option_types(factory)
    for p in sig.parameters.values():
        if p.name in skip or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        default = "required" if p.default is p.empty else repr(p.default)
        text = _type_text(p.annotation)
        tp, bounds = types.get(p.name, (None, {}))
        if bounds:  # Annotated[float, Range(...)]: the type, then its bounds
            sym = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
            text = f"{_type_text(tp)} ({', '.join(f'{sym[k]} {v:g}' for k, v in bounds.items())})"
        out.append(Option(p.name, text, default))
    return tuple(out)


_HEAD = re.compile(r"^(\s*)Reference:\s*$")
_FIELD = re.compile(r"^\s*(paper|code|departures|measured):\s*(.*)$")


def parse_reference(doc: str | None) -> dict[str, str]:
    """The fields of a docstring's ``Reference:`` block (lines joined, whitespace
    collapsed); ``{}`` when it has none."""
    if not doc:
        return {}
    lines = inspect.cleandoc(doc).splitlines()
    out: dict[str, str] = {}
    for i, line in enumerate(lines):
        head = _HEAD.match(line)
        if head is None:
            continue
        indent = len(head.group(1))
        key = None
        for body in lines[i + 1:]:
            if body.strip() and len(body) - len(body.lstrip()) <= indent:
                break  # the block ends at the next line indented like its head
            m = _FIELD.match(body)
            if m is not None:
                key = m.group(1)
                out[key] = m.group(2).strip()
            elif key is not None and body.strip():
                out[key] = f"{out[key]} {body.strip()}".strip()
        break
    return out


def _summary(doc: str | None) -> str:
    if not doc:
        return ""
    para = inspect.cleandoc(doc).split("\n\n")[0]
    return " ".join(para.split())


def entries(builtin_only: bool = True) -> list[Entry]:
    """One entry per registered name of every algorithm kind, in :data:`KINDS` order."""
    out = []
    for kind, *_ in KINDS:
        for name in available(kind):
            where = origin(kind, name)
            if builtin_only and where != "fedloom":
                continue
            factory = get(kind, name)
            # A class's own docstring (inspect.getdoc would inherit its base's).
            doc = (vars(factory).get("__doc__") if isinstance(factory, type)
                   else factory.__doc__)
            source = f"{factory.__module__}.{getattr(factory, '__qualname__', name)}"
            out.append(Entry(kind, name, source, _summary(doc), _options(factory, kind),
                             parse_reference(doc), where))
    return out


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(items: list[Entry] | None = None) -> str:
    """The site's algorithm reference (``docs/reference/algorithms.md``)."""
    items = entries() if items is None else items
    lines = [
        "# Algorithms",
        "",
        "Every built-in algorithm of fedloom: the config field that picks it, its options "
        "(types and defaults from the factory's signature), the paper, the public code it "
        "was checked against, and every departure. The math and the measured comparisons "
        "are in each implementation's docstring (the module named under each entry).",
        "",
        f"Generated from the registry when the site is built (`{COMMAND}` prints it). "
        "Plug-ins (entry points, `module:attr`) are described in "
        "[your own algorithm](../tutorials/own-algorithm.md); "
        "`fedloom algorithms` lists the installed ones too.",
        "",
    ]
    for kind, heading, field, where in KINDS:
        group = [e for e in items if e.kind == kind]
        if not group:
            continue
        lines += [f"## {heading}", "", f"Chosen by `{field}`; options: `{where}`.", ""]
        for e in group:
            lines += [f"### `{e.name}`", ""]
            if e.summary:
                lines += [e.summary, ""]
            lines += [f"Source: `{e.source}`", ""]
            if e.options:
                lines += ["| option | type | default |", "|---|---|---|"]
                lines += [f"| `{o.name}` | {_md(o.type) or '–'} | `{_md(o.default)}` |"
                          for o in e.options]
                lines.append("")
            else:
                lines += ["Options: none.", ""]
            for key in FIELDS:
                if key in e.reference:
                    lines.append(f"- **{key}**: {e.reference[key]}")
            missing = [k for k in FIELDS[:3] if k not in e.reference]
            if missing:
                lines.append(f"- not stated: {', '.join(missing)}")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def render_text(items: list[Entry]) -> str:
    """A terminal listing: kind, name, options, where it comes from."""
    rows = []
    for e in items:
        opts = ", ".join(f"{o.name}={o.default}" for o in e.options) or "-"
        where = "" if e.origin == "fedloom" else f"  [{e.origin}]"
        rows.append(f"{e.kind:<16} {e.name:<14} {opts}{where}")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedloom.report.algorithms",
                                description="print the algorithm reference (Markdown)")
    p.parse_args(argv)
    sys.stdout.write(render_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
