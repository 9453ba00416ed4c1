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

pytestmark = pytest.mark.redis


def _values(n: int, size: int, seed: int = 0) -> dict[bytes, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {os.urandom(16): rng.integers(0, 256, size + i, dtype=np.uint8) for i in range(n)}


def _slot_of(cluster, redis_key: bytes) -> int:  # type: ignore[no-untyped-def]
    return int(cluster.cmd(next(iter(cluster.procs)), "CLUSTER", "KEYSLOT", redis_key.decode()))


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
            slots = {_slot_of(redis_cluster, p) for p in [head, *ver.chunk_keys(head)]}
            assert slots == {_slot_of(redis_cluster, head)}
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
        time.sleep(0.3)  # replication is asynchronous: let the replicas catch up (unacknowledged otherwise)
        victim = redis_cluster.primary_of(tier._k(next(iter(values))))
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
