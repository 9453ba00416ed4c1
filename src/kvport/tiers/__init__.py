"""Tiers: host RAM, local disk, Redis, device. Bytes in, bytes out; no owners, no policy.

Public API: :class:`Tier`, :class:`TierCaps` (:mod:`kvport.tiers.base`), :class:`HostTier`,
:class:`DiskTier`, :class:`RedisTier`, :class:`DeviceTier` (only usable when CUDA exists),
:class:`FaultTier` (wraps a tier and injects faults, for tests and chaos runs).
"""

from kvport.tiers.base import Buffer, Tier, TierCaps, byte_view, writable_view
from kvport.tiers.device import DeviceTier
from kvport.tiers.disk import DiskTier
from kvport.tiers.faults import FaultTier
from kvport.tiers.host import HostTier
from kvport.tiers.redis_tier import RedisTier

__all__ = ["Buffer", "DeviceTier", "DiskTier", "FaultTier", "HostTier", "RedisTier", "Tier", "TierCaps",
           "byte_view", "writable_view"]
