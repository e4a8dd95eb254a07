"""Sphinx configuration of attnx's documentation (``tox -e docs``).

The build needs no network: no intersphinx inventories are fetched, and the
performance page is generated here from the ``attnx bench`` JSON files kept
in ``bench/results/``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import attnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))

import performance_tables  # noqa: E402  (docs/performance_tables.py)

project = "attnx"
author = "the attnx developers"
copyright = "2026, the attnx developers"
release = version = attnx.__version__

extensions = [
    "myst_parser",
    "numpydoc",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinxarg.ext",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
# performance_tables.md is generated and included by performance.md; archive/ keeps
# the sessions' logs for git readers, off the site
exclude_patterns = ["_build", "performance_tables.md", "archive"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autosummary_generate = True
autodoc_typehints = "none"  # numpydoc's Parameters say the types; signatures stay short
autodoc_default_options = {"members": False}
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
# Each public operation's docstring is held to Parameters, Returns, Raises
# and Examples by tests/test_docstrings.py; numpydoc only renders here.
numpydoc_validation_checks: set[str] = set()

html_theme = "pydata_sphinx_theme"
html_title = f"attnx {version}"
html_static_path = ["_static"]
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
}
html_sidebars = {"index": [], "changelog": []}

nitpicky = False


def _write_performance(app) -> None:
    performance_tables.write(ROOT / "bench" / "results", Path(app.srcdir) / "performance_tables.md")


def setup(app):
    app.connect("builder-inited", _write_performance)
