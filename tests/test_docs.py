"""The site builds, and the snippets of the README and the site run as written.

- The site (``docs/``, ``make docs``) is built with warnings as errors into a
  temporary folder: a broken link or cross-reference, a page outside every table
  of contents, a docstring autodoc cannot read or a generated page that fails
  stops ``make test``. On the built pages: the API page says each paragraph once,
  no page shows a reST role as text, the config page lists every key of the
  config's dataclasses and the command-line pages every command of the parser.
- Every ``python`` block of the README and of the site's pages is executed, in a
  temporary working directory that sees the repository's ``configs/``.
- Every ``fedloom`` command line of a ``bash`` block is parsed by the CLI's own
  parser; a ``fedloom run``/``partition`` line's config and overrides are loaded and
  validated (the runs themselves are long: the snippets' Python twins run them),
  and a ``fedloom sweep`` line's suite file must exist.
- A ``yaml`` block made of config sections is validated as part of the quickstart
  config.

Pages left out, with why: ``docs/results/`` (written by ``fedloom sweep``: commands
only, each the page's own regeneration), ``docs/architecture.md`` (its worked
example has a test of its own, ``tests/test_architecture_doc.py``) and
``docs/deploy.md`` (Flower apps: the same code runs under Flower's simulation in
``tests/test_flower_quickstart.py`` and ``tests/test_flower.py``).
"""

from __future__ import annotations

import html as html_lib
import importlib.util
import re
import shlex
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SKIP = {DOCS / "architecture.md", DOCS / "deploy.md",
        # its blocks build on each other (a module file, then runs that import it):
        # tests/test_tutorial_python.py runs the page in order
        DOCS / "tutorials" / "python-experiment.md"}


def _pages() -> list[Path]:
    pages = [ROOT / "README.md"]
    pages += sorted(p for p in DOCS.rglob("*.md")
                    if p not in SKIP and "results" not in p.relative_to(DOCS).parts
                    and "_build" not in p.parts)
    return pages


def _blocks(lang: str) -> list[tuple[str, str]]:
    """(id, text) of every fenced block in ``lang`` (indented ones too)."""
    out = []
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        for m in re.finditer(rf"^( *)```{lang}\n(.*?)^\1```", text, flags=re.S | re.M):
            body = "\n".join(line[len(m.group(1)):] for line in m.group(2).splitlines())
            line = text[:m.start()].count("\n") + 1
            out.append((f"{page.relative_to(ROOT)}:{line}", body))
    return out


def _params(lang: str) -> list:
    return [pytest.param(body, id=where) for where, body in _blocks(lang)]


# --------------------------------------------------------------------- the site
@pytest.fixture(scope="module")
def site(tmp_path_factory) -> tuple[int, str, Path]:
    """``make docs``'s build (``sphinx-build -W --keep-going``), here in this process:
    autodoc then imports the package that this process has already imported, instead
    of a fresh interpreter importing torch and the package again. Built once for the
    checks below: (exit status, warnings, the html folder)."""
    for mod in ("sphinx", "myst_parser", "furo"):
        pytest.importorskip(mod)
    from sphinx.cmd.build import build_main

    tmp = tmp_path_factory.mktemp("site")
    html = tmp / "html"
    warnings_file = tmp / "warnings.txt"
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        mp.chdir(ROOT)
        mp.setattr(sys, "path", list(sys.path))  # docs/conf.py prepends its folders
        warnings.simplefilter("ignore")  # Python's own warnings, not the site's
        rc = build_main(["-W", "--keep-going", "-q", "-b", "html", "-w", str(warnings_file),
                         "-d", str(tmp / "doctrees"), str(DOCS), str(html)])
    warned = warnings_file.read_text() if warnings_file.exists() else ""
    return rc, warned, html


def _text(page: Path) -> str:
    """A built page's text: tags out, entities read, whitespace collapsed."""
    return " ".join(html_lib.unescape(re.sub(r"<[^>]+>", "", page.read_text())).split())


def test_site_builds_with_warnings_as_errors(site):
    rc, warned, html = site
    assert rc == 0, warned[-4000:]
    for page in ("index", "tutorials/quickstart", "reference/api", "results/craft"):
        assert (html / f"{page}.html").is_file(), page
    # the generated pages were filled in, not left as their stubs
    assert "craft" in (html / "reference/algorithms.html").read_text()
    assert '"additionalProperties": false' in _text(html / "reference/schema.html")
    assert "--resume" in (html / "reference/cli.html").read_text()


def test_the_api_page_says_each_paragraph_once(site):
    # napoleon writes `a, b: text` of a docstring's Args as one field a name, the
    # text under each: the extension keeps it under the first (_shared_params)
    page = (site[2] / "reference/api.html").read_text()
    paragraphs = Counter(" ".join(html_lib.unescape(re.sub(r"<[^>]+>", "", p)).split())
                         for p in re.findall(r"<p>(.*?)</p>", page, flags=re.S))
    repeated = {p: n for p, n in paragraphs.items() if n > 1 and len(p.split()) >= 8}
    assert not repeated, repeated


