"""Against a real server process: what leases and pins can make the server hold is bounded, charged
before it is recorded, and refused with a typed error (LeaseError) past the caps."""

from __future__ import annotations

import time

import numpy as np
import psutil
import pytest

from kvport.errors import LeaseError
from kvport.protocol.server import MAX_TTL_S
from kvport.server.limits import ServerLimits

from .conftest import MiB, ServerProc, base_args

LIMITS = ServerLimits()
CHAIN = 64  # blocks of one stored prefix
PER_CLIENT = LIMITS.max_held_per_client  # 65,536: 1,024 leases of the whole chain
PER_TENANT = LIMITS.max_held_per_tenant  # 262,144: four such clients


def _chain(srv: ServerProc) -> list[bytes]:
    c = srv.client(pool_size=1)
    keys = [i.to_bytes(2, "little") * 8 for i in range(CHAIN)]
    parent = None
    for k in keys:
        c.put_value(k, np.full(4096, 1, dtype=np.uint8), parent=parent)
        parent = k
    c.close()
    return keys


def _rss(srv: ServerProc) -> int:
    return int(psutil.Process(srv.pid).memory_info().rss)


def test_empty_and_repeated_key_leases_hold_nothing_extra(server_factory) -> None:  # type: ignore[no-untyped-def]
    """Empty LEASE / LOOKUP lists record nothing; a key named as often as one request can carry
    (3,500 times: 64 KiB of metadata) in one LEASE, PIN or UNPIN counts once; thousands of such
    requests leave the server's memory flat."""
    srv = server_factory(*base_args())
    keys = _chain(srv)
    c = srv.client(pool_size=1, client="repeater")
    rss0 = _rss(srv)
    for _ in range(3000):
        assert c.lease([], ttl_s=MAX_TTL_S) == (None, 0)
        assert c.lookup([], lease_s=MAX_TTL_S).lease_id is None
    assert c.stats().leases == ()  # nothing recorded
    same = [keys[0]] * min(LIMITS.max_keys_per_request, 3500)
    lease_id, held = c.lease(same, ttl_s=MAX_TTL_S)
    assert lease_id is not None and held == 1
    assert c.pin(same) == 1
    assert [p.count for p in c.stats().pins] == [1]
    assert c.unpin(same) == 1 and c.stats().pins == ()
    for _ in range(300):
        c.lease(same, ttl_s=MAX_TTL_S)
    rows = c.stats().leases
    assert len(rows) == 301 and {r.blocks for r in rows} == {1}
    assert max(r.expires_in_s for r in rows) <= LIMITS.max_lease_ttl_s  # the asked 7 days are capped
    assert _rss(srv) - rss0 < 32 * MiB
    c.close()


def test_lease_caps_per_client_and_per_tenant(server_factory) -> None:  # type: ignore[no-untyped-def]
    """LOOKUPs with the longest lease on the whole chain: each client (instance) gets exactly
    PER_CLIENT lease-blocks, then LeaseError; a tenant with many instances gets PER_TENANT in all,
    then LeaseError for every instance (lease, lookup, pin, GET with a lease); the server's memory
    stays bounded meanwhile. Short leases lapse and the room comes back."""
    srv = server_factory(*base_args())
    keys = _chain(srv)
    rss0 = _rss(srv)
    per_client = PER_CLIENT // CHAIN
    clients = [srv.client(pool_size=1, client=f"instance-{i}") for i in range(PER_TENANT // PER_CLIENT + 1)]
    for c in clients[:-1]:
        for _ in range(per_client):
            assert c.lookup(keys, lease_s=MAX_TTL_S).hits == CHAIN
        with pytest.raises(LeaseError, match="per client"):
            c.lookup(keys, lease_s=MAX_TTL_S)
    last = clients[-1]  # a fresh instance of the same tenant
    with pytest.raises(LeaseError, match="per tenant"):
        last.lookup(keys, lease_s=MAX_TTL_S)
    with pytest.raises(LeaseError, match="per tenant"):
        last.lease(keys[:1], ttl_s=1)
    with pytest.raises(LeaseError, match="per tenant"):
        last.pin(keys[:1])
    with pytest.raises(LeaseError, match="per tenant"):
        last.get_leased(keys[0], bytearray(4096), lease_s=1)
    assert last.get_into(keys[0], bytearray(4096)) == 4096  # reads without a kept lease go on
    assert last.lookup(keys).hits == CHAIN
    grew = _rss(srv) - rss0
    assert grew < 192 * MiB, f"{PER_TENANT} lease-blocks took {grew / MiB:.0f} MiB"
    # the first instance lets its leases go: the tenant has room again, for any instance
    first = clients[0]
    for row in first.stats().leases:
        if row.holder.endswith("/instance-0"):
            first.release(row.lease)
    lease_id, held = last.lease(keys, ttl_s=1.0)  # short: lapses by itself
    assert lease_id is not None and held == CHAIN
    end = time.monotonic() + 30
    while any(r.lease == lease_id for r in last.stats().leases):  # reaped within a tick of its TTL
        assert time.monotonic() < end
        time.sleep(0.2)
    for c in clients:
        c.close()
