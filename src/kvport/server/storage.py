"""What the server stores on: one :class:`~kvport.store.TieredStore` (host pages + disk) and its ledger.

::

    TieredStore(ledger, quotas = {tenant: bytes}, keep_orphans=False)
      +- "host"  PagedTier(HostTier pool)              values received straight into pool pages
      +- "disk"  PagedTier(DiskTier, journal=folder)   values as one slab each; the journal records
                                                       (key, length, BlockMeta) so a restart finds
                                                       every block with its parent, lifetime, tenant;
                                                       eviction leaves room for the host pool (up to
                                                       half the disk): a graceful shutdown moves
                                                       every host block down, parents first
    keep_spillable=(host, disk)                        a write is refused that the disk (its real
                                                       free space and its journal's) could not
                                                       take with every host block at shutdown

Placement, eviction (prefix-aware: a block never outlives its parent), demotion, lifetimes and TTLs
are the store's; ownership, leases and pins are the ledger's (a PUT hands the block to the pool,
recorded with the client that put it and its lifetime class); a tenant's quota is the store's
quota for the tenant's account. Block keys are tenant-salted storage keys (:mod:`.tenants`); what the
server keeps beside the bytes is :class:`Attrs` (the client's key and the chunk checksums verified
on PUT, resent on GET instead of hashing the value again).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from kvport.errors import ConfigError, TierError
from kvport.keys import KEY_BYTES
from kvport.ledger import Ledger
from kvport.store import LifetimePolicy, TieredStore, TierPolicy
from kvport.store.eviction import DEFAULT_POLICY
from kvport.tiers.base import fs_room
from kvport.tiers.disk import DiskTier
from kvport.tiers.host import HostTier
from kvport.tiers.journal import Journal
from kvport.tiers.paged_tier import PagedTier

log = logging.getLogger(__name__)

MiB = 1 << 20
_MIN_HOST_PAGES = 4
HOST, DISK = "host", "disk"


@dataclass(frozen=True, slots=True)
class Attrs:
    """The server's bytes kept with a block: ``client key (16) | chunk checksums (8 per page)``."""

    client_key: bytes
    checksums: bytes

    def encode(self) -> bytes:
        return self.client_key + self.checksums

    @classmethod
    def decode(cls, raw: bytes) -> Attrs:
        return cls(raw[:KEY_BYTES], raw[KEY_BYTES:])


@contextmanager
def _allocating(nbytes: int, flag: str) -> Iterator[None]:
    """The host pool is mapped at start (and faulted in with ``prefault``): a size the machine cannot map is the
    flag's fault."""
    try:
        yield
    except (OSError, OverflowError, MemoryError) as exc:
        raise ConfigError(f"{flag}: cannot allocate a host pool of {nbytes} bytes: {exc}") from exc


def available_memory() -> int | None:
    """Bytes this process could still make resident: the machine's available memory, or less under a cgroup
    v2 limit (its ``memory.max`` less its current use); None when neither can be read."""
    room: int | None = int(psutil.virtual_memory().available)
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
    except (OSError, ValueError):
        return room
    if text.isdecimal():
        limit_room = max(0, int(text) - used)
        room = limit_room if room is None else min(room, limit_room)
    return room


def host_pool_bytes(capacity_bytes: int, inflight_bytes: int, page_bytes: int) -> int:
    """The host pool: whatever the process budget leaves after the measured baseline and staging."""
    with _allocating(page_bytes, "--page-size"):
        HostTier(page_bytes, page_bytes, pin=False).close()  # load the pool's libraries first
    baseline = int(psutil.Process().memory_info().rss)
    host_bytes = capacity_bytes - baseline - inflight_bytes - MiB
    if host_bytes < _MIN_HOST_PAGES * page_bytes:
        raise ConfigError(f"capacity {capacity_bytes} leaves no room for a host pool (baseline {baseline} "
                          f"bytes, in-flight {inflight_bytes})")
    return host_bytes


