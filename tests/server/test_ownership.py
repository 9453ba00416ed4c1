"""Ownership against a real server process: a PUT hands the block to the pool (recorded with the client
and its lifetime), leases and pins belong to a client and lapse at their TTL (also when the client is
killed), eviction is prefix-aware, and every refusal is typed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvport.cli.main import main
from kvport.errors import LeaseError, ServerError, TierFullError, UnknownBlockError
from kvport.lifetime import Lifetime
from kvport.protocol.rejects import Rejected, RejectReason
from tests.waits import until

from .conftest import MiB, base_args


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_a_put_hands_the_block_to_the_pool_with_its_lifetime_and_the_client(shared_server) -> None:  # type: ignore[no-untyped-def]
    c = shared_server.client()
    c.put_value(k(500), np.ones(MiB, dtype=np.uint8), lifetime=Lifetime.PREFIX)
    c.put_value(k(501), np.ones(1000, dtype=np.uint8), parent=k(500), lifetime=Lifetime.SESSION, ttl_s=120)
    c.pin([k(500)], "shared system prompt", ttl_s=60)
    rows = c.owners([k(501)]).blocks  # the block and the prefix it ends, root first
    assert [r.key for r in rows] == [k(500).hex(), k(501).hex()]
    root, leaf = rows
    assert root.owner == "pool:pool" and root.state == "shared" and root.handed_off_by.startswith("client:default/")
    assert leaf.lifetime is Lifetime.SESSION and 100 < (leaf.expires_in_s or 0) <= 120
    assert leaf.parent == k(500).hex() and root.children == 1 and root.tiers == ("host",)
    (pin,) = root.pins
    assert pin.reason == "shared system prompt" and pin.holder == root.handed_off_by
    assert 0 < (pin.expires_in_s or 0) <= 60
    assert c.unpin([k(500)]) == 1
    assert [r.key for r in c.owners(prefix=k(500).hex()[:30]).blocks] == [k(500).hex()]
    assert main(["inspect", "--server", f"127.0.0.1:{shared_server.port}", "--owners", k(501).hex(), "--json"]) == 0
    c.close()


def test_refusals_are_typed_and_change_nothing(shared_server) -> None:  # type: ignore[no-untyped-def]
    c = shared_server.client(backpressure_timeout_s=0.0)
    orphan = c.put_value(k(601), np.ones(100, dtype=np.uint8), parent=k(600))  # the parent was never stored
    assert orphan == Rejected(RejectReason.NO_PARENT, None, orphan.detail)  # type: ignore[union-attr]
    with pytest.raises(TierFullError) as exc:
        c.put_block(k(601), [np.ones(100, dtype=np.uint8)], meta=_meta(parent=k(600)))
    assert exc.value.reason == "no_parent" and exc.value.retry_after_s is None  # reaches the caller intact
    assert c.contains_many([k(601)]) == [False]
    c.put(k(602), np.ones(100, dtype=np.uint8))
    with pytest.raises(UnknownBlockError):
        c.lease([k(602), k(603)], ttl_s=10)  # a block this tenant does not hold: nothing is leased
    assert c.stats().leases == ()
    lease_id, held = c.lease([k(602)], ttl_s=0.5)
    assert held == 1 and lease_id is not None
    time.sleep(1.6)  # past its TTL (and reaped by the server's tick)
    with pytest.raises(LeaseError):
        c.release(lease_id)
    other = shared_server.client(client="someone-else")
    lease2, _ = c.lease([k(602)], ttl_s=30)
    with pytest.raises(LeaseError):
        other.release(lease2)  # not the holder's
    c.release(lease2)
    with pytest.raises(LeaseError):
        c.release(lease2)  # twice
    other.close()
    c.close()


def _meta(parent: bytes):  # type: ignore[no-untyped-def]
    from kvport.tiers.base import BlockMeta

    return BlockMeta(parent=parent)


def test_a_killed_clients_leases_and_pins_lapse_at_their_ttl_never_later(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = server_factory(*base_args("384MiB"))
    c = srv.client(client="survivor")
    for i in range(3):
        c.put_value(k(i), np.full(MiB, i, dtype=np.uint8), parent=None if i == 0 else k(i - 1))
    script = textwrap.dedent(f"""
        import sys
        from kvport.client import ClientConfig, RemoteTier
        t = RemoteTier(ClientConfig(port={srv.port}, client="doomed"))
        keys = [i.to_bytes(16, "little") for i in range(3)]
        lk = t.lookup(keys, lease_s=2.0)
        t.pin(keys[:1], "about to die", ttl_s=2.0)
        print(lk.hits, flush=True)
        sys.stdin.readline()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "3"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(10)
    t_kill = time.monotonic()
    rows = c.owners([k(2)]).blocks
    assert all(any(ls.holder == "client:default/doomed" for ls in r.leases) for r in rows)
    assert [p.holder for p in rows[0].pins] == ["client:default/doomed"]
    assert c.delete_many([k(2)]) == 0  # held by the dead client's lease: nothing leaves yet
    # the server's reaper ends them at its first tick after the TTL (every second; later under load)
    until(lambda: not any(r.leases or r.pins for r in c.owners([k(2)]).blocks), "the dead client's hold never lapsed",
          2.0 + 10.0 - (time.monotonic() - t_kill))
    rows = c.owners([k(2)]).blocks
    assert all(r.leases == () and r.pins == () for r in rows)
    assert c.leaks().clean
    assert c.delete_many([k(2)]) == 1 and c.delete_many([k(0)]) == 1  # free again; the root takes its child along
    assert c.contains_many([k(0), k(1)]) == [False, False]
    c.close()


def test_eviction_in_the_server_is_prefix_aware(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A small pool (host + disk) under a stream of chains: no block is ever kept without its parent,
    and what leaves the pool are whole leaves first."""
    srv = server_factory(*base_args("192MiB", "--disk", str(tmp_path / "d"), "--disk-capacity", "48MiB"))
    c = srv.client(backpressure_timeout_s=2.0)
    chains = 12
    for ch in range(chains):
        prev = None
        for j in range(4):  # chains of four 4 MiB blocks: 16 MiB each, 192 MiB in all > host + disk
            key = k(1000 * ch + j)
            out = c.put_value(key, np.full(4 * MiB, j, dtype=np.uint8), parent=prev)
            assert not isinstance(out, Rejected), out
            prev = key
        leaks = c.leaks()
        assert leaks.orphan_children == () and leaks.clean
    present = {(ch, j): p for ch in range(chains) for j, p in
               enumerate(c.contains_many([k(1000 * ch + j) for j in range(4)]))}
    for (ch, j), p in present.items():
        if p and j:
            assert present[(ch, j - 1)], f"chain {ch}: block {j} kept without its parent"
    assert not all(present.values())  # the pool was too small for everything: something was evicted
    doc = subprocess.run([sys.executable, "-m", "kvport.cli.main", "inspect", "--server", f"127.0.0.1:{srv.port}",
                          "--leaks", "--json"], capture_output=True, text=True, check=True)
    assert json.loads(doc.stdout)["orphan_children"] == []
    c.close()


def test_server_error_for_a_release_of_an_unknown_lease(shared_server) -> None:  # type: ignore[no-untyped-def]
    c = shared_server.client()
    with pytest.raises((LeaseError, ServerError)):
        c.release(987654321)
    c.close()
