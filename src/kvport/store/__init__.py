"""TieredStore: lookup, put/get, promotion and eviction across tiers, prefetch, lifetimes.

Public API: :class:`TieredStore`, :class:`LookupResult`, :class:`StoreStats`, :class:`TierPolicy`,
:class:`WriteMode`, :class:`Reserved`, :class:`ReadViews`, :class:`Lifetime`, :class:`LifetimeRule`,
:class:`LifetimePolicy`, :class:`TierIndex` and the eviction policies (:func:`make_policy`: ``"fslru"``
default, ``"slru"``, ``"lru"``, ``"lfu"``).

Modules, the facade first, then its parts (each imports only those below it), then what they use::

    tiered     TieredStore, the facade: each public call takes the lock and hands off to one part
    placement  put / put_many: the first allowed tier with room, then THROUGH / BEHIND copies below
    reads      lookup's longest prefix, reads from the top healthy tier, promotion, zero-copy read views
    reserve    zero-copy writes: room reserved in a tier's own memory, then commit or abort
    behind     write-behind: the bounded queue, its thread, and the store's copy function it runs
    shared     the shared-tier view: probe tiers other processes write, confirm what only they vouch for
    mover      room, eviction, demotion, spill, quota room, drops: ONE rule of what may leave
    catalog    block records, tier indexes, prefix links, usage per account, counters, restart adoption
    expiry     idle TTLs, one heap
    health     broken tiers, skipped until a probe succeeds
    guard      the store's one re-entrant lock (it knows its owner) and the Busy scope of a write
    index      TierIndex: one tier's sizes, prefix tree and eviction heap (pure, no I/O)
    eviction   the eviction policies as priority rules
    lifetime   lifetime classes -> the tiers and TTLs each may have
    types      values that cross the store's boundary
"""

from kvport.lifetime import Lifetime
from kvport.store.eviction import POLICIES, EvictionPolicy, LFUDAPolicy, LRUPolicy, make_policy
from kvport.store.index import TierIndex
from kvport.store.lifetime import LifetimePolicy, LifetimeRule
from kvport.store.tiered import TieredStore
from kvport.store.types import LookupResult, ReadViews, Reserved, StoreStats, TierPolicy, WriteMode

__all__ = ["POLICIES", "EvictionPolicy", "LFUDAPolicy", "LRUPolicy", "Lifetime", "LifetimePolicy", "LifetimeRule",
           "LookupResult", "ReadViews", "Reserved", "StoreStats", "TierIndex", "TierPolicy", "TieredStore",
           "WriteMode", "make_policy"]
