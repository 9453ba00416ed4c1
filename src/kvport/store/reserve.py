"""Zero-copy writes: room for a block reserved in a tier's own memory, filled in place, then committed.

::

    reserve(key, n) --> the first allowed tier with ``caps.zero_copy_write`` that works and has room
                        (quota room and eviction first, as for a put): writable views of its pages;
                        the room is counted in its index at once (``used``) but the block is no entry,
                        so never a victim, and its parent may not leave meanwhile (in_flight_parents)
    commit(res)     --> the tier links the pages under the key: the block becomes a record, admitted
    abort(res)      --> the pages go back; nothing of the block was ever visible

A key reserved is neither held nor absent: a put or a second reserve of it is refused (TierFullError)
until its commit or abort.
"""

from __future__ import annotations

from kvport.errors import IllegalMoveError, TierFullError
from kvport.ledger import Owner
from kvport.lifetime import Lifetime
from kvport.store.catalog import Catalog
from kvport.store.guard import Busy
from kvport.store.mover import Mover
from kvport.store.types import Reserved

_NONE: frozenset[bytes] = frozenset()


class ZeroCopy:
    """Reservations, under the store's lock (the caller holds it)."""

    def __init__(self, catalog: Catalog, mover: Mover, busy: Busy) -> None:
        self._cat = catalog
        self._mover = mover
        self._busy = busy
        self._reserved = catalog.reserved
        self._in_flight = catalog.in_flight_parents

    def reserve(self, key: bytes, nbytes: int, lifetime: Lifetime, parent: bytes | None, owner: Owner | None,
                request_id: str | None, account: str | None, ttl_s: float | None,
                origin: Owner | None) -> Reserved | None:
        cat = self._cat
        if key in cat.records or key in self._reserved:
            raise TierFullError(f"block {key.hex()} is already held or being written")
        allowed = cat.policy.tiers_for(lifetime, cat.names)
        parent = parent if (parent in cat.records and parent != key) else None
        charged = cat.charge_for(allowed, nbytes)
        with self._busy({parent} if parent is not None else _NONE):
            self._mover.quota_room(account, charged)
            for name in allowed:
                t = cat.tiers[name]
                if not t.caps.zero_copy_write or not cat.health.healthy(t):
                    continue
                charge = t.charge(nbytes)
                if self._mover.spill_short(name, key, charge):
                    continue
                self._mover.make_room(name, charge)
                ix = cat.idx[name]
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
                    self._in_flight[parent] = self._in_flight.get(parent, 0) + 1
                return res
            return None

    def commit(self, res: Reserved, attrs: bytes) -> str:
        cat = self._cat
        self._end(res)
        m = cat.record(res.key, res.lifetime, res.parent, res.nbytes, request_id=res.request_id, account=res.account,
                       charged=cat.charge_for(cat.policy.tiers_for(res.lifetime, cat.names), res.nbytes),
                       ttl_s=res.ttl_s, attrs=attrs)
        cat.tiers[res.tier].commit(res.key, m.block_meta())
        cat.records[res.key] = m
        cat.written(res.tier, res.key, res.nbytes, res.charge)
        cat.admit(res.key, m, res.owner, res.origin)
        return res.tier

    def abort(self, res: Reserved) -> None:
        self._end(res)
        self._cat.tiers[res.tier].abort(res.key)

    def _end(self, res: Reserved) -> None:
        if self._reserved.get(res.key) is not res:
            raise IllegalMoveError(f"block {res.key.hex()} has no open reservation")
        del self._reserved[res.key]
        self._cat.idx[res.tier].used -= res.charge
        if res.parent is not None:
            n = self._in_flight.get(res.parent, 0) - 1
            if n > 0:
                self._in_flight[res.parent] = n
            else:
                self._in_flight.pop(res.parent, None)
