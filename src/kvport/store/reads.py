"""Reads: lookup's longest prefix, a block's bytes from the top healthy tier holding it, and promotion.

::

    lookup(keys)   --> the longest prefix held by healthy tiers (a miss probes the shared tiers; what
                       only a shared tier's index vouches for is confirmed there); the hit prefix is
                       touched last-block-first, so parents stay as recent as children
    read(key, fn)  --> fn(tier) on the top healthy tier holding it; a tier that lost it or whose bytes
                       fail their check forgets it and the next one serves; a hit below the block's
                       top allowed tier is promoted (written up, best effort); gone from every tier:
                       dropped with its descendants (those somebody holds stay, as orphans)
    get_many(items)  runs of keys in the same tier read with one batched tier call
    views(key)     --> read-only views of the top tier's own memory (``caps.zero_copy_read``)

Every read counts its bytes out and is a hit (eviction order and idle time start over). All of it
runs under the store's lock (the caller holds it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

from kvport.deadline import Deadline
from kvport.errors import BlockNotFoundError, CorruptBlockError, TierFullError, TierUnavailableError
from kvport.store.catalog import MISSES, Catalog
from kvport.store.mover import Mover
from kvport.store.shared import SharedView
from kvport.store.types import LookupResult, ReadViews
from kvport.tiers.base import Buffer, Tier, byte_view


class Reads:
    def __init__(self, catalog: Catalog, mover: Mover, shared: SharedView) -> None:
        self._cat = catalog
        self._records = catalog.records
        self._mover = mover
        self._shared = shared
        self._try_drop = mover.try_drop

    def lookup(self, ks: tuple[bytes, ...]) -> LookupResult:
        cat, records, shared = self._cat, self._records, self._shared
        cat.expiry.expire(self._try_drop)
        tiers: list[str] = []
        sizes: list[int] = []
        asked = len(ks)  # keys from here on were just confirmed by the shared tiers
        for i, k in enumerate(ks):
            where = cat.where(k)
            if where is None and shared.probe(ks, i):
                asked = min(asked, i)
                where = cat.where(k)
            if where is None:
                break
            tiers.append(where)
            sizes.append(records[k].size)
        n = shared.confirm(ks, tiers, min(asked, len(tiers)))
        del tiers[n:], sizes[n:]
        for k, name in zip(reversed(ks[:n]), reversed(tiers), strict=True):
            cat.touch(k, name)
        for name in tiers:
            c = cat.counts[name]
            c.hits += 1
            c.hit()
        cat.misses += len(ks) - n
        MISSES.inc(len(ks) - n)
        return LookupResult(ks, n, tuple(tiers), tuple(sizes))

    def read(self, key: bytes, read: Callable[[Tier], memoryview], deadline: Deadline | None = None) -> int:
        cat = self._cat
        if key not in self._records and not self._shared.probe((key,), 0):
            raise BlockNotFoundError(f"store has no block {key.hex()}")
        for name in cat.names:
            if key not in cat.idx[name]:
                continue
            if deadline is not None:
                deadline.check(f"read of block {key.hex()}")
            t = cat.tiers[name]
            if not cat.health.healthy(t):
                continue
            try:
                data = read(t)
            except (BlockNotFoundError, CorruptBlockError):
                cat.forget_in(name, key)
                continue
            except TierUnavailableError as exc:
                cat.health.mark_broken(t, exc)
                continue
            cat.read_out(name, data.nbytes)
            cat.touch(key, name)
            self._promote(key, name, data)
            return data.nbytes
        if key in self._records and not any(key in ix for ix in cat.idx.values()):
            self._mover.drop_unreadable(key)
        raise BlockNotFoundError(f"no working tier holds block {key.hex()}")

    def _promote(self, key: bytes, found_in: str, data: memoryview) -> None:
        m = self._records.get(key)
        if m is None:
            return
        names = self._cat.names
        allowed = self._cat.policy.tiers_for(m.lifetime, names)
        if not allowed or names.index(allowed[0]) >= names.index(found_in):
            return
        with contextlib.suppress(TierFullError, TierUnavailableError):
            self._mover.write(allowed[0], key, (data,), m)

    def get_into(self, key: bytes, dst: Buffer) -> int:
        def read(t: Tier) -> memoryview:
            return byte_view(dst)[: t.get_into(key, dst)]

        return self.read(key, read)

    def get_many(self, items: Sequence[tuple[bytes, Buffer]], deadline: Deadline | None) -> list[int | None]:
        cat, records = self._cat, self._records
        out: list[int | None] = [None] * len(items)
        missing = [i for i, (k, _) in enumerate(items) if k not in records]
        if missing:
            self._shared.probe(tuple(items[i][0] for i in missing), 0)
        run: list[int] = []
        run_tier: str | None = None

        def flush() -> None:
            if run_tier is None or not run or (deadline is not None and deadline.expired):
                return
            t = cat.tiers[run_tier]
            try:
                got = t.get_many_into([items[i] for i in run])
            except TierUnavailableError as exc:
                cat.health.mark_broken(t, exc)
                got = [None] * len(run)
            for i, n in zip(run, got, strict=True):
                key = items[i][0]
                if n is None:
                    cat.forget_in(run_tier, key)
                    try:  # a copy in another tier still serves it
                        out[i] = self.get_into(key, items[i][1])
                    except BlockNotFoundError:
                        out[i] = None
                    continue
                if key not in records:  # dropped meanwhile with a parent that failed its check
                    continue
                out[i] = n
                cat.read_out(run_tier, n)
                cat.touch(key, run_tier)

        for i, (k, _) in enumerate(items):
            where = cat.where(k) if k in records else None
            if where != run_tier:
                flush()
                run, run_tier = [], where
            if where is not None:
                run.append(i)
        flush()
        return out

    def views(self, key: bytes) -> ReadViews | None:
        cat = self._cat
        if key not in self._records:
            raise BlockNotFoundError(f"store has no block {key.hex()}")
        name = cat.where(key)
        if name is None:
            raise BlockNotFoundError(f"no working tier holds block {key.hex()}")
        t = cat.tiers[name]
        if not t.caps.zero_copy_read:
            return None
        try:
            views = t.read_views(key)
        except (BlockNotFoundError, CorruptBlockError):
            cat.forget_in(name, key)
            raise BlockNotFoundError(f"{name} lost block {key.hex()}") from None
        n = sum(v.nbytes for v in views)
        cat.read_out(name, n)
        cat.touch(key, name)
        return ReadViews(name, n, tuple(views))
