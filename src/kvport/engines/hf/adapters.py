"""BlockStore adapters: the engine's three calls over kvport's store and tiers.

:class:`StoreBlocks` is the normal one: a :class:`~kvport.store.TieredStore` (host + disk tiers, or a
shared/remote tier) decides placement, lifetimes, promotion and eviction; blocks are put with their
parent key so the store's prefix tree never strands a child.

:class:`TierBlocks` serves blocks straight from one :class:`~kvport.tiers.Tier` (a host pool, a disk
directory, Redis): one value per block. Lifetimes are a store concern: a bare tier ignores them.

Every value both write is a sealed block (:class:`kvport.codec.envelope.BlockFormat` of the spec:
header, manifest, the LKHTD block; ``stored_bytes(spec)`` bytes), and every load checks it before a
byte reaches the cache: the value's length, the identity (spec fingerprint, layout, tp rank, head
range) and key, every part present and in place, each part's xxh3. A block that fails is dropped
from the tier that held it (``CorruptBlockError``: the store serves a lower tier's copy, else the
load fails and the engine recomputes); ``last_refusal`` keeps the envelope's typed error. A value of
another length (an old block without envelope, another layout) is a miss at lookup already.

Hot paths (``kvport bench prefix`` measures the load against memcpy): a load hands ``fn`` the checked
payload as a view of the host pool's own page (one native hash call per block reads it into cache,
the copy into the cache tensors reads it from there); a write fills a reserved host page straight
from the cache tensors and hashes each part right after it was written (no staging copy).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvport import metrics
from kvport.codec.envelope import BlockFormat, block_format
from kvport.deadline import Deadline, within
from kvport.errors import BufferMismatchError, CodecError, CorruptBlockError, EngineError
from kvport.keys import BlockKey
from kvport.spec import KVSpec
from kvport.store import Lifetime, TieredStore, WriteMode
from kvport.tiers import Tier

log = logging.getLogger(__name__)

_REFUSED = metrics.counter("hf_blocks_refused", "stored blocks refused by their envelope (recomputed)", ["error"])

Fill = Callable[[int, memoryview], None]  # fill(i, payload): write block i's bytes into a value's payload


def _byte_rows(t: torch.Tensor, n: int, block_bytes: int, what: str) -> np.ndarray:
    """``t[:n]`` as ``n`` rows of raw bytes (a numpy view sharing the tensor's memory)."""
    if not t.is_contiguous() or t.shape[0] < n or t[0].nbytes != block_bytes:
        raise BufferMismatchError(f"{what} of shape {tuple(t.shape)} cannot hold {n} blocks of {block_bytes} bytes")
    rows: np.ndarray = t.numpy().reshape(t.shape[0], -1).view(np.uint8)
    return rows


def _copy_rows(rows: np.ndarray) -> Fill:
    def fill(i: int, dst: memoryview) -> None:
        np.copyto(np.frombuffer(dst, np.uint8), rows[i])

    return fill


def _opened(fmt: BlockFormat, view: memoryview, key: BlockKey, owner: StoreBlocks | TierBlocks) -> memoryview:
    """The checked payload of ``view`` stored under ``key``; a refusal is a CorruptBlockError (the
    store drops that tier's copy), its envelope error kept in ``owner.last_refusal``."""
    try:
        return fmt.open(view, key)
    except CodecError as exc:
        owner.last_refusal = exc
        _REFUSED.labels(type(exc).__name__).inc()
        log.warning("kvport: stored block %s refused (%s: %s); dropped, its tokens are recomputed",
                    key.hex(), type(exc).__name__, exc)
        raise CorruptBlockError(f"block {key.hex()} refused: {exc}") from exc


class StoreBlocks:
    """A :class:`~kvport.engines.hf.port.BlockStore` over a :class:`~kvport.store.TieredStore`.

    ``request_id`` tags REQUEST-lifetime blocks so ``store.end_request`` can drop them. Every tier of
    ``store`` must hold a sealed block (``StoreConfig(block_bytes=stored_bytes(spec))``).
    """

    def __init__(self, store: TieredStore, spec: KVSpec, request_id: str | None = None) -> None:
        self.store = store
        self.format = block_format(spec)
        self.block_bytes = spec.bytes_per_block  # a block's own bytes (the envelope's payload)
        self.value_bytes = self.format.value_bytes  # what the store holds per key
        small = [t.name for t in store.tiers.values() if t.caps.max_value_bytes < self.value_bytes]
        if small:
            raise EngineError(f"tiers {small} hold values below one stored block of {self.value_bytes} bytes "
                              "(size host pages with kvport.codec.envelope.stored_bytes(spec))")
        self.request_id = request_id
        self.last_tiers: tuple[str, ...] = ()  # where the last lookup's hits sat (reports)
        self.last_refusal: CodecError | None = None  # why the last refused block was refused
        self._scratch: np.ndarray | None = None  # one stored block, for tiers without zero-copy reads
        self._value: np.ndarray | None = None  # one stored block being written, when no page is reserved

    def longest_prefix(self, keys: Sequence[BlockKey], *, deadline: Deadline | None = None) -> int:
        self.last_tiers = ()
        res = self.store.lookup(keys, deadline=deadline)
        n = res.prefix_blocks
        for i, size in enumerate(res.sizes[:n]):
            if size != self.value_bytes:  # no envelope (an old block), or another layout: stop before it
                n = i
                break
        self.last_tiers = res.tiers[:n]
        return n

    def read_each(self, keys: Sequence[BlockKey], fn: Fill, *, deadline: Deadline | None = None) -> None:
        """``fn(i, block i's bytes)`` for every key in order: the checked payload, a view of the holding
        tier's memory where it allows (:meth:`TieredStore.consume`: the host pool, no copy), else of a
        scratch buffer; valid only during the call. A block that fails its envelope raises (dropped
        from its tier; ``CorruptBlockError``, or ``BlockNotFoundError`` when no other tier has it)
        before ``fn`` sees a byte of it."""
        if self._scratch is None:
            self._scratch = np.empty(self.value_bytes, dtype=np.uint8)
        scratch, fmt = self._scratch, self.format
        with self.store.holding(deadline):  # the views stay valid (nothing evicted) while fn runs
            for i, key in enumerate(keys):
                if deadline is not None:
                    deadline.check(f"load of {len(keys)} blocks")

                def take(view: memoryview, i: int = i, key: BlockKey = key) -> None:
                    fn(i, _opened(fmt, view, key, self))

                self.store.consume(key, take, scratch, deadline=deadline)

    def read_into(self, keys: Sequence[BlockKey], out: torch.Tensor, *, deadline: Deadline | None = None) -> None:
        rows = _byte_rows(out, len(keys), self.block_bytes, "staging")
        self.read_each(keys, lambda i, payload: np.copyto(rows[i], np.frombuffer(payload, np.uint8)),
                       deadline=deadline)

    def write(self, keys: Sequence[BlockKey], blocks: torch.Tensor, lifetime: Lifetime,
              parent: BlockKey | None = None) -> None:
        self.write_each(keys, _copy_rows(_byte_rows(blocks, len(keys), self.block_bytes, "blocks")), lifetime, parent)

    def write_each(self, keys: Sequence[BlockKey], fill: Fill, lifetime: Lifetime,
                   parent: BlockKey | None = None) -> None:
        """Store one block per key, each under the one before (the first under ``parent``):
        ``fill(i, payload)`` writes block i's bytes (``block_bytes``, the spec's layout) into the
        value's payload, then the envelope is sealed (each part hashed right after it was written).
        The value is a page reserved in the store's host tier where it has one (``reserve`` /
        ``commit``: nothing is copied but by ``fill``), else a reused buffer that is ``put``."""
        through = any(p.write is WriteMode.THROUGH for p in self.store.tier_policies.values())
        rid = self.request_id if lifetime is Lifetime.REQUEST else None
        fmt = self.format
        for i, key in enumerate(keys):
            up = keys[i - 1] if i else parent
            res = None
            if not through and key not in self.store:  # write-through tiers take a put
                res = self.store.reserve(key, self.value_bytes, lifetime=lifetime, parent=up, request_id=rid)
            if res is not None and len(res.views) == 1:
                try:
                    fill(i, fmt.payload(res.views[0]))
                    fmt.seal(res.views[0], key)
                except BaseException:
                    self.store.abort(res)
                    raise
                self.store.commit(res)
                continue
            if res is not None:
                self.store.abort(res)
            if self._value is None:
                self._value = np.empty(self.value_bytes, np.uint8)
            fill(i, fmt.payload(self._value))
            fmt.seal(self._value, key)
            self.store.put(key, self._value, lifetime=lifetime, parent=up, request_id=rid)


class TierBlocks:
    """A :class:`~kvport.engines.hf.port.BlockStore` over one tier (sealed blocks, as StoreBlocks)."""

    def __init__(self, tier: Tier, spec: KVSpec) -> None:
        self.tier = tier
        self.format = block_format(spec)
        self.block_bytes = spec.bytes_per_block
        self.value_bytes = self.format.value_bytes
        self.last_refusal: CodecError | None = None
        self._scratch = np.empty(self.value_bytes, np.uint8)

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
            try:
                with within(deadline):  # a remote tier's waits are cut to the time left
                    n = self.tier.get_into(key, self._scratch)
                payload = _opened(self.format, self._scratch.data[:n], key, self)
            except (BufferMismatchError, CorruptBlockError):  # not a sealed block of this spec: gone
                self.tier.delete(key)
                raise
            np.copyto(arr[i], np.frombuffer(payload, np.uint8))

    def write(self, keys: Sequence[BlockKey], blocks: torch.Tensor, lifetime: Lifetime,
              parent: BlockKey | None = None) -> None:
        arr = _byte_rows(blocks, len(keys), self.block_bytes, "blocks")
        values = np.empty((len(keys), self.value_bytes), np.uint8)
        for i, key in enumerate(keys):
            np.copyto(np.frombuffer(self.format.payload(values[i]), np.uint8), arr[i])
            self.format.seal(values[i], key)
        self.tier.put_many([(k, values[i]) for i, k in enumerate(keys)])
