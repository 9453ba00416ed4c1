"""A package docstring that lists its modules is a promise: every module is named, and every name is
a module (a ``name/`` a subpackage). The listing is the docstring's ``::`` block, one module a line,
indented by four spaces; deeper lines continue the line above."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

PACKAGES = ("kvport.bench", "kvport.bench.faults", "kvport.demo", "kvport.evidence", "kvport.workers")


def _listed(doc: str) -> set[str]:
    block = doc.split("::\n", 1)[1]
    return {m.group(1) for m in re.finditer(r"^    ([a-z_]+/?)(?:\s|$)", block, flags=re.M)}


def _modules(folder: Path) -> set[str]:
    files = {p.stem for p in folder.glob("*.py") if p.name != "__init__.py"}
    return files | {f"{p.parent.name}/" for p in folder.glob("*/__init__.py")}


@pytest.mark.parametrize("name", PACKAGES)
def test_the_package_docstring_lists_exactly_its_modules(name: str) -> None:
    pkg = importlib.import_module(name)
    assert pkg.__doc__ is not None and pkg.__file__ is not None
    assert _listed(pkg.__doc__) == _modules(Path(pkg.__file__).parent)
