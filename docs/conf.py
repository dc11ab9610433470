"""Sphinx configuration: the guide (MyST Markdown pages under docs/) and the API reference
generated from the docstrings (docs/api.md). Built by ``scripts/run.sh docs`` into docs/_build
with warnings as errors."""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

project = "ep_comm"
author = "ep_comm developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "bench/**"]
myst_heading_anchors = 3  # "page.md#a-heading" links, as GitHub renders them
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # signatures carry them; docstrings say shapes and dtypes
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields of the class, not entries beside its members
html_theme = "alabaster"
html_title = "ep_comm"


def _require_docstrings(app, what, name, obj, options, lines):
    """A public module-level function or class with no docstring is a warning (an error under
    ``-W``): the reference must say what every public name takes and returns."""
    if what in ("function", "class", "exception") and not any(line.strip() for line in lines):
        from sphinx.util import logging
        logging.getLogger(__name__).warning(f"{name}: public {what} without a docstring")


def setup(app):
    app.connect("autodoc-process-docstring", _require_docstrings)
