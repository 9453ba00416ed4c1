"""BlockStore adapters: the engine's three calls over kvport's store and tiers.

:class:`StoreBlocks` is the normal one: a :class:`~kvport.store.TieredStore` (host + disk tiers, or a
shared/remote tier) decides placement, lifetimes, promotion and eviction; blocks are put with their
parent key so the store's prefix tree never strands a child.

:class:`TierBlocks` serves blocks straight from one :class:`~kvport.tiers.Tier` (a host pool, a disk
directory, Redis): one value per block, exactly ``spec.bytes_per_block`` bytes, read with
``get_into`` into the engine's staging buffer (a ``numpy`` view of the tensor, no copy in between).
A value of any other length is refused (:class:`BufferMismatchError`), so bytes written under
another layout never reach the model even if a key collided. Lifetimes are a store concern: a bare
tier ignores them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvport.errors import BufferMismatchError
from kvport.keys import BlockKey
from kvport.spec import KVSpec
from kvport.store import Lifetime, TieredStore
from kvport.tiers import Tier


def _byte_rows(t: torch.Tensor, n: int, block_bytes: int, what: str) -> np.ndarray:
    """``t[:n]`` as ``n`` rows of raw bytes (a numpy view sharing the tensor's memory)."""
    if not t.is_contiguous() or t.shape[0] < n or t[0].nbytes != block_bytes:
        raise BufferMismatchError(f"{what} of shape {tuple(t.shape)} cannot hold {n} blocks of {block_bytes} bytes")
    rows: np.ndarray = t.numpy().reshape(t.shape[0], -1).view(np.uint8)
    return rows


class StoreBlocks:
    """A :class:`~kvport.engines.hf.port.BlockStore` over a :class:`~kvport.store.TieredStore`.

    ``request_id`` tags REQUEST-lifetime blocks so ``store.end_request`` can drop them.
    """

    def __init__(self, store: TieredStore, spec: KVSpec, request_id: str | None = None) -> None:
        self.store = store
        self.block_bytes = spec.bytes_per_block
        self.request_id = request_id
        self.last_tiers: tuple[str, ...] = ()  # where the last lookup's hits sat (reports)
        self._scratch: np.ndarray | None = None  # one block, for tiers without zero-copy reads

    def longest_prefix(self, keys: Sequence[BlockKey]) -> int:
        self.last_tiers = ()
        res = self.store.lookup(keys)
        n = res.prefix_blocks
        for i, size in enumerate(res.sizes[:n]):
            if size != self.block_bytes:  # another layout under a colliding key: stop before it
                n = i
                break
        self.last_tiers = res.tiers[:n]
        return n

    def read_each(self, keys: Sequence[BlockKey], fn: Callable[[int, memoryview], None]) -> None:
        """``fn(i, bytes of keys[i])`` for each key in order, without a copy where the holding tier
        allows (:meth:`TieredStore.consume`; the view is valid only during the call). A block of
        the wrong length raises before ``fn`` sees it."""
        if self._scratch is None:
            self._scratch = np.empty(self.block_bytes, dtype=np.uint8)
        scratch = self._scratch
        for i, key in enumerate(keys):
            def check(view: memoryview, i: int = i, key: BlockKey = key) -> None:
                if view.nbytes != self.block_bytes:
                    raise BufferMismatchError(f"block {key.hex()} holds {view.nbytes} bytes, "
                                              f"a block is {self.block_bytes}")
                fn(i, view)

            self.store.consume(key, check, scratch)

    def read_into(self, keys: Sequence[BlockKey], out: torch.Tensor) -> None:
        rows = _byte_rows(out, len(keys), self.block_bytes, "staging")
        for i, key in enumerate(keys):
            n = self.store.get_into(key, rows[i])
            if n != self.block_bytes:
                raise BufferMismatchError(f"block {key.hex()} holds {n} bytes, a block is {self.block_bytes}")

    def write(self, keys: Sequence[BlockKey], blocks: torch.Tensor, lifetime: Lifetime,
              parent: BlockKey | None = None) -> None:
        rows = _byte_rows(blocks, len(keys), self.block_bytes, "blocks")
        for i, key in enumerate(keys):
            self.store.put(key, rows[i], lifetime=lifetime, parent=keys[i - 1] if i else parent,
                           request_id=self.request_id if lifetime is Lifetime.REQUEST else None)


class TierBlocks:
    """A :class:`~kvport.engines.hf.port.BlockStore` over one tier."""

    def __init__(self, tier: Tier, spec: KVSpec) -> None:
        self.tier = tier
        self.block_bytes = spec.bytes_per_block

    def longest_prefix(self, keys: Sequence[BlockKey]) -> int:
        n = 0
        for present in self.tier.contains_many(keys):
            if not present:
                break
            n += 1
        return n

    def read_into(self, keys: Sequence[BlockKey], out: torch.Tensor) -> None:
        arr = _byte_rows(out, len(keys), self.block_bytes, "staging")
        for i, key in enumerate(keys):
            n = self.tier.get_into(key, arr[i])
            if n != self.block_bytes:
                raise BufferMismatchError(f"block {key.hex()} holds {n} bytes, a block is {self.block_bytes}")

    def write(self, keys: Sequence[BlockKey], blocks: torch.Tensor, lifetime: Lifetime,
              parent: BlockKey | None = None) -> None:
        arr = _byte_rows(blocks, len(keys), self.block_bytes, "blocks")
        self.tier.put_many([(k, arr[i]) for i, k in enumerate(keys)])

