"""docs/architecture.md's module table, checked against the code (as test_wire checks
protocol.md's tables): every module under ``aotx/`` has a row, every row names a module
that exists, and each row's "Imports (aotx)" column names exactly the aotx modules it
imports.

The column lists backticked names relative to ``aotx`` (``wire``, ``engine.llama``);
``gateway.*`` stands for any module of that package and must match at least one.  Text in
parentheses and everything after the first ``;`` (third-party libraries) are prose;
``none`` is no aotx import.  A row whose column says "Any module" is not checked.

``python tests/unit/test_docs_modules.py`` prints each row that disagrees, with the
modules the code imports.
"""

from __future__ import annotations

import ast
import pathlib
import re

from .test_layout import ROOT, modules

DOC = ROOT.parent / "docs" / "architecture.md"
_CELL_NAME = re.compile(r"`([^`]+)`")


def table_rows(text: str) -> list[tuple[list[str], str]]:
    """(the modules a row names, its imports cell) for each row of the Modules tables."""
    section = text.split("### Modules", 1)[1].split("\n### ", 1)[0]
    out = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("Module", "---") or set(cells[0]) <= {"-"}:
            continue
        out.append((_CELL_NAME.findall(cells[0]), cells[3]))
    return out


def module_of(file: str) -> str:
    """``gateway/calls.py`` -> ``aotx.gateway.calls``; ``wire/__init__.py`` -> ``aotx.wire``."""
    parts = ["aotx", *file.removesuffix(".py").strip("/").split("/")]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def aotx_imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The aotx modules ``name`` imports, other than itself: ``from .. import wire`` is
    ``aotx.wire`` (not ``aotx``), ``from ..wire import Reason`` is ``aotx.wire``."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                         for a in node.names)
    return {m for m in found if m in known and m not in (name, "aotx")}


def documented(cell: str, known: set[str]) -> tuple[set[str], set[str], list[str]]:
    """(modules named, packages named with ``.*``, names that are no module) of a cell."""
    cell = re.sub(r"\([^)]*\)", "", cell).split(";", 1)[0]
    ours = {n.split(".")[1] for n in known if "." in n}  # gateway, wire, config, ...
    exact, wild, unknown = set(), set(), []
    for name in _CELL_NAME.findall(cell):
        full = "aotx." + name.removesuffix(".*")
        if name.endswith(".*") and full in known:
            wild.add(full)
        elif full in known:
            exact.add(full)
        elif name.split(".")[0] in ours:  # an aotx module that is not there (any more)
            unknown.append(name)
    return exact, wild, unknown


def disagreements(text: str | None = None) -> list[str]:
    """What the Modules tables of ``text`` (architecture.md's) get wrong about the code."""
    seen = modules()
    known = set(seen)
    bad, covered = [], set()
    for files, cell in table_rows(DOC.read_text() if text is None else text):
        names = [module_of(f) for f in files if f.endswith(".py")]
        if not names:  # a folder of static files (the console)
            continue
        missing = [n for n in names if n not in seen]
        if missing:
            bad.append(f"{files}: no such module {missing}")
            continue
        covered.update(names)
        if cell.lower().startswith("any module"):
            continue
        actual = set().union(*(aotx_imports(n, seen[n], known) for n in names))
        exact, wild, unknown = documented(cell, known)
        loose = {m for m in actual if m not in exact and not any(
            m.startswith(w + ".") for w in wild)}
        unused = exact - actual
        idle = {w for w in wild if not any(m.startswith(w + ".") for m in actual)}
        if loose or unused or idle or unknown:
            want = ", ".join(f"`{m.removeprefix('aotx.')}`" for m in sorted(actual)) or "none"
            bad.append(f"{files}: code imports {want}; not listed {sorted(loose)}, "
                       f"listed but not imported {sorted(unused | idle)}, unknown {unknown}")
    bad += [f"{m}: no row" for m in sorted(known - covered)]
    return bad


def test_the_module_table_matches_the_code() -> None:
    assert not disagreements(), "\n".join(disagreements())


def test_the_table_check_sees_a_stale_row() -> None:
    """The check could fail: an import listed that the code lacks, a row for a module
    that is gone and a module without a row are each found."""
    text = DOC.read_text()
    output = next(ln for ln in text.splitlines() if ln.startswith("| `engine/output.py` |"))
    masks = next(ln for ln in text.splitlines() if ln.startswith("| `engine/masks.py` |"))
    stale = (text.replace(output, output.removesuffix("none |") + "`ids` |")
             .replace(masks + "\n", "| `engine/gone.py` | device | x | none |\n"))
    found = "\n".join(disagreements(stale))
    assert "['engine/output.py']" in found and "aotx.ids" in found
    assert "no such module ['aotx.engine.gone']" in found
    assert "aotx.engine.masks: no row" in found
    known = set(modules())
    exact, wild, unknown = documented("`wire`, `gateway.*`, `engine.nowhere`, `numpy`; `x`",
                                      known)
    assert exact == {"aotx.wire"} and wild == {"aotx.gateway"}
    assert unknown == ["engine.nowhere"]  # numpy is a library, not a stale module
    assert module_of("wire/__init__.py") == "aotx.wire"


if __name__ == "__main__":
    print("\n".join(disagreements()) or "the module table matches the code")
