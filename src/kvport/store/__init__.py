"""TieredStore: lookup, put/get, promotion and eviction across tiers, prefetch, lifetimes.

Public API: :class:`TieredStore`, :class:`LookupResult`, :class:`StoreStats`, :class:`TierPolicy`,
:class:`WriteMode`, :class:`Lifetime`, :class:`LifetimeRule`, :class:`LifetimePolicy`,
:class:`TierIndex` and the eviction policies (:func:`make_policy`: ``"slru"`` default, ``"lru"``, ``"lfu"``).
"""

from kvport.lifetime import Lifetime
from kvport.store.eviction import POLICIES, EvictionPolicy, LFUDAPolicy, LRUPolicy, make_policy
from kvport.store.index import TierIndex
from kvport.store.lifetime import LifetimePolicy, LifetimeRule
from kvport.store.tiered import TieredStore
from kvport.store.types import LookupResult, StoreStats, TierPolicy, WriteMode

__all__ = ["POLICIES", "EvictionPolicy", "LFUDAPolicy", "LRUPolicy", "Lifetime", "LifetimePolicy", "LifetimeRule",
           "LookupResult", "StoreStats", "TierIndex", "TierPolicy", "TieredStore", "WriteMode", "make_policy"]
