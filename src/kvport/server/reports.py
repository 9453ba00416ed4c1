"""What ``kvport inspect`` shows: usage (STATS), who holds which block (OWNERS), leaks (LEAKS).

Every answer is built from the store and the ledger, never from a copy of them. A tenant sees only
its own blocks, rows and counts, per tier too (used bytes and blocks: its own); an admin tenant
sees every tenant and the server-wide figures (per-tier use, staging in flight), as /metrics shows
them to the operator. Server-wide capacities are visible to every tenant (they say nothing about
another tenant's blocks). Blocks are named by the
client's key (hex); a "prefix" is named by its last block's chained key, which fixes the whole
prefix before it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from kvport.ledger import Lease, Owner, Pin
from kvport.lifetime import Lifetime
from kvport.protocol.server import (
    MAX_ROWS,
    BlockOwners,
    LeaksAnswer,
    LeaseRow,
    OwnersAnswer,
    PinRow,
    PrefixRow,
    ServerUsage,
    StatsAnswer,
    TenantUsage,
    TierUsage,
)
from kvport.server.state import ServerState
from kvport.server.storage import Attrs
from kvport.server.tenants import Tenant

TOP = 10


def _tenant_of(srv: ServerState, skey: bytes) -> str | None:
    meta = srv.store.meta_of(skey)
    return None if meta is None else meta.account


def _client_key(srv: ServerState, skey: bytes) -> str:
    meta = srv.store.meta_of(skey)
    return "" if meta is None else Attrs.decode(meta.attrs).client_key.hex()


def _visible(holder: Owner, tenant: Tenant) -> bool:
    return tenant.admin or holder.id.split("/", 1)[0] == tenant.name


def _pin_row(p: Pin, now: float, key: str = "") -> PinRow:
    return PinRow(str(p.holder)[:128], p.reason, round(now - p.since, 3),
                  None if p.expires_at is None else round(p.expires_at - now, 3), p.count, key)


def _lease_row(ls: Lease, now: float) -> LeaseRow:
    return LeaseRow(ls.lease_id, str(ls.holder)[:128], len(ls.keys), round(ls.expires_at - now, 3))


def _mine(srv: ServerState, tenant: Tenant) -> list[bytes]:
    return [k for k in srv.store.blocks() if tenant.admin or _tenant_of(srv, k) == tenant.name]


def stats(srv: ServerState, tenant: Tenant, brief: bool, list_keys: bool) -> StatsAnswer:
    store = srv.store
    capacity = sum(t.capacity_bytes for t in store.tiers.values())
    used, _ = store.usage(tenant.name)
    keys: tuple[bytes, ...] = ()
    if list_keys:
        mine = [Attrs.decode(m.attrs).client_key for m in (store.meta_of(k) for k in store.blocks())
                if m is not None and m.account == tenant.name]
        keys = tuple(mine[:MAX_ROWS])
    if brief:
        return StatsAnswer(capacity, tenant.quota_bytes, used, keys=keys)
    now = time.monotonic()
    st = store.stats()
    conns: dict[str, int] = {}
    for who in srv.logged_in.values():
        conns[who.name] = conns.get(who.name, 0) + 1
    tenants = []
    for name in srv.tenants.names():
        if not tenant.admin and name != tenant.name:
            continue
        t = srv.tenants.get(name)
        b, n = store.usage(name)
        tenants.append(TenantUsage(name, b, n, None if t is None else t.quota_bytes, conns.get(name, 0)))
    srv.hits.prune()
    mine_set = set(_mine(srv, tenant))
    top_rows = [PrefixRow(_tenant_of(srv, k) or "", _client_key(srv, k), n, store.size_of(k) or 0,
                          (store.where(k) or ("",))[0]) for k, n in srv.hits.top(mine_set, TOP)]
    pins = [_pin_row(p, now, _client_key(srv, p.key)) for p in srv.ledger.pins() if p.key in mine_set][:MAX_ROWS]
    leases = [_lease_row(ls, now) for ls in srv.ledger.leases() if _visible(ls.holder, tenant)][:MAX_ROWS]
    if tenant.admin:
        tier_used, tier_blocks = st.used_bytes, st.blocks
    else:  # a tenant's own: other tenants' use of a tier is theirs to know
        tier_used, tier_blocks = dict.fromkeys(store.names, 0), dict.fromkeys(store.names, 0)
        for k in mine_set:
            size = store.size_of(k) or 0
            for tier in store.where(k):
                tier_used[tier] += store.tiers[tier].charge(size)
                tier_blocks[tier] += 1
    server = ServerUsage(
        tiers=tuple(TierUsage(n, tier_used[n], store.tiers[n].capacity_bytes, tier_blocks[n]) for n in store.names),
        page_bytes=srv.page_bytes, connections=len(srv.logged_in) if tenant.admin else conns.get(tenant.name, 0),
        staging_bytes=srv.pool.allocated if tenant.admin else 0, draining=srv.draining,
        uptime_s=round(now - srv.started, 3))
    return StatsAnswer(capacity, tenant.quota_bytes, used, server, tuple(tenants), tuple(top_rows), tuple(pins),
                       tuple(leases), keys)


def _owners_row(srv: ServerState, skey: bytes, now: float) -> BlockOwners | None:
    store, led = srv.store, srv.ledger
    meta = store.meta_of(skey)
    if meta is None:
        return None
    rec = led.record(skey) if led.knows(skey) else None
    parent = meta.parent
    exp = store.expires_at(skey)
    return BlockOwners(
        key=Attrs.decode(meta.attrs).client_key.hex(), tenant=meta.account or "",
        owner=str(rec.owner) if rec else "(none)", state=rec.state.value if rec else "(no record)",
        since_s=round(now - rec.since, 3) if rec else 0.0,
        handed_off_by=str(rec.origin)[:128] if rec and rec.origin else "",
        lifetime=meta.lifetime or Lifetime.PREFIX, expires_in_s=None if exp is None else round(exp - now, 3),
        tiers=store.where(skey), length=store.size_of(skey) or 0,
        parent="" if parent is None else _client_key(srv, parent), children=store.children_of(skey),
        pins=tuple(_pin_row(p, now) for p in rec.pins) if rec else (),
        leases=tuple(_lease_row(ls, now) for ls in rec.leases) if rec else ())


def owners(srv: ServerState, tenant: Tenant, keys: Iterable[bytes], prefix: str) -> OwnersAnswer:
    """Rows for the tenant's blocks named by ``keys``; a single key also brings the chain it ends
    (its ancestors, root first); ``prefix``: every block whose client key starts with that hex."""
    now = time.monotonic()
    want: list[bytes] = []
    ks = list(keys)
    for k in ks:
        sk = srv.tenants.storage_key(tenant.name, k)
        if len(ks) == 1:  # the prefix this key ends: walk up the chain
            chain: list[bytes] = []
            cur: bytes | None = sk
            while cur is not None and cur in srv.store and len(chain) < MAX_ROWS:
                chain.append(cur)
                cur = srv.store.parent_of(cur)
            want.extend(reversed(chain))
        else:
            want.append(sk)
    if prefix:
        p = prefix.lower()
        want.extend(k for k in _mine(srv, tenant) if _client_key(srv, k).startswith(p))
    rows = [r for r in (_owners_row(srv, k, now) for k in want[:MAX_ROWS]) if r is not None]
    return OwnersAnswer(tuple(rows), truncated=len(want) > MAX_ROWS)


def leaks(srv: ServerState, tenant: Tenant) -> LeaksAnswer:
    """Pins and leases past their TTL that the reaper has not removed yet, blocks stored without a
    ledger record (no owner), ledger records whose bytes are gone, and children kept without their
    parent. All empty on a healthy server."""
    now = time.monotonic()
    store, led = srv.store, srv.ledger
    mine = _mine(srv, tenant)
    rep = led.leak_report(now)
    mine_set = set(mine)
    stale = tuple(_pin_row(p, now, _client_key(srv, p.key)) for p in rep.stale_pins if p.key in mine_set)
    expired = tuple(_lease_row(ls, now) for ls in rep.expired_leases if _visible(ls.holder, tenant))
    without = tuple(_client_key(srv, k) for k in mine if not led.knows(k))
    unstored = tuple(k.hex() for k in led.blocks() if k not in store and (tenant.admin or False))
    orphans = tuple(_client_key(srv, k) for k in mine if (p := store.parent_of(k)) is not None and p not in store)
    meta_orphans = tuple(_client_key(srv, k) for k in mine
                         if (m := store.meta_of(k)) is not None and m.parent is not None and m.parent not in store)
    return LeaksAnswer(stale[:MAX_ROWS], expired[:MAX_ROWS], without[:MAX_ROWS], unstored[:MAX_ROWS],
                       tuple(dict.fromkeys(orphans + meta_orphans))[:MAX_ROWS])
