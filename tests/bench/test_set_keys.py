"""``kvport bench SUITE --set KEY=VALUE``: a key the suite does not read is refused before it runs, naming
the keys it does (issue 25, defect 11); the keys declared in ``kvport.bench.SUITES`` are the keys the
suites read (their modules and ``<module>_*`` helpers, or every module of a suite that is a package,
read from the source, nothing imported)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from kvport.bench import SUITES
from kvport.bench.harness import Report, SuiteOptions
from kvport.cli.main import main


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[SuiteOptions]:
    """The hash and trace suites replaced by a stub that records its options (nothing is measured)."""
    seen: list[SuiteOptions] = []

    def stub(opts: SuiteOptions) -> Report:
        seen.append(opts)
        return Report("stub", {}, {}, {})

    for name in ("hash", "trace"):
        monkeypatch.setattr(importlib.import_module(f"kvport.bench.{name}"), "run", stub)
    return seen


@pytest.mark.parametrize(("suite", "valid"),
                         [("hash", "none"), ("trace", "capacity, quality, requests, sweep, trace, traces")])
def test_an_unknown_key_is_refused_naming_the_valid_ones(suite: str, valid: str, runs: list[SuiteOptions],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", suite, "--quick", "--set", "unknown=1", "--set", "requests=2"] if suite == "trace" else
                ["bench", suite, "--quick", "--set", "unknown=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("kvport: error: --set unknown:"), err
    assert err.endswith(f"(its keys: {valid})"), err
    assert runs == []  # refused before the suite ran


def test_a_known_key_reaches_the_suite(runs: list[SuiteOptions]) -> None:
    assert main(["bench", "trace", "--quick", "--set", "requests=5"]) == 0
    assert [o.extra for o in runs] == [{"requests": 5}]


def _keys_read(tree: ast.AST) -> set[str]:
    """String keys read through ``opts.number(K)``, ``<...>.extra.get(K)``, ``extra[K]``, ``K in extra``
    (``extra`` or a name assigned from ``<...>.extra``)."""
    aliases = {n.targets[0].id for n in ast.walk(tree)
               if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
               and isinstance(n.value, ast.Attribute) and n.value.attr == "extra"}

    def is_extra(e: ast.expr) -> bool:
        return (isinstance(e, ast.Attribute) and e.attr == "extra") or (isinstance(e, ast.Name) and e.id in aliases)

    def key(e: ast.expr) -> str | None:
        return e.value if isinstance(e, ast.Constant) and isinstance(e.value, str) else None

    out: set[str] = set()
    for n in ast.walk(tree):
        found: Any = None
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.args:
            f = n.func
            if (f.attr == "number" and isinstance(f.value, ast.Name) and f.value.id == "opts") or (
                    f.attr == "get" and is_extra(f.value)):
                found = key(n.args[0])
        elif isinstance(n, ast.Subscript) and is_extra(n.value):
            found = key(n.slice)
        elif isinstance(n, ast.Compare) and isinstance(n.ops[0], ast.In) and is_extra(n.comparators[0]):
            found = key(n.left)
        if found is not None:
            out.add(found)
    return out


@pytest.mark.parametrize("name", sorted(SUITES))
def test_the_declared_keys_are_the_keys_the_suite_reads(name: str) -> None:
    spec = importlib.util.find_spec(SUITES[name].module)
    assert spec is not None and spec.origin is not None
    main_file = Path(spec.origin)
    if SUITES[name].module.count(".") > 2:  # a suite of its own package (kvport.bench.faults.suite)
        files = sorted(main_file.parent.glob("*.py"))
    else:
        files = [main_file, *sorted(main_file.parent.glob(f"{main_file.stem}_*.py"))]
    read = set().union(*(_keys_read(ast.parse(f.read_text())) for f in files))
    assert read == SUITES[name].keys, f"{name}: read but not declared {sorted(read - SUITES[name].keys)}, " \
                                      f"declared but not read {sorted(SUITES[name].keys - read)}"
