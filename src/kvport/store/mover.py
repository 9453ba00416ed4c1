"""Mover: every way a block goes down or out -- room made, eviction, demotion, spill, quota room,
drops on request -- under ONE rule of what may leave, and the tier writes that need room.

The rule (:meth:`Mover.may_leave`)::

    held     being written or the parent of one (Busy, in-flight reservations), pinned or leased
    may_leave(key, tier)   not held, known to the ledger, and -- when it leaves the store (no tier
                           below may take it, no other tier holds it; tier None: the store) -- without
                           cached children: a child never outlives its parent

Orders: eviction takes the tier's lowest-priority leaves (:class:`~kvport.store.index.TierIndex`)
that may leave; each is demoted to the next tier its lifetime allows (its copy below written
first), else dropped; a copy below that fails drops a leaf of the whole store like any victim and
keeps a block with cached children where it is. Quota room drops the account's own leaves, bottom
tier first. A drop on request (delete, expiry, end of request) takes a block with its descendants
only when none of them is held.

``keep_spillable = (upper, lower)``: a block is written to either only while the lower tier can
take, for real (``Tier.shortfall``: capacity, free space of its filesystem, its journal), every
block of the upper one and this one -- what a graceful shutdown spills down; else the lower tier's
own victims leave, then the upper one's leaves (only where that makes the room), else TierFullError.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from kvport.errors import (
    BlockNotFoundError,
    CorruptBlockError,
    QuotaExceededError,
    TierError,
    TierFullError,
    TierUnavailableError,
)
from kvport.metrics import counter
from kvport.store.catalog import Catalog, Meta
from kvport.store.guard import Busy
from kvport.store.types import TierPolicy
from kvport.tiers.base import Tier

log = logging.getLogger(__name__)

_EVICTIONS = counter("store_evictions_total", "Blocks evicted from a tier", ["tier", "action"])


class Mover:
    def __init__(self, catalog: Catalog, busy: Busy, tier_policies: Mapping[str, TierPolicy],
                 quotas: Mapping[str, int], keep_spillable: tuple[str, str] | None) -> None:
        self._cat = catalog
        self._records = catalog.records
        self._idx = catalog.idx
        self._tiers = catalog.tiers
        self._names = catalog.names
        self._health = catalog.health
        self._ledger = catalog.ledger
        self._clock = catalog.clock
        self._busy = busy
        self._tier_policies = tier_policies
        self._quotas = quotas
        self._keep_spillable = keep_spillable

    # ------------------------------------------------------------------ the rule
    def held(self, key: bytes, now: float) -> bool:
        """Somebody keeps ``key``: it is being written (or is the parent of a block being written or
        reserved), pinned or leased."""
        return key in self._busy.keys or key in self._cat.in_flight_parents or \
            (self._ledger.knows(key) and not self._ledger.is_evictable(key, now))

    def may_leave(self, key: bytes, tier: str | None = None) -> bool:
        """May ``key`` leave ``tier`` (None: the store)? See the module docstring."""
        if self.held(key, self._clock()) or not self._ledger.knows(key):
            return False
        if tier is not None and (self.lower_target(tier, key) is not None or self._cat.elsewhere(key, tier)):
            return True  # it stays in the store
        return not self._cat.has_children(key)

    def lower_target(self, name: str, key: bytes) -> str | None:
        """The next tier below ``name`` that ``key``'s lifetime allows and that works (or holds it)."""
        allowed = self._cat.policy.tiers_for(self._records[key].lifetime, self._names)
        below = [n for n in allowed if self._names.index(n) > self._names.index(name)]
        for n in below:
            if key in self._idx[n] or self._health.healthy(self._tiers[n]):
                return n
        return None

    # ------------------------------------------------------------------ writes that make room
    def write(self, name: str, key: bytes, parts: Sequence[memoryview], m: Meta, *,
              evict_when_full: bool = True) -> None:
        """Write one block (a record) into tier ``name``, room made first by its eviction order. A
        tier of this store's own (not shared) that runs out of room before its accounting says so (a
        disk whose filesystem is full: ENOSPC) makes room the same way, its least valuable leaves
        first, until the write fits or nothing more may leave (``evict_when_full=False``: nothing is
        evicted for it, neither to its watermark nor on ENOSPC)."""
        t = self._tiers[name]
        if not self._health.healthy(t):
            raise TierUnavailableError(f"{name} is marked broken")
        n = parts[0].nbytes if len(parts) == 1 else sum(p.nbytes for p in parts)
        charge = t.charge(n)
        short = self.spill_short(name, key, charge) if evict_when_full else 0
        if short:
            up, low = self._keep_spillable or (name, name)
            raise TierFullError(f"{name}: {low} could not take this block with those of {up} at a graceful "
                                f"shutdown ({short} bytes short)")
        if evict_when_full:
            self.make_room(name, charge)
        ttl = self.native_ttl(t, m)
        while True:
            try:
                if t.caps.block_meta or t.caps.pool_records or len(parts) != 1:
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
        self._cat.written(name, key, n, charge)

    def write_many(self, name: str, srcs: list[tuple[bytes, memoryview]]) -> None:
        """Write a chain of records into tier ``name`` with one batched call (one disk slab)."""
        t = self._tiers[name]
        if t.caps.block_meta:  # the tier keeps (or forwards) each block's metadata: one block at a time
            for k, v in srcs:
                self.write(name, k, (v,), self._records[k])
            return
        if not self._health.healthy(t):
            raise TierUnavailableError(f"{name} is marked broken")
        charges = [t.charge(v.nbytes) for _, v in srcs]
        if self.spill_short(name, None, sum(charges), len(srcs)):
            raise TierFullError(f"{name}: no room to keep {len(srcs)} blocks through a graceful shutdown")
        self.make_room(name, sum(charges))
        try:
            ttl = self.native_ttl(t, self._records[srcs[0][0]])
            if t.caps.pool_records:
                t.put_many_meta(srcs, [self._records[k].block_meta() for k, _ in srcs], ttl_s=ttl)
            else:
                t.put_many(srcs, ttl_s=ttl)
        except TierUnavailableError as exc:
            self._health.mark_broken(t, exc)
            raise
        for (k, v), charge in zip(srcs, charges, strict=True):
            self._cat.written(name, k, v.nbytes, charge)

    def native_ttl(self, t: Tier, m: Meta) -> float | None:
        """The TTL a tier with its own expiry (Redis) gets for the block."""
        return self._cat.policy.idle_ttl(m.lifetime, m.ttl_s) if t.caps.native_ttl else None

    def copy_down(self, src_name: str, dst_name: str, key: bytes, m: Meta, *, evict_when_full: bool = True) -> None:
        src = self._tiers[src_name]
        if src.caps.zero_copy_read:  # the source's own pages go straight to the write below
            self.write(dst_name, key, src.read_views(key), m, evict_when_full=evict_when_full)
            return
        buf = bytearray(m.size)
        n = src.get_into(key, buf)
        self.write(dst_name, key, (memoryview(buf)[:n],), m, evict_when_full=evict_when_full)

    # ------------------------------------------------------------------ eviction and demotion
    def make_room(self, name: str, charge: int) -> None:
        """Evict from ``name`` down to its low watermark when ``charge`` more would pass its high one."""
        ix = self._idx[name]
        pol = self._tier_policies[name]
        if ix.used + charge <= pol.high_watermark * ix.capacity:
            return
        target = pol.low_watermark * ix.capacity - charge
        self.evict(name, ix.used - target)

    def evict(self, name: str, nbytes: float) -> int:
        """Free at least ``nbytes`` of ``name`` (demoting or dropping leaves); returns bytes freed."""
        freed = 0
        kept: set[bytes] = set()
        ix = self._idx[name]
        for k in ix.victims(lambda k: k not in kept and self.may_leave(k, name)):
            if freed >= nbytes:
                break
            before = ix.used
            if self.demote(name, k) == name:
                kept.add(k)  # could not move down now: not a victim again in this pass
            freed += before - ix.used
        return freed

    def demote(self, name: str, key: bytes) -> str | None:
        """Move ``key`` down (its copy below is written first, then this one goes), or drop it when
        no tier below may hold it. When the copy below fails (that tier full of blocks that may not
        leave, or down), a leaf of the whole store is dropped like any evicted block; a block with
        cached children stays where it is (returns ``name``): eviction never strands a child.
        Returns the tier it moved to, None when dropped."""
        m = self._records[key]
        target = self.lower_target(name, key)
        if target is not None and key not in self._idx[target]:
            try:
                self.copy_down(name, target, key, m)
            except (TierFullError, TierUnavailableError):
                if not self._cat.elsewhere(key, name) and self._cat.has_children(key):
                    _EVICTIONS.labels(name, "kept").inc()
                    return name
                target = None
            except (BlockNotFoundError, CorruptBlockError):  # this copy is bad: nothing to keep
                target = None
        if target is None and self._cat.elsewhere(key, name):
            target = next(n for n in self._names if n != name and key in self._idx[n])
        if target is None:
            _EVICTIONS.labels(name, "drop").inc()
            self._cat.drop(key)
            return None
        _EVICTIONS.labels(name, "demote").inc()
        self._cat.counts[name].demotions += 1
        self._cat.forget_in(name, key)
        return target

    # ------------------------------------------------------------------ quotas
    def quota_room(self, account: str | None, charge: int) -> None:
        """Make ``charge`` bytes of room under ``account``'s quota by dropping its own leaves that may
        leave (least valuable first, bottom tier first); QuotaExceededError when it cannot."""
        limit = None if account is None else self._quotas.get(account)
        if limit is None or account is None:
            return
        if charge > limit:
            raise QuotaExceededError(f"{charge} bytes can never fit {account}'s quota of {limit}")
        need = self._cat.usage.get(account, 0) + charge - limit
        for name in reversed(self._names):
            if need <= 0:
                return
            for k in self._idx[name].victims(lambda k: self._records[k].account == account and self.may_leave(k)):
                if need <= 0:
                    break
                need -= self._records[k].charged
                _EVICTIONS.labels(name, "quota").inc()
                self._cat.drop(k)
        if need > 0:
            raise QuotaExceededError(f"{account}'s quota of {limit} bytes is full of pinned or leased blocks")

    # ------------------------------------------------------------------ drops on request
    def try_drop(self, key: bytes) -> bool:
        """Drop ``key`` and its cached descendants, unless any of them is held."""
        if self._held_below(key, self._clock()):
            return False
        self._cat.drop(key)
        return True

    def drop_unreadable(self, key: bytes) -> None:
        """``key``'s bytes are gone from every tier (damaged, lost): drop it with its descendants,
        except a descendant that is held, or has a held block below it: its bytes are intact and
        somebody holds it. It stays linked to ``key`` (listed by ``inspect --leaks`` as kept without
        its parent); when ``key`` is stored again (an engine recomputes the prefix and saves it) the
        chain is whole again."""
        m = self._records.get(key)
        if m is None:
            return
        now = self._clock()
        for c in [c for c in m.children if c in self._records and self._held_below(c, now)]:
            self._cat.keep_orphaned(key, c)
        self._cat.drop(key)

    def _held_below(self, key: bytes, now: float) -> bool:
        """``key`` or one of its descendants is held."""
        stack = [key]
        while stack:
            k = stack.pop()
            if self.held(k, now):
                return True
            stack.extend(c for c in self._records[k].children if c in self._records)
        return False

    # ------------------------------------------------------------------ keep_spillable and spill
    def spill_short(self, name: str, key: bytes | None, charge: int, values: int = 1) -> int:
        """Bytes the lower tier of ``keep_spillable`` lacks, now, to take every block of the upper one
        plus this write of ``charge`` into ``name`` (0: it may go ahead). A copy between the two (a
        demotion, a promotion, a write behind) changes nothing and is not checked. Room is made
        first by evicting the lower tier's own victims (as its eviction would: they are older than
        anything above), then by the upper tier's leaves leaving the store, in its eviction order
        -- but only when their leaving would make the room: a write refused costs no upper block."""
        if self._keep_spillable is None or name not in self._keep_spillable:
            return 0
        up, low = self._keep_spillable
        if key is not None and key in self._idx[low if name == up else up]:
            return 0
        ix = self._idx[up]
        values += len(ix) + sum(1 for r in self._cat.reserved.values() if r.tier == up)
        lower = self._tiers[low]
        try:
            short = lower.shortfall(ix.used + charge, values)
            while short > 0 and self.evict(low, short) > 0:  # a slab's room comes back with its last block
                short = lower.shortfall(ix.used + charge, values)
            if short <= 0 or lower.shortfall(charge, 1) > 0:
                return short  # fits, or would not fit even alone (a full journal): nothing more leaves
            freed, leaving = self._leavable(up, low)
            if lower.shortfall(ix.used - freed + charge, values - leaving) > 0:
                return short  # would not fit with every leaf of ``up`` gone: none leaves for nothing
            for k in ix.victims(self.may_leave):  # the upper tier's own leaves leave the store
                if k in self._idx[low]:
                    self._cat.forget_in(up, k)
                else:
                    _EVICTIONS.labels(up, "spill_room").inc()
                    self._cat.drop(k)
                values -= 1
                short = lower.shortfall(ix.used + charge, values)
                if short <= 0:
                    break
        except TierError as exc:  # its room cannot be read (statvfs failed): the write finds out itself
            log.warning("store: room of %s unknown: %s", low, exc)
            return 0
        return short

    def _leavable(self, up: str, low: str) -> tuple[int, int]:
        """(charged bytes, blocks) of ``up`` that the loop of :meth:`spill_short` could take away:
        each block not held whose cached descendants all leave the store with it (a parent becomes a
        leaf only once its children are gone, and a child also held by ``low`` stays in the store)."""
        ix, below = self._idx[up], self._idx[low]
        now = self._clock()
        goes: dict[bytes, bool] = {}
        for root in ix:
            stack = [(root, False)]
            while stack:
                k, expanded = stack.pop()
                if k in goes:
                    continue
                kids = [c for c in self._records[k].children if c in self._records]
                if not expanded:
                    stack.append((k, True))
                    stack.extend((c, False) for c in kids if c not in goes)
                    continue
                goes[k] = (k in ix and not self.held(k, now) and self._ledger.knows(k)
                           and all(goes[c] and c not in below for c in kids))
        gone = [k for k, ok in goes.items() if ok]
        return sum(ix.size_of(k) or 0 for k in gone), len(gone)

    def spill(self, from_tier: str) -> tuple[int, int]:
        """Demote every block of ``from_tier`` to the next tier its lifetime allows; (moved, stayed)."""
        moved = stayed = 0
        for k in self._spill_order(from_tier):
            if k not in self._idx[from_tier] or k not in self._records:
                continue
            target = self.lower_target(from_tier, k)
            if target is None:
                stayed += 1
                continue
            ix = self._idx[target]
            if k not in ix and ix.used + self._tiers[target].charge(self._records[k].size) > ix.capacity:
                stayed += 1  # no free room below: what is there is not evicted for it
                continue
            if k not in ix:
                try:
                    self.copy_down(from_tier, target, k, self._records[k], evict_when_full=False)
                except TierError:
                    stayed += 1
                    continue
            self._cat.counts[from_tier].demotions += 1
            self._cat.forget_in(from_tier, k)
            moved += 1
        return moved, stayed

    def _spill_order(self, from_tier: str) -> list[bytes]:
        """``from_tier``'s blocks in the order :meth:`spill` moves them: first those a block of a lower
        tier descends from, parents before children (one that stayed for want of room would leave
        its descendants below without their parent, dropped at the next start), then the rest,
        newest first."""
        ix = self._idx[from_tier]
        below = self._names[self._names.index(from_tier) + 1 :]
        depth: dict[bytes, int] = {}
        for name in below:
            for k in self._idx[name]:
                m = self._records.get(k)
                chain: list[bytes] = []
                p = None if m is None else m.parent
                while p is not None and p in ix and p not in depth and p in self._records:
                    chain.append(p)
                    p = self._records[p].parent
                base = -1 if p is None else depth.get(p, -1)
                for j, a in enumerate(reversed(chain)):  # the top of the chain first
                    depth[a] = base + 1 + j
        first = sorted(depth, key=depth.__getitem__)
        return first + [k for k in ix.keys()[::-1] if k not in depth]

