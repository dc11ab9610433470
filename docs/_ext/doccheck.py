"""Sphinx checks that make the docs build fail (under ``-W``) where a page went stale:

- a public function, class, exception, method or property without a docstring (autodoc gives it an
  empty entry), or a docstring that shows a private path (``jax.jaxlib._jax.Array``);
- (not a warning) a dataclass's fields are listed once, in its ``Attributes:``;
- a name ``ep_comm.*`` / ``ep_comm.collectives.*`` / ``ep_comm.topology.*`` quoted in backticks on a page that
  does not exist (renamed or removed).

``tests/test_docs.py`` applies :func:`stale_names` to README.md too (not a Sphinx source)."""

from __future__ import annotations

import importlib
import re

from sphinx.util import logging

NAME = re.compile(r"`(ep_comm(?:\.[A-Za-z_]\w*)+)")
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


DOCUMENTED = ("function", "class", "exception", "method", "property", "classmethod",
              "staticmethod")


PRIVATE_PATH = re.compile(r"\b[a-z]\w*(?:\.\w+)*\._[a-z]\w*\.[A-Z]\w*")  # jax.jaxlib._jax.Array


def _require_docstrings(app, what, name, obj, options, lines):
    if what in DOCUMENTED and not any(line.strip() for line in lines):
        _log.warning(f"{name}: public {what} without a docstring")
    for line in lines:
        for path in PRIVATE_PATH.findall(line):
            _log.warning(f"{name}: shows the private path {path} (name the public one)")


PACKAGES = ("ep_comm", "ep_comm.distributed", "ep_comm.plan", "ep_comm.nnx",
            "ep_comm.collectives", "ep_comm.topology")


def dataclass_fields() -> frozenset[str]:
    """The field names of the public dataclasses of the API reference's modules."""
    import dataclasses

    names = set()
    for module in PACKAGES:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        for attr in dir(mod):
            obj = getattr(mod, attr)
            if isinstance(obj, type) and dataclasses.is_dataclass(obj):
                names.update(f.name for f in dataclasses.fields(obj))
    return frozenset(names)


_FIELDS: list[frozenset[str]] = []


def _skip_dataclass_fields(app, what, name, obj, skip, options):
    """A dataclass's fields are documented once, in its docstring's ``Attributes:`` section (as
    fields of the class): autodoc's own entry for each (its default value and annotated type, a
    private path such as ``jax.jaxlib._jax.Array``) is left out. Methods and properties stay."""
    if what != "class" or callable(obj) or isinstance(obj, property):
        return None
    if not _FIELDS:
        _FIELDS.append(dataclass_fields())
    return True if name in _FIELDS[0] else None


def _check_names(app, docname, source):
    for name in stale_names(source[0]):
        _log.warning(f"{docname}: names {name}, which does not exist")


def setup(app):
    app.connect("autodoc-process-docstring", _require_docstrings)
    app.connect("autodoc-skip-member", _skip_dataclass_fields)
    app.connect("source-read", _check_names)
    return {"parallel_read_safe": True}
