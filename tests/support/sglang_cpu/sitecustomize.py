"""Test-only start-up patches that let SGLang 0.5.23's HiCache run on a CPU-only machine (on
PYTHONPATH of the SGLang server processes the tests start; never part of kvport's package):

- host KV pools are allocated without ``pin_memory`` (torch cannot page-lock without an accelerator);
- ``transfer_kv_direct`` (device <-> host copies of ``--hicache-io-backend direct``), imported by
  SGLang only for CUDA/HIP/XPU, is given in plain torch: ``dst[dst_indices] = src[src_indices]`` per
  layer tensor.

Both are applied right after the module that needs them is imported (a meta-path hook), so the
process imports nothing of SGLang before it asks.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any


def transfer_kv_direct(src_layers: Sequence[Any], dst_layers: Sequence[Any], src_indices: Any,
                       dst_indices: Any, page_size: int = 1) -> None:
    import torch

    src_idx = src_indices.to(device="cpu", dtype=torch.int64)
    dst_idx = dst_indices.to(device="cpu", dtype=torch.int64)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst.index_copy_(0, dst_idx.to(dst.device), src.index_select(0, src_idx.to(src.device)).to(dst.device))


def _patch_base(module: ModuleType) -> None:
    cls = module.HostKVCache
    original = cls.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        if "pin_memory" in kwargs:
            kwargs["pin_memory"] = False
        original(self, *args, **kwargs)
        self.pin_memory = False

    cls.__init__ = init


def _patch_mha(module: ModuleType) -> None:
    module.transfer_kv_direct = transfer_kv_direct


_PATCHES = {
    "sglang.srt.mem_cache.pool_host.base": _patch_base,
    "sglang.srt.mem_cache.pool_host.mha": _patch_mha,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: Any) -> None:
        self.inner, self.patch = inner, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, patch)
        return spec


sys.meta_path.insert(0, _Finder())
