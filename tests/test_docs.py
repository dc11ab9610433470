"""The documentation's examples run and its links resolve.

Every ```python block right after a ``<!-- example -->`` line in README.md or docs/*.md runs as
it stands (on this run's devices: 8 CPU devices in the test command), every relative link
between those pages names a file that exists and, with ``#anchor``, a heading in it, every
``ep_comm.*`` / ``ep_comm.collectives.*`` / ``ep_comm.topology.*`` name they quote exists, and the performance
page's plots are drawn from the committed benchmark JSON. (The Sphinx build, warnings as errors,
checks the site's cross-references and that every public name has a docstring.)
"""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_EXAMPLE = re.compile(r"^<!-- example -->\n```python\n(.*?)^```", re.M | re.S)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def examples():
    """Each example's code, with ``page:line`` as its test id."""
    return [pytest.param(m.group(1),
                         id=f"{p.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}")
            for p in PAGES for text in [p.read_text()] for m in _EXAMPLE.finditer(text)]


def _load(relpath: str):
    """A module of the repository that is not on the import path (a script, a Sphinx extension)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(pathlib.Path(relpath).stem, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def anchors(page: pathlib.Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    heads = re.findall(r"^#+ (.*)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("code", examples())
def test_example_runs(code):
    exec(compile(code, "<docs example>", "exec"), {"__name__": "docs_example"})


def test_plots_are_drawn_from_the_committed_json(tmp_path):
    pytest.importorskip("matplotlib")
    plots = _load("tools/docs_plots.py")
    written = plots.main(str(tmp_path))
    assert [pathlib.Path(p).name for p in written] == list(plots.PLOTS)
    for p in written:  # and the committed ones the pages show exist
        assert pathlib.Path(p).stat().st_size > 10_000
        assert (ROOT / "docs" / "plots" / pathlib.Path(p).name).exists()


def test_there_are_examples():
    assert examples(), "no <!-- example --> block in README.md or docs/*.md"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    bad = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no file {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, "\n".join(bad)



@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_api_exists(page):
    """Every ``ep_comm.x`` / ``ep_comm.collectives.x`` / ``ep_comm.topology.x`` a page names in backticks exists
    (the docs build checks the guide's pages the same way; README.md is not one of them)."""
    pytest.importorskip("sphinx", reason="the check lives in the docs' Sphinx extension")
    stale = _load("docs/_ext/doccheck.py").stale_names(page.read_text())
    assert not stale, f"{page.relative_to(ROOT)} names what does not exist: {stale}"


PACKAGE_DIRS = ("ep_comm", "collectives", "topology")


def test_layout_names_every_module():
    """docs/layout.md names every module of the three packages and their subpackages (`name.py`
    in its package's bullet), so the map of the code cannot leave one out."""
    text = (ROOT / "docs" / "layout.md").read_text()
    packages = sorted({path.parent.relative_to(ROOT).as_posix() for top in PACKAGE_DIRS
                       for path in (ROOT / top).rglob("*.py")} - {"collectives/csrc"})
    bullets = {pkg: re.search(rf"^- `{pkg}/`:(.*?)(?=^- |\Z)", text, re.M | re.S)
               for pkg in packages}
    missing = []
    for pkg, bullet in bullets.items():
        assert bullet, f"docs/layout.md has no bullet for {pkg}/"
        for path in sorted((ROOT / pkg).glob("*.py")):
            if path.name != "__init__.py" and f"`{path.name}`" not in bullet.group(1):
                missing.append(f"{pkg}/{path.name}")
    assert not missing, f"docs/layout.md does not name {missing}"


def test_layout_names_every_native_source():
    """docs/layout.md's `collectives/csrc/` bullet names every native source, header and handler
    list (`name.ext`), so a new kernel file cannot go unmapped."""
    text = (ROOT / "docs" / "layout.md").read_text()
    bullet = re.search(r"^- `collectives/csrc/`:(.*?)(?=^- |\Z)", text, re.M | re.S)
    assert bullet, "docs/layout.md has no bullet for collectives/csrc/"
    sources = sorted(p for p in (ROOT / "collectives" / "csrc").rglob("*")
                     if p.suffix in {".cc", ".cu", ".cuh", ".h", ".def"} or p.name == "CMakeLists.txt")
    assert len(sources) > 20, sources
    missing = [p.relative_to(ROOT).as_posix() for p in sources
               if f"`{p.name}`" not in bullet.group(1)]
    assert not missing, f"docs/layout.md does not name {missing}"


# An import of, or `python -m` with, a top-level `collectives` or `topology`: the packages install
# as ep_comm.collectives and ep_comm.topology, so these names work only where the source tree
# happens to be on sys.path (an editable install puts it there), not when installed.
TOP_LEVEL_USE = re.compile(
    r"(?:^|[;\"'])\s*(?:from|import) (?:collectives|topology)\b|-m\W+(?:collectives|topology)\b",
    re.M)


def test_no_top_level_collectives_or_topology():
    """Nothing in the tree imports or runs ``collectives`` or ``topology`` by a top-level name."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    found = []
    for name in tracked:
        path = ROOT / name
        if path.suffix in {".py", ".sh", ".md", ".toml"} and not name.startswith("docs/bench/"):
            found += [f"{name}: {m.group(0).strip()}" for m in TOP_LEVEL_USE.finditer(path.read_text())]
    assert not found, f"top-level names that exist only in the source tree: {found}"


def test_every_tool_is_listed_and_cited():
    """Each probe under tools/ has a row in tools/README.md and is cited by a page of the docs
    (an uncited probe is deleted, not kept)."""
    listed = (ROOT / "tools" / "README.md").read_text()
    pages = "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    unlisted = [p.name for p in (ROOT / "tools").glob("*.py") if f"`{p.name}`" not in listed]
    uncited = [p.name for p in (ROOT / "tools").glob("*.py") if f"tools/{p.name}" not in pages]
    assert not unlisted and not uncited, (f"tools/README.md leaves out {unlisted}; no docs page "
                                          f"cites {uncited}")
