"""TierIndex: what one tier holds, as the store sees it: sizes, prefix tree, eviction order.

Pure Python, no I/O: the store drives one index per tier, and ``kvport bench trace`` replays a trace
through the same objects without moving bytes.

Prefix tree: each entry names its parent (the previous block of the same prefix, or None) and counts
its children present *in this index*. Only leaves (no children here) are eviction candidates, so a
parent never leaves before its children::

    heap of (priority, seq, key) for leaves only; lazy deletion:
    an entry is stale when the key is gone, its priority changed, or it gained a child.
    When a leaf leaves, its parent may become a leaf and is pushed with its current priority.

Listeners: ``on_change(stored, key, parent)`` (optional) is told of every key that enters
(``stored`` True) or leaves (False) the index, after the change, on the caller's thread: the
store's KV events (:mod:`kvport.events.store`) come from here, so no way in or out is missed.

Every hit pushes an entry and leaves the old one stale, so a pool that is read but never evicts
would grow the heap without bound. A push that finds the heap over ``2 x entries + 64`` compacts
it: every stale item dropped, one item kept per leaf (the one that would pop first), heapified.
Each compaction drops more than half the heap, so it costs O(1) per push amortised, and it never
changes the eviction order (only items that would be skipped are dropped).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvport.store.eviction import EvictionPolicy

_HEAP_SLACK = 64  # compact once the heap holds more than 2 x entries + this many items


@dataclass(slots=True)
class _Entry:
    size: int
    priority: float
    parent: bytes | None
    children: int = 0


Changes = Callable[[bool, bytes, "bytes | None"], None]


class TierIndex:
    def __init__(self, policy: EvictionPolicy, capacity: int, on_change: Changes | None = None) -> None:
        self.policy = policy
        self.capacity = capacity
        self.on_change = on_change
        self.used = 0
        self._entries: dict[bytes, _Entry] = {}
        self._heap: list[tuple[float, int, bytes]] = []
        self._seq = itertools.count()

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[bytes]:
        return list(self._entries)

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self._entries))

    def size_of(self, key: bytes) -> int | None:
        e = self._entries.get(key)
        return None if e is None else e.size

    def children(self, key: bytes) -> int:
        e = self._entries.get(key)
        return 0 if e is None else e.children

    @property
    def heap_items(self) -> int:
        """Items in the eviction heap, live and stale: at most ``2 x len(self) + 64`` after any change."""
        return len(self._heap)

    def _push(self, key: bytes, e: _Entry) -> None:
        heapq.heappush(self._heap, (e.priority, next(self._seq), key))
        if len(self._heap) > 2 * len(self._entries) + _HEAP_SLACK:
            self._compact()

    def _live(self, item: tuple[float, int, bytes]) -> bool:
        e = self._entries.get(item[2])
        return e is not None and e.priority == item[0] and not e.children

    def _compact(self) -> None:
        """Drop the stale items, keeping per leaf the item that pops first (in place: ``victims``
        may be iterating over the heap)."""
        first: dict[bytes, tuple[float, int, bytes]] = {}
        for item in self._heap:
            if self._live(item) and (item[2] not in first or item < first[item[2]]):
                first[item[2]] = item
        self._heap[:] = first.values()
        heapq.heapify(self._heap)

    # ------------------------------------------------------------------ changes
    def add(self, key: bytes, size: int, parent: bytes | None = None) -> None:
        """Insert ``key`` (or refresh it as a hit when present)."""
        e = self._entries.get(key)
        if e is not None:
            self.touch(key)
            return
        e = _Entry(size, self.policy.on_insert(key), parent if parent in self._entries else None)
        self._entries[key] = e
        self.used += size
        if e.parent is not None:
            self._entries[e.parent].children += 1
        self._push(key, e)
        if self.on_change is not None:
            self.on_change(True, key, e.parent)

    def touch(self, key: bytes) -> None:
        e = self._entries.get(key)
        if e is None:
            return
        e.priority = self.policy.on_hit(key)
        if e.children == 0:
            self._push(key, e)

    def remove(self, key: bytes, *, evicted: bool = False) -> int:
        """Drop ``key``; returns its size (0 when absent). Its children lose their parent link."""
        e = self._entries.pop(key, None)
        if e is None:
            return 0
        self.used -= e.size
        if evicted:
            self.policy.on_evict(key, e.priority)
        self.policy.on_remove(key)
        if e.parent is not None:
            p = self._entries.get(e.parent)
            if p is not None:
                p.children -= 1
                if p.children == 0:
                    self._push(e.parent, p)
        if e.children:
            for c in self._entries.values():  # rare: only when a non-leaf is removed on purpose
                if c.parent == key:
                    c.parent = None
        if self.on_change is not None:
            self.on_change(False, key, e.parent)
        return e.size

    # ------------------------------------------------------------------ eviction order
    def victims(self, evictable: Callable[[bytes], bool] = lambda _k: True) -> Iterator[bytes]:
        """Leaves in eviction order (lowest priority first), skipping keys ``evictable`` refuses.

        The caller removes each yielded key (``remove(key, evicted=True)``) before asking for the
        next; a parent whose last child left becomes a candidate in the same pass. Skipped keys are
        pushed back when the iterator finishes."""
        skipped: list[tuple[float, int, bytes]] = []
        current: tuple[float, int, bytes] | None = None
        try:
            while self._heap:
                item = heapq.heappop(self._heap)
                key = item[2]
                if not self._live(item):
                    continue  # stale
                if not evictable(key):
                    skipped.append(item)
                    continue
                current = item
                yield key
                current = None
                if key in self._entries:  # caller kept it: it stays a candidate
                    skipped.append(item)
        finally:
            if current is not None and current[2] in self._entries:  # the caller stopped before removing it
                skipped.append(current)
            for item in skipped:
                heapq.heappush(self._heap, item)
