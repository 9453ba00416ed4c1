"""Against a real server process: what leases and pins can make the server hold is bounded, charged
before it is recorded (to the connection and the tenant, never to the client's own label, and in
record bytes to a budget inside the capacity), and refused with a typed error (LeaseError) past the caps."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest

from kvport.errors import ConfigError, LeaseError
from kvport.ledger import lease_bytes
from kvport.protocol.server import MAX_TTL_S
from kvport.server.held import HELD_SHARE
from kvport.server.limits import ServerLimits
from kvport.server.tenants import Tenant

from .conftest import MiB, ServerProc, base_args, write_tenants

LIMITS = ServerLimits()
CHAIN = 64  # blocks of one stored prefix
PER_CLIENT = LIMITS.max_held_per_client  # 65,536: 1,024 leases of the whole chain
PER_TENANT = LIMITS.max_held_per_tenant  # 262,144: four such clients


def _chain(srv: ServerProc, tenant: str = "default") -> list[bytes]:
    c = srv.client(tenant, pool_size=1)
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
    stays bounded meanwhile. Short leases lapse and the room comes back. (512 MiB: a tenant at its cap
    takes PER_TENANT x 196 B of records, within the 64 MiB the server sets aside for them.)"""
    srv = server_factory(*base_args("512MiB"))
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


def test_caps_are_charged_to_the_connection_and_tenant_not_to_the_label(server_factory) -> None:  # type: ignore[no-untyped-def]
    """The instance label is the client's own choice: a connection that names itself like one at
    its cap still gets its own room, a client that reconnects under new labels never gets past its
    tenant's cap, and a release on another connection gives the room back at once."""
    srv = server_factory(*base_args("512MiB"))
    keys = _chain(srv)
    per_client = PER_CLIENT // CHAIN
    full = srv.client(pool_size=1, client="same")
    ids = [full.lookup(keys, lease_s=MAX_TTL_S).lease_id for _ in range(per_client)]
    with pytest.raises(LeaseError, match="per client"):
        full.lookup(keys, lease_s=MAX_TTL_S)
    twin = srv.client(pool_size=1, client="same")  # another connection under the full one's label
    assert twin.lookup(keys, lease_s=MAX_TTL_S).lease_id is not None
    twin.close()
    taken, label = per_client + 1, 0
    while True:  # reconnect under a new label each time the connection is full
        c = srv.client(pool_size=1, client=f"again-{label}")
        label += 1
        try:
            for _ in range(per_client):
                c.lookup(keys, lease_s=MAX_TTL_S)
                taken += 1
        except LeaseError as exc:
            assert "per tenant" in str(exc)
            break
        finally:
            c.close()
    assert taken * CHAIN == PER_TENANT  # the labels gave no room beyond the tenant's
    other = srv.client(pool_size=1, client="same")
    other.release(ids[0])  # the same holder on a third connection lets one of full's leases go
    late = srv.client(pool_size=1, client="late")
    assert late.lookup(keys, lease_s=1).lease_id is not None  # no sweep needed: the tenant has room again
    for c in (full, other, late):
        c.close()


def test_a_lease_flood_from_many_tenants_stays_inside_the_capacity(server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Three tenants each lease as much as their caps allow: the records' bytes stop at the budget
    the server set aside for them inside ``--capacity`` (refused with LeaseError past it, for every
    tenant), as /metrics shows, and the server's memory grows by less than that budget."""
    names = ["t0", "t1", "t2"]
    f = write_tenants(tmp_path / "tenants.json", [{"name": n} for n in names])
    capacity = 400 * MiB
    srv = server_factory(*base_args("400MiB", "--tenants", str(f), "--http-port", "0"))
    budget = capacity // HELD_SHARE
    chains = {n: _chain(srv, n) for n in names}
    rss0 = _rss(srv)
    taken, refused = dict.fromkeys(names, 0), dict.fromkeys(names, "")
    for n in names:
        for i in range(PER_TENANT // PER_CLIENT):
            c = srv.client(n, pool_size=1, client=f"flood-{i}")
            try:
                for _ in range(PER_CLIENT // CHAIN):
                    c.lookup(chains[n], lease_s=MAX_TTL_S)
                    taken[n] += 1
            except LeaseError as exc:
                refused[n] = str(exc)
                break
            finally:
                c.close()
    assert taken["t0"] * CHAIN == PER_TENANT  # the first tenant's records fit the budget whole
    assert 0 < taken["t1"] * CHAIN < PER_TENANT and taken["t2"] == 0
    assert "budget" in refused["t1"] and "budget" in refused["t2"]
    assert (taken["t0"] + taken["t1"]) * lease_bytes(CHAIN) <= budget < (taken["t0"] + taken["t1"] + 1) * \
        lease_bytes(CHAIN)
    srv.client("t0").stats()  # let a tick pass so that the gauges are fresh
    time.sleep(1.5)
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.info['http_port']}/metrics", timeout=10) as r:
        text = r.read().decode()

    def gauge(name: str, place: str) -> float:
        m = re.search(rf'kvport_{name}{{place="{place}"}} (\S+)', text)
        assert m is not None, (name, place)
        return float(m.group(1))

    assert gauge("server_capacity_bytes", "held") == budget
    assert budget - lease_bytes(CHAIN) < gauge("server_used_bytes", "held") <= budget
    assert gauge("server_capacity_bytes", "host") + budget + 64 * MiB < capacity  # staging (--inflight) too
    grew = _rss(srv) - rss0
    assert grew < budget, f"{(taken['t0'] + taken['t1']) * CHAIN} lease-blocks took {grew / MiB:.0f} MiB"


def test_a_tenant_name_cannot_hold_the_holder_separator() -> None:
    """Holders are ``tenant/instance``: tenant ``a`` with instance ``b/c`` would be tenant ``a/b``'s
    instance ``c`` (one holder: one cap, and either could release the other's leases)."""
    with pytest.raises(ConfigError, match="must not contain '/'"):
        Tenant("a/b")
