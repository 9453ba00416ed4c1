"""The pool's records in Redis and in a real Redis Cluster (kvport.client.redis_pool): who handed each
block over, leases and pins with native TTLs that outlive their client, prefix-aware leases, and the
owners / leaks reports `kvport inspect --redis` prints."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from click.testing import CliRunner

from kvport.cli.main import cli
from kvport.client.port import StoreConfig, open_port
from kvport.client.redis_pool import PoolBook
from kvport.errors import LeaseExpiredError, TierError, UserInputError
from kvport.lifetime import Lifetime
from kvport.tiers.redis_tier import RedisTier

BLOCK = 96 << 10  # two chunks of 64 KiB: the chunks' TTLs must follow the head's


def _chain(n: int, seed: int) -> list[tuple[bytes, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.bytes(16), rng.integers(0, 256, BLOCK, dtype=np.uint8)) for _ in range(n)]


def _open(url: str, client: str):  # type: ignore[no-untyped-def]
    return open_port(StoreConfig(block_bytes=BLOCK, redis_url=f"{url}{'&' if '?' in url else '?'}client={client}"))


def _flush(url: str) -> None:
    t = RedisTier.from_url(url, records=False)
    try:
        if t.cluster:
            t._r.flushall(target_nodes="primaries")
        else:
            t._r.flushall()
    finally:
        t.close()


def _exercise_pool_records(url: str) -> None:
    _flush(url)
    a, b = _open(url, "prefill-0"), _open(url, "decode-0")
    try:
        chain = _chain(4, 1)
        keys = [k for k, _ in chain]
        a.store.put_many(chain, lifetime=Lifetime.SESSION, ttl_s=30)
        assert a.book is not None and b.book is not None and a.pool is a.book

        # who handed each block to the pool, its lifetime, parent and TTL, read by another client
        rows = b.book.owners([keys[-1]]).blocks
        assert [r.key for r in rows] == [k.hex() for k in keys]  # the chain the key ends, root first
        assert [r.parent for r in rows] == [""] + [k.hex() for k in keys[:-1]]
        assert {r.handed_off_by for r in rows} == {"prefill-0"} and {r.lifetime for r in rows} == {Lifetime.SESSION}
        assert all(r.length == BLOCK and 0 < (r.expires_in_s or 0) <= 30 for r in rows)
        assert [r.children for r in rows] == [1, 1, 1, 0]
        assert b.book.leaks().clean

        # a lease holds the chain's leading blocks only: a child whose parent is gone is never counted
        lid, held = b.book.lease(keys, 20)
        assert lid is not None and held == 4
        assert all(len(r.leases) == 1 and r.leases[0].holder == "decode-0" for r in a.book.owners([keys[-1]]).blocks)
        b.book.release(lid)
        with pytest.raises(LeaseExpiredError):
            b.book.release(lid)
        a.book.tier._r.delete(a.book.tier._k(keys[1]))  # the parent's head gone (an eviction)
        assert b.book.lease(keys, 20)[1] == 1
        assert b.store.lookup(keys).prefix_blocks == 1  # a store that never saw the chain counts the root only
        rep = b.book.leaks()  # the record went with its block: only the orphan is left to report
        assert rep.orphan_children == (keys[2].hex(),) and rep.unstored_records == () and not rep.without_owner

        # pins: per holder, counted, with a reason; renewed by pinning again
        assert a.book.pin(keys[:1], reason="system prompt", ttl_s=60) == 1
        assert a.book.pin(keys[:1], reason="system prompt", ttl_s=60) == 1
        (row,) = b.book.owners([keys[0]]).blocks
        assert [(p.holder, p.count, p.reason) for p in row.pins] == [("prefill-0", 2, "system prompt")]
        assert a.book.unpin(keys[:1]) == 1 and a.book.unpin(keys[:1]) == 1 and a.book.unpin(keys[:1]) == 0
        assert b.book.owners([keys[0]]).blocks[0].pins == ()

        # bad input is a typed error, nothing recorded
        for bad in (lambda: a.book.lease(keys, 0), lambda: a.book.pin(keys, reason="x" * 300),
                    lambda: a.book.lease(keys, 5, holder="a{b}")):
            with pytest.raises(TierError):
                bad()
    finally:
        a.store.close()
        b.store.close()


def _exercise_ttls(url: str) -> None:
    """A lease keeps a block past its own TTL; a lease whose client died lapses at its TTL."""
    _flush(url)
    a, b = _open(url, "writer"), _open(url, "reader")
    try:
        chain = _chain(2, 2)
        keys = [k for k, _ in chain]
        a.store.put_many(chain, lifetime=Lifetime.SESSION, ttl_s=1.0)
        assert b.book is not None
        _, held = b.book.lease(keys[:1], 4.0)
        assert held == 1
        time.sleep(1.6)  # past the values' own TTL, inside the lease's
        assert a.book is not None
        redis = a.book.tier
        assert not redis.contains(keys[1])  # unleased: Redis expired it
        out = np.empty(BLOCK, np.uint8)
        assert redis.get_into(keys[0], out) == BLOCK and np.array_equal(out, chain[0][1])  # head and chunks kept
        (row,) = b.book.owners([keys[0]]).blocks
        assert row.handed_off_by == "writer" and len(row.leases) == 1
        b.book._leases.clear()  # the reader dies holding it: nothing releases it
        time.sleep(3.0)
        assert a.book is not None and a.book.owners([keys[0]]).blocks == ()  # lapsed with its block, by Redis
        assert a.book.leaks().clean
    finally:
        a.store.close()
        b.store.close()


def test_pool_records_on_one_redis(redis_server) -> None:  # type: ignore[no-untyped-def]
    _exercise_pool_records(f"redis://127.0.0.1:{redis_server.port}/0")


def test_leases_outlive_ttls_and_lapse_with_a_dead_client(redis_server) -> None:  # type: ignore[no-untyped-def]
    _exercise_ttls(f"redis://127.0.0.1:{redis_server.port}/0")


def test_pool_records_in_a_cluster_stay_on_their_blocks_slot(redis_cluster) -> None:  # type: ignore[no-untyped-def]
    url = f"{redis_cluster.url}?cluster=true"
    _exercise_pool_records(url)
    t = RedisTier.from_url(url)
    try:  # every record of a block on its slot: one script, one node, whatever the topology
        chain = _chain(8, 3)
        t.put_many_meta(chain, [None] * 8)
        book = PoolBook(t)
        lid, _ = book.lease([k for k, _ in chain], 10)
        assert book.pin([chain[0][0]], reason="r") == 1
        for k, _ in chain:
            slots = {t._r.keyslot(n) for n in t._r.scan_iter(match=t._k(k) + b"*")}
            assert len(slots) == 1
        nodes = {t._r.get_node_from_key(t._k(k)).name for k, _ in chain}
        assert len(nodes) > 1  # the chain spans primaries
        assert lid is not None
        book.release(lid)
    finally:
        t.close()


def test_inspect_redis_answers_owners_and_leaks(redis_server) -> None:  # type: ignore[no-untyped-def]
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    _flush(url)
    opened = _open(url, "engine-7")
    try:
        chain = _chain(3, 4)
        opened.store.put_many(chain, lifetime=Lifetime.PREFIX)
        run = CliRunner().invoke
        res = run(cli, ["inspect", "--redis", url, "--owners", chain[-1][0].hex(), "--json"])
        assert res.exit_code == 0, res.output
        rows = json.loads(res.output)["blocks"]
        assert [r["key"] for r in rows] == [k.hex() for k, _ in chain]
        assert {r["handed_off_by"] for r in rows} == {"engine-7"}
        assert run(cli, ["inspect", "--redis", url, "--leaks"]).exit_code == 0
        raw = RedisTier.from_url(url, records=False)  # a writer without records: a block without an owner
        raw.put(b"\x07" * 16, b"x" * 100)
        raw.close()
        res = run(cli, ["inspect", "--redis", url, "--leaks", "--json"])
        assert res.exit_code == 1 and json.loads(res.output)["without_owner"] == [(b"\x07" * 16).hex()]
        res = run(cli, ["inspect", "--redis", url])
        assert isinstance(res.exception, UserInputError) and "--owners" in str(res.exception)
    finally:
        opened.store.close()
