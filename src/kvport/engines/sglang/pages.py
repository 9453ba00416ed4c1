"""SGLang's host KV pool (HiCache's L2) seen page by page in kvport's stored block format.

A stored block is one SGLang page, layer-major, each layer's slab ``(2, P, H, D)``: the page's K
``[tokens, heads, dim]``, then its V (``Layout.VLLM_NHD`` in the envelope; SGLang's own token-major
order, so the copies from and to the usual host layouts move long runs), or ``(P, D)`` for an MLA
latent cache. Every host layout converts to that one format on save and from it on load, so a page
saved by an engine with one ``--hicache-mem-layout`` loads into an engine with another, and no bytes
are ever read in a layout they were not written in. The host pool's layouts (S tokens, L layers, H
KV heads of this rank, D head size, P tokens per page) and the strided view of all its pages as
``(S/P, L, 2, P, H, D)`` (MLA: ``(S/P, L, P, D)``), a view of the same memory, no copy:

=====================  ===========================  ===========================
``--hicache-mem-layout``  MHA ``kv_buffer``         MLA ``kv_buffer``
=====================  ===========================  ===========================
``layer_first``        (2, L, S, H, D)              (L, S, 1, D)
``page_first``         (2, S, L, H, D)              (S, L, 1, D)
``page_first_direct``  (2, S/P, L, P, H, D)         (S/P, L, P, 1, D)
``page_head``          (2, S/P, H, P, L, D)         --
=====================  ===========================  ===========================

Copies are one ``copy_`` per page between that view and a contiguous block (contiguous runs of a
whole layer's ``P x H x D`` for ``layer_first`` and ``page_first_direct``, ``H x D`` for
``page_first``, ``D`` for ``page_head``); no per-token Python work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvport.errors import EngineError
from kvport.spec import DType, KVSpec

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
_TORCH_DTYPES = {DType.FP32: torch.float32, DType.FP16: torch.float16, DType.BF16: torch.bfloat16}


def _mha_pages(buf: torch.Tensor, layout: str, size: int, page: int) -> torch.Tensor:
    n = size // page
    if layout == "layer_first":  # (2, L, S, H, D)
        _, L, _, H, D = buf.shape
        return buf.view(2, L, n, page, H, D).permute(2, 1, 0, 3, 4, 5)
    if layout == "page_first":  # (2, S, L, H, D)
        _, _, L, H, D = buf.shape
        return buf.view(2, n, page, L, H, D).permute(1, 3, 0, 2, 4, 5)
    if layout == "page_first_direct":  # (2, S/P, L, P, H, D)
        return buf.permute(1, 2, 0, 3, 4, 5)
    if layout == "page_head":  # (2, S/P, H, P, L, D)
        return buf.permute(1, 4, 0, 3, 2, 5)
    raise EngineError(f"SGLang host layout {layout!r} has no kvport page view (known: {', '.join(LAYOUTS)})")


def _mla_pages(buf: torch.Tensor, layout: str, size: int, page: int) -> torch.Tensor:
    n = size // page
    if layout == "layer_first":  # (L, S, 1, D)
        L, _, _, D = buf.shape
        return buf.view(L, n, page, D).permute(1, 0, 2, 3)
    if layout == "page_first":  # (S, L, 1, D)
        _, L, _, D = buf.shape
        return buf.view(n, page, L, D).permute(0, 2, 1, 3)
    if layout == "page_first_direct":  # (S/P, L, P, 1, D)
        return buf.squeeze(3)
    raise EngineError(f"SGLang MLA host layout {layout!r} has no kvport page view "
                      "(known: layer_first, page_first, page_first_direct)")


class HostPages:
    """The pages of one SGLang host KV pool, as blocks of ``spec`` (checked against the pool)."""

    def __init__(self, pool: Any, spec: KVSpec, *, mla: bool) -> None:
        self.layout = str(pool.layout)
        self.page = int(pool.page_size)
        self.size = int(pool.size)
        buf = pool.kv_buffer
        if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu":
            raise EngineError("kvport's SGLang backend needs the host pool's kv_buffer as one CPU tensor")
        if self.size % self.page:
            raise EngineError(f"host pool of {self.size} tokens is not whole pages of {self.page}")
        layers = int(pool.layer_num)
        want = _TORCH_DTYPES.get(spec.dtype)
        if spec.latent != mla:
            raise EngineError(f"model spec latent={spec.latent} but SGLang's storage config says MLA={mla}")
        if mla:
            dim = int(pool.kv_cache_dim)
            got = (layers, 1, dim, buf.dtype)
            expect = (spec.num_layers, 1, spec.head_dim, want)
            self.pages = _mla_pages(buf, self.layout, self.size, self.page)
        else:
            heads, dim = int(pool.head_num), int(pool.head_dim)
            if int(getattr(pool, "v_head_dim", dim)) != dim:
                raise EngineError(f"K head size {dim} != V head size {pool.v_head_dim}: no kvport block format")
            got = (layers, heads, dim, buf.dtype)
            expect = (spec.num_layers, spec.kv_heads_per_rank, spec.head_dim, want)
            self.pages = _mha_pages(buf, self.layout, self.size, self.page)
        if got != expect or self.page != spec.block_size:
            raise EngineError(f"SGLang host pool (layers, heads, head size, dtype) = {got}, page {self.page} "
                              f"does not match the model's KV spec {expect}, block {spec.block_size}")
        self.block_shape = tuple(self.pages.shape[1:])
        self.dtype = buf.dtype
        if self.pages[0].numel() * buf.element_size() != spec.bytes_per_block:
            raise EngineError("SGLang page bytes differ from the spec's block bytes")

    def page_ids(self, host_indices: torch.Tensor, count: int) -> list[int]:
        """The page of each of ``count`` pages of token indices (``count * P`` of them, page-aligned
        runs, as HiCache allocates them); EngineError for anything else."""
        idx = host_indices.reshape(-1)
        if idx.numel() != count * self.page:
            raise EngineError(f"{idx.numel()} host indices for {count} pages of {self.page}")
        rows = idx.reshape(count, self.page).to(torch.int64)
        first = rows[:, 0]
        whole = torch.equal(rows, first[:, None] + torch.arange(self.page, dtype=torch.int64))
        if not whole or bool(((first % self.page) != 0).any()) or bool((first < 0).any()) \
                or bool((first + self.page > self.size).any()):
            raise EngineError("host indices are not whole pages of the host pool")
        return [int(p) for p in (first // self.page).tolist()]

    def block(self, payload: memoryview) -> torch.Tensor:
        """A block's payload bytes as a tensor shaped like one page view (shares the memory)."""
        return torch.frombuffer(payload, dtype=self.dtype).view(self.block_shape)

    def _flat(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """SGLang's flat page (``get_data_page``: the host layout's own order) as (shape, the permutation
        of a block's axes giving it)."""
        shape = self.block_shape
        if len(shape) == 3:  # MLA (L, P, D)
            L, P, D = shape
            if self.layout == "page_first":
                return (P, L, D), (1, 0, 2)
            return (L, P, D), (0, 1, 2)
        L, _, P, H, D = shape  # a block: (L, 2, P, H, D)
        if self.layout == "page_first":
            return (2, P, L, H, D), (1, 2, 0, 3, 4)
        if self.layout == "page_head":
            return (2, H, P, L, D), (1, 3, 2, 0, 4)
        return (2, L, P, H, D), (1, 0, 2, 3, 4)

    def block_from_flat(self, value: torch.Tensor, payload: memoryview) -> None:
        """A flat page SGLang hands over (``batch_set``) into a block's payload."""
        shape, perm = self._flat()
        if not isinstance(value, torch.Tensor) or value.numel() != self.pages[0].numel() or value.dtype != self.dtype:
            raise EngineError("a batch_set value is not one page of the host pool")
        self.block(payload).permute(perm).copy_(value.reshape(shape))

    def flat_into(self, payload: memoryview, dst: torch.Tensor) -> None:
        """A block's payload into a flat page tensor SGLang gave (``batch_get``)."""
        shape, perm = self._flat()
        if not isinstance(dst, torch.Tensor) or dst.numel() != self.pages[0].numel() or dst.dtype != self.dtype:
            raise EngineError("a batch_get target is not one page of the host pool")
        dst.view(shape).copy_(self.block(payload).permute(perm))

    def gather(self, page_ids: Sequence[int], payloads: Sequence[memoryview]) -> None:
        for pid, out in zip(page_ids, payloads, strict=True):
            self.block(out).copy_(self.pages[pid])

    def scatter(self, page_ids: Sequence[int], payloads: Sequence[memoryview]) -> None:
        for pid, src in zip(page_ids, payloads, strict=True):
            self.pages[pid].copy_(self.block(src))
