"""Moving KV between transformers' cache tensors and kvport's canonical LKHTD blocks.

transformers (5.x ``DynamicCache``) holds, per layer, K and V as ``[batch=1, H, T, D]``. kvport holds
a block as ``spec.block_shape = (L, 2, H, B, D)``, contiguous. A run of ``n`` consecutive blocks is
staged as one contiguous tensor::

    staging[n, L, 2, H, B, D]      block i = staging[i]  (spec.bytes_per_block bytes, what tiers store)
                                   layer l of block i = staging[i, l]  (spec.bytes_per_layer_block bytes)

and the cache side of the same tokens is the *landing* tensor::

    landing[L, 2, 1, H, Tcap, D]   layer l K = landing[l, 0, :, :, :T],  V = landing[l, 1, :, :, :T]

Both are allocated once per :class:`BlockLayout` and grown (never shrunk) when a longer prompt
arrives, so the hot path does no large fresh allocation (page faults run at ~1 GB/s here). Each
direction is one strided ``copy_`` (a gather or a scatter: ``n`` and ``B`` are not adjacent in
memory on the other side, so a copy is unavoidable; the measure is memcpy, ``kvport bench prefix``).
Copies run on one thread (two threads collapse on a loaded 2-core box, shared/limits/LIMITS.md).

Invariant: views handed out (``staging(n)``, cache tensors) stay valid until the next call that
grows the buffers or writes them again; callers copy out what they keep.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvport.errors import BufferMismatchError, EngineError
from kvport.spec import KVSpec


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread for the duration (copy paths), restored afterwards."""
    before = torch.get_num_threads()
    if before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before != 1:
            torch.set_num_threads(before)


def torch_dtype(spec: KVSpec) -> torch.dtype:
    dt = getattr(torch, spec.dtype.torch_name, None)
    if not isinstance(dt, torch.dtype):
        raise EngineError(f"torch has no dtype {spec.dtype.torch_name}")
    return dt


