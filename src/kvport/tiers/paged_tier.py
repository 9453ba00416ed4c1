"""PagedTier: values of any length over fixed-size pages of an inner tier (host pool or disk).

A value of ``n`` bytes is cut into ``ceil(n / page_bytes)`` pages; page ``i`` lives in the inner
tier under its own key ``BLAKE2b-128(key | i as u32 LE)``::

    value  [ page 0 | page 1 | ... | page k-1 (may be shorter) ]
             inner[pk0] inner[pk1]     inner[pk(k-1)]

* host inner (``HostTier``): ``reserve_views`` hands out one writable pool page per page, so a value
  is received straight into the pool (the server's PUT path), and ``read_views`` gives the pages as
  read-only views for a zero-copy send (the caller holds a lease meanwhile);
* disk inner (``DiskTier``): a value is one ``put_many`` (one slab file), read back with one
  ``get_many_into``.

With a :class:`~kvport.tiers.journal.Journal` the tier is persistent on its own: every value's (key, length, BlockMeta)
is recorded in a :class:`~kvport.tiers.journal.Journal` after its pages are in place and removed
before they go (write-ahead order: a demotion into this tier is durable before the upper copy is
dropped), and a restart rebuilds the values from the journal, keeping only values whose pages
are all there. A delete on a filesystem too full for its journal record frees the pages first and
records it after. Pages no record accounts for are kept and reported (``quarantined``), never
deleted. Values are all or nothing.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvport.errors import BlockNotFoundError, BufferMismatchError, CorruptBlockError, TierError, TierFullError
from kvport.tiers.base import BlockMeta, Buffer, Tier, TierCaps, byte_view, writable_view
from kvport.tiers.journal import Entry, Journal

log = logging.getLogger(__name__)
_NO_META = BlockMeta()


def page_keys(key: bytes, n: int) -> list[bytes]:
    return [hashlib.blake2b(key + i.to_bytes(4, "little"), digest_size=16).digest() for i in range(n)]


@dataclass(slots=True)
class _Value:
    length: int
    meta: BlockMeta


class PagedTier(Tier):
    def __init__(self, inner: Tier, page_bytes: int, *, name: str | None = None, journal: Journal | None = None,
                 max_value_bytes: int = 1 << 30) -> None:
        """``journal``: open it (it locks its folder) *before* opening ``inner`` on that folder, so a
        second process is refused before it touches anything."""
        if page_bytes <= 0 or page_bytes > inner.caps.max_value_bytes:
            raise TierError(f"page_bytes {page_bytes} must be in (0, {inner.caps.max_value_bytes}]")
        self.inner = inner
        self.page_bytes = page_bytes
        self.name = name or inner.name
        ic = inner.caps
        self.caps = TierCaps(persistent=journal is not None and ic.persistent, shared=False,
                             zero_copy_read=ic.zero_copy_read, zero_copy_write=ic.zero_copy_write,
                             max_value_bytes=max_value_bytes, block_meta=True, device=ic.device)
        self._vals: dict[bytes, _Value] = {}
        self._reserved: dict[bytes, int] = {}
        self._lock = threading.RLock()
        self.quarantined: set[bytes] = set()
        self.journal = journal
        if journal is not None:
            try:
                self._recover()
            except BaseException:
                journal.close()
                raise

    # ------------------------------------------------------------------ pages
    def n_pages(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.page_bytes))

    def _pages(self, parts: Sequence[Buffer], n: int) -> list[memoryview]:
        """Page-sized views of the value made of ``parts`` (no copy when the parts are pages or one
        contiguous buffer; else one join)."""
        views = [byte_view(p) for p in parts]
        pb = self.page_bytes
        if len(views) > 1 and all(v.nbytes == pb for v in views[:-1]) and 0 < views[-1].nbytes <= pb:
            return views
        whole = views[0] if len(views) == 1 else memoryview(b"".join(views))
        return [whole[i : i + pb] for i in range(0, max(n, 1), pb)] if n else [whole[:0]]

    # ------------------------------------------------------------------ sizes
    @property
    def capacity_bytes(self) -> int:
        return self.inner.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    def charge(self, nbytes: int) -> int:
        full, rest = divmod(nbytes, self.page_bytes)
        out = full * self.inner.charge(self.page_bytes)
        return out + (self.inner.charge(rest) if rest or not full else 0)

    def shortfall(self, nbytes: int, values: int) -> int:
        """The inner tier's shortfall, or the journal's: a value is kept only with its record."""
        short = self.inner.shortfall(nbytes, values)
        return short if self.journal is None else max(short, self.journal.shortfall(values))

    # ------------------------------------------------------------------ writes
    def put(self, key: bytes, data: Buffer, *, ttl_s: float | None = None) -> None:
        self.put_block(key, [data], _NO_META, ttl_s=ttl_s)

    def put_block(self, key: bytes, parts: Sequence[Buffer], meta: BlockMeta, *, ttl_s: float | None = None) -> None:
        n = sum(byte_view(p).nbytes for p in parts)
        if n > self.caps.max_value_bytes:
            raise BufferMismatchError(f"{self.name}: value of {n} bytes exceeds {self.caps.max_value_bytes}")
        pages = self._pages(parts, n)
        with self._lock:
            if key in self._reserved:
                raise TierError(f"{self.name}: block {key.hex()} is being written")
            if key in self._vals:
                self.delete(key)
            pks = page_keys(key, len(pages))
            try:
                self.inner.put_many(list(zip(pks, pages, strict=True)))
            except BaseException:
                self._delete_pages(pks)
                raise
            try:
                if self.journal is not None:
                    self.journal.add(key, n, meta)
            except BaseException:
                self._delete_pages(pks)
                raise
            self._vals[key] = _Value(n, meta)

    def reserve_views(self, key: bytes, nbytes: int) -> list[memoryview]:
        if not self.caps.zero_copy_write:
            return super().reserve_views(key, nbytes)
        if not 0 <= nbytes <= self.caps.max_value_bytes:
            raise BufferMismatchError(f"{self.name}: value of {nbytes} bytes exceeds {self.caps.max_value_bytes}")
        with self._lock:
            if key in self._reserved or key in self._vals:
                raise TierError(f"{self.name}: block {key.hex()} is already held or being written")
            pks = page_keys(key, self.n_pages(nbytes))
            views: list[memoryview] = []
            try:
                for i, pk in enumerate(pks):
                    views += self.inner.reserve_views(pk, min(self.page_bytes, nbytes - i * self.page_bytes))
            except BaseException:
                for pk in pks[: len(views)]:
                    self.inner.abort(pk)
                raise
            self._reserved[key] = nbytes
            return views

    def commit(self, key: bytes, meta: BlockMeta | None = None) -> None:
        with self._lock:
            n = self._reserved.pop(key, None)
            if n is None:
                raise TierError(f"{self.name}: commit of {key.hex()} that is not reserved")
            pks = page_keys(key, self.n_pages(n))
            for pk in pks:
                self.inner.commit(pk)
            m = meta or _NO_META
            if self.journal is not None:
                try:
                    self.journal.add(key, n, m)
                except BaseException:
                    self._delete_pages(pks)
                    raise
            self._vals[key] = _Value(n, m)

    def abort(self, key: bytes) -> None:
        with self._lock:
            n = self._reserved.pop(key, None)
            if n is None:
                raise TierError(f"{self.name}: abort of {key.hex()} that is not reserved")
            for pk in page_keys(key, self.n_pages(n)):
                self.inner.abort(pk)

    # ------------------------------------------------------------------ reads
    def _value(self, key: bytes) -> _Value:
        v = self._vals.get(key)
        if v is None:
            raise BlockNotFoundError(f"{self.name}: no block {key.hex()}")
        return v

    def get_into(self, key: bytes, dst: Buffer) -> int:
        with self._lock:
            v = self._value(key)
            out = writable_view(dst, v.length)
            pb = self.page_bytes
            pks = page_keys(key, self.n_pages(v.length))
            got = self.inner.get_many_into([(pk, out[i * pb : min((i + 1) * pb, v.length)])
                                            for i, pk in enumerate(pks)])
            want = [min(pb, v.length - i * pb) for i in range(len(pks))]
            if got != want:  # a page missing or failing its check: the value is gone, a clean miss next
                self.delete(key)
                raise CorruptBlockError(f"{self.name}: block {key.hex()} lost a page")
            return v.length

    def read_views(self, key: bytes) -> list[memoryview]:
        with self._lock:
            v = self._value(key)
            return [self.inner.view(pk) for pk in page_keys(key, self.n_pages(v.length))]

    def view(self, key: bytes) -> memoryview:
        views = self.read_views(key)
        if len(views) != 1:
            raise TierError(f"{self.name}: block {key.hex()} spans {len(views)} pages; use read_views")
        return views[0]

    def size_of(self, key: bytes) -> int | None:
        v = self._vals.get(key)
        return None if v is None else v.length

    def contains(self, key: bytes) -> bool:
        return key in self._vals

    def meta_of(self, key: bytes) -> BlockMeta | None:
        v = self._vals.get(key)
        return None if v is None else v.meta

    def keys(self) -> Iterator[bytes]:
        with self._lock:
            return iter(list(self._vals))

    def records(self) -> Iterator[tuple[bytes, int, BlockMeta | None]]:
        with self._lock:
            return iter([(k, v.length, v.meta) for k, v in self._vals.items()])

    # ------------------------------------------------------------------ removal
    def delete(self, key: bytes) -> bool:
        with self._lock:
            v = self._vals.get(key)
            if v is None:
                return False
            pks = page_keys(key, self.n_pages(v.length))
            if self.journal is not None:
                try:
                    self.journal.remove(key)  # before the pages go: a crash keeps bytes, never a dangling record
                except TierFullError:
                    # no room for even the record (a full filesystem): the pages go first, then the
                    # record; a crash in between leaves a record without its pages, which recovery drops
                    del self._vals[key]
                    self._delete_pages(pks)
                    try:
                        self.journal.remove(key)
                    except TierError as exc:
                        log.warning("%s: delete of %s not recorded (%s); recovery drops it", self.name, key.hex(),
                                    exc)
                    return True
            del self._vals[key]
            self._delete_pages(pks)
            return True

    def _delete_pages(self, pks: list[bytes]) -> None:
        for pk in pks:
            try:
                self.inner.delete(pk)
            except TierError as exc:  # left behind: reported at the next recovery
                log.warning("%s: page %s not deleted: %s", self.name, pk.hex(), exc)

    def sync(self) -> None:
        if self.journal is not None:
            self.journal.sync()

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        self.inner.close()

    # ------------------------------------------------------------------ restart
    def _recover(self) -> None:
        """Values from the journal whose pages are all present; the rest reported, nothing deleted."""
        assert self.journal is not None
        rep = self.journal.read()
        on_disk = set(self.inner.keys())
        kept: list[Entry] = []
        accounted: set[bytes] = set()
        for e in rep.live.values():
            pks = page_keys(e.key, self.n_pages(e.length))
            if all(pk in on_disk for pk in pks):
                self._vals[e.key] = _Value(e.length, e.meta)
                kept.append(e)
                accounted.update(pks)
        self.quarantined = on_disk - accounted
        try:
            self.journal.rewrite(kept)
        except TierFullError:  # no room to compact (a full disk): keep appending to the journal as it is
            log.warning("%s: disk full, journal not compacted; appending to it as it is", self.name)
            self.journal.open_append()
        if self.quarantined or len(kept) != len(rep.live):
            log.warning("%s: recovered %d values; %d records without all their pages dropped; %d pages no record "
                        "accounts for kept in quarantine", self.name, len(kept), len(rep.live) - len(kept),
                        len(self.quarantined))
