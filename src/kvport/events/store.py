"""A store's tier changes as KV events: every block that enters or leaves a tier of a
:class:`~kvport.store.TieredStore` (``TieredStore(changes=StoreEvents(...))``) is published as
``BlockStored`` / ``BlockRemoved`` naming the tier (``ownership: kvport:<tier>``), its medium
(device tier: GPU; host: CPU; disk, Redis, a kvport server: STORAGE) and whether other engines read
it too (``locality``: REMOTE for a shared tier, else LOCAL).

The store calls :meth:`StoreEvents.__call__` under its lock, so it only appends to a list; a thread
flushes every ``flush_s`` (or at ``max_events``) into one batch, consecutive changes of the same
kind and tier folded into one event (their order kept), and hands it to the publisher, which never
blocks (a full queue drops the batch and counts it: the subscribers see the gap in the sequence
numbers and replay). Block hashes are kvport's block keys (16 bytes), parents included.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping, Sequence

from kvport.events.wire import (
    LOCAL,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    REMOTE,
    BlockRemoved,
    BlockStored,
    Event,
)
from kvport.tiers.base import Tier

Publish = Callable[[Sequence[Event]], object]


def place_of(tier: Tier) -> tuple[str, str]:
    """(medium, locality) of a tier, from what it declares."""
    caps = tier.caps
    if caps.device:
        return MEDIUM_GPU, LOCAL
    if caps.shared:
        return MEDIUM_STORAGE, REMOTE
    if caps.persistent:
        return MEDIUM_STORAGE, LOCAL
    return MEDIUM_CPU, LOCAL


def save_places(tiers: Sequence[Tier], written: Collection[str] = ()) -> list[tuple[str, str, str]]:
    """(medium, locality, ownership) of every tier a save lands in, when one event per save and
    tier is all there is (an engine's connector reporting its saves): the top tier, and each tier
    below it that every save is copied to (``written``: write-through or write-behind)."""
    return [(*place_of(t), f"kvport:{t.name}") for i, t in enumerate(tiers) if i == 0 or t.name in written]


class StoreEvents:
    """The store's ``changes`` listener: batches its tier changes into events for ``publish``."""

    def __init__(self, tiers: Mapping[str, Tier] | Sequence[Tier], publish: Publish, *, block_size: int = 0,
                 flush_s: float = 0.02, max_events: int = 4096) -> None:
        items = tiers.values() if isinstance(tiers, Mapping) else tiers
        self.places = {t.name: place_of(t) for t in items}
        self.publish = publish
        self.block_size = block_size
        self.flush_s, self.max_events = flush_s, max_events
        self._pending: list[tuple[str, bool, bytes, bytes | None]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvport-store-events", daemon=True)
        self._thread.start()

    def __call__(self, tier: str, stored: bool, key: bytes, parent: bytes | None) -> None:
        with self._lock:
            self._pending.append((tier, stored, key, parent))
            full = len(self._pending) >= self.max_events
        if full:
            self._wake.set()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self.flush_s)
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        """Publish what is pending now, as one batch."""
        with self._lock:
            pending, self._pending = self._pending, []
        if pending:
            self.publish(self.events(pending))

    def events(self, changes: Sequence[tuple[str, bool, bytes, bytes | None]]) -> list[Event]:
        """Changes folded into events: a run of one kind in one tier is one event (stored blocks
        share an event only while each one's parent is the block before it, as in vLLM's)."""
        out: list[Event] = []
        run: list[bytes] = []
        run_parent: bytes | None = None
        cur: tuple[str, bool] | None = None

        def close() -> None:
            if cur is None or not run:
                return
            medium, locality = self.places.get(cur[0], (None, None))
            owner = f"kvport:{cur[0]}"
            if cur[1]:
                out.append(BlockStored(tuple(run), run_parent, (), self.block_size, medium, locality, owner))
            else:
                out.append(BlockRemoved(tuple(run), medium, locality, owner))

        for tier, stored, key, parent in changes:
            same = cur == (tier, stored) and (not stored or parent == run[-1])
            if not same:
                close()
                cur, run, run_parent = (tier, stored), [], parent
            run.append(key)
        close()
        return out

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(2.0)
        self.flush()


__all__ = ["StoreEvents", "place_of", "save_places"]
