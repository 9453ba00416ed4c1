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

import ctypes
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvport.deadline import Deadline, within
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


def _joined(views: list[memoryview], at: int) -> memoryview:
    """One read-only view of ``views``, which lie back to back in memory from address ``at``."""
    if len(views) == 1:
        return views[0]
    total = sum(v.nbytes for v in views)
    return memoryview((ctypes.c_char * total).from_address(at)).cast("B").toreadonly()


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

    def longest_prefix(self, keys: Sequence[BlockKey], *, deadline: Deadline | None = None) -> int:
        self.last_tiers = ()
        res = self.store.lookup(keys, deadline=deadline)
        n = res.prefix_blocks
        for i, size in enumerate(res.sizes[:n]):
            if size != self.block_bytes:  # another layout under a colliding key: stop before it
                n = i
                break
        self.last_tiers = res.tiers[:n]
        return n

    def read_each(self, keys: Sequence[BlockKey], fn: Callable[[int, memoryview], None], *,
                  deadline: Deadline | None = None) -> None:
        """``fn(i, bytes of keys[i:i + k])`` over all keys in order, without a copy where the holding
        tier allows (:meth:`TieredStore.consume`; the views are valid only during the call).
        Blocks that lie back to back in the tier's memory (a host pool whose pages were handed out
        in order) come as one view of ``k`` blocks, so the caller copies them in one go. A block of
        the wrong length raises before ``fn`` sees it."""
        if self._scratch is None:
            self._scratch = np.empty(self.block_bytes, dtype=np.uint8)
        scratch, bb = self._scratch, self.block_bytes
        scratch_at = int(scratch.ctypes.data)
        run: list[memoryview] = []  # zero-copy views of adjacent blocks, not yet handed to fn
        run_start = run_at = 0

        def flush() -> None:
            if run:
                fn(run_start, _joined(run, run_at))
                run.clear()

        with self.store.holding(deadline):  # the views stay valid (nothing evicted) until the last flush
            for i, key in enumerate(keys):
                if deadline is not None:
                    deadline.check(f"load of {len(keys)} blocks")
                def take(view: memoryview, i: int = i, key: BlockKey = key) -> None:
                    nonlocal run_start, run_at
                    if view.nbytes != bb:
                        raise BufferMismatchError(f"block {key.hex()} holds {view.nbytes} bytes, a block is {bb}")
                    at = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
                    if at == scratch_at:  # a copy in our scratch buffer: overwritten by the next block
                        flush()
                        fn(i, view)
                    elif run and at == run_at + len(run) * bb:
                        run.append(view)
                    else:
                        flush()
                        run.append(view)
                        run_start, run_at = i, at

                self.store.consume(key, take, scratch, deadline=deadline)
            flush()

    def read_into(self, keys: Sequence[BlockKey], out: torch.Tensor, *, deadline: Deadline | None = None) -> None:
        rows = _byte_rows(out, len(keys), self.block_bytes, "staging")
        for i, key in enumerate(keys):
            n = self.store.get_into(key, rows[i], deadline=deadline)
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

    def longest_prefix(self, keys: Sequence[BlockKey], *, deadline: Deadline | None = None) -> int:
        n = 0
        with within(deadline):
            present_all = self.tier.contains_many(keys)
        for present in present_all:
            if not present:
                break
            n += 1
        return n

    def read_into(self, keys: Sequence[BlockKey], out: torch.Tensor, *, deadline: Deadline | None = None) -> None:
        arr = _byte_rows(out, len(keys), self.block_bytes, "staging")
        for i, key in enumerate(keys):
            if deadline is not None:
                deadline.check(f"load of {len(keys)} blocks")
            with within(deadline):  # a remote tier's waits are cut to the time left
                n = self.tier.get_into(key, arr[i])
            if n != self.block_bytes:
                raise BufferMismatchError(f"block {key.hex()} holds {n} bytes, a block is {self.block_bytes}")

    def write(self, keys: Sequence[BlockKey], blocks: torch.Tensor, lifetime: Lifetime,
              parent: BlockKey | None = None) -> None:
        arr = _byte_rows(blocks, len(keys), self.block_bytes, "blocks")
        self.tier.put_many([(k, arr[i]) for i, k in enumerate(keys)])

