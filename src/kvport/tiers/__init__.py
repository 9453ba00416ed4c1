"""Tiers: host RAM, local disk, Redis, device. Bytes in, bytes out; no owners, no policy.

Public API: :class:`Tier`, :class:`TierCaps` (:mod:`kvport.tiers.base`), :class:`HostTier`,
:class:`DiskTier`, :class:`RedisTier`, :class:`DeviceTier` (only usable when CUDA exists),
:class:`FaultTier` (wraps a tier and injects faults, for tests and chaos runs), :class:`CodecTier`
(wraps a tier and keeps its blocks codec-encoded: the per-tier codec).

All of them import without torch or numba (the core install): :class:`DeviceTier` and pinned host
memory import torch when used, a lossy codec loads its numba kernels on its first ``get_codec``.

::

    base        the Tier interface and TierCaps: opaque values of recorded length under 16-byte keys
    host        HostTier: one preallocated RAM pool of fixed-size pages; no allocation per put or get
    disk        DiskTier: slab files of checksummed blocks; the index rebuilt from disk at start
    redis_tier  RedisTier: values in Redis / Valkey (or Redis Cluster), chunked under the bulk limit
    device      DeviceTier: fixed-size pages in one preallocated CUDA buffer
    paged_tier  PagedTier: values of any length over fixed-size pages of an inner tier (host pool or disk)
    journal     Journal: an append-only, per-record checksummed list of the values a folder holds
    codec_tier  CodecTier: wraps a tier and keeps its blocks codec-encoded
    fault_tier  FaultTier: wraps a tier and injects failures on demand
    checksums   checksums beside the copy: one hashing thread per process for the tiers' large batches
"""

from kvport.tiers.base import Buffer, Tier, TierCaps, byte_view, writable_view
from kvport.tiers.codec_tier import CodecTier
from kvport.tiers.device import DeviceTier
from kvport.tiers.disk import DiskTier
from kvport.tiers.fault_tier import FaultTier
from kvport.tiers.host import HostTier
from kvport.tiers.redis_tier import RedisTier

__all__ = ["Buffer", "CodecTier", "DeviceTier", "DiskTier", "FaultTier", "HostTier", "RedisTier", "Tier", "TierCaps",
           "byte_view", "writable_view"]

