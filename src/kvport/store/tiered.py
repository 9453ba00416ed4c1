"""TieredStore: where each block sits (tier), decided by lifetime rules and eviction policy -- a
facade over the parts that decide it. Each public call takes the store's one re-entrant lock
(:class:`~kvport.store.guard.StoreLock`) once and hands off to one part; the facade holds no policy.

Data flow::

    put(key, data, lifetime) --> first allowed tier with room (evicting/demoting to make room)
                              \\-> every lower allowed tier whose WriteMode is THROUGH (BEHIND: queued)
    lookup(keys)    --> longest prefix held by healthy tiers (probing shared tiers for local misses)
    get_into(key)   --> top-most healthy tier holding it; a hit below the top is promoted (copied up)
    reserve(key, n) --> writable views straight into the first zero-copy tier; commit makes it visible
    read_views(key) --> read-only views of the top tier's own memory (the caller holds a lease or pin)
    eviction        --> lowest-priority *leaf* of a tier's prefix tree that may leave: demoted to the
                        next allowed tier, or dropped when none is left (never with cached children)

Parts (each uses only those after it; ``kvport/store/__init__.py`` lists the modules in this order)::

    Placement   put / put_many                              -> WriteBehind, Mover, Catalog
    Reads       lookup, get / consume / get_many, views     -> SharedView, Mover, Catalog
    ZeroCopy    reserve / commit / abort                    -> Mover, Catalog
    WriteBehind the BEHIND copies, after the put returned   -> StoreCopy -> Mover, Catalog
    SharedView  probe and confirm the shared tiers          -> Catalog
    Mover       room, eviction, demotion, spill, quotas, drops: one rule of what may leave -> Catalog
    Catalog     records, indexes, usage, counters, adoption -> Expiry, TierHealth, TierIndex
    guard       StoreLock (shared by all) and Busy (the keys a write holds still)

Invariants (kept by the catalog and the mover): ``records`` holds exactly the blocks present in at
least one tier index, each registered in the ledger and forgotten there when it leaves; a block never
outlives its parent in the store; a block moves down only once its copy below is in place.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from kvport.deadline import Deadline
from kvport.errors import BlockNotFoundError, ConfigError
from kvport.ledger import Ledger, Owner
from kvport.lifetime import Lifetime
from kvport.store.behind import StoreCopy, WriteBehind
from kvport.store.catalog import Catalog
from kvport.store.eviction import DEFAULT_POLICY
from kvport.store.guard import Busy, StoreLock
from kvport.store.lifetime import LifetimePolicy
from kvport.store.mover import Mover
from kvport.store.placement import Placement
from kvport.store.reads import Reads
from kvport.store.reserve import ZeroCopy
from kvport.store.shared import SharedView
from kvport.store.types import LookupResult, ReadViews, Reserved, StoreStats, TierChanges, TierPolicy, WriteMode
from kvport.tiers.base import BlockMeta, Buffer, Tier, byte_view

__all__ = ["ReadViews", "Reserved", "TieredStore"]


class TieredStore:
    def __init__(self, tiers: Sequence[Tier], ledger: Ledger | None = None, policy: LifetimePolicy | None = None,
                 eviction: str = DEFAULT_POLICY, *, tier_policies: Mapping[str, TierPolicy] | None = None,
                 clock: Callable[[], float] = time.monotonic, retry_broken_s: float = 1.0,
                 adopt_persistent: bool = True, quotas: Mapping[str, int] | None = None,
                 keep_orphans: bool = True, keep_spillable: tuple[str, str] | None = None,
                 changes: TierChanges | None = None) -> None:
        """``changes``: told of every block that enters or leaves a tier (the store's KV events,
        :mod:`kvport.events.store`); ``quotas``: bytes per account (blocks put with that ``account``);
        ``keep_orphans=False``: a persistent tier's block whose parent did not survive a restart is
        dropped at adoption (a child without its parent can never be hit); ``keep_spillable``: (upper, lower), see
        :mod:`kvport.store.mover`."""
        if not tiers:
            raise ConfigError("a TieredStore needs at least one tier")
        names = tuple(t.name for t in tiers)
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique, got {names}")
        self.tiers: dict[str, Tier] = {t.name: t for t in tiers}
        self.names = names
        self.ledger = ledger if ledger is not None else Ledger(clock=clock)
        self.policy = policy if policy is not None else LifetimePolicy()
        for lt in Lifetime:
            self.policy.tiers_for(lt, names)  # validates tier names now, not on the first put
        self.tier_policies = {n: (tier_policies or {}).get(n, TierPolicy()) for n in names}
        if keep_spillable is not None and not set(keep_spillable) <= set(names):
            raise ConfigError(f"keep_spillable {keep_spillable} names a tier not in {names}")
        self.keep_spillable = keep_spillable
        self.clock = clock
        self.quotas: dict[str, int] = dict(quotas or {})
        self.keep_orphans = keep_orphans
        behind = any(p.write is WriteMode.BEHIND for p in self.tier_policies.values())
        if behind and self.tier_policies[names[0]].write is WriteMode.BEHIND:
            raise ConfigError(f"{names[0]} is the top tier: nothing is above it to write behind")
        self._lock = StoreLock()
        busy = Busy()
        self._cat = cat = Catalog(self.tiers, eviction, self.ledger, self.policy, clock, retry_broken_s, keep_orphans,
                                  changes)
        self._meta, self._idx, self._health = cat.records, cat.idx, cat.health
        self._mover = Mover(cat, busy, self.tier_policies, self.quotas, keep_spillable)
        self._try_drop = self._mover.try_drop
        self._behind = WriteBehind(StoreCopy(self._lock, cat, self._mover, busy)) if behind else None
        self._place = Placement(cat, self._mover, busy, self.tier_policies, self._behind)
        self._zero_copy = ZeroCopy(cat, self._mover, busy)
        self._shared = SharedView(cat)
        self._reads = Reads(cat, self._mover, self._shared)
        self._pool: ThreadPoolExecutor | None = None
        if adopt_persistent:
            for t in tiers:
                if t.caps.persistent and not t.caps.shared:
                    cat.adopt(t)

    @property
    def orphans_dropped(self) -> int:
        """Blocks dropped at adoption for a parent that did not survive the restart (``keep_orphans=False``)."""
        return self._cat.orphans_dropped

    # ------------------------------------------------------------------ lookup
    def lookup(self, keys: Sequence[bytes], *, deadline: Deadline | None = None) -> LookupResult:
        """Longest cached prefix of ``keys``; broken tiers count as misses. With a ``deadline``, the
        store's lock and the shared tiers' answers are waited for at most until then."""
        with self._lock.locked(deadline):
            return self._reads.lookup(tuple(keys))

    # ------------------------------------------------------------------ put
    def put(self, key: bytes, data: Buffer, *, lifetime: Lifetime = Lifetime.PREFIX, parent: bytes | None = None,
            owner: Owner | None = None, request_id: str | None = None, account: str | None = None,
            ttl_s: float | None = None, attrs: bytes = b"", origin: Owner | None = None) -> str:
        """Store a block; returns the tier it landed in. A key already held is only touched (keys are
        content hashes) and its lifetime raised to ``lifetime`` if higher. TierFullError when no
        allowed tier can take it, QuotaExceededError when ``account`` is full of blocks that may not
        leave. ``ttl_s``: this block's idle TTL (any lifetime); ``attrs``: the caller's bytes kept with
        it (:meth:`meta_of`); ``origin``: who handed it to the store (recorded by the ledger)."""
        src = byte_view(data)
        try:
            with self._lock:
                return self._place.put(key, src, lifetime, parent, owner, request_id, account, ttl_s, attrs, origin)
        finally:
            self._behind_room()

    def put_many(self, items: Sequence[tuple[bytes, Buffer]], *, lifetime: Lifetime = Lifetime.PREFIX,
                 parent: bytes | None = None, owner: Owner | None = None, request_id: str | None = None,
                 account: str | None = None, ttl_s: float | None = None) -> list[str]:
        """Put a chain of blocks (each the parent of the next; the first under ``parent``) with one
        batched write per tier (the disk tier makes it one slab, read back in one sequential pass).
        When no tier takes the whole batch, or a block is already held, falls back to ``put`` per
        block. Returns the tier of each block."""
        srcs = [(k, byte_view(d)) for k, d in items]
        try:
            with self._lock:
                return self._place.put_many(srcs, lifetime, parent, owner, request_id, account, ttl_s)
        finally:
            self._behind_room()

    def _behind_room(self) -> None:
        """After a put, outside the lock: wait while the write-behind queue is over its bound (not in a
        put nested in another store call, which holds the lock the writer needs)."""
        if self._behind is not None and not self._lock.owned():
            self._behind.wait_room()

    # ------------------------------------------------------------------ get
    def get_into(self, key: bytes, dst: Buffer, *, deadline: Deadline | None = None) -> int:
        """Copy the block into ``dst`` from the top-most healthy tier holding it; promote it to the
        top allowed tier when found lower. BlockNotFoundError when no working tier has it;
        DeadlineExceeded when ``deadline`` passes first (the store's lock and the tiers' waits on a
        peer are bounded by it)."""

        def read(t: Tier) -> memoryview:
            return byte_view(dst)[: t.get_into(key, dst)]

        with self._lock.locked(deadline):
            return self._reads.read(key, read, deadline)

    @contextlib.contextmanager
    def holding(self, deadline: Deadline | None = None) -> Iterator[None]:
        """Hold the store's (reentrant) lock for the block: zero-copy views handed out by
        :meth:`consume` inside it stay valid until it exits (nothing is evicted or replaced).
        With a ``deadline``, waits for the lock at most until then (DeadlineExceeded)."""
        with self._lock.locked(deadline):
            yield

    def consume(self, key: bytes, fn: Callable[[memoryview], None], scratch: Buffer, *,
                deadline: Deadline | None = None) -> int:
        """Hand the block's bytes to ``fn``: a read-only view of the holding tier's own memory where
        it allows one (``caps.zero_copy_read``: the host pool, no copy), else ``scratch`` filled by
        ``get_into``. The view is valid only during ``fn``: the store's lock is held, so nothing is
        evicted, replaced or promoted over it meanwhile. Same lookup, promotion and errors as
        :meth:`get_into`; returns the block's length."""

        def read(t: Tier) -> memoryview:
            view = t.view(key) if t.caps.zero_copy_read else byte_view(scratch)[: t.get_into(key, scratch)]
            fn(view)
            return view

        with self._lock.locked(deadline):
            return self._reads.read(key, read, deadline)

    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]], *,
                      deadline: Deadline | None = None) -> list[int | None]:
        """Batched :meth:`get_into`: runs of keys held by the same tier are read with one batched tier
        call (a disk slab's neighbours with one ``preadv``); None for a key no working tier holds or
        whose bytes failed their check (a clean miss, dropped from that tier). Past ``deadline`` the
        keys not read yet are None (a miss: the caller recomputes them)."""
        with self._lock.locked(deadline):
            return self._reads.get_many(items, deadline)

    def contains(self, key: bytes) -> bool:
        """Held by a working tier (shared tiers are asked about keys this store has not indexed)."""
        with self._lock:
            if key not in self._meta:
                self._shared.probe((key,), 0)
            return key in self._meta and self._cat.where(key) is not None

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """:meth:`contains` of each key, the shared tiers asked once for the run of keys this store has
        not indexed that starts at the first of them (a chain's blocks come in order: one round trip
        where :meth:`contains` key by key takes one each). A key after a gap in that run reads as
        absent unless indexed: a caller that writes it again only touches it."""
        with self._lock:
            missing = tuple(k for k in keys if k not in self._meta)
            if missing:
                self._shared.probe(missing, 0)
            return [k in self._meta and self._cat.where(k) is not None for k in keys]

    def read_views(self, key: bytes) -> ReadViews | None:
        """The block's bytes as read-only views of the top healthy tier's own memory, when that tier
        allows it (``caps.zero_copy_read``), else None (use :meth:`get_into`). Valid only while the
        caller holds a lease or pin on ``key`` in :attr:`ledger` (nothing evicts or replaces it
        then); counts as a hit. BlockNotFoundError when no tier holds it."""
        with self._lock:
            return self._reads.views(key)

    def prefetch(self, keys: Sequence[bytes]) -> Future[int]:
        """Promote, in a background thread, every block of ``keys`` held only below its top tier.
        The future gives the number of blocks promoted."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvport-prefetch")
            pool = self._pool
        return pool.submit(self._prefetch, tuple(keys))

    def _prefetch(self, keys: tuple[bytes, ...]) -> int:
        done = 0
        for k in keys:
            with self._lock:
                m = self._meta.get(k)
                if m is None:
                    continue
                top = self.policy.tiers_for(m.lifetime, self.names)[0]
                if k in self._idx[top] or self._cat.where(k) is None:
                    continue
                buf = bytearray(m.size)
            try:
                self.get_into(k, buf)  # promotes on the way
            except BlockNotFoundError:
                continue
            done += 1
        return done

    # ------------------------------------------------------------------ zero-copy write
    def reserve(self, key: bytes, nbytes: int, *, lifetime: Lifetime = Lifetime.PREFIX, parent: bytes | None = None,
                owner: Owner | None = None, request_id: str | None = None, account: str | None = None,
                ttl_s: float | None = None, origin: Owner | None = None) -> Reserved | None:
        """Room for a block of ``nbytes`` in the first allowed tier that takes writes in place
        (``caps.zero_copy_write``), evicting to make it; the block stays invisible until
        :meth:`commit`. None when no such tier can take it (then receive into a buffer and
        :meth:`put`). QuotaExceededError as for :meth:`put`; TierFullError when ``key`` is held or
        already being written."""
        with self._lock:
            self._cat.expiry.expire(self._try_drop)
            return self._zero_copy.reserve(key, nbytes, lifetime, parent, owner, request_id, account, ttl_s, origin)

    def commit(self, res: Reserved, attrs: bytes = b"") -> str:
        """The reserved bytes are complete (and verified): make the block visible; returns its tier."""
        with self._lock:
            return self._zero_copy.commit(res, attrs)

    def abort(self, res: Reserved) -> None:
        """Drop a reservation; none of its bytes ever become visible."""
        with self._lock:
            self._zero_copy.abort(res)

    def writing(self, key: bytes) -> bool:
        """True while ``key`` is reserved (its bytes are arriving)."""
        return key in self._cat.reserved

    # ------------------------------------------------------------------ leaving on request
    def delete(self, key: bytes) -> bool:
        """Drop ``key`` and its cached descendants from every tier, unless one of them is pinned,
        leased or being written (then nothing changes and the answer is False)."""
        with self._lock:
            if key not in self._meta or key in self._cat.in_flight_parents:
                return False
            return self._try_drop(key)

    def end_request(self, request_id: str) -> int:
        """Drop the REQUEST blocks put under ``request_id`` (pinned or leased ones stay); returns count."""
        with self._lock:
            doomed = [k for k, m in self._meta.items() if m.lifetime is Lifetime.REQUEST and m.request_id == request_id]
            return sum(1 for k in reversed(doomed) if k in self._meta and self._try_drop(k))

    def expire(self, now: float | None = None) -> int:
        """Drop SESSION (and own-TTL) blocks idle longer than their TTL; returns count."""
        with self._lock:
            return self._cat.expiry.expire(self._try_drop, now)

    def promote(self, key: bytes, lifetime: Lifetime) -> None:
        """Raise a block's lifetime (REQUEST -> SESSION -> PREFIX); never lowers it."""
        with self._lock:
            m = self._meta.get(key)
            if m is None:
                raise BlockNotFoundError(f"store has no block {key.hex()}")
            if lifetime.rank > m.lifetime.rank:
                m.lifetime = lifetime
                self._cat.expiry.start(key, m)

    def evict(self, name: str, nbytes: float) -> int:
        """Free at least ``nbytes`` of ``name`` (demoting or dropping leaves); returns bytes freed."""
        with self._lock:
            return self._mover.evict(name, nbytes)

    def demote(self, key: bytes, from_tier: str) -> str | None:
        """Move ``key`` from ``from_tier`` to the next allowed tier (dropping it when none); returns
        the tier it moved to, or None when dropped."""
        with self._lock:
            if key not in self._idx[from_tier]:
                raise BlockNotFoundError(f"{from_tier} holds no block {key.hex()}")
            return self._mover.demote(from_tier, key)

    def spill(self, from_tier: str) -> tuple[int, int]:
        """Demote every block of ``from_tier`` to the next tier its lifetime allows (a server's
        graceful shutdown: nobody reads any more, so leases do not hold blocks here); a block that
        cannot move (no tier below, no free room there -- nothing below is evicted for it --, a
        write that fails) stays and the rest go on. Returns (moved, stayed)."""
        with self._lock:
            return self._mover.spill(from_tier)

    # ------------------------------------------------------------------ metadata and introspection
    def usage(self, account: str) -> tuple[int, int]:
        """(charged bytes, blocks) the store holds for ``account``."""
        return self._cat.usage.get(account, 0), self._cat.account_blocks.get(account, 0)

    def size_of(self, key: bytes) -> int | None:
        m = self._meta.get(key)
        return None if m is None else m.size

    def meta_of(self, key: bytes) -> BlockMeta | None:
        m = self._meta.get(key)
        return None if m is None else m.block_meta()

    def parent_of(self, key: bytes) -> bytes | None:
        m = self._meta.get(key)
        return None if m is None else m.parent

    def children_of(self, key: bytes) -> int:
        m = self._meta.get(key)
        return 0 if m is None else sum(1 for c in m.children if c in self._meta)

    def expires_at(self, key: bytes) -> float | None:
        m = self._meta.get(key)
        return None if m is None else m.expires_at

    def lifetime_of(self, key: bytes) -> Lifetime | None:
        m = self._meta.get(key)
        return None if m is None else m.lifetime

    def where(self, key: bytes) -> tuple[str, ...]:
        """Every tier holding ``key`` (broken ones included), top first."""
        return tuple(n for n in self.names if key in self._idx[n])

    def blocks(self) -> list[bytes]:
        """Every block the store holds (a snapshot)."""
        with self._lock:
            return list(self._meta)

    def __contains__(self, key: bytes) -> bool:
        return key in self._meta

    def __len__(self) -> int:
        return len(self._meta)

    def stats(self) -> StoreStats:
        with self._lock:
            c = self._cat.counts
            return StoreStats(hits={n: c[n].hits for n in self.names}, misses=self._cat.misses,
                              bytes_in={n: c[n].bytes_in for n in self.names},
                              bytes_out={n: c[n].bytes_out for n in self.names},
                              demotions={n: c[n].demotions for n in self.names}, drops=self._cat.drops,
                              blocks={n: len(ix) for n, ix in self._idx.items()},
                              used_bytes={n: ix.used for n, ix in self._idx.items()}, broken=self._health.broken)

    # ------------------------------------------------------------------ write-behind and shutdown
    def after_writes(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once every block queued for write-behind so far is written (at once when nothing
        is queued, or the store has no write-behind tier)."""
        if self._behind is None:
            fn()
        else:
            self._behind.after(fn)

    def flush_behind(self, timeout_s: float | None = None) -> bool:
        """Wait until the write-behind queue is empty; False if ``timeout_s`` passed first."""
        return True if self._behind is None else self._behind.flush(timeout_s)

    def close(self) -> None:
        if self._behind is not None:
            self._behind.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
