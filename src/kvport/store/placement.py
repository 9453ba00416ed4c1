"""Placement: where a put lands -- the first tier its lifetime allows that takes it, then the copies below.

::

    put(key, data, lifetime) --> held already: touched (keys are content hashes), lifetime raised
                             --> else: quota room for its account (Mover.quota_room), then the first
                                 allowed tier that takes it (room made by its eviction order), then
                                 every lower allowed tier by its WriteMode: THROUGH written now (best
                                 effort), BEHIND queued for the write-behind thread, BACK nothing
    put_many(chain)          --> the same with one batched write per tier (one disk slab); a chain
                                 with a block already held, or that no tier takes whole: put by put

While a block is written, it and its parent are busy (:class:`~kvport.store.guard.Busy`): the room
made for it never takes its parent. Its record is in the catalog provisionally meanwhile (the index
entries link to the parent) and admitted only once a tier holds it; a put that fails leaves nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from kvport.errors import TierFullError, TierUnavailableError
from kvport.ledger import Owner
from kvport.lifetime import Lifetime
from kvport.store.behind import WriteBehind
from kvport.store.catalog import Catalog
from kvport.store.guard import Busy, around
from kvport.store.mover import Mover
from kvport.store.types import TierPolicy, WriteMode


class Placement:
    """Puts, under the store's lock (the caller holds it)."""

    def __init__(self, catalog: Catalog, mover: Mover, busy: Busy, tier_policies: Mapping[str, TierPolicy],
                 behind: WriteBehind | None) -> None:
        self._cat = catalog
        self._records = catalog.records
        self._mover = mover
        self._try_drop = mover.try_drop
        self._busy = busy
        self._policies = tier_policies
        self._behind = behind

    def put(self, key: bytes, src: memoryview, lifetime: Lifetime, parent: bytes | None, owner: Owner | None,
            request_id: str | None, account: str | None, ttl_s: float | None, attrs: bytes,
            origin: Owner | None) -> str:
        cat, records = self._cat, self._records
        cat.expiry.expire(self._try_drop)
        m = records.get(key)
        if m is not None:
            if lifetime.rank > m.lifetime.rank:
                m.lifetime = lifetime
                cat.expiry.start(key, m)
            where = cat.where(key)
            if where is not None:
                cat.touch(key, where)
                return where
            cat.drop(key)
        if key in cat.reserved:
            raise TierFullError(f"block {key.hex()} is being written")
        allowed = cat.policy.tiers_for(lifetime, cat.names)
        parent = parent if (parent in records and parent != key) else None
        charged = cat.charge_for(allowed, src.nbytes)
        placed: str | None = None
        last_exc: Exception | None = None
        with self._busy(around(key, parent)):
            self._mover.quota_room(account, charged)
            m = cat.record(key, lifetime, parent, src.nbytes, request_id=request_id, account=account,
                           charged=charged, ttl_s=ttl_s, attrs=attrs)
            records[key] = m  # provisional: the index entries below link to the parent
            try:
                for name in allowed:
                    if placed is None:
                        try:
                            self._mover.write(name, key, (src,), m)
                            placed = name
                        except (TierFullError, TierUnavailableError) as exc:
                            last_exc = exc
                    elif self._policies[name].write is WriteMode.THROUGH:
                        with contextlib.suppress(TierFullError, TierUnavailableError):
                            self._mover.write(name, key, (src,), m)
                    elif self._policies[name].write is WriteMode.BEHIND and self._behind is not None:
                        self._behind.submit(name, (key,), src.nbytes, wait=False)
            finally:
                if placed is None:
                    del records[key]
        if placed is None:
            raise TierFullError(f"no tier of {allowed} could take block {key.hex()}"
                                + (f": {last_exc}" if last_exc is not None else "")) from last_exc
        cat.admit(key, m, owner, origin)
        return placed

    def put_many(self, srcs: list[tuple[bytes, memoryview]], lifetime: Lifetime, parent: bytes | None,
                 owner: Owner | None, request_id: str | None, account: str | None,
                 ttl_s: float | None) -> list[str]:
        cat, records = self._cat, self._records
        keys = [k for k, _ in srcs]
        cat.expiry.expire(self._try_drop)
        if len(set(keys)) != len(keys) or any(k in records or k in cat.reserved for k in keys) or parent in keys:
            return self._put_chain(srcs, lifetime, parent, owner, request_id, account, ttl_s)
        allowed = cat.policy.tiers_for(lifetime, cat.names)
        charges = [cat.charge_for(allowed, v.nbytes) for _, v in srcs]
        placed: str | None = None
        behind: list[str] = []
        with self._busy(set(keys) | ({parent} if parent is not None else set())):
            self._mover.quota_room(account, sum(charges))
            prev = parent
            for (k, v), ch in zip(srcs, charges, strict=True):  # provisional, chained: index entries link to parents
                records[k] = cat.record(k, lifetime, prev, v.nbytes, request_id=request_id, account=account,
                                        charged=ch, ttl_s=ttl_s)
                prev = k
            try:
                for name in allowed:
                    if placed is not None and self._policies[name].write is WriteMode.BEHIND:
                        behind.append(name)
                    elif placed is None or self._policies[name].write is WriteMode.THROUGH:
                        try:
                            self._mover.write_many(name, srcs)
                            placed = placed or name
                        except (TierFullError, TierUnavailableError):
                            continue
            finally:
                if placed is None:
                    for k in keys:
                        del records[k]
        if placed is None:
            return self._put_chain(srcs, lifetime, parent, owner, request_id, account, ttl_s)
        for k in keys:
            cat.admit(k, records[k], owner, None)
        if self._behind is not None:
            for name in behind:
                self._behind.submit(name, keys, sum(v.nbytes for _, v in srcs), wait=False)
        return [placed] * len(keys)

    def _put_chain(self, srcs: list[tuple[bytes, memoryview]], lifetime: Lifetime, parent: bytes | None,
                   owner: Owner | None, request_id: str | None, account: str | None,
                   ttl_s: float | None) -> list[str]:
        out: list[str] = []
        for k, v in srcs:
            out.append(self.put(k, v, lifetime, parent, owner, request_id, account, ttl_s, b"", None))
            parent = k
        return out
