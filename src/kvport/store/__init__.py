"""TieredStore: lookup, put/get, promotion and eviction across tiers, prefetch, lifetimes.

Public API: :class:`TieredStore`, :class:`LookupResult`, :class:`StoreStats`, :class:`TierPolicy`,
:class:`WriteMode`, :class:`Reserved`, :class:`ReadViews`, :class:`Lifetime`, :class:`LifetimeRule`,
:class:`LifetimePolicy`, :class:`TierIndex` and the eviction policies (:func:`make_policy`: ``"slru"``
default, ``"lru"``, ``"lfu"``).

::

    tiered     TieredStore: where each block sits, decided by lifetime rules and the eviction policy
    types      values that cross the store's boundary: TierPolicy, WriteMode, LookupResult, Reserved,
               ReadViews, StoreStats
    index      TierIndex: what one tier holds as the store sees it (sizes, prefix tree, eviction order)
    eviction   eviction policies as priority rules: the lowest-priority leaf leaves first
    lifetime   LifetimePolicy / LifetimeRule: each lifetime class mapped to tiers and TTLs
    behind     write-behind: a tier's copies written by one background thread after the put returned
    health     broken-tier tracking: a tier that was unavailable is skipped until a probe succeeds
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
