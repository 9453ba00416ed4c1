"""Values as pages over the host and disk tiers, with the catalog and the disk manifest.

A value of ``size`` bytes is cut into ``n = ceil(size / page_bytes)`` pages; page ``i`` lives under
its own tier key ``BLAKE2b-128(storage_key | i)`` in the :class:`~kvport.tiers.host.HostTier`
(one page per pool page) or in the disk tier (one page per disk value). The wire chunk size of a
PUT equals ``page_bytes``, so chunk ``i`` is received straight into host page ``i``::

    PUT chunk i --recv_into--> host.reserve(page key i)   (invisible)
    every chunk verified ----> host.commit(page keys), catalog.add   (visible, all at once)
    client gone / bad chunk -> host.abort(page keys), catalog.unhold  (never visible)

Reads of host values send views of the pool pages (no copy) under a lease; disk values are read
into a staging buffer. Demotion moves a value page by page from host to disk and appends an ADD to
the manifest after the last page is on disk; a drop appends REMOVE and deletes the pages.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from kvport.errors import BlockNotFoundError, CorruptBlockError, TierError
from kvport.server.catalog import Catalog, Entry, Place, Placement
from kvport.server.manifest import DiskRecord, Manifest, read_records
from kvport.tiers.base import Tier
from kvport.tiers.host import HostTier

log = logging.getLogger(__name__)


def page_keys(skey: bytes, n: int) -> list[bytes]:
    return [hashlib.blake2b(skey + i.to_bytes(4, "little"), digest_size=16).digest() for i in range(n)]


@dataclass(frozen=True, slots=True)
class Reservation:
    """Host pages reserved for one value in flight; ``views[i]`` receives chunk ``i``."""

    skey: bytes
    size: int
    charged: int
    pkeys: tuple[bytes, ...]
    views: tuple[memoryview, ...]


class BlockStore:
    def __init__(self, host: HostTier, disk: Tier | None, manifest: Manifest | None,
                 retry_after_s: float = 0.05) -> None:
        self.host = host
        self.disk = disk
        self.manifest = manifest
        self.page_bytes = host.page_bytes
        disk_cap = 0 if disk is None else disk.capacity_bytes
        self.catalog = Catalog(host.capacity_bytes, disk_cap, retry_after_s)

    # ------------------------------------------------------------ sizes
    def n_pages(self, size: int) -> int:
        return max(1, -(-size // self.page_bytes))

    def charged(self, size: int) -> int:
        return self.n_pages(size) * self.page_bytes

    # ------------------------------------------------------------ restart
    def recover(self) -> int:
        """Rebuild disk entries from the manifest; delete disk pages no record accounts for."""
        if self.disk is None or self.manifest is None:
            return 0
        records = read_records(self.manifest.path)
        on_disk = set(self.disk.keys())
        kept: list[DiskRecord] = []
        wanted: set[bytes] = set()
        for r in records.values():
            pks = page_keys(r.skey, self.n_pages(r.size))
            charged = self.charged(r.size)
            if all(pk in on_disk for pk in pks) and self.catalog.disk_used + charged <= self.catalog.disk_capacity:
                self.catalog.add(r.skey, Entry(r.tenant, r.client_key, charged, Place.DISK, length=r.size))
                kept.append(r)
                wanted.update(pks)
        orphans = on_disk - wanted
        for pk in orphans:
            self.disk.delete(pk)
        self.manifest.rewrite(kept)
        if orphans or len(kept) != len(records):
            log.warning("recovered %d disk blocks; dropped %d incomplete, %d orphan pages",
                        len(kept), len(records) - len(kept), len(orphans))
        return len(kept)

    # ------------------------------------------------------------ making room
    def apply(self, plan: Placement) -> None:
        """Carry out a plan's drops, then its demotions (the catalog follows each step)."""
        for skey in plan.drops:
            self.drop(skey)
        for skey in plan.demotes:
            self.demote(skey)

    def drop(self, skey: bytes) -> None:
        e = self.catalog.remove(skey)
        tier = self.host if e.place is Place.HOST else self.disk
        if tier is not None:
            for pk in page_keys(skey, self.n_pages(e.length)):
                tier.delete(pk)
        if e.place is Place.DISK and self.manifest is not None:
            self.manifest.remove(skey)

    def demote(self, skey: bytes) -> None:
        e = self.catalog.get(skey)
        if e is None or self.disk is None or e.place is not Place.HOST:
            raise TierError("demote of a block that is not on host")
        pks = page_keys(skey, self.n_pages(e.length))
        try:
            for pk in pks:  # zero-copy: the pool page goes straight to the disk tier's write
                self.disk.put(pk, self.host.view(pk))
        except BaseException:
            for pk in pks:
                self.disk.delete(pk)
            raise
        self.catalog.move(skey, Place.DISK)
        for pk in pks:
            self.host.delete(pk)
        if self.manifest is not None:
            self.manifest.add(DiskRecord(skey, e.tenant, e.client_key, e.length))

    # ------------------------------------------------------------ writes
    def reserve_host(self, skey: bytes, size: int) -> Reservation:
        """Host pages for a value in flight (room already made by :meth:`apply`)."""
        charged = self.charged(size)
        self.catalog.hold(Place.HOST, charged)
        n = self.n_pages(size)
        pkeys = page_keys(skey, n)
        views: list[memoryview] = []
        try:
            for i, pk in enumerate(pkeys):
                views.append(self.host.reserve(pk, min(self.page_bytes, size - i * self.page_bytes)))
        except BaseException:
            for pk in pkeys[: len(views)]:
                self.host.abort(pk)
            self.catalog.unhold(Place.HOST, charged)
            raise
        return Reservation(skey, size, charged, tuple(pkeys), tuple(views))

    def abort(self, res: Reservation) -> None:
        for pk in res.pkeys:
            self.host.abort(pk)
        self.catalog.unhold(Place.HOST, res.charged)

    def commit(self, res: Reservation, tenant: str, client_key: bytes, checksums: bytes = b"") -> None:
        for pk in res.pkeys:
            self.host.commit(pk)
        entry = Entry(tenant, client_key, res.charged, Place.HOST, length=res.size, checksums=checksums)
        self.catalog.add(res.skey, entry, held=True)

    def put_disk(self, skey: bytes, data: memoryview, tenant: str, client_key: bytes, checksums: bytes = b"") -> None:
        """Write a whole verified value to disk into room the caller holds (``catalog.hold(DISK, charged)``);
        on success the hold becomes the entry, on failure the pages are deleted and the hold stays
        the caller's to release."""
        if self.disk is None:
            raise TierError("no disk tier")
        size = data.nbytes
        pks = page_keys(skey, self.n_pages(size))
        try:
            for i, pk in enumerate(pks):
                self.disk.put(pk, data[i * self.page_bytes : (i + 1) * self.page_bytes])
        except BaseException:
            for pk in pks:
                self.disk.delete(pk)
            raise
        entry = Entry(tenant, client_key, self.charged(size), Place.DISK, length=size, checksums=checksums)
        self.catalog.add(skey, entry, held=True)
        if self.manifest is not None:
            self.manifest.add(DiskRecord(skey, tenant, client_key, size))

    # ------------------------------------------------------------ reads
    def host_views(self, skey: bytes, e: Entry) -> list[memoryview]:
        """Zero-copy views of a host value's pages; valid while the caller holds a lease."""
        return [self.host.view(pk) for pk in page_keys(skey, self.n_pages(e.length))]

    def read_disk_into(self, skey: bytes, e: Entry, dst: memoryview) -> None:
        """Read a disk value into ``dst``; a corrupt or missing page drops the block (a clean miss)."""
        if self.disk is None:
            raise BlockNotFoundError("no disk tier")
        try:
            for i, pk in enumerate(page_keys(skey, self.n_pages(e.length))):
                self.disk.get_into(pk, dst[i * self.page_bytes : (i + 1) * self.page_bytes])
        except (CorruptBlockError, BlockNotFoundError):
            if e.movable:
                self.drop(skey)
            raise

    # ------------------------------------------------------------ shutdown
    def spill(self, skeys: Iterable[bytes]) -> int:
        """Demote host values to disk while disk has room for them (graceful shutdown)."""
        n = 0
        for skey in skeys:
            e = self.catalog.get(skey)
            if e is None or e.place is not Place.HOST or not e.movable or self.disk is None:
                continue
            if self.catalog.disk_used + e.size > self.catalog.disk_capacity:
                continue
            self.demote(skey)
            n += 1
        return n

    def close(self) -> None:
        if self.manifest is not None:
            self.manifest.close()
        if self.disk is not None:
            self.disk.close()
        self.host.close()
