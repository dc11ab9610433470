"""Sphinx configuration: the guide (MyST Markdown pages under docs/) and the API reference
generated from the docstrings (docs/api.md). Built by ``scripts/run.sh docs`` into docs/_build
with warnings as errors."""

import os
import sys

# ep_comm is imported as installed (scripts/run.sh docs installs it): its subpackages
# ep_comm.collectives and ep_comm.topology exist only in the installed layout.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ext"))

project = "ep_comm"
author = "ep_comm developers"
# doccheck (docs/_ext): a public name without a docstring, or a page quoting an API name that
# does not exist, is a warning, an error under -W
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "doccheck"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "bench/**"]
myst_heading_anchors = 3  # "page.md#a-heading" links, as GitHub renders them
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # signatures carry them; docstrings say shapes and dtypes
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields of the class, not entries beside its members
# the fields' text gives shapes and dtypes; their annotations would show private paths
# (jax.Array as jax.jaxlib._jax.Array): doccheck fails a docstring that shows one
napoleon_attr_annotations = False
html_theme = "alabaster"
html_title = "ep_comm"