class BlockLayout:
    """Preallocated staging (LKHTD blocks) and landing (cache-shaped) buffers for one spec."""

    def __init__(self, spec: KVSpec, capacity_blocks: int = 0) -> None:
        if spec.latent:
            raise EngineError("latent (MLA) caches are not supported by the transformers adapter")
        self.spec = spec
        self.dtype = torch_dtype(spec)
        self._staging = torch.empty((0, *spec.block_shape), dtype=self.dtype)
        self._landing = torch.empty(0, dtype=self.dtype)
        self._cap = 0
        if capacity_blocks:
            self.reserve(capacity_blocks)

    @property
    def capacity_blocks(self) -> int:
        return self._cap

    def reserve(self, n_blocks: int) -> None:
        """Grow both buffers to hold ``n_blocks`` blocks (no-op when they already do)."""
        if n_blocks <= self._cap:
            return
        s = self.spec
        cap = max(n_blocks, 2 * self._cap)
        self._staging = torch.empty((cap, *s.block_shape), dtype=self.dtype)
        self._landing = torch.empty((s.num_layers, 2, 1, s.kv_heads_per_rank, cap * s.block_size, s.head_dim),
                                    dtype=self.dtype)
        self._cap = cap

    def staging(self, n_blocks: int) -> torch.Tensor:
        """Contiguous view ``[n, L, 2, H, B, D]`` of the staging buffer."""
        self.reserve(n_blocks)
        return self._staging[:n_blocks]

    # ------------------------------------------------------------------ blocks -> cache
    def _landing_view(self, n_blocks: int) -> torch.Tensor:
        s = self.spec
        t = n_blocks * s.block_size
        return self._landing[:, :, 0, :, :t].view(s.num_layers, 2, s.kv_heads_per_rank, n_blocks, s.block_size,
                                                  s.head_dim)

    def gather_layer(self, n_blocks: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy layer ``layer`` of ``staging[:n]`` into the landing buffer; return its (K, V) ``[1,H,T,D]``."""
        t = n_blocks * self.spec.block_size
        with one_thread():
            self._landing_view(n_blocks)[layer].copy_(self._staging[:n_blocks, layer].permute(1, 2, 0, 3, 4))
        return self._landing[layer, 0, :, :, :t], self._landing[layer, 1, :, :, :t]

    def gather_block(self, i: int, data: memoryview) -> None:
        """Copy stored blocks (their raw bytes: ``k`` blocks ``[L, 2, H, B, D]`` back to back) straight
        into block slots ``i .. i+k`` of the landing buffer: the load path that skips staging, one
        strided copy per run. ``reserve`` must cover them."""
        s = self.spec
        k, rem = divmod(data.nbytes, s.bytes_per_block)
        if rem or not k or i < 0 or i + k > self._cap:
            raise EngineError(f"{data.nbytes} bytes at block {i} do not fit the landing buffer "
                              f"({self._cap} blocks of {s.bytes_per_block} bytes)")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only source: torch is only read from it
            src = torch.frombuffer(data, dtype=self.dtype).view(k, *s.block_shape)
        t0 = i * s.block_size
        dst = self._landing[:, :, 0, :, t0 : t0 + k * s.block_size].view(
            s.num_layers, 2, s.kv_heads_per_rank, k, s.block_size, s.head_dim)
        with one_thread():
            dst.copy_(src.permute(1, 2, 3, 0, 4, 5))

    def gather_all(self, n_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copy all layers of ``staging[:n]`` into the landing buffer in one strided copy."""
        t = n_blocks * self.spec.block_size
        with one_thread():
            self._landing_view(n_blocks).copy_(self._staging[:n_blocks].permute(1, 2, 3, 0, 4, 5))
        return [(self._landing[i, 0, :, :, :t], self._landing[i, 1, :, :, :t]) for i in range(self.spec.num_layers)]

    def cache(self, config: Any, n_blocks: int) -> Any:
        """A transformers cache over the landing buffer, its first ``n_blocks`` blocks valid (after
        :meth:`gather_all`, or 0): the model appends the tokens it computes in place, into the room
        the buffer has left (:meth:`reserve` for the whole prompt *before* gathering: growing
        reallocates). See :mod:`kvport.engines.hf.cache`."""
        from kvport.engines.hf.cache import room_cache

        if n_blocks > self._cap:
            raise BufferMismatchError(f"landing buffer holds {self._cap} blocks, asked for {n_blocks}")
        bufs = [(self._landing[i, 0], self._landing[i, 1]) for i in range(self.spec.num_layers)] if self._cap else []
        if not bufs:  # nothing reserved: a plain cache that grows by concatenation
            from transformers import DynamicCache

            return DynamicCache(config=config)
        return room_cache(config, bufs, n_blocks * self.spec.block_size)

    # ------------------------------------------------------------------ cache -> blocks
    def scatter_from_cache(self, layers: list[tuple[torch.Tensor, torch.Tensor]], first_block: int,
                           n_blocks: int) -> torch.Tensor:
        """Copy blocks ``first_block .. first_block+n`` of per-layer (K, V) into ``staging[:n]``; return it."""
        s = self.spec
        if len(layers) != s.num_layers:
            raise BufferMismatchError(f"cache has {len(layers)} layers, spec says {s.num_layers}")
        out = self.staging(n_blocks)
        if n_blocks == 0:
            return out
        t0, t1 = first_block * s.block_size, (first_block + n_blocks) * s.block_size
        with one_thread():
            for i, (k, v) in enumerate(layers):
                if k.dim() != 4 or k.shape[0] != 1 or k.shape[1] != s.kv_heads_per_rank or k.shape[3] != s.head_dim:
                    raise BufferMismatchError(f"layer {i}: cache tensor shape {tuple(k.shape)} does not match spec")
                if k.shape[2] < t1 or k.dtype != self.dtype:
                    raise BufferMismatchError(f"layer {i}: {k.shape[2]} tokens of {k.dtype}, need {t1} of {self.dtype}")
                for kv, src in ((0, k), (1, v)):
                    blk = src[0, :, t0:t1].reshape(s.kv_heads_per_rank, n_blocks, s.block_size, s.head_dim)
                    blk = blk.permute(1, 0, 2, 3)
                    out[:, i, kv].copy_(blk)
        return out


    def block_filler(self, layers: list[tuple[torch.Tensor, torch.Tensor]],
                     n_blocks: int) -> Callable[[int, memoryview], None]:
        """``fill(b, dst)``: block ``b`` (< ``n_blocks``) of the cache ``layers`` into ``dst``, one block's
        LKHTD bytes (a stored value's payload, e.g. a reserved host page: the write path without
        staging). One strided copy per block when the layers lie in one buffer at uniform strides
        (a :class:`BlockLayout`'s landing buffer: the engine's cache), else one per layer and K/V."""
        s = self.spec
        if len(layers) != s.num_layers:
            raise BufferMismatchError(f"cache has {len(layers)} layers, spec says {s.num_layers}")
        tokens = n_blocks * s.block_size
        for i, (k, v) in enumerate(layers):
            for t in (k, v):
                if t.dim() != 4 or t.shape[0] != 1 or t.shape[1] != s.kv_heads_per_rank or t.shape[3] != s.head_dim \
                        or t.shape[2] < tokens or t.dtype != self.dtype:
                    raise BufferMismatchError(f"layer {i}: cache tensor {tuple(t.shape)} {t.dtype} cannot give "
                                              f"{tokens} tokens of this spec")
        stacked = _stacked(layers)
        bs = s.block_size

        def fill(b: int, dst: memoryview) -> None:
            if not 0 <= b < n_blocks:
                raise BufferMismatchError(f"block {b} is not among the cache's {n_blocks} full blocks")
            out = torch.frombuffer(dst, dtype=self.dtype).view(s.block_shape)
            t0 = b * bs
            with one_thread():
                if stacked is not None:
                    out.copy_(stacked[:, :, :, t0 : t0 + bs])
                    return
                for i, (k, v) in enumerate(layers):
                    out[i, 0].copy_(k[0, :, t0 : t0 + bs])
                    out[i, 1].copy_(v[0, :, t0 : t0 + bs])

        return fill

    def scatter_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, first_block: int, tokens: int) -> int:
        """Copy tokens ``[first_block*B, tokens)`` of one layer into ``staging[first_block:n, layer]``.

        ``n = ceil(tokens / B)``: a trailing partial block is zero-padded (the receiver crops it back to
        ``tokens``). The staging buffer must already hold ``n`` blocks (:meth:`reserve` first: this runs
        inside a forward hook and must not reallocate). Returns ``n``.
        """
        s = self.spec
        bs, heads, dim = s.block_size, s.kv_heads_per_rank, s.head_dim
        full, rest = divmod(tokens, bs)
        n = full + (1 if rest else 0)
        if n > self._cap or k.shape[2] < tokens or not 0 <= first_block <= full:
            raise BufferMismatchError(f"layer {layer}: {tokens} tokens from block {first_block} do not fit "
                                      f"(cache holds {k.shape[2]}, staging {self._cap} blocks)")
        out = self._staging
        with one_thread():
            for kv, src in ((0, k), (1, v)):
                if full > first_block:
                    blk = src[0, :, first_block * bs : full * bs].reshape(heads, full - first_block, bs, dim)
                    out[first_block:full, layer, kv].copy_(blk.permute(1, 0, 2, 3))
                if rest:
                    tail = out[full, layer, kv]
                    tail[:, :rest].copy_(src[0, :, full * bs : tokens])
                    tail[:, rest:].zero_()
        return n


