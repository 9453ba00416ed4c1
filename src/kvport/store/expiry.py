"""Expiry: the idle deadline of every block with a TTL, in one heap.

A block's TTL is its own ``ttl_s`` (a put's), else its lifetime class's (SESSION only; see
:mod:`kvport.store.lifetime`). Its deadline is ``clock() + ttl`` from its put and every hit
(:meth:`Expiry.start`); each start pushes a heap entry and leaves the old one stale (an entry counts
only while it equals the block's ``expires_at``). :meth:`Expiry.expire` pops what is due and asks
``try_drop`` (the store's drop on request) to take each block with its descendants; one somebody
holds (pinned, leased, being written) is looked at again ``_RETRY_S`` later.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from typing import Protocol

from kvport.lifetime import Lifetime
from kvport.store.lifetime import LifetimePolicy

_RETRY_S = 1.0


class Timed(Protocol):
    """What expiry reads and sets of a block's record (:class:`kvport.store.catalog.Meta`)."""

    lifetime: Lifetime
    ttl_s: float | None
    expires_at: float | None


class Expiry:
    def __init__(self, records: Mapping[bytes, Timed], policy: LifetimePolicy, clock: Callable[[], float]) -> None:
        self._records = records
        self._policy = policy
        self._clock = clock
        self._heap: list[tuple[float, bytes]] = []

    def start(self, key: bytes, m: Timed) -> None:
        """(Re)start ``key``'s idle time: now, for its TTL (none: it never expires)."""
        ttl = self._policy.idle_ttl(m.lifetime, m.ttl_s)
        m.expires_at = None if ttl is None else self._clock() + ttl
        if m.expires_at is not None:
            heapq.heappush(self._heap, (m.expires_at, key))

    def expire(self, try_drop: Callable[[bytes], bool], now: float | None = None) -> int:
        """Drop the blocks idle past their TTL (``try_drop``: False when somebody holds it); returns count."""
        heap = self._heap
        t = self._clock() if now is None else now
        dropped = 0
        while heap and heap[0][0] <= t:
            at, k = heapq.heappop(heap)
            m = self._records.get(k)
            if m is None or m.expires_at != at:
                continue
            if try_drop(k):
                dropped += 1
            else:  # pinned or leased (itself or a descendant): look again a little later
                m.expires_at = t + _RETRY_S
                heapq.heappush(heap, (m.expires_at, k))
        return dropped