def open_storage(host_bytes: int, page_bytes: int, disk_dir: Path | None, disk_capacity: int,
                 quotas: dict[str, int], max_value_bytes: int, eviction: str = DEFAULT_POLICY,
                 spill_reserve: bool = True, prefault: bool = False) -> TieredStore:
    """The server's store; a ``disk_dir`` another process holds is refused (ConfigError).

    ``spill_reserve``: the disk keeps room for the host tier (up to half the disk) that eviction does
    not use, so that a graceful shutdown moves every host block down (:meth:`TieredStore.spill`):
    a host block that found no room would be lost, and with it the blocks below that descend from
    it (a restart drops a block whose parent is gone). The room is real: at start a
    ``disk_capacity`` over what the filesystem can hold (free space plus the blocks already there)
    is lowered to it, with one warning; while running, a write the disk could not take at shutdown
    with every host block (another process took the space, the journal's filesystem is full) is
    refused (``keep_spillable``: TierFullError, after the disk's own victims left).

    ``prefault``: the host pool is faulted in now (resident from the start); otherwise it is mapped
    and grows resident as it fills (:class:`~kvport.tiers.host.HostTier`)."""
    with _allocating(host_bytes, "--capacity"):
        pool = HostTier(host_bytes, page_bytes, pin=False, name="server-host", prefault=prefault)
    room = None if prefault else available_memory()  # mapped, not resident: the machine may not hold it all
    if room is not None and host_bytes > room:
        log.warning("--capacity: a host pool of %d bytes over the %d bytes this machine (or its cgroup) has "
                    "available: it grows as it fills, and the kernel may kill the server when it does "
                    "(--prefault claims it at start instead)", host_bytes, room)
    host = PagedTier(pool, page_bytes, name=HOST, max_value_bytes=max_value_bytes)
    tiers = [host]
    if disk_dir is not None:
        journal = None
        try:
            journal = Journal(disk_dir)  # locks the folder first: a second server touches nothing
            slabs = DiskTier(disk_dir / "blocks", disk_capacity)
            disk = PagedTier(slabs, page_bytes, name=DISK, journal=journal, max_value_bytes=max_value_bytes)
            disk_capacity = _fit_filesystem(slabs, disk_dir)
        except TierError as exc:
            if journal is not None:
                journal.close()
            host.close()
            raise ConfigError(f"--disk {disk_dir}: {exc}") from exc
        tiers.append(disk)
    exact = TierPolicy(high_watermark=1.0, low_watermark=1.0)
    reserve = min(host_bytes, disk_capacity // 2) if spill_reserve and disk_dir is not None else 0
    if reserve < host_bytes and disk_dir is not None and spill_reserve:
        log.warning("--disk-capacity %d is under twice the host pool (%d): a graceful shutdown may not find "
                    "room on disk for every host block", disk_capacity, host_bytes)
    below = 1.0 - reserve / disk_capacity if disk_capacity else 1.0
    disk_policy = TierPolicy(high_watermark=below, low_watermark=below)
    store = TieredStore(tiers, Ledger(), LifetimePolicy(), eviction, tier_policies={HOST: exact, DISK: disk_policy},
                        quotas=quotas, keep_orphans=False,
                        keep_spillable=(HOST, DISK) if spill_reserve and disk_dir is not None else None)
    if disk_dir is not None:
        log.info("recovered %d blocks from disk (%d dropped: parent gone)", len(store),
                 store.orphans_dropped)
    return store


def _fit_filesystem(slabs: DiskTier, disk_dir: Path) -> int:
    """The disk's capacity, lowered to what its filesystem can hold (free space plus the blocks
    already there), with one warning when it was over."""
    fs = fs_room(disk_dir)
    real = fs.free_bytes + slabs.used_bytes
    if slabs.capacity_bytes > real:
        log.warning("--disk-capacity %d is more than the filesystem of %s can hold (%d bytes free, %d held): "
                    "using %d", slabs.capacity_bytes, disk_dir, fs.free_bytes, slabs.used_bytes, real)
        slabs.limit_capacity(real)
    return slabs.capacity_bytes