def _stacked(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
    """``[L, 2, H, T, D]``: every layer's K and V as one strided view, when they lie in one buffer at
    uniform strides (each element is exactly the layers' own), else None."""
    k0, v0 = layers[0]
    es, st = k0.element_size(), k0.stride()
    base, storage = k0.data_ptr(), k0.untyped_storage().data_ptr()
    d_kv = v0.data_ptr() - base
    d_l = layers[1][0].data_ptr() - base if len(layers) > 1 else 0
    if d_kv <= 0 or d_l < 0 or d_kv % es or d_l % es:
        return None
    for i, (k, v) in enumerate(layers):
        for t, at in ((k, base + i * d_l), (v, base + i * d_l + d_kv)):
            if t.data_ptr() != at or t.stride() != st or t.shape != k0.shape or \
                    t.untyped_storage().data_ptr() != storage:
                return None
    try:
        return torch.as_strided(k0, (len(layers), 2, *k0.shape[1:]), (d_l // es, d_kv // es, *st[1:]),
                                k0.storage_offset())
    except RuntimeError:  # outside the storage: not one buffer after all
        return None


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) of a transformers 5.x ``DynamicCache`` (``cache.layers[i].keys/values``)."""
    try:
        return [(layer.keys, layer.values) for layer in cache.layers]
    except AttributeError as exc:
        raise EngineError(f"unsupported cache object {type(cache).__name__}: {exc}") from exc


def dynamic_cache(config: Any, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A ``DynamicCache`` whose layers hold exactly these tensors (no copy: the tensors are adopted).

    ``DynamicLayer.update`` would ``torch.cat`` onto an empty tensor (a full copy); instead each layer
    is lazily initialised and handed the tensors, which is what ``update`` leaves behind anyway.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    if len(cache.layers) != len(layers):
        raise EngineError(f"model has {len(cache.layers)} cache layers, got {len(layers)}")
    for layer, (k, v) in zip(cache.layers, layers, strict=True):
        if type(layer) is not DynamicLayer:
            raise EngineError(f"cache layer type {type(layer).__name__} is not supported (full attention only)")
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return cache
