"""RedisTier against a real Redis Cluster (3 primaries + 3 replicas of ``redis-server
--cluster-enabled yes``, joined by ``redis-cli --cluster create``): values spread over every node
read back exactly, every part of a value on its key's slot, native TTLs; and a primary killed
mid-run: while its replica takes over, a get is the exact bytes or a typed miss, never other bytes
and never an error outside kvport's tree."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvport.errors import BlockNotFoundError, TierUnavailableError
from kvport.tiers import RedisTier
from tests.waits import until

pytestmark = pytest.mark.redis


def _values(n: int, size: int, seed: int = 0) -> dict[bytes, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {os.urandom(16): rng.integers(0, 256, size + i, dtype=np.uint8) for i in range(n)}


def test_values_over_every_node_read_back_exactly_each_on_one_slot(redis_cluster) -> None:  # type: ignore[no-untyped-def]
    tier = RedisTier(redis_cluster.url, cluster=True, chunk_bytes=4096, socket_timeout_s=3)
    try:
        small, large = _values(40, 1000), _values(6, 3 * 4096 + 17, seed=1)  # inline, and chunked values
        tier.put_many(list(small.items()))
        tier.put_many(list(large.items()))
        assert len({redis_cluster.primary_of(tier._k(k)) for k in small}) == 3  # spread over every primary
        for k, v in {**small, **large}.items():
            out = bytearray(v.nbytes)
            assert tier.get_into(k, out) == v.nbytes and bytes(out) == v.tobytes()
        for k in large:  # a value's head and chunks share its hash tag's slot
            head = tier._k(k)
            ver = tier._versions([k])[0]
            assert ver is not None and ver.n_chunks == 4
            slots = {redis_cluster.slot_of(p) for p in [head, *ver.chunk_keys(head)]}
            assert slots == {redis_cluster.slot_of(head)}
        assert all(tier.contains(k) for k in small) and not tier.contains(os.urandom(16))
        k0 = next(iter(small))
        tier.delete(k0)
        assert not tier.contains(k0)
        kt = os.urandom(16)
        tier.put(kt, np.ones(100, np.uint8), ttl_s=0.3)  # a native TTL on every part
        assert tier.contains(kt)
        time.sleep(0.6)
        assert not tier.contains(kt)
    finally:
        tier.close()


def test_a_primary_killed_mid_run_gives_exact_bytes_or_typed_misses_and_its_replica_takes_over(  # type: ignore[no-untyped-def]
        redis_cluster) -> None:
    tier = RedisTier(redis_cluster.url, cluster=True, chunk_bytes=4096, socket_timeout_s=2)
    try:
        values = _values(60, 2000, seed=2)
        tier.put_many(list(values.items()))
        victim = redis_cluster.primary_of(tier._k(next(iter(values))))
        # replication is asynchronous: the values count as written once the victim's replica has them
        until(lambda: redis_cluster.caught_up(victim), "the replica never caught up")
        redis_cluster.kill(victim)
        wrong, misses, reads = 0, 0, 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # during the failover and after it
            ok = 0
            for k, v in values.items():
                out = bytearray(v.nbytes)
                try:
                    n = tier.get_into(k, out)
                except (TierUnavailableError, BlockNotFoundError):  # the node is gone, or its replica lacks it
                    misses += 1
                    continue
                reads += 1
                ok += 1
                wrong += int(n != v.nbytes or bytes(out) != v.tobytes())
            if ok == len(values):
                break
            time.sleep(0.2)
        assert wrong == 0
        assert ok == len(values), f"the replica did not take over within 30 s ({misses} misses)"
        redis_cluster.wait_ok()
        assert victim != redis_cluster.primary_of(tier._k(next(iter(values))))  # a replica serves it now
    finally:
        tier.close()


def test_with_wait_every_acknowledged_put_survives_its_primary_killed_at_once(redis_cluster) -> None:  # type: ignore[no-untyped-def]
    """``wait_replicas=1``: a put returns only once a replica holds it, so killing the primary right
    after (no time for asynchronous replication) loses none of them."""
    tier = RedisTier(redis_cluster.url, cluster=True, chunk_bytes=4096, socket_timeout_s=3, wait_replicas=1)
    try:
        values = _values(30, 5000, seed=3)  # chunked values: head and chunks all covered by the WAIT
        items = list(values.items())
        for lo in range(0, len(items), 5):
            tier.put_many(items[lo : lo + 5])
        victim = redis_cluster.primary_of(tier._k(items[0][0]))
        redis_cluster.kill(victim)
        redis_cluster.wait_ok()
        for k, v in values.items():
            out = bytearray(v.nbytes)
            deadline = time.monotonic() + 10
            while True:  # the client finds the promoted replica on its first error
                try:
                    n = tier.get_into(k, out)
                    break
                except TierUnavailableError:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
            assert n == v.nbytes and bytes(out) == v.tobytes()
        assert tier.unacknowledged_puts == 0
    finally:
        tier.close()


def test_a_replica_behind_makes_a_waiting_put_unacknowledged_never_a_partial_value(redis_cluster) -> None:  # type: ignore[no-untyped-def]
    """The replica of one primary stopped (it falls behind the replication stream): a put that waits
    for a replica raises TierUnavailableError within its WAIT timeout, and counts it; what it left is
    the whole value or nothing. Once the replica catches up, puts are acknowledged again."""
    tier = RedisTier(redis_cluster.url, cluster=True, chunk_bytes=4096, socket_timeout_s=3, wait_replicas=1,
                     wait_timeout_s=0.3)
    try:
        key, value = os.urandom(16), np.arange(3 * 4096 + 5, dtype=np.uint32).view(np.uint8)
        behind = redis_cluster.replica_of(redis_cluster.primary_of(tier._k(key)))
        redis_cluster.pause(behind)
        t0 = time.monotonic()
        with pytest.raises(TierUnavailableError, match="not acknowledged"):
            tier.put(key, value)
        assert time.monotonic() - t0 < 2.5  # the WAIT's timeout bounds it, not the socket's
        assert tier.unacknowledged_puts == 1
        out = bytearray(value.nbytes)
        assert tier.get_into(key, out) == value.nbytes and bytes(out) == value.tobytes()  # whole on the primary
        redis_cluster.resume(behind)
        redis_cluster.wait_ok()
        tier.put(key, value[::-1].copy())
        assert tier.unacknowledged_puts == 1
    finally:
        tier.close()


def test_slots_migrated_while_serving_lose_nothing_and_answer_no_wrong_bytes(redis_cluster) -> None:  # type: ignore[no-untyped-def]
    """``redis-cli --cluster reshard`` moves slots holding kvport's values while the tier keeps
    putting and reading batches (MOVED/ASK mid-batch): every read is the exact bytes or a typed miss,
    and after the move every value put is there, exact."""
    tier = RedisTier(redis_cluster.url, cluster=True, chunk_bytes=4096, socket_timeout_s=3)
    try:
        values = _values(200, 3000, seed=4)
        items = list(values.items())
        tier.put_many(items[:100])
        src, dst = redis_cluster.primaries()[:2]
        mover = redis_cluster.migrate(src, dst, 600)
        wrong = misses = 0
        at = 100
        while mover.poll() is None or at < len(items):
            if at < len(items):
                try:
                    tier.put_many(items[at : at + 10])
                    at += 10
                except TierUnavailableError:
                    misses += 1
            recent = items[max(0, at - 40) : at]
            outs = [bytearray(v.nbytes) for _, v in recent]
            got = tier.get_many_into([(k, o) for (k, _), o in zip(recent, outs, strict=True)])
            for (_, v), o, n in zip(recent, outs, got, strict=True):
                if n is None:
                    misses += 1  # a clean miss (the slot between nodes): the caller recomputes
                    continue
                wrong += int(n != v.nbytes or bytes(o) != v.tobytes())
        assert mover.wait(120) == 0, mover.stderr.read() if mover.stderr else ""
        assert wrong == 0
        for k, v in values.items():
            out = bytearray(v.nbytes)
            assert tier.get_into(k, out) == v.nbytes and bytes(out) == v.tobytes()
        moved = sum(hi - lo + 1 for n in redis_cluster.nodes() if n["port"] == dst for lo, hi in n["slots"])
        assert moved > 16384 // 3 + 500  # the slots really moved
    finally:
        tier.close()


def test_the_url_names_the_cluster_and_the_wait_and_a_malformed_option_is_a_config_error() -> None:
    from kvport.errors import ConfigError
    from kvport.tiers.redis_tier import split_url

    assert split_url("redis://h:7000/0?cluster=true&wait_replicas=1&wait_timeout_ms=250&socket_keepalive=1") == (
        "redis://h:7000/0?socket_keepalive=1", {"cluster": True, "wait_replicas": 1, "wait_timeout_s": 0.25})
    assert split_url("redis://h:6379/0") == ("redis://h:6379/0", {})
    for bad in ("http://h:1", "redis://h:1/0?cluster=2", "redis://h:1/0?wait_replicas=x"):
        with pytest.raises(ConfigError):
            split_url(bad)


def test_a_primary_partitioned_away_then_back_rejoins_as_a_replica_and_nothing_acknowledged_is_lost(  # type: ignore[no-untyped-def]
        redis_cluster) -> None:
    """A primary cut off from everyone (stopped: no client, no peer hears it) past the node timeout:
    its replica is promoted, the client's reads are exact bytes or typed misses, puts with WAIT go
    on; when the partition heals the old primary comes back as a replica of the new one (its stale
    view is discarded) and every acknowledged value reads back exactly."""
    tier = RedisTier(redis_cluster.url, cluster=True, chunk_bytes=4096, socket_timeout_s=1, wait_replicas=1,
                     wait_timeout_s=0.5)
    try:
        before = _values(24, 3000, seed=4)
        tier.put_many(list(before.items()))
        victim = redis_cluster.primary_of(tier._k(next(iter(before))))
        redis_cluster.pause(victim)  # the partition
        acked: dict[bytes, np.ndarray] = dict(before)
        wrong = 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and victim in redis_cluster.primaries():
            for k, v in before.items():  # reads during the partition
                out = bytearray(v.nbytes)
                try:
                    n = tier.get_into(k, out)
                    wrong += int(n != v.nbytes or bytes(out) != v.tobytes())
                except (TierUnavailableError, BlockNotFoundError):
                    pass
            time.sleep(0.2)
        assert victim not in redis_cluster.primaries(), "no failover within 30 s"
        during = _values(12, 3000, seed=5)
        for k, v in during.items():  # writes on the majority side, each waiting for a replica
            try:
                tier.put(k, v)
                acked[k] = v
            except TierUnavailableError:  # not acknowledged (its new primary has no replica yet): not counted
                pass
        redis_cluster.resume(victim)  # the partition heals
        redis_cluster.wait_ok()
        # back as a replica, not a second primary (it learns of its demotion by gossip, on its own time)
        until(lambda: victim not in redis_cluster.primaries(), "the healed primary stayed a primary")
        for k, v in acked.items():
            out = bytearray(v.nbytes)
            end = time.monotonic() + 10
            while True:
                try:
                    n = tier.get_into(k, out)
                    break
                except TierUnavailableError:
                    assert time.monotonic() < end
                    time.sleep(0.1)
            wrong += int(n != v.nbytes or bytes(out) != v.tobytes())
        assert wrong == 0 and len(acked) > len(before)
    finally:
        tier.close()
