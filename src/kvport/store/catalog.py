"""Catalog: what the store holds, block by block, and where; the one place its records change.

::

    records   key -> Meta: lifetime, parent, size, children, account + charge, TTL, attrs
    idx       tier -> TierIndex: what that tier holds (sizes, its prefix tree, its eviction order)
    reserved  key -> Reserved: a block in flight (room held in its tier, not a record yet)
    in_flight_parents   parent -> reserved blocks under it (never a victim meanwhile)
    usage     account -> (charged bytes, blocks)
    orphans   a block whose bytes were lost -> its children kept (somebody held them)
    counts    tier -> hits, bytes in / out, demotions: each counted once, here, with its metric
    health    tier -> working or broken (:mod:`kvport.store.health`)

Invariants: ``records`` holds exactly the blocks present in at least one tier index; each is
registered in the ledger (:meth:`Catalog.admit`: owned by the pool unless an owner is given) and
forgotten there when it leaves the store (:meth:`Catalog.drop`). A record's ``children`` are the
records that name it as their parent (a reader skips links to blocks gone). A block never outlives
its parent: :meth:`Catalog.drop` takes its cached descendants with it. :meth:`Catalog.record` is the
only constructor of a ``Meta``; :meth:`Catalog.written` the only place bytes written into a tier are
counted.

Restart adoption (:meth:`Catalog.adopt`) indexes what a persistent tier already holds, parents
before children; a broken tier that answers again (:meth:`Catalog.recovered`) loses the entries it lost.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kvport.errors import IllegalMoveError, KVPortError, TierError, TierUnavailableError, UnknownBlockError
from kvport.ledger import Ledger, Owner, OwnerKind
from kvport.lifetime import Lifetime
from kvport.metrics import counter, gauge
from kvport.store.eviction import make_policy
from kvport.store.expiry import Expiry
from kvport.store.health import TierHealth
from kvport.store.index import TierIndex
from kvport.store.lifetime import LifetimePolicy
from kvport.store.types import Reserved, TierChanges
from kvport.tiers.base import BlockMeta, Tier

log = logging.getLogger(__name__)

_HITS = counter("store_hits_total", "Blocks found by lookup/get, by tier", ["tier"])
_BYTES_IN = counter("store_bytes_in_total", "Bytes written into a tier by the store", ["tier"])
_BYTES_OUT = counter("store_bytes_out_total", "Bytes read out of a tier by the store", ["tier"])
_USED = gauge("store_used_bytes", "Bytes the store accounts in a tier", ["tier"])
MISSES = counter("store_misses_total", "Blocks looked up and not found")


@dataclass(slots=True)
class Meta:
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


def _tier_changes(changes: TierChanges, name: str) -> Callable[[bool, bytes, bytes | None], None]:
    return lambda stored, key, parent: changes(name, stored, key, parent)


class TierCounts:
    """One tier's counters, each beside its metric (the metric's child looked up once)."""

    __slots__ = ("bytes_in", "bytes_out", "demotions", "hit", "hits", "inc_in", "inc_out", "used")

    def __init__(self, name: str) -> None:
        self.hits = self.bytes_in = self.bytes_out = self.demotions = 0
        self.hit = _HITS.labels(name).inc
        self.inc_in = _BYTES_IN.labels(name).inc
        self.inc_out = _BYTES_OUT.labels(name).inc
        self.used = _USED.labels(name).set


class Catalog:
    def __init__(self, tiers: dict[str, Tier], eviction: str, ledger: Ledger, policy: LifetimePolicy,
                 clock: Callable[[], float], retry_broken_s: float, keep_orphans: bool,
                 changes: TierChanges | None = None) -> None:
        self.tiers = tiers  # the store's own dict
        self.names = tuple(tiers)
        self.ledger = ledger
        self.policy = policy
        self.clock = clock
        self.keep_orphans = keep_orphans
        self.records: dict[bytes, Meta] = {}
        self.idx = {n: TierIndex(make_policy(eviction), t.capacity_bytes,
                                 None if changes is None else _tier_changes(changes, n)) for n, t in tiers.items()}
        self.reserved: dict[bytes, Reserved] = {}
        self.in_flight_parents: dict[bytes, int] = {}
        self.usage: dict[str, int] = {}
        self.account_blocks: dict[str, int] = {}
        self.orphans: dict[bytes, set[bytes]] = {}
        self.counts = {n: TierCounts(n) for n in self.names}
        self.misses = 0
        self.drops = 0
        self.orphans_dropped = 0
        self.health = TierHealth(clock, retry_broken_s, self.recovered)
        self.expiry = Expiry(self.records, policy, clock)

    # ------------------------------------------------------------------ where
    def where(self, key: bytes) -> str | None:
        """The top healthy tier holding ``key``."""
        idx, tiers, healthy = self.idx, self.tiers, self.health.healthy
        for name in self.names:
            if key in idx[name] and healthy(tiers[name]):
                return name
        return None

    def elsewhere(self, key: bytes, name: str) -> bool:
        """A tier other than ``name`` holds ``key``."""
        return any(key in ix for n, ix in self.idx.items() if n != name)

    def has_children(self, key: bytes) -> bool:
        """``key`` has a child the store holds."""
        records = self.records
        return any(c in records for c in records[key].children)

    def charge_for(self, allowed: tuple[str, ...], nbytes: int) -> int:
        """What a block counts against its account: its charge in the first tier it may occupy."""
        return self.tiers[allowed[0]].charge(nbytes) if allowed else nbytes

    # ------------------------------------------------------------------ arrivals
    def record(self, key: bytes, lifetime: Lifetime, parent: bytes | None, size: int, *,
               request_id: str | None = None, account: str | None = None, charged: int = 0,
               ttl_s: float | None = None, attrs: bytes = b"") -> Meta:
        """A new block's record (not inserted: the caller does, when its bytes are in place or
        provisionally while they are written); its parent kept only when held."""
        if parent is not None and (parent == key or parent not in self.records):
            parent = None
        return Meta(lifetime, parent, size, request_id, account=account, charged=charged, ttl_s=ttl_s, attrs=attrs)

    def written(self, name: str, key: bytes, nbytes: int, charge: int) -> None:
        """``nbytes`` of ``key`` (a record) are now in tier ``name``, taking ``charge`` of it."""
        c = self.counts[name]
        c.bytes_in += nbytes
        c.inc_in(nbytes)
        ix = self.idx[name]
        ix.add(key, charge, self.records[key].parent)
        c.used(ix.used)

    def found(self, name: str, key: bytes, size: int, parent: bytes | None, lifetime: Lifetime,
              meta: BlockMeta | None = None) -> None:
        """Tier ``name`` holds ``key`` without this store having written it there (a shared tier's
        block of another process, a persistent tier's after a restart): indexed, and admitted when new."""
        m = self.records.get(key)
        if m is None:
            if meta is None:
                m = self.record(key, lifetime, parent, size)
            else:
                m = self.record(key, lifetime, parent, size, account=meta.account, ttl_s=meta.ttl_s, attrs=meta.attrs,
                                charged=self.charge_for(self.policy.tiers_for(lifetime, self.names), size))
            self.records[key] = m
            self.admit(key, m, None, None)
        ix = self.idx[name]
        ix.add(key, self.tiers[name].charge(size), m.parent)
        self.counts[name].used(ix.used)

    def admit(self, key: bytes, m: Meta, owner: Owner | None, origin: Owner | None) -> None:
        """A new block is in its tiers: link it under its parent, start its TTL, count it against its
        account, and record its owner (the pool unless told otherwise) in the ledger."""
        records = self.records
        if m.parent is not None and m.parent in records:
            records[m.parent].children.add(key)
        kept = self.orphans.pop(key, None)  # children kept when this block's bytes were lost
        if kept:
            m.children.update(c for c in kept if c in records and records[c].parent == key)
        self.expiry.start(key, m)
        if m.account is not None:
            self.usage[m.account] = self.usage.get(m.account, 0) + m.charged
            self.account_blocks[m.account] = self.account_blocks.get(m.account, 0) + 1
        dst = owner if owner is not None else Owner.pool()
        if not self.ledger.knows(key):
            self.ledger.register(key, dst, lifetime=m.lifetime, origin=origin)
        else:  # an engine's own block now also held by the store: handed to the pool, recorded
            cur = self.ledger.owner_of(key)
            if cur != dst and dst.kind is OwnerKind.POOL:
                with contextlib.suppress(IllegalMoveError):
                    self.ledger.hand_off(key, cur, dst, lifetime=m.lifetime)

    def touch(self, key: bytes, name: str) -> None:
        """A hit in tier ``name``: its eviction order and its idle time start over."""
        self.idx[name].touch(key)
        m = self.records[key]
        if m.expires_at is not None:
            self.expiry.start(key, m)

    def read_out(self, name: str, nbytes: int) -> None:
        c = self.counts[name]
        c.bytes_out += nbytes
        c.inc_out(nbytes)

    # ------------------------------------------------------------------ departures
    def forget_in(self, name: str, key: bytes) -> None:
        """Remove ``key`` from one tier (and its index)."""
        ix = self.idx[name]
        ix.remove(key, evicted=True)
        self.counts[name].used(ix.used)
        try:
            self.tiers[name].delete(key)
        except TierUnavailableError as exc:
            self.health.mark_broken(self.tiers[name], exc)
        except KVPortError as exc:  # a peer past the caller's deadline: the index is what counts here
            log.info("store: delete of %s from %s failed: %s", key.hex(), name, exc)

    def drop(self, key: bytes, gone_from: str | None = None) -> None:
        """Remove ``key`` from every tier and the ledger; its cached descendants go with it.
        ``gone_from``: a tier known not to hold ``key`` or its descendants any more (only the index
        entries go there: a shared tier may hold the key again, written by another process)."""
        m = self.records.pop(key, None)
        if m is None:
            return
        for c in list(m.children):
            if c in self.records:
                self.drop(c, gone_from)
        for name, ix in self.idx.items():
            if key in ix:
                if name == gone_from:
                    ix.remove(key, evicted=True)
                    self.counts[name].used(ix.used)
                else:
                    self.forget_in(name, key)
        if m.parent is not None and m.parent in self.records:
            self.records[m.parent].children.discard(key)
        elif m.parent is not None and m.parent in self.orphans:
            self.orphans[m.parent].discard(key)
            if not self.orphans[m.parent]:
                del self.orphans[m.parent]
        if m.account is not None:
            self.usage[m.account] = self.usage.get(m.account, 0) - m.charged
            self.account_blocks[m.account] = self.account_blocks.get(m.account, 0) - 1
        with contextlib.suppress(IllegalMoveError, UnknownBlockError):  # pinned/leased: the leak report lists it
            self.ledger.forget(key)
        self.drops += 1

    def keep_orphaned(self, key: bytes, child: bytes) -> None:
        """``key`` is about to be dropped for lost bytes while ``child`` is held: the child stays,
        linked to ``key`` again should it be stored again (:meth:`admit`)."""
        self.records[key].children.discard(child)
        self.orphans.setdefault(key, set()).add(child)

    # ------------------------------------------------------------------ restarts and recoveries
    def adopt(self, t: Tier) -> None:
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
                self.found(t.name, key, n, parent, lifetime, meta)
                state[key] = parent_ok = True

    def recovered(self, name: str) -> None:
        """A broken tier answers again: drop index entries it lost (e.g. a restarted Redis)."""
        ix = self.idx[name]
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
                if not any(k in i for i in self.idx.values()):
                    self.drop(k)
