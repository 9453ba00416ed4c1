"""What the transformers adapter needs from a KV store: three calls, blocks in LKHTD layout.

``out`` / ``blocks`` are contiguous tensors ``[n, *spec.block_shape]`` (see :mod:`.layout`); block ``i``
belongs to ``keys[i]``. A store raises kvport errors only (``TierError`` family for a missing, corrupt
or unreachable block, ``CodecError`` for an undecodable one); the engine turns any of them into a
recompute of the affected tokens.

Optional: a store may also offer ``read_each(keys, fn, deadline=None)``, calling ``fn(i, view)`` with
the bytes of block ``i`` (one block per call, in key order, checked, valid only during the call), and
``write_each(keys, fill, lifetime, parent=None)``, calling ``fill(i, payload)`` to have block ``i``
written into the stored value itself. The engine then copies straight between the store's memory and
the cache and skips the staging buffer (:class:`~kvport.engines.hf.adapters.StoreBlocks` does both over
a host pool, with the block envelope checked on every load and sealed on every write).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvport.deadline import Deadline
from kvport.keys import BlockKey
from kvport.lifetime import Lifetime

__all__ = ["BlockStore", "Lifetime"]


class BlockStore(Protocol):
    def longest_prefix(self, keys: Sequence[BlockKey], *, deadline: Deadline | None = None) -> int:
        """How many leading ``keys`` are held (a block is useless without its whole prefix); waits on
        the store at most until ``deadline``."""
        ...

    def read_into(self, keys: Sequence[BlockKey], out: torch.Tensor, *, deadline: Deadline | None = None) -> None:
        """Copy the blocks of ``keys`` into ``out[: len(keys)]``; raise on any missing or bad block, and
        ``DeadlineExceeded`` once ``deadline`` passes (nothing waits past it)."""
        ...

    def write(self, keys: Sequence[BlockKey], blocks: torch.Tensor, lifetime: Lifetime,
              parent: BlockKey | None = None) -> None:
        """Store ``blocks[i]`` under ``keys[i]`` with ``lifetime`` (the store copies the bytes).

        ``parent`` is the key before ``keys[0]`` in the chain (None at the root)."""
        ...
