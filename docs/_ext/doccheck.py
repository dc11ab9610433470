"""Sphinx checks that make the docs build fail (under ``-W``) where a page went stale:

- a public function, class or exception without a docstring (autodoc gives it an empty entry);
- a name ``ep_comm.*`` / ``collectives.*`` / ``topology.*`` quoted in backticks on a page that
  does not exist (renamed or removed).

``tests/test_docs.py`` applies :func:`stale_names` to README.md too (not a Sphinx source)."""

from __future__ import annotations

import importlib
import re

from sphinx.util import logging

NAME = re.compile(r"`((?:ep_comm|collectives|topology)(?:\.[A-Za-z_]\w*)+)")
_log = logging.getLogger(__name__)


def resolves(dotted: str) -> bool:
    """``pkg.mod.attr...`` names an importable module and attributes of it."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def stale_names(text: str) -> list[str]:
    """The quoted API names in ``text`` that do not exist."""
    return sorted({m for m in NAME.findall(text) if not resolves(m)})


def _require_docstrings(app, what, name, obj, options, lines):
    if what in ("function", "class", "exception") and not any(line.strip() for line in lines):
        _log.warning(f"{name}: public {what} without a docstring")


def _check_names(app, docname, source):
    for name in stale_names(source[0]):
        _log.warning(f"{docname}: names {name}, which does not exist")


def setup(app):
    app.connect("autodoc-process-docstring", _require_docstrings)
    app.connect("source-read", _check_names)
    return {"parallel_read_safe": True}
