"""Test-only start-up patches that let SGLang 0.5.23's HiCache run on a CPU-only machine (on
PYTHONPATH of the SGLang server processes the tests start; never part of kvport's package):

- host KV pools are allocated without ``pin_memory`` (torch cannot page-lock without an accelerator);
- ``transfer_kv_direct`` (device <-> host copies of ``--hicache-io-backend direct``), imported by
  SGLang only for CUDA/HIP/XPU, is given in plain torch: ``dst[dst_indices] = src[src_indices]`` per
  layer tensor.

Both are applied right after the module that needs them is imported (a meta-path hook), so the
process imports nothing of SGLang before it asks.

Opt-in, ``KVPORT_SGLANG_SUFFIX_ATTENTION=1`` (``kvport bench prefix --set engine=sglang
--set attention=suffix``): SGLang's CPU fallback attention (``torch_native``, what runs on a CPU
without AMX) computes an extend's attention for the *whole* sequence, prefix queries included, and
keeps the new tokens' rows (its own TODO says so), so a cached prefix saves only the linear layers.
This stand-in computes the new tokens' queries only, against the whole prefix's keys under the same
causal rule, as SGLang's GPU backends and its AMX kernel do; the answers are the same (the benchmark
checks its tokens). Sliding windows and encoder-decoder calls keep SGLang's own code.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
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


def _patch_torch_native(module: ModuleType) -> None:
    cls = module.TorchNativeAttnBackend
    original = cls._run_sdpa_forward_extend

    def extend(self: Any, query: Any, output: Any, k_cache: Any, v_cache: Any, req_to_token: Any,
               req_pool_indices: Any, seq_lens: Any, extend_prefix_lens: Any, extend_seq_lens: Any,
               encoder_lens: Any = None, scaling: Any = None, enable_gqa: bool = False, causal: bool = False,
               is_cross_attn: bool = False, sliding_window_size: Any = None) -> Any:
        if encoder_lens is not None or (sliding_window_size is not None and sliding_window_size > -1):
            return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                            extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa, causal,
                            is_cross_attn, sliding_window_size)
        import torch
        from torch.nn.functional import scaled_dot_product_attention

        q_all = query.movedim(0, query.dim() - 2)  # [heads, tokens, dim]
        start_q = 0
        for i in range(seq_lens.shape[0]):
            n_q, prefix, n_kv = int(extend_seq_lens[i]), int(extend_prefix_lens[i]), int(seq_lens[i])
            q = q_all[:, start_q : start_q + n_q, :]
            tokens = req_to_token[req_pool_indices[i], :n_kv]
            k = k_cache[tokens].movedim(0, query.dim() - 2).to(q.dtype)
            v = v_cache[tokens].movedim(0, query.dim() - 2).to(q.dtype)
            mask = None
            if causal and prefix > 0:  # query j (absolute position prefix + j) sees keys 0 .. prefix + j
                mask = torch.arange(n_kv, device=q.device)[None, :] <= (
                    prefix + torch.arange(n_q, device=q.device)[:, None])
            out = scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                               enable_gqa=enable_gqa, scale=scaling,
                                               is_causal=causal and prefix == 0)
            output[start_q : start_q + n_q, :, :] = out.squeeze(0).movedim(query.dim() - 2, 0)
            start_q += n_q
        return output

    cls._run_sdpa_forward_extend = extend


_PATCHES = {
    "sglang.srt.mem_cache.pool_host.base": _patch_base,
    "sglang.srt.mem_cache.pool_host.mha": _patch_mha,
}
if os.environ.get("KVPORT_SGLANG_SUFFIX_ATTENTION") == "1":
    _PATCHES["sglang.srt.layers.attention.torch_native_backend"] = _patch_torch_native


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
