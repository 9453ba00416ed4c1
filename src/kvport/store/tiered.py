"""TieredStore: where each block sits (tier), decided by lifetime rules and eviction policy.

Data flow::

    put(key, data, lifetime) --> first allowed tier with room (evicting/demoting to make room)
                              \\-> every lower allowed tier whose WriteMode is THROUGH
    lookup(keys)  --> longest prefix held by healthy tiers (probing shared tiers for local misses);
                      the hit prefix is touched last-block-first, so parents stay as recent as children
    get_into(key) --> top-most healthy tier holding it; a hit below the top is promoted (copied up)
    eviction      --> lowest-priority *leaf* of the tier's prefix tree that the ledger calls evictable;
                      demoted to the next allowed tier, or dropped when none is left (a block with
                      children anywhere in the store is never dropped, so no child is stranded)

    reserve(key, n) --> writable views straight into the first zero-copy tier (room made first);
                        commit(res) makes the block visible, abort(res) leaves nothing behind
    read_views(key) --> read-only views of the top tier's own memory (the caller holds a lease or pin)
    quotas          --> a block may name an ``account`` (a tenant); a put that would take the account
                        over its quota first drops the account's own evictable leaves, else raises
                        QuotaExceededError (placement is unchanged: quota is a policy of the store)
    keep_spillable  --> (upper, lower): a block is written to either only while the lower tier can take,
                        for real (Tier.shortfall: capacity, free space of its filesystem, its journal),
                        every block of the upper one and this one: what a graceful shutdown spills
                        down; else the lower tier's own victims leave, then the upper one's leaves
                        (only where that makes the room), else TierFullError

Invariants: ``_meta`` holds exactly the blocks present in at least one tier index; every block in
``_meta`` is registered in the ledger (the store registers what it puts, owned by the pool unless an
owner is given) and forgotten when it leaves the store. A block never outlives its parent in the
store (eviction takes leaves; dropping a block drops its cached descendants), and a block is moved
down only once its copy below is in place (a demotion that fails leaves the block where it was).
One re-entrant lock guards all state.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from kvport.deadline import Deadline, within
from kvport.errors import (
    BlockNotFoundError,
    ConfigError,
    CorruptBlockError,
    DeadlineExceeded,
    IllegalMoveError,
    KVPortError,
    QuotaExceededError,
    TierError,
    TierFullError,
    TierUnavailableError,
    UnknownBlockError,
)
from kvport.ledger import Ledger, Owner, OwnerKind
from kvport.lifetime import Lifetime
from kvport.metrics import counter, gauge
from kvport.store.behind import WriteBehind, count_dropped
from kvport.store.eviction import DEFAULT_POLICY, make_policy
from kvport.store.health import TierHealth
from kvport.store.index import TierIndex
from kvport.store.lifetime import LifetimePolicy
from kvport.store.types import LookupResult, ReadViews, Reserved, StoreStats, TierPolicy, WriteMode
from kvport.tiers.base import BlockMeta, Buffer, Tier, byte_view

log = logging.getLogger(__name__)

_HITS = counter("store_hits_total", "Blocks found by lookup/get, by tier", ["tier"])
_MISSES = counter("store_misses_total", "Blocks looked up and not found")
_BYTES_IN = counter("store_bytes_in_total", "Bytes written into a tier by the store", ["tier"])
_BYTES_OUT = counter("store_bytes_out_total", "Bytes read out of a tier by the store", ["tier"])
_EVICTIONS = counter("store_evictions_total", "Blocks evicted from a tier", ["tier", "action"])
_EXPIRY_RETRY_S = 1.0
_USED = gauge("store_used_bytes", "Bytes the store accounts in a tier", ["tier"])


@dataclass(slots=True)
class _Meta:
    lifetime: Lifetime
    parent: bytes | None
    size: int
    request_id: str | None = None
    expires_at: float | None = None
    children: set[bytes] = field(default_factory=set)
    account: str | None = None
    charged: int = 0  # bytes counted against the account's quota
    ttl_s: float | None = None  # this block's own idle TTL (else the lifetime rule's)
    attrs: bytes = b""

    def block_meta(self) -> BlockMeta:
        return BlockMeta(self.parent, self.lifetime, self.ttl_s, self.account, self.attrs)


__all__ = ["ReadViews", "Reserved", "TieredStore"]


class TieredStore:
    def __init__(self, tiers: Sequence[Tier], ledger: Ledger | None = None, policy: LifetimePolicy | None = None,
                 eviction: str = DEFAULT_POLICY, *, tier_policies: Mapping[str, TierPolicy] | None = None,
                 clock: Callable[[], float] = time.monotonic, retry_broken_s: float = 1.0,
                 adopt_persistent: bool = True, quotas: Mapping[str, int] | None = None,
                 keep_orphans: bool = True, keep_spillable: tuple[str, str] | None = None) -> None:
        """``quotas``: bytes per account (blocks put with that ``account``); ``keep_orphans=False``:
        a persistent tier's block whose parent did not survive a restart is dropped at adoption (a
        child without its parent can never be hit); ``keep_spillable``: (upper, lower), see the
        module docstring."""
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
        self._idx = {t.name: TierIndex(make_policy(eviction), t.capacity_bytes) for t in tiers}
        self._meta: dict[bytes, _Meta] = {}
        self._expiry: list[tuple[float, bytes]] = []
        self._lock = threading.RLock()
        self._health = TierHealth(clock, retry_broken_s, self._recovered)
        self._pool: ThreadPoolExecutor | None = None
        self._busy: set[bytes] = set()  # the key being put and its parent: never evicted meanwhile
        self._hits = dict.fromkeys(names, 0)
        self._bytes_in = dict.fromkeys(names, 0)
        self._bytes_out = dict.fromkeys(names, 0)
        self._demotions = dict.fromkeys(names, 0)
        self._misses = 0
        self._drops = 0
        self.quotas: dict[str, int] = dict(quotas or {})
        self.keep_orphans = keep_orphans
        self._usage: dict[str, int] = {}
        self._account_blocks: dict[str, int] = {}
        self._reserved: dict[bytes, Reserved] = {}
        self._in_flight_parents: dict[bytes, int] = {}  # parents of reserved blocks: not evictable meanwhile
        self.orphans_dropped = 0
        self._orphans: dict[bytes, set[bytes]] = {}  # a lost block -> its children kept (held)
        self._behind: WriteBehind | None = None
        if any(p.write is WriteMode.BEHIND for p in self.tier_policies.values()):
            if self.tier_policies[names[0]].write is WriteMode.BEHIND:
                raise ConfigError(f"{names[0]} is the top tier: nothing is above it to write behind")
            self._behind = WriteBehind(self._copy_behind)
        self._behind_scratch = bytearray(0)  # the write-behind thread's read buffer, grown to the largest block
        if adopt_persistent:
            for t in tiers:
                if t.caps.persistent and not t.caps.shared:
                    self._adopt_all(t)

    # ------------------------------------------------------------------ lookup
    def lookup(self, keys: Sequence[bytes], *, deadline: Deadline | None = None) -> LookupResult:
        """Longest cached prefix of ``keys``; broken tiers count as misses. With a ``deadline``, the
        store's lock and the shared tiers' answers are waited for at most until then."""
        ks = tuple(keys)
        with self._locked(deadline):
            self.expire()
            tiers: list[str] = []
            sizes: list[int] = []
            asked = len(ks)  # keys from here on were just confirmed by the shared tiers
            for i, k in enumerate(ks):
                where = self._where(k)
                if where is None and self._probe_shared(ks, i):
                    asked = min(asked, i)
                    where = self._where(k)
                if where is None:
                    break
                tiers.append(where)
                sizes.append(self._meta[k].size)
            n = self._confirm_shared(ks, tiers, min(asked, len(tiers)))
            del tiers[n:], sizes[n:]
            for k, name in zip(reversed(ks[:n]), reversed(tiers), strict=True):
                self._touch(k, name)
            for name in tiers:
                self._hits[name] += 1
                _HITS.labels(name).inc()
            self._misses += len(ks) - n
            _MISSES.inc(len(ks) - n)
            return LookupResult(ks, n, tuple(tiers), tuple(sizes))

    def _where(self, key: bytes) -> str | None:
        for name in self.names:
            if key in self._idx[name] and self._health.healthy(self.tiers[name]):
                return name
        return None

    def _confirm_shared(self, keys: tuple[bytes, ...], tiers: list[str], upto: int) -> int:
        """How many of the found prefix still stand: a block found (among the first ``upto``) in a
        shared tier's index only is asked for there, since another process may have evicted or
        deleted it, or a load found it damaged; the first one gone there is forgotten here with its
        descendants (not deleted there: it is not there) and the prefix ends before it."""
        cut = len(tiers)
        for name in dict.fromkeys(tiers[:upto]):
            t = self.tiers[name]
            if not t.caps.shared:
                continue
            idx = [i for i in range(upto) if tiers[i] == name]
            try:
                have = t.contains_many([keys[i] for i in idx])
            except TierUnavailableError as exc:
                self._health.mark_broken(t, exc)
                cut = min(cut, idx[0])
                continue
            gone = next((i for i, ok in zip(idx, have, strict=True) if not ok), None)
            if gone is not None:
                cut = min(cut, gone)
                self._drop(keys[gone], gone_from=name)
        return cut

    def _probe_shared(self, keys: tuple[bytes, ...], start: int) -> bool:
        """Ask healthy shared tiers (other processes write there) about ``keys[start:]``; adopt hits."""
        found = False
        for name in self.names:
            t = self.tiers[name]
            if not t.caps.shared or not self._health.healthy(t):
                continue
            try:
                sizes = t.sizes_of(keys[start:])  # one round trip to a remote tier, not one per key
                for j, size in enumerate(sizes):
                    if size is None:
                        break
                    k = keys[start + j]
                    if k in self._idx[name]:
                        continue
                    parent = keys[start + j - 1] if start + j > 0 else None
                    self._index_add(name, k, size, parent, Lifetime.PREFIX, None)
                    found = True
            except TierUnavailableError as exc:
                self._health.mark_broken(t, exc)
        return found

    # ------------------------------------------------------------------ put
    def put(self, key: bytes, data: Buffer, *, lifetime: Lifetime = Lifetime.PREFIX, parent: bytes | None = None,
            owner: Owner | None = None, request_id: str | None = None, account: str | None = None,
            ttl_s: float | None = None, attrs: bytes = b"", origin: Owner | None = None) -> str:
        """Store a block; returns the tier it landed in. A key already held is only touched (keys are
        content hashes) and its lifetime raised to ``lifetime`` if higher. TierFullError when no
        allowed tier can take it, QuotaExceededError when ``account`` is full of blocks that may not
        leave. ``ttl_s``: this block's idle TTL (any lifetime); ``attrs``: the caller's bytes kept with
        it (:meth:`meta_of`); ``origin``: who handed it to the store (recorded by the ledger)."""
        try:
            return self._put(key, data, lifetime, parent, owner, request_id, account, ttl_s, attrs, origin)
        finally:
            self._behind_room()

    def _put(self, key: bytes, data: Buffer, lifetime: Lifetime, parent: bytes | None, owner: Owner | None,
             request_id: str | None, account: str | None, ttl_s: float | None, attrs: bytes,
             origin: Owner | None) -> str:
        src = byte_view(data)
        with self._lock:
            self.expire()
            m = self._meta.get(key)
            if m is not None:
                if lifetime.rank > m.lifetime.rank:
                    self.promote(key, lifetime)
                where = self._where(key)
                if where is not None:
                    self._touch(key, where)
                    return where
                self._drop(key)
            if key in self._reserved:
                raise TierFullError(f"block {key.hex()} is being written")
            allowed = self.policy.tiers_for(lifetime, self.names)
            parent = parent if (parent in self._meta and parent != key) else None
            charged = self._charge_for(allowed, src.nbytes)
            self._busy = {key, parent} if parent is not None else {key}
            try:
                self._quota_room(account, charged)
            finally:
                self._busy = set()
            m = _Meta(lifetime, parent, src.nbytes, request_id, account=account, charged=charged, ttl_s=ttl_s,
                      attrs=attrs)
            self._meta[key] = m  # provisional: the index entries below link to the parent
            self._busy = {key, parent} if parent is not None else {key}
            placed: str | None = None
            last_exc: Exception | None = None
            try:
                for name in allowed:
                    if placed is None:
                        try:
                            self._write(name, key, (src,), m)
                            placed = name
                        except (TierFullError, TierUnavailableError) as exc:
                            last_exc = exc
                    elif self.tier_policies[name].write is WriteMode.THROUGH:
                        with contextlib.suppress(TierFullError, TierUnavailableError):
                            self._write(name, key, (src,), m)
                    elif self.tier_policies[name].write is WriteMode.BEHIND and self._behind is not None:
                        self._behind.submit(name, (key,), src.nbytes, wait=False)
            finally:
                self._busy = set()
                if placed is None:
                    del self._meta[key]
            if placed is None:
                raise TierFullError(f"no tier of {allowed} could take block {key.hex()}"
                                    + (f": {last_exc}" if last_exc is not None else "")) from last_exc
            self._admitted(key, m, owner, origin)
            return placed

    def put_many(self, items: Sequence[tuple[bytes, Buffer]], *, lifetime: Lifetime = Lifetime.PREFIX,
                 parent: bytes | None = None, owner: Owner | None = None, request_id: str | None = None,
                 account: str | None = None, ttl_s: float | None = None) -> list[str]:
        """Put a chain of blocks (each the parent of the next; the first under ``parent``) with one
        batched write per tier (the disk tier makes it one slab, read back in one sequential pass).
        When no tier takes the whole batch, or a block is already held, falls back to ``put`` per
        block. Returns the tier of each block."""
        try:
            return self._put_many(items, lifetime, parent, owner, request_id, account, ttl_s)
        finally:
            self._behind_room()

    def _put_many(self, items: Sequence[tuple[bytes, Buffer]], lifetime: Lifetime, parent: bytes | None,
                  owner: Owner | None, request_id: str | None, account: str | None,
                  ttl_s: float | None) -> list[str]:
        srcs = [(k, byte_view(d)) for k, d in items]
        keys = [k for k, _ in srcs]
        with self._lock:
            self.expire()
            if len(set(keys)) != len(keys) or any(k in self._meta or k in self._reserved for k in keys) \
                    or parent in keys:
                return self._put_chain(srcs, lifetime, parent, owner, request_id, account, ttl_s)
            allowed = self.policy.tiers_for(lifetime, self.names)
            charges = [self._charge_for(allowed, v.nbytes) for _, v in srcs]
            self._busy = set(keys) | ({parent} if parent is not None else set())
            try:
                self._quota_room(account, sum(charges))
            finally:
                self._busy = set()
            prev = parent if parent in self._meta else None
            for (k, v), ch in zip(srcs, charges, strict=True):  # provisional, chained: index entries link to parents
                self._meta[k] = _Meta(lifetime, prev, v.nbytes, request_id, account=account, charged=ch, ttl_s=ttl_s)
                prev = k
            self._busy = set(keys) | ({parent} if parent is not None else set())
            placed: str | None = None
            behind: list[str] = []
            try:
                for name in allowed:
                    if placed is not None and self.tier_policies[name].write is WriteMode.BEHIND:
                        behind.append(name)
                    elif placed is None or self.tier_policies[name].write is WriteMode.THROUGH:
                        try:
                            self._write_many(name, srcs)
                            placed = placed or name
                        except (TierFullError, TierUnavailableError):
                            continue
            finally:
                self._busy = set()
                if placed is None:
                    for k in keys:
                        del self._meta[k]
            if placed is None:
                return self._put_chain(srcs, lifetime, parent, owner, request_id, account, ttl_s)
            for k in keys:
                self._admitted(k, self._meta[k], owner, None)
            if self._behind is not None:
                for name in behind:
                    self._behind.submit(name, keys, sum(v.nbytes for _, v in srcs), wait=False)
            return [placed] * len(keys)

    def _put_chain(self, srcs: list[tuple[bytes, memoryview]], lifetime: Lifetime, parent: bytes | None,
                   owner: Owner | None, request_id: str | None, account: str | None,
                   ttl_s: float | None) -> list[str]:
        out: list[str] = []
        for k, v in srcs:
            out.append(self.put(k, v, lifetime=lifetime, parent=parent, owner=owner, request_id=request_id,
                                account=account, ttl_s=ttl_s))
            parent = k
        return out

    def _admitted(self, key: bytes, m: _Meta, owner: Owner | None, origin: Owner | None) -> None:
        """A new block is in its tiers: link it under its parent, start its TTL, count it against its
        account, and record its owner (the pool unless told otherwise) in the ledger."""
        if m.parent is not None and m.parent in self._meta:
            self._meta[m.parent].children.add(key)
        kept = self._orphans.pop(key, None)  # children kept when this block's bytes were lost
        if kept:
            m.children.update(c for c in kept if c in self._meta and self._meta[c].parent == key)
        self._refresh_expiry(key, m)
        if m.account is not None:
            self._usage[m.account] = self._usage.get(m.account, 0) + m.charged
            self._account_blocks[m.account] = self._account_blocks.get(m.account, 0) + 1
        dst = owner if owner is not None else Owner.pool()
        if not self.ledger.knows(key):
            self.ledger.register(key, dst, lifetime=m.lifetime, origin=origin)
        else:  # an engine's own block now also held by the store: handed to the pool, recorded
            cur = self.ledger.owner_of(key)
            if cur != dst and dst.kind is OwnerKind.POOL:
                with contextlib.suppress(IllegalMoveError):
                    self.ledger.hand_off(key, cur, dst, lifetime=m.lifetime)

    def _write_many(self, name: str, srcs: list[tuple[bytes, memoryview]]) -> None:
        t = self.tiers[name]
        if t.caps.block_meta:  # the tier keeps (or forwards) each block's metadata: one block at a time
            for k, v in srcs:
                self._write(name, k, (v,), self._meta[k])
            return
        if not self._health.healthy(t):
            raise TierUnavailableError(f"{name} is marked broken")
        charges = [t.charge(v.nbytes) for _, v in srcs]
        if self._spill_short(name, None, sum(charges), len(srcs)):
            raise TierFullError(f"{name}: no room to keep {len(srcs)} blocks through a graceful shutdown")
        self._make_room(name, sum(charges))
        m0 = self._meta[srcs[0][0]]
        try:
            t.put_many(srcs, ttl_s=self._native_ttl(t, m0))
        except TierUnavailableError as exc:
            self._health.mark_broken(t, exc)
            raise
        for (k, v), charge in zip(srcs, charges, strict=True):
            self._bytes_in[name] += v.nbytes
            _BYTES_IN.labels(name).inc(v.nbytes)
            self._index_add(name, k, v.nbytes, None, m0.lifetime, charge)

    def _write(self, name: str, key: bytes, parts: Sequence[memoryview], m: _Meta, *,
               evict_when_full: bool = True) -> None:
        """Write one block into tier ``name``, room made first by its eviction order. A tier of this
        store's own (not shared) that runs out of room before its accounting says so (a disk whose
        filesystem is full: ENOSPC) makes room the same way, its least valuable leaves first, until
        the write fits or nothing more may leave (``evict_when_full=False``: nothing is evicted for
        it, neither to its watermark nor on ENOSPC)."""
        t = self.tiers[name]
        if not self._health.healthy(t):
            raise TierUnavailableError(f"{name} is marked broken")
        n = sum(p.nbytes for p in parts)
        charge = t.charge(n)
        short = self._spill_short(name, key, charge) if evict_when_full else 0
        if short:
            up, low = self.keep_spillable or (name, name)
            raise TierFullError(f"{name}: {low} could not take this block with those of {up} at a graceful "
                                f"shutdown ({short} bytes short)")
        if evict_when_full:
            self._make_room(name, charge)
        ttl = self._native_ttl(t, m)
        while True:
            try:
                if t.caps.block_meta or len(parts) != 1:
                    t.put_block(key, parts, m.block_meta(), ttl_s=ttl)
                else:
                    t.put(key, parts[0], ttl_s=ttl)
                break
            except TierUnavailableError as exc:
                self._health.mark_broken(t, exc)
                raise
            except TierFullError:
                if not evict_when_full or t.caps.shared or self.evict(name, charge) <= 0:
                    raise
        self._bytes_in[name] += n
        _BYTES_IN.labels(name).inc(n)
        self._index_add(name, key, n, None, m.lifetime, charge)

    def _spill_short(self, name: str, key: bytes | None, charge: int, values: int = 1) -> int:
        """Bytes the lower tier of ``keep_spillable`` lacks, now, to take every block of the upper one
        plus this write of ``charge`` into ``name`` (0: it may go ahead). A copy between the two (a
        demotion, a promotion, a write behind) changes nothing and is not checked. Room is made
        first by evicting the lower tier's own victims (as its eviction would: they are older than
        anything above), then by the upper tier's leaves leaving the store, in its eviction order
        -- but only when their leaving would make the room: a write refused costs no upper block."""
        if self.keep_spillable is None or name not in self.keep_spillable:
            return 0
        up, low = self.keep_spillable
        if key is not None and key in self._idx[low if name == up else up]:
            return 0
        ix = self._idx[up]
        values += len(ix) + sum(1 for r in self._reserved.values() if r.tier == up)
        lower = self.tiers[low]
        try:
            short = lower.shortfall(ix.used + charge, values)
            while short > 0 and self.evict(low, short) > 0:  # a slab's room comes back with its last block
                short = lower.shortfall(ix.used + charge, values)
            if short <= 0 or lower.shortfall(charge, 1) > 0:
                return short  # fits, or would not fit even alone (a full journal): nothing more leaves
            freed, leaving = self._leavable(up, low)
            if lower.shortfall(ix.used - freed + charge, values - leaving) > 0:
                return short  # would not fit with every leaf of ``up`` gone: none leaves for nothing
            for k in ix.victims(self._droppable):  # the upper tier's own leaves leave the store
                if k in self._idx[low]:
                    self._forget_in(up, k)
                else:
                    _EVICTIONS.labels(up, "spill_room").inc()
                    self._drop(k)
                values -= 1
                short = lower.shortfall(ix.used + charge, values)
                if short <= 0:
                    break
        except TierError as exc:  # its room cannot be read (statvfs failed): the write finds out itself
            log.warning("store: room of %s unknown: %s", low, exc)
            return 0
        return short

    def _leavable(self, up: str, low: str) -> tuple[int, int]:
        """(charged bytes, blocks) of ``up`` that the loop of :meth:`_spill_short` could take away:
        each block droppable by itself whose cached descendants all leave the store with it (a
        parent becomes a leaf only once its children are gone, and a child also held by ``low``
        stays in the store)."""
        ix, below = self._idx[up], self._idx[low]
        goes: dict[bytes, bool] = {}
        for root in ix:
            stack = [(root, False)]
            while stack:
                k, expanded = stack.pop()
                if k in goes:
                    continue
                kids = [c for c in self._meta[k].children if c in self._meta]
                if not expanded:
                    stack.append((k, True))
                    stack.extend((c, False) for c in kids if c not in goes)
                    continue
                goes[k] = (k in ix and self._droppable_self(k)
                           and all(goes[c] and c not in below for c in kids))
        gone = [k for k, ok in goes.items() if ok]
        return sum(ix.size_of(k) or 0 for k in gone), len(gone)

    def _native_ttl(self, t: Tier, m: _Meta) -> float | None:
        return self.policy.idle_ttl(m.lifetime, m.ttl_s) if t.caps.native_ttl else None

    def _charge_for(self, allowed: Sequence[str], nbytes: int) -> int:
        """What a block counts against its account: its charge in the first tier it may occupy."""
        return self.tiers[allowed[0]].charge(nbytes) if allowed else nbytes

    def _index_add(self, name: str, key: bytes, size: int, parent: bytes | None, lifetime: Lifetime,
                   charge: int | None, meta: BlockMeta | None = None) -> None:
        m = self._meta.get(key)
        if m is None:
            m = _Meta(lifetime, parent if parent in self._meta else None, size)
            if meta is not None:
                m.account, m.ttl_s, m.attrs = meta.account, meta.ttl_s, meta.attrs
                m.charged = self._charge_for(self.policy.tiers_for(lifetime, self.names), size)
            self._meta[key] = m
            self._admitted(key, m, None, None)
        self._idx[name].add(key, charge if charge is not None else self.tiers[name].charge(size), m.parent)
        _USED.labels(name).set(self._idx[name].used)

    # ------------------------------------------------------------------ get
    def get_into(self, key: bytes, dst: Buffer, *, deadline: Deadline | None = None) -> int:
        """Copy the block into ``dst`` from the top-most healthy tier holding it; promote it to the
        top allowed tier when found lower. BlockNotFoundError when no working tier has it;
        DeadlineExceeded when ``deadline`` passes first (the store's lock and the tiers' waits on a
        peer are bounded by it)."""

        def read(t: Tier) -> memoryview:
            return byte_view(dst)[: t.get_into(key, dst)]

        with self._locked(deadline):
            return self._read(key, read, deadline)

    @contextlib.contextmanager
    def _locked(self, deadline: Deadline | None) -> Iterator[None]:
        """The store's lock, waited for at most until ``deadline``; tier calls inside see it as the
        current deadline (remote tiers set their socket timeouts from it)."""
        if deadline is None:
            with self._lock:
                yield
            return
        if not self._lock.acquire(timeout=deadline.remaining()):
            raise DeadlineExceeded("the store was busy past the load's deadline")
        try:
            with within(deadline):
                yield
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def holding(self, deadline: Deadline | None = None) -> Iterator[None]:
        """Hold the store's (reentrant) lock for the block: zero-copy views handed out by
        :meth:`consume` inside it stay valid until it exits (nothing is evicted or replaced).
        With a ``deadline``, waits for the lock at most until then (DeadlineExceeded)."""
        with self._locked(deadline):
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

        with self._locked(deadline):
            return self._read(key, read, deadline)

    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]], *,
                      deadline: Deadline | None = None) -> list[int | None]:
        """Batched :meth:`get_into`: runs of keys held by the same tier are read with one batched tier
        call (a disk slab's neighbours with one ``preadv``); None for a key no working tier holds or
        whose bytes failed their check (a clean miss, dropped from that tier). Past ``deadline`` the
        keys not read yet are None (a miss: the caller recomputes them)."""
        out: list[int | None] = [None] * len(items)
        with self._locked(deadline):
            missing = [i for i, (k, _) in enumerate(items) if k not in self._meta]
            if missing:
                self._probe_shared(tuple(items[i][0] for i in missing), 0)
            run: list[int] = []
            run_tier: str | None = None

            def flush() -> None:
                if run_tier is None or not run or (deadline is not None and deadline.expired):
                    return
                t = self.tiers[run_tier]
                try:
                    got = t.get_many_into([items[i] for i in run])
                except TierUnavailableError as exc:
                    self._health.mark_broken(t, exc)
                    got = [None] * len(run)
                for i, n in zip(run, got, strict=True):
                    key = items[i][0]
                    if n is None:
                        self._forget_in(run_tier, key)
                        try:  # a copy in another tier still serves it
                            out[i] = self.get_into(key, items[i][1])
                        except BlockNotFoundError:
                            out[i] = None
                        continue
                    if key not in self._meta:  # dropped meanwhile with a parent that failed its check
                        continue
                    out[i] = n
                    self._bytes_out[run_tier] += n
                    _BYTES_OUT.labels(run_tier).inc(n)
                    self._touch(key, run_tier)

            for i, (k, _) in enumerate(items):
                where = self._where(k) if k in self._meta else None
                if where != run_tier:
                    flush()
                    run, run_tier = [], where
                if where is not None:
                    run.append(i)
            flush()
        return out

    def contains(self, key: bytes) -> bool:
        """Held by a working tier (shared tiers are asked about keys this store has not indexed)."""
        with self._lock:
            if key not in self._meta:
                self._probe_shared((key,), 0)
            return key in self._meta and self._where(key) is not None

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """:meth:`contains` of each key, the shared tiers asked once for the run of keys this store has
        not indexed that starts at the first of them (a chain's blocks come in order: one round trip
        where :meth:`contains` key by key takes one each). A key after a gap in that run reads as
        absent unless indexed: a caller that writes it again only touches it."""
        with self._lock:
            missing = tuple(k for k in keys if k not in self._meta)
            if missing:
                self._probe_shared(missing, 0)
            return [k in self._meta and self._where(k) is not None for k in keys]

    def read_views(self, key: bytes) -> ReadViews | None:
        """The block's bytes as read-only views of the top healthy tier's own memory, when that tier
        allows it (``caps.zero_copy_read``), else None (use :meth:`get_into`). Valid only while the
        caller holds a lease or pin on ``key`` in :attr:`ledger` (nothing evicts or replaces it
        then); counts as a hit. BlockNotFoundError when no tier holds it."""
        with self._lock:
            if key not in self._meta:
                raise BlockNotFoundError(f"store has no block {key.hex()}")
            name = self._where(key)
            if name is None:
                raise BlockNotFoundError(f"no working tier holds block {key.hex()}")
            t = self.tiers[name]
            if not t.caps.zero_copy_read:
                return None
            try:
                views = t.read_views(key)
            except (BlockNotFoundError, CorruptBlockError):
                self._forget_in(name, key)
                raise BlockNotFoundError(f"{name} lost block {key.hex()}") from None
            n = sum(v.nbytes for v in views)
            self._bytes_out[name] += n
            _BYTES_OUT.labels(name).inc(n)
            self._touch(key, name)
            return ReadViews(name, n, tuple(views))

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
            self.expire()
            if key in self._meta or key in self._reserved:
                raise TierFullError(f"block {key.hex()} is already held or being written")
            allowed = self.policy.tiers_for(lifetime, self.names)
            parent = parent if (parent in self._meta and parent != key) else None
            charged = self._charge_for(allowed, nbytes)
            self._busy = {parent} if parent is not None else set()
            try:
                self._quota_room(account, charged)
                for name in allowed:
                    t = self.tiers[name]
                    if not t.caps.zero_copy_write or not self._health.healthy(t):
                        continue
                    charge = t.charge(nbytes)
                    if self._spill_short(name, key, charge):
                        continue
                    self._make_room(name, charge)
                    ix = self._idx[name]
                    if ix.used + charge > ix.capacity:
                        continue
                    try:
                        views = t.reserve_views(key, nbytes)
                    except TierFullError:
                        continue
                    ix.used += charge  # held for the block in flight (not an entry: never a victim)
                    res = Reserved(key, name, nbytes, tuple(views), charge, lifetime, parent, account, ttl_s,
                                   owner, origin, request_id)
                    self._reserved[key] = res
                    if parent is not None:
                        self._in_flight_parents[parent] = self._in_flight_parents.get(parent, 0) + 1
                    return res
                return None
            finally:
                self._busy = set()

    def commit(self, res: Reserved, attrs: bytes = b"") -> str:
        """The reserved bytes are complete (and verified): make the block visible; returns its tier."""
        with self._lock:
            self._end_reservation(res)
            parent = res.parent if res.parent in self._meta else None
            m = _Meta(res.lifetime, parent, res.nbytes, res.request_id, account=res.account,
                      charged=self._charge_for(self.policy.tiers_for(res.lifetime, self.names), res.nbytes),
                      ttl_s=res.ttl_s, attrs=attrs)
            t = self.tiers[res.tier]
            t.commit(res.key, m.block_meta())
            self._meta[res.key] = m
            self._bytes_in[res.tier] += res.nbytes
            _BYTES_IN.labels(res.tier).inc(res.nbytes)
            self._index_add(res.tier, res.key, res.nbytes, None, res.lifetime, res.charge)
            self._admitted(res.key, m, res.owner, res.origin)
            return res.tier

    def abort(self, res: Reserved) -> None:
        """Drop a reservation; none of its bytes ever become visible."""
        with self._lock:
            self._end_reservation(res)
            self.tiers[res.tier].abort(res.key)

    def _end_reservation(self, res: Reserved) -> None:
        if self._reserved.get(res.key) is not res:
            raise IllegalMoveError(f"block {res.key.hex()} has no open reservation")
        del self._reserved[res.key]
        self._idx[res.tier].used -= res.charge
        if res.parent is not None:
            n = self._in_flight_parents.get(res.parent, 0) - 1
            if n > 0:
                self._in_flight_parents[res.parent] = n
            else:
                self._in_flight_parents.pop(res.parent, None)

    def writing(self, key: bytes) -> bool:
        """True while ``key`` is reserved (its bytes are arriving)."""
        return key in self._reserved

    # ------------------------------------------------------------------ quotas
    def _quota_room(self, account: str | None, charge: int) -> None:
        """Make ``charge`` bytes of room under ``account``'s quota by dropping its own evictable
        leaves (least valuable first, bottom tier first); QuotaExceededError when it cannot."""
        limit = None if account is None else self.quotas.get(account)
        if limit is None or account is None:
            return
        if charge > limit:
            raise QuotaExceededError(f"{charge} bytes can never fit {account}'s quota of {limit}")
        need = self._usage.get(account, 0) + charge - limit
        for name in reversed(self.names):
            if need <= 0:
                return
            ix = self._idx[name]
            for k in ix.victims(lambda k: self._meta[k].account == account and self._droppable(k)):
                if need <= 0:
                    break
                need -= self._meta[k].charged
                _EVICTIONS.labels(name, "quota").inc()
                self._drop(k)
        if need > 0:
            raise QuotaExceededError(f"{account}'s quota of {limit} bytes is full of pinned or leased blocks")

    def _droppable(self, key: bytes) -> bool:
        return self._droppable_self(key) and not any(c in self._meta for c in self._meta[key].children)

    def _droppable_self(self, key: bytes) -> bool:
        """Nothing but its children keeps ``key`` in the store: not busy, pinned, leased or a parent in flight."""
        if key in self._busy or key in self._in_flight_parents:
            return False
        return self.ledger.knows(key) and self.ledger.is_evictable(key, self.clock())

    def usage(self, account: str) -> tuple[int, int]:
        """(charged bytes, blocks) the store holds for ``account``."""
        return self._usage.get(account, 0), self._account_blocks.get(account, 0)

    # ------------------------------------------------------------------ removal on request
    def delete(self, key: bytes) -> bool:
        """Drop ``key`` and its cached descendants from every tier, unless one of them is pinned,
        leased or being written (then nothing changes and the answer is False)."""
        with self._lock:
            if key not in self._meta or key in self._in_flight_parents:
                return False
            return self._try_drop(key)

    def spill(self, from_tier: str) -> tuple[int, int]:
        """Demote every block of ``from_tier`` to the next tier its lifetime allows (a server's
        graceful shutdown: nobody reads any more, so leases do not hold blocks here); a block that
        cannot move (no tier below, no free room there -- nothing below is evicted for it --, a
        write that fails) stays and the rest go on.
        Returns (moved, stayed)."""
        moved = stayed = 0
        with self._lock:
            for k in self._spill_order(from_tier):
                if k not in self._idx[from_tier] or k not in self._meta:
                    continue
                target = self._lower_target(from_tier, k)
                if target is None:
                    stayed += 1
                    continue
                ix = self._idx[target]
                if k not in ix and ix.used + self.tiers[target].charge(self._meta[k].size) > ix.capacity:
                    stayed += 1  # no free room below: what is there is not evicted for it
                    continue
                if k not in self._idx[target]:
                    try:
                        self._copy_down(from_tier, target, k, self._meta[k], evict_when_full=False)
                    except TierError:
                        stayed += 1
                        continue
                self._demotions[from_tier] += 1
                self._forget_in(from_tier, k)
                moved += 1
        return moved, stayed

    def _spill_order(self, from_tier: str) -> list[bytes]:
        """``from_tier``'s blocks in the order :meth:`spill` moves them: first those a block of a lower
        tier descends from, parents before children (one that stayed for want of room would leave
        its descendants below without their parent, dropped at the next start), then the rest,
        newest first."""
        ix = self._idx[from_tier]
        below = self.names[self.names.index(from_tier) + 1 :]
        depth: dict[bytes, int] = {}
        for name in below:
            for k in self._idx[name]:
                m = self._meta.get(k)
                chain: list[bytes] = []
                p = None if m is None else m.parent
                while p is not None and p in ix and p not in depth and p in self._meta:
                    chain.append(p)
                    p = self._meta[p].parent
                base = -1 if p is None else depth.get(p, -1)
                for j, a in enumerate(reversed(chain)):  # the top of the chain first
                    depth[a] = base + 1 + j
        first = sorted(depth, key=depth.__getitem__)
        return first + [k for k in ix.keys()[::-1] if k not in depth]

    # ------------------------------------------------------------------ metadata
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

    def blocks(self) -> list[bytes]:
        """Every block the store holds (a snapshot)."""
        with self._lock:
            return list(self._meta)

    def _read(self, key: bytes, read: Callable[[Tier], memoryview], deadline: Deadline | None = None) -> int:
        with self._lock:
            m = self._meta.get(key)
            if m is None and not self._probe_shared((key,), 0):
                raise BlockNotFoundError(f"store has no block {key.hex()}")
            for name in self.names:
                if key not in self._idx[name]:
                    continue
                if deadline is not None:
                    deadline.check(f"read of block {key.hex()}")
                t = self.tiers[name]
                if not self._health.healthy(t):
                    continue
                try:
                    data = read(t)
                except (BlockNotFoundError, CorruptBlockError):
                    self._forget_in(name, key)
                    continue
                except TierUnavailableError as exc:
                    self._health.mark_broken(t, exc)
                    continue
                n = data.nbytes
                self._bytes_out[name] += n
                _BYTES_OUT.labels(name).inc(n)
                self._touch(key, name)
                self._maybe_promote(key, name, data)
                return n
            if key in self._meta and not any(key in ix for ix in self._idx.values()):
                self._drop_unreadable(key)
            raise BlockNotFoundError(f"no working tier holds block {key.hex()}")

    def _maybe_promote(self, key: bytes, found_in: str, data: memoryview) -> None:
        m = self._meta.get(key)
        if m is None:
            return
        allowed = self.policy.tiers_for(m.lifetime, self.names)
        if not allowed or allowed[0] == found_in or self.names.index(allowed[0]) > self.names.index(found_in):
            return
        with contextlib.suppress(TierFullError, TierUnavailableError):
            self._write(allowed[0], key, (data,), m)

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
                if k in self._idx[top] or self._where(k) is None:
                    continue
                buf = bytearray(m.size)
            try:
                self.get_into(k, buf)  # promotes on the way
            except BlockNotFoundError:
                continue
            done += 1
        return done

    # ------------------------------------------------------------------ lifetimes
    def end_request(self, request_id: str) -> int:
        """Drop the REQUEST blocks put under ``request_id`` (pinned or leased ones stay); returns count."""
        with self._lock:
            doomed = [k for k, m in self._meta.items() if m.lifetime is Lifetime.REQUEST and m.request_id == request_id]
            return sum(1 for k in reversed(doomed) if k in self._meta and self._try_drop(k))

    def promote(self, key: bytes, lifetime: Lifetime) -> None:
        """Raise a block's lifetime (REQUEST -> SESSION -> PREFIX); never lowers it."""
        with self._lock:
            m = self._meta.get(key)
            if m is None:
                raise BlockNotFoundError(f"store has no block {key.hex()}")
            if lifetime.rank > m.lifetime.rank:
                m.lifetime = lifetime
                self._refresh_expiry(key, m)

    def expire(self, now: float | None = None) -> int:
        """Drop SESSION blocks idle longer than their TTL; returns count."""
        t = self.clock() if now is None else now
        dropped = 0
        with self._lock:
            while self._expiry and self._expiry[0][0] <= t:
                at, k = heapq.heappop(self._expiry)
                m = self._meta.get(k)
                if m is None or m.expires_at != at:
                    continue
                if self._try_drop(k):
                    dropped += 1
                else:  # pinned or leased (itself or a descendant): look again a little later
                    m.expires_at = t + _EXPIRY_RETRY_S
                    heapq.heappush(self._expiry, (m.expires_at, k))
        return dropped

    def _refresh_expiry(self, key: bytes, m: _Meta) -> None:
        ttl = self.policy.idle_ttl(m.lifetime, m.ttl_s)
        m.expires_at = None if ttl is None else self.clock() + ttl
        if m.expires_at is not None:
            heapq.heappush(self._expiry, (m.expires_at, key))

    def _touch(self, key: bytes, name: str) -> None:
        self._idx[name].touch(key)
        m = self._meta[key]
        if m.expires_at is not None:
            self._refresh_expiry(key, m)

    # ------------------------------------------------------------------ eviction
    def _make_room(self, name: str, charge: int) -> None:
        ix = self._idx[name]
        pol = self.tier_policies[name]
        if ix.used + charge <= pol.high_watermark * ix.capacity:
            return
        target = pol.low_watermark * ix.capacity - charge
        self.evict(name, ix.used - target)

    def evict(self, name: str, nbytes: float) -> int:
        """Free at least ``nbytes`` of ``name`` (demoting or dropping leaves); returns bytes freed."""
        freed = 0
        kept: set[bytes] = set()
        with self._lock:
            ix = self._idx[name]
            for k in ix.victims(lambda k: k not in kept and self._evictable(name, k)):
                if freed >= nbytes:
                    break
                before = ix.used
                if self._demote_or_drop(name, k) == name:
                    kept.add(k)  # could not move down now: not a victim again in this pass
                freed += before - ix.used
        return freed

    def _evictable(self, name: str, key: bytes) -> bool:
        if key in self._busy or key in self._in_flight_parents:
            return False
        if not self.ledger.knows(key) or not self.ledger.is_evictable(key, self.clock()):
            return False
        if self._lower_target(name, key) is None and not any(key in self._idx[n] for n in self.names if n != name):
            return not any(c in self._meta for c in self._meta[key].children)  # leaving the store: leaves only
        return True

    def _lower_target(self, name: str, key: bytes) -> str | None:
        allowed = self.policy.tiers_for(self._meta[key].lifetime, self.names)
        below = [n for n in allowed if self.names.index(n) > self.names.index(name)]
        for n in below:
            if key in self._idx[n] or self._health.healthy(self.tiers[n]):
                return n
        return None

    def demote(self, key: bytes, from_tier: str) -> str | None:
        """Move ``key`` from ``from_tier`` to the next allowed tier (dropping it when none); returns
        the tier it moved to, or None when dropped."""
        with self._lock:
            if key not in self._idx[from_tier]:
                raise BlockNotFoundError(f"{from_tier} holds no block {key.hex()}")
            return self._demote_or_drop(from_tier, key)

    def _demote_or_drop(self, name: str, key: bytes) -> str | None:
        """Move ``key`` down (its copy below is written first, then this one goes), or drop it when
        no tier below may hold it. When the copy below fails (that tier full of blocks that may not
        leave, or down), a leaf of the whole store is dropped like any evicted block; a block with
        cached children stays where it is (returns ``name``): eviction never strands a child."""
        m = self._meta[key]
        target = self._lower_target(name, key)
        if target is not None and key not in self._idx[target]:
            try:
                self._copy_down(name, target, key, m)
            except (TierFullError, TierUnavailableError):
                elsewhere = any(key in self._idx[n] for n in self.names if n != name)
                if not elsewhere and any(c in self._meta for c in m.children):
                    _EVICTIONS.labels(name, "kept").inc()
                    return name
                target = None
            except (BlockNotFoundError, CorruptBlockError):  # this copy is bad: nothing to keep
                target = None
        if target is None and any(key in self._idx[n] for n in self.names if n != name):
            target = next(n for n in self.names if n != name and key in self._idx[n])
        if target is None:
            _EVICTIONS.labels(name, "drop").inc()
            self._drop(key)
            return None
        _EVICTIONS.labels(name, "demote").inc()
        self._demotions[name] += 1
        self._forget_in(name, key)
        return target

    def _copy_down(self, src_name: str, dst_name: str, key: bytes, m: _Meta, *,
                   evict_when_full: bool = True) -> None:
        src = self.tiers[src_name]
        if src.caps.zero_copy_read:  # the source's own pages go straight to the write below
            self._write(dst_name, key, src.read_views(key), m, evict_when_full=evict_when_full)
            return
        buf = bytearray(m.size)
        n = src.get_into(key, buf)
        self._write(dst_name, key, (memoryview(buf)[:n],), m, evict_when_full=evict_when_full)

    def _forget_in(self, name: str, key: bytes) -> None:
        """Remove ``key`` from one tier (and its index)."""
        ix = self._idx[name]
        ix.remove(key, evicted=True)
        _USED.labels(name).set(ix.used)
        try:
            self.tiers[name].delete(key)
        except TierUnavailableError as exc:
            self._health.mark_broken(self.tiers[name], exc)
        except KVPortError as exc:  # a peer past the caller's deadline: the index is what counts here
            log.info("store: delete of %s from %s failed: %s", key.hex(), name, exc)

    def _try_drop(self, key: bytes) -> bool:
        """Drop ``key`` and its cached descendants, unless any of them is pinned, leased or busy."""
        if self._held_below(key, self.clock()):
            return False
        self._drop(key)
        return True

    def _drop_unreadable(self, key: bytes) -> None:
        """``key``'s bytes are gone from every tier (damaged, lost): drop it with its descendants,
        except a descendant that is pinned, leased or being written, or has such a block below it:
        its bytes are intact and somebody holds it. It stays linked to ``key`` (listed by
        ``inspect --leaks`` as kept without its parent); when ``key`` is stored again (an engine
        recomputes the prefix and saves it) the chain is whole again."""
        m = self._meta.get(key)
        if m is None:
            return
        now = self.clock()
        for c in [c for c in m.children if c in self._meta and self._held_below(c, now)]:
            m.children.discard(c)
            self._orphans.setdefault(key, set()).add(c)
        self._drop(key)

    def _held_below(self, key: bytes, now: float) -> bool:
        """``key`` or one of its descendants is pinned, leased or busy."""
        stack = [key]
        while stack:
            k = stack.pop()
            if k in self._busy or k in self._in_flight_parents or \
                    (self.ledger.knows(k) and not self.ledger.is_evictable(k, now)):
                return True
            stack.extend(c for c in self._meta[k].children if c in self._meta)
        return False

    def _drop(self, key: bytes, gone_from: str | None = None) -> None:
        """Remove ``key`` from every tier and the ledger; its cached descendants go with it.
        ``gone_from``: a tier known not to hold ``key`` or its descendants any more (only the index
        entries go there: a shared tier may hold the key again, written by another process)."""
        m = self._meta.pop(key, None)
        if m is None:
            return
        for c in list(m.children):
            if c in self._meta:
                self._drop(c, gone_from)
        for name in self.names:
            if key in self._idx[name]:
                if name == gone_from:
                    self._idx[name].remove(key, evicted=True)
                    _USED.labels(name).set(self._idx[name].used)
                else:
                    self._forget_in(name, key)
        if m.parent is not None and m.parent in self._meta:
            self._meta[m.parent].children.discard(key)
        elif m.parent is not None and m.parent in self._orphans:
            self._orphans[m.parent].discard(key)
            if not self._orphans[m.parent]:
                del self._orphans[m.parent]
        if m.account is not None:
            self._usage[m.account] = self._usage.get(m.account, 0) - m.charged
            self._account_blocks[m.account] = self._account_blocks.get(m.account, 0) - 1
        with contextlib.suppress(IllegalMoveError, UnknownBlockError):  # pinned/leased: the leak report lists it
            self.ledger.forget(key)
        self._drops += 1

    def _adopt_all(self, t: Tier) -> None:
        """Index what a persistent tier already holds, parents before children (as its metadata
        names them); with ``keep_orphans=False`` a block whose parent is gone is dropped from it."""
        recs = {k: (n, meta) for k, n, meta in t.records()}
        state: dict[bytes, bool] = {}  # key -> adopted (True) or dropped (False)
        for root in recs:
            chain: list[bytes] = []  # walk up to the first decided (or missing) ancestor
            k: bytes | None = root
            while k is not None and k in recs and k not in state and k not in chain:
                chain.append(k)
                meta = recs[k][1]
                k = None if meta is None else meta.parent
            parent_ok = k is None or state.get(k, False)
            for key in reversed(chain):  # top of the chain first
                n, meta = recs[key]
                parent = None if meta is None else meta.parent
                if parent is not None and not parent_ok:
                    if not self.keep_orphans:
                        with contextlib.suppress(TierError):
                            t.delete(key)
                        self.orphans_dropped += 1
                        state[key] = False
                        continue
                    parent = None
                lifetime = Lifetime.PREFIX if meta is None or meta.lifetime is None else meta.lifetime
                self._index_add(t.name, key, n, parent, lifetime, None, meta)
                state[key] = parent_ok = True

    def _recovered(self, name: str) -> None:
        """A broken tier answers again: drop index entries it lost (e.g. a restarted Redis)."""
        ix = self._idx[name]
        keys = ix.keys()
        if not keys:
            return
        try:
            have = self.tiers[name].contains_many(keys)
        except TierUnavailableError:
            return
        for k, ok in zip(keys, have, strict=True):
            if not ok:
                ix.remove(k)
                if not any(k in i for i in self._idx.values()):
                    self._drop(k)

    # ------------------------------------------------------------------ introspection
    def where(self, key: bytes) -> tuple[str, ...]:
        """Every tier holding ``key`` (broken ones included), top first."""
        return tuple(n for n in self.names if key in self._idx[n])

    def lifetime_of(self, key: bytes) -> Lifetime | None:
        m = self._meta.get(key)
        return None if m is None else m.lifetime

    def __contains__(self, key: bytes) -> bool:
        return key in self._meta

    def __len__(self) -> int:
        return len(self._meta)

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(hits=dict(self._hits), misses=self._misses, bytes_in=dict(self._bytes_in),
                              bytes_out=dict(self._bytes_out), demotions=dict(self._demotions), drops=self._drops,
                              blocks={n: len(ix) for n, ix in self._idx.items()},
                              used_bytes={n: ix.used for n, ix in self._idx.items()}, broken=self._health.broken)

    # ------------------------------------------------------------------ write-behind
    def _behind_room(self) -> None:
        """After a put, outside the lock: wait while the write-behind queue is over its bound (not in a
        put nested in another store call, which holds the lock the writer needs)."""
        if self._behind is not None and not self._lock._is_owned():  # type: ignore[attr-defined]
            self._behind.wait_room()

    def _copy_behind(self, tier: str, keys: Sequence[bytes]) -> None:
        """The write-behind thread's work: each block still held is read from the tier above (under
        the lock: a local read) and written to ``tier`` outside it, so a slow or hung tier below
        never stalls the store's other calls; indexed there once written, unless it left meanwhile."""
        dropped = 0
        t = self.tiers[tier]
        for key in keys:
            with self._lock:
                m = self._meta.get(key)
                if m is None or key in self._idx[tier]:
                    dropped += m is None
                    continue
                src = next((n for n in self.names if n != tier and key in self._idx[n]), None)
                if src is None or not self._health.healthy(t):
                    dropped += 1
                    continue
                if len(self._behind_scratch) < m.size:
                    self._behind_scratch = bytearray(m.size)
                view = memoryview(self._behind_scratch)[: m.size]
                try:
                    n = self.tiers[src].get_into(key, view)
                    charge = t.charge(n)
                    self._busy = {key}
                    try:
                        self._make_room(tier, charge)
                    finally:
                        self._busy = set()
                except KVPortError as exc:
                    log.debug("kvport: write-behind of %s to %s dropped (%s)", key.hex(), tier, exc)
                    dropped += 1
                    continue
                meta, ttl = m.block_meta(), self._native_ttl(t, m)
            try:  # outside the lock
                if t.caps.block_meta:
                    t.put_block(key, (view[:n],), meta, ttl_s=ttl)
                else:
                    t.put(key, view[:n], ttl_s=ttl)
            except TierUnavailableError as exc:
                self._health.mark_broken(t, exc)
                log.debug("kvport: write-behind of %s to %s dropped (%s)", key.hex(), tier, exc)
                dropped += 1
                continue
            except KVPortError as exc:  # full, a value it refuses: this copy is not made
                log.debug("kvport: write-behind of %s to %s dropped (%s)", key.hex(), tier, exc)
                dropped += 1
                continue
            with self._lock:
                if key in self._meta and key not in self._idx[tier]:
                    self._bytes_in[tier] += n
                    _BYTES_IN.labels(tier).inc(n)
                    self._index_add(tier, key, n, None, self._meta[key].lifetime, charge)
                elif key not in self._meta:  # deleted while it was being written: not kept below either
                    with contextlib.suppress(KVPortError):
                        t.delete(key)
        if dropped:
            count_dropped(tier, dropped)

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