def test_no_page_shows_a_raw_role(site):
    # a reST role in Markdown (a page, a docstring or comment rendered into one) is text
    role = re.compile(r":(?:py:)?(?:mod|class|func|meth|attr|data|exc|obj):`")
    shown = {str(p.relative_to(site[2])): sorted(set(role.findall(p.read_text())))
             for p in site[2].rglob("*.html")}
    assert not {p: r for p, r in shown.items() if r}


def _config_keys(cls: type, prefix: str = "") -> Iterator[str]:
    """Every dotted key of the config's dataclasses (a list of rows: ``key[].field``)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        yield key
        tp = hints[f.name]
        args = typing.get_args(tp)
        inner = [(a, "[]" if typing.get_origin(tp) is list else "")
                 for a in (args or (tp,)) if dataclasses.is_dataclass(a)]
        for sub, rows in inner:
            yield from _config_keys(sub, f"{key}{rows}.")


def test_the_config_page_lists_every_key(site):
    from fedloom.config import Config

    page = (site[2] / "reference/config.html").read_text()
    shown = set(re.findall(r'<span class="pre">([^<]+)</span>', page))
    keys = list(_config_keys(Config))
    assert {"cohort.selection", "system.mode", "system.concurrency", "system.buffer",
            "system.staleness", "logging.plots", "model.options", "model.buffers",
            "data.options", "data.augment",
            "system.classes[].speed"} <= set(keys)
    assert [k for k in keys if k not in shown] == []
    # with the comment written at it in the source
    text = _text(site[2] / "reference/config.html")
    assert "each arrival weighted by s(τ) of its staleness τ" in text  # system.mode


def test_the_cli_pages_list_every_command(site):
    import argparse

    from fedloom.cli import build_parser

    sub = next(a for a in build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    for page in ("reference/cli", "howto/cli"):
        text = _text(site[2] / f"{page}.html")
        assert [c for c in sub.choices if f"fedloom {c}" not in text] == [], page


def test_names_documented_together_keep_one_paragraph():
    spec = importlib.util.spec_from_file_location("fedloom_docs", DOCS / "_ext"
                                                  / "fedloom_docs.py")
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    lines = [":param x: the input", ":param a: objects used", "   instead of names",
             ":param b: objects used", "   instead of names", ":param c:", ""]
    ext._shared_params(None, "function", "f", None, None, lines)
    assert lines == [":param x: the input", ":param a: ``a``, ``b``: objects used",
                     "   instead of names", ":param b: see ``a``.", ":param c:", ""]


# ------------------------------------------------------------ python snippets
@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("code", _params("python"))
def test_python_snippet_runs(code, in_tmp):
    exec(compile(code, "<snippet>", "exec"), {"__name__": "__snippet__"})


# --------------------------------------------------------- command-line snippets
# A synopsis line (`fedloom run CONFIG [key=value ...]`) names no file to run.
SYNOPSIS = re.compile(r"\[|\.\.\.|…|\b[A-Z][A-Z_]{2,}\b")


def _commands() -> list:
    out = []
    for where, body in _blocks("bash"):
        text = re.sub(r"\\\n\s*", " ", body)
        for line in text.splitlines():
            # the command itself: no comment, no redirection or pipe after it
            line = re.split(r"\s(?:#|>|\|)\s?", line)[0].strip()
            if line.startswith("fedloom ") and not SYNOPSIS.search(line):
                out.append(pytest.param(line, id=f"{where}: {line[:60]}"))
    return out


@pytest.mark.parametrize("line", _commands())
def test_command_line_snippet_is_valid(line, monkeypatch):
    from fedloom.cli import build_parser
    from fedloom.config import load_config

    monkeypatch.chdir(ROOT)
    argv = shlex.split(line)[1:]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --version and --help print and exit 0
        assert e.code == 0, line
        return
    if args.command in ("run", "partition"):
        assert Path(args.config).is_file(), args.config
        load_config(args.config, args.overrides)
    elif args.command == "sweep":
        assert Path(args.suite).is_file(), args.suite


def _config_sections() -> list:
    from fedloom.config import Config, yaml_load

    fields = set(Config.__dataclass_fields__)
    out = []
    for where, body in _blocks("yaml"):
        data = yaml_load(body, where)  # as a config file is read (YAML 1.2 floats)
        if isinstance(data, dict) and data and set(data) <= fields:
            out.append(pytest.param(data, id=where))
    return out


@pytest.mark.parametrize("section", _config_sections())
def test_config_snippet_is_valid(section):
    from fedloom.config import load_config, yaml_load

    base = yaml_load((ROOT / "configs" / "quickstart.yaml").read_text())
    load_config({**base, **section})


def test_every_page_has_its_snippets_found():
    # a fence the patterns above miss would silently leave a snippet untested
    found = {where.split(":")[0] for where, _ in _blocks("python")}
    assert {"README.md", "docs/tutorials/quickstart.md", "docs/tutorials/own-data.md",
            "docs/tutorials/own-algorithm.md"} <= found
    # a tutorial runs a local-step term that reads its StepContext and a server chain
    assert any("ctx.step" in body and "ctx.W0" in body and "chain(heavy_ball(" in body
               for where, body in _blocks("python") if where.startswith("docs/tutorials/"))
    assert _commands() and _config_sections()
