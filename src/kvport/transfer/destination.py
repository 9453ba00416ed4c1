"""Where received KV lands: the receiver asks for a writable view per (block, layer) and receives
straight into it (``recv_into``); it calls ``commit`` only after every chunk passed its checksum,
else ``abort`` (nothing linked, buffers returned).

Implementations:

* :class:`BlockTableDestination` -- caller-provided buffers, canonical LKHTD blocks::

      buffer = [slot 0: layer 0 | layer 1 | ... ][slot 1: ...] ...   slot = spec.bytes_per_block
      view(i, l) = buffer[slot_i * bytes_per_block + l * bytes_per_layer_block : ... + bytes_per_layer_block]

* :class:`LayerMajorDestination` -- one buffer per layer, block-contiguous inside (vLLM's per-layer
  caches): ``view(i, l) = layers[l][slot_i * bytes_per_layer_block : ...]``.
* :class:`HostTierDestination` -- a page of :class:`kvport.tiers.host.HostTier` per block, reserved on
  first use (``reserve``), made visible by ``commit``, returned by ``abort``.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from kvport.errors import BufferMismatchError, IllegalMoveError
from kvport.protocol.transport import Buffer
from kvport.transfer.meta import TransferMeta

if TYPE_CHECKING:  # types only: the tier is used through reserve / commit / abort
    from kvport.tiers.host import HostTier


@runtime_checkable
class Destination(Protocol):
    def view(self, block: int, layer: int) -> memoryview:
        """Writable view of exactly ``spec.bytes_per_layer_block`` (the decoded block-layer) for block
        ``block`` (index in the transfer)."""

    def commit(self) -> None:
        """Link every block (all chunks verified)."""

    def abort(self) -> None:
        """Link nothing; return reserved buffers."""


DestinationFactory = Callable[[TransferMeta], Destination]


class DestState(enum.Enum):
    OPEN = "open"
    COMMITTED = "committed"
    ABORTED = "aborted"


class _Lifecycle:
    """OPEN -> COMMITTED | ABORTED; abort after commit or a second commit raises."""

    def __init__(self) -> None:
        self.state = DestState.OPEN
        self._lock = threading.Lock()

    def move(self, to: DestState) -> bool:
        with self._lock:
            if self.state is DestState.OPEN:
                self.state = to
                return True
            if self.state is to is DestState.ABORTED:
                return False  # abort is idempotent
            raise IllegalMoveError(f"destination {self.state.value} -> {to.value}")


def _flat(buf: Buffer | np.ndarray) -> memoryview:
    mv = buf.data if isinstance(buf, np.ndarray) else memoryview(buf)
    if mv.readonly:
        raise BufferMismatchError("destination buffer is read-only")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


class BlockTableDestination(_Lifecycle):
    def __init__(self, buffer: Buffer | np.ndarray, slots: Sequence[int], meta: TransferMeta) -> None:
        super().__init__()
        self.mv = _flat(buffer)
        self.meta = meta
        self.slots = list(slots)
        self.stride = meta.spec.bytes_per_block
        self.lb = meta.spec.bytes_per_layer_block  # decoded size (== the chunk on raw links)
        if len(self.slots) != meta.n_blocks:
            raise BufferMismatchError(f"{len(self.slots)} slots for {meta.n_blocks} blocks")
        if self.slots and (max(self.slots) + 1) * self.stride > self.mv.nbytes:
            raise BufferMismatchError(f"slot {max(self.slots)} beyond a {self.mv.nbytes}-byte buffer")
        self.linked: list[int] = []

    def view(self, block: int, layer: int) -> memoryview:
        off = self.slots[block] * self.stride + layer * self.lb
        return self.mv[off : off + self.lb]

    def commit(self) -> None:
        self.move(DestState.COMMITTED)
        self.linked = list(self.slots)

    def abort(self) -> None:
        self.move(DestState.ABORTED)


class LayerMajorDestination(_Lifecycle):
    def __init__(self, layers: Sequence[Buffer | np.ndarray], slots: Sequence[int], meta: TransferMeta) -> None:
        super().__init__()
        self.layers = [_flat(b) for b in layers]
        self.slots = list(slots)
        self.lb = meta.spec.bytes_per_layer_block  # decoded size (== the chunk on raw links)
        if len(self.layers) != meta.spec.num_layers:
            raise BufferMismatchError(f"{len(self.layers)} layer buffers for {meta.spec.num_layers} layers")
        if self.slots and any((max(self.slots) + 1) * self.lb > b.nbytes for b in self.layers):
            raise BufferMismatchError(f"slot {max(self.slots)} beyond a layer buffer")
        self.linked: list[int] = []

    def view(self, block: int, layer: int) -> memoryview:
        off = self.slots[block] * self.lb
        return self.layers[layer][off : off + self.lb]

    def commit(self) -> None:
        self.move(DestState.COMMITTED)
        self.linked = list(self.slots)

    def abort(self) -> None:
        self.move(DestState.ABORTED)


class HostTierDestination(_Lifecycle):
    """Block i lands in a HostTier page under ``meta.block_keys[i]`` (layers lo..hi-1, LKHTD order)."""

    def __init__(self, tier: HostTier, meta: TransferMeta) -> None:
        super().__init__()
        self.tier = tier
        self.meta = meta
        self.lb = meta.spec.bytes_per_layer_block  # decoded size (== the chunk on raw links)
        self.lo = meta.layers.start
        self.block_bytes = len(meta.layers) * self.lb
        self._pages: dict[int, memoryview] = {}
        self._plock = threading.Lock()

    def view(self, block: int, layer: int) -> memoryview:
        with self._plock:
            page = self._pages.get(block)
            if page is None:  # TierFullError propagates: the receiver drains and reports the loss
                page = self.tier.reserve(self.meta.block_keys[block], self.block_bytes)
                self._pages[block] = page
        off = (layer - self.lo) * self.lb
        return page[off : off + self.lb]

    def commit(self) -> None:
        self.move(DestState.COMMITTED)
        if len(self._pages) != self.meta.n_blocks:
            missing = self.meta.n_blocks - len(self._pages)
            self._abort_pages()
            raise BufferMismatchError(f"commit with {missing} blocks never received")
        for i in sorted(self._pages):
            self.tier.commit(self.meta.block_keys[i])
        self._pages.clear()

    def abort(self) -> None:
        if self.move(DestState.ABORTED):
            self._abort_pages()

    def _abort_pages(self) -> None:
        with self._plock:
            for i in list(self._pages):
                self.tier.abort(self.meta.block_keys[i])
            self._pages.clear()


def host_tier_factory(tier: HostTier) -> DestinationFactory:
    return lambda meta: HostTierDestination(tier, meta)
