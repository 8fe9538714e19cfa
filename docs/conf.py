"""Sphinx configuration of fedloom's site (``make docs``: docs/_build/html).

The Markdown pages are read by MyST. The reference pages that a command prints
(``fedloom algorithms --markdown``, ``fedloom schema``, the CLI's ``--help``) and
the config's keys on ``reference/config.md`` are generated while the site builds
(``_ext/fedloom_docs.py``), so no copy of them is committed and none can go stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
# The package from the source tree, installed or not (`make docs` on a fresh clone).
sys.path.insert(0, str(HERE.parent / "src"))

from fedloom import __version__  # noqa: E402

project = "fedloom"
author = "fedloom authors"
copyright = "fedloom authors"
release = version = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "fedloom_docs",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "Thumbs.db", ".DS_Store"]
# Pages a sweep writes for suites whose data is not in the repository
# (configs/published/*.yaml: docs/results/*-published.md) join the site when they exist
# (_ext/fedloom_docs.py adds them to the results page's contents).

myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
# Links to a page's section (`page.md#heading`) resolve to the heading's slug.
myst_heading_anchors = 4

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Types named in signatures that autodoc cannot link (torch's, numpy's) stay text:
# nitpicky mode would turn each into a warning.
nitpicky = False

html_theme = "furo"
html_title = f"fedloom {release}"
html_static_path: list[str] = []
html_show_sourcelink = False
