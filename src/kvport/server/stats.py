"""The STATS answer (what ``kvport inspect`` prints): usage, tenants, top prefixes, pins, leases.

A non-admin tenant sees only its own rows; server-wide totals are visible to every tenant. A
"prefix" is named by its last block's client key: a chained key fixes the whole prefix before it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvport.server.handlers import Handlers

TOP = 10


def build_stats(h: Handlers, only: str | None) -> dict[str, Any]:
    cat = h.store.catalog
    now = time.monotonic()
    mine = [(sk, e) for sk, e in cat.items() if only is None or e.tenant == only]
    conns: dict[str, int] = {}
    for c in h.connections.values():
        if c.tenant is not None:
            conns[c.tenant.name] = conns.get(c.tenant.name, 0) + 1
    tenants = []
    for name in h.tenants.names():
        if only is not None and name != only:
            continue
        t = h.tenants.get(name)
        tenants.append({"name": name, "bytes": cat.usage.get(name, 0), "blocks": cat.blocks.get(name, 0),
                        "quota": None if t is None else t.quota_bytes, "connections": conns.get(name, 0)})
    top = sorted(mine, key=lambda kv: kv[1].hits, reverse=True)[:TOP]
    return {
        "server": {"host_capacity": cat.host_capacity, "host_used": cat.host_used,
                   "disk_capacity": cat.disk_capacity, "disk_used": cat.disk_used, "blocks": len(cat),
                   "page_bytes": h.store.page_bytes, "connections": len(h.connections),
                   "staging_bytes": h.pool.allocated, "draining": h.draining,
                   "uptime_s": round(now - h.started, 3)},
        "tenants": tenants,
        "top_prefixes": [{"tenant": e.tenant, "key": e.client_key.hex(), "hits": e.hits, "bytes": e.length,
                          "place": e.place.value} for _, e in top],
        "pins": [{"tenant": e.tenant, "key": e.client_key.hex(), "pins": e.pins} for _, e in mine if e.pins],
        "leases": [{"lease": ls.lease_id, "tenant": ls.tenant, "blocks": len(ls.skeys),
                    "expires_in_s": round(ls.expires_at - now, 3)}
                   for ls in cat.leases() if only is None or ls.tenant == only],
    }
