"""The site builds, and the snippets of the README and the site run as written.

- The site (``docs/``, ``make docs``) is built with warnings as errors into a
  temporary folder: a broken link or cross-reference, a page outside every table
  of contents, a docstring autodoc cannot read or a generated page that fails
  stops ``make test``.
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

import re
import shlex
import sys
import warnings
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
def test_site_builds_with_warnings_as_errors(tmp_path, monkeypatch):
    """``make docs``'s build (``sphinx-build -W --keep-going``), here in this process:
    autodoc then imports the package that this process has already imported, instead
    of a fresh interpreter importing torch and the package again."""
    for mod in ("sphinx", "myst_parser", "furo"):
        pytest.importorskip(mod)
    from sphinx.cmd.build import build_main

    html = tmp_path / "html"
    warnings_file = tmp_path / "warnings.txt"
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))  # docs/conf.py prepends its folders
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Python's own warnings, not the site's
        rc = build_main(["-W", "--keep-going", "-q", "-b", "html", "-w", str(warnings_file),
                         "-d", str(tmp_path / "doctrees"), str(DOCS), str(html)])
    warned = warnings_file.read_text() if warnings_file.exists() else ""
    assert rc == 0, warned[-4000:]
    for page in ("index", "tutorials/quickstart", "reference/api", "results/craft"):
        assert (html / f"{page}.html").is_file(), page
    # the generated pages were filled in, not left as their stubs
    assert "craft" in (html / "reference/algorithms.html").read_text()
    assert "client.lr" in (html / "reference/schema.html").read_text()
    assert "--resume" in (html / "reference/cli.html").read_text()


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
    assert {"README.md", "docs/tutorials/quickstart.md", "docs/tutorials/own-data.md"} <= found
    assert _commands() and _config_sections()
