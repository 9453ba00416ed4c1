"""Every package's docstring is a true map of it, and no two classes of kvport share a name.

A *map line* is a line of a package's ``__init__.py`` docstring indented by exactly four spaces
that starts with a name, or names joined by ``|``, then two or more spaces and what it is for (or
nothing: the next, deeper indented line says it)::

    conn       one connection: its state machine, the handshake, the request loop
    tcp | shm  transports
    units | metrics | memops
               (a deeper indent continues the line above)

Each package must name, on its map lines, every module it holds (``x.py``, or a compiled ``x``
beside its ``x.pyi`` stub) and every subpackage, each once, and nothing else. Private modules
(``_x``) and ``__main__`` are named too: a newcomer opens them as files like any other, and
"private" says who may import a module, not whether it needs a line. Only ``__init__`` itself is
exempt (it is the map). A subpackage may be written ``name/``. A dotted ``kvport.a.b`` in a package docstring
must name a module, or an attribute of one, that exists.

The walk reads files only: nothing is imported, so packages whose extras are missing are checked
too.
"""

from __future__ import annotations

import ast
import collections
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "kvport"
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_MAP_LINE = re.compile(rf"^ {{4}}({_NAME}/?(?:\s*\|\s*{_NAME}/?)*)(?:\s{{2,}}\S|\s*$)")
_DOTTED = re.compile(r"\bkvport(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def _packages() -> list[Path]:
    return sorted(p.parent for p in ROOT.rglob("__init__.py") if "__pycache__" not in p.parts)


def _contents(pkg: Path) -> set[str]:
    """Module and subpackage names of ``pkg`` (``__init__`` left out)."""
    names = {p.stem for p in pkg.glob("*.py")} | {p.stem for p in pkg.glob("*.pyi")}
    names |= {d.name for d in pkg.iterdir() if (d / "__init__.py").is_file()}
    names.discard("__init__")
    return names


def _docstring(pkg: Path) -> str:
    return ast.get_docstring(ast.parse((pkg / "__init__.py").read_text()), clean=False) or ""


def _mapped(doc: str) -> list[str]:
    out: list[str] = []
    for line in doc.splitlines():
        m = _MAP_LINE.match(line)
        if m:
            out.extend(n.strip().rstrip("/") for n in m.group(1).split("|"))  # ``name/``: a subpackage
    return out


def _dotted(pkg: Path) -> str:
    rel = pkg.relative_to(ROOT.parent)
    return ".".join(rel.parts)


@pytest.mark.parametrize("pkg", _packages(), ids=_dotted)
def test_the_package_docstring_names_every_module_and_nothing_else(pkg: Path) -> None:
    doc = _docstring(pkg)
    named = _mapped(doc)
    there = _contents(pkg)
    missing = sorted(there - set(named))
    absent = sorted(set(named) - there)
    twice = sorted(n for n, c in collections.Counter(named).items() if c > 1)
    assert not missing, f"{_dotted(pkg)}'s docstring has no map line for {missing}"
    assert not absent, f"{_dotted(pkg)}'s docstring names {absent}, which it does not hold"
    assert not twice, f"{_dotted(pkg)}'s docstring names {twice} twice"


def _source(parts: list[str]) -> Path | None:
    path = ROOT.parent.joinpath(*parts)
    for src in (path / "__init__.py", path.with_suffix(".py"), path.with_suffix(".pyi")):
        if src.is_file():
            return src
    return None


def _resolves(dotted: str) -> bool:
    """``kvport.a.b``: a module or package, or a name defined in one (``kvport.a.b.Name``)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        src = _source(parts[:n])
        if src is not None:
            rest = parts[n:]
            return not rest or (len(rest) == 1 and re.search(rf"\b{re.escape(rest[0])}\b", src.read_text()) is not None)
    return False


@pytest.mark.parametrize("pkg", _packages(), ids=_dotted)
def test_dotted_names_in_the_package_docstring_exist(pkg: Path) -> None:
    wrong = sorted({d for d in _DOTTED.findall(_docstring(pkg)) if not _resolves(d)})
    assert not wrong, f"{_dotted(pkg)}'s docstring names {wrong}, which do not exist"


def test_no_two_classes_share_a_name() -> None:
    """One name, one thing: a class name says which class it is anywhere in kvport."""
    where: dict[str, list[str]] = collections.defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(str(path.relative_to(ROOT.parent)))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not shared, f"class names used twice: {shared}"


def test_the_map_reader_reads_what_the_docstrings_write() -> None:
    doc = """Title.

Modules::

    frame       the frame codec
    tcp | shm   transports
                (a continuation)
    units | metrics
                names alone on a line, said below
    x = f(y)    # code in a literal block is not a map line
      deeper    neither is this
not indented    nor this
"""
    assert _mapped(doc) == ["frame", "tcp", "shm", "units", "metrics"]
