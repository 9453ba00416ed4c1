import time

import numpy as np
import pytest

from kvport.errors import BlockNotFoundError, CorruptBlockError, TierFullError, TierUnavailableError
from kvport.tiers import RedisTier

K1, K2 = b"1" * 16, b"2" * 16


@pytest.fixture()
def tier(redis_server, request):  # type: ignore[no-untyped-def]
    t = RedisTier(redis_server.url, prefix=f"t-{request.node.name}:", chunk_bytes=4096, socket_timeout_s=2)
    yield t
    try:
        for k in list(t.keys()):
            t.delete(k)
    except TierUnavailableError:
        pass
    t.close()


def test_put_get_chunked_and_batched(tier) -> None:  # type: ignore[no-untyped-def]
    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8)  # 3 chunks of 4 KiB
    tier.put_many([(K1, data), (K2, b"tiny")])
    assert tier.size_of(K1) == 10_000 and tier.size_of(K2) == 4
    a, b = bytearray(10_000), bytearray(10)
    assert tier.get_many_into([(K1, a), (K2, b), (b"3" * 16, bytearray(1))]) == [10_000, 4, None]
    assert bytes(a) == data.tobytes() and b[:4] == b"tiny"
    assert sorted(tier.keys()) == [K1, K2]
    assert tier.contains_many([K1, b"3" * 16]) == [True, False]
    assert tier.delete(K1)
    with pytest.raises(BlockNotFoundError):
        tier.get_into(K1, a)


def test_ttl_expires_values(tier) -> None:  # type: ignore[no-untyped-def]
    tier.put(K1, b"session", ttl_s=0.2)
    ttl = tier.ttl_of(K1)
    assert ttl is not None and 0 < ttl <= 0.2
    time.sleep(0.35)
    assert not tier.contains(K1)


def test_tampered_value_is_corrupt_never_wrong_data(tier) -> None:  # type: ignore[no-untyped-def]
    tier.put(K1, b"x" * 5000)
    tier._r.setrange(tier._c(K1, 1), 3, b"!")
    with pytest.raises(CorruptBlockError):
        tier.get_into(K1, bytearray(5000))
    assert not tier.contains(K1)


def test_evicted_chunk_is_a_clean_miss(tier) -> None:  # type: ignore[no-untyped-def]
    tier.put_many([(K1, b"x" * 9000), (K2, b"y" * 100)])
    tier._r.delete(tier._c(K1, 2))  # what Redis maxmemory eviction can do to one part of a value
    a, b = bytearray(9000), bytearray(100)
    assert tier.get_many_into([(K1, a), (K2, b)]) == [None, 100]
    assert not tier.contains(K1) and bytes(b) == b"y" * 100


def test_redis_down_then_restarted(redis_server, tier) -> None:  # type: ignore[no-untyped-def]
    tier.put(K1, b"before")
    redis_server.stop()
    try:
        with pytest.raises(TierUnavailableError):
            tier.put(K2, b"x")
        with pytest.raises(TierUnavailableError):
            tier.get_into(K1, bytearray(8))
        with pytest.raises(TierUnavailableError):
            tier.contains(K1)
    finally:
        redis_server.start()
    assert not tier.contains(K1)  # persistence is off: a restart loses the values, a clean miss
    tier.put(K2, b"after")
    assert tier.get(K2) == b"after"


@pytest.mark.parametrize("threaded", [False, True])
def test_grouped_batched_get_checks_every_value_in_every_group(tier, monkeypatch, threaded: bool) -> None:  # type: ignore[no-untyped-def]
    from kvport.tiers import checksums
    from kvport.tiers import redis_tier as rt

    monkeypatch.setattr(rt, "GET_GROUP_BYTES", 3000)  # ~2 values a group: several groups in flight
    monkeypatch.setattr(checksums, "ASIDE_MIN_BYTES", 1 if threaded else 1 << 62)
    rng = np.random.default_rng(3)
    keys = [bytes([65 + i]) * 16 for i in range(9)]
    vals = [rng.integers(0, 256, 1500 + 37 * i, dtype=np.uint8).tobytes() for i in range(9)]  # one chunk each
    tier.put_many(list(zip(keys, vals, strict=True)))
    tier._r.setrange(tier._c(keys[6], 0), 10, b"!")  # a value in a later group, tampered
    outs = [bytearray(len(v)) for v in vals]
    got = tier.get_many_into(list(zip(keys, outs, strict=True)))
    assert got == [len(v) if i != 6 else None for i, v in enumerate(vals)]
    assert all(bytes(o) == v for i, (o, v) in enumerate(zip(outs, vals, strict=True)) if i != 6)
    assert not tier.contains(keys[6])  # dropped, a clean miss from now on
    assert rt.pipeline_groups([len(o) for o in outs], 3000)[0] == (0, 2)


def test_out_of_memory_mid_batch_is_tier_full_and_nothing_half_visible(tier) -> None:  # type: ignore[no-untyped-def]
    """Redis refusing writes (maxmemory, noeviction) part-way through a batched put: TierFullError,
    every value either absent or whole, and the connection back in step for the next call."""
    r = tier._r
    used = int(r.info("memory")["used_memory"])
    old_max, old_policy = r.config_get("maxmemory")["maxmemory"], r.config_get("maxmemory-policy")["maxmemory-policy"]
    rng = np.random.default_rng(9)
    vals = [rng.integers(0, 256, 100_000, dtype=np.uint8).tobytes() for _ in range(8)]
    keys = [bytes([97 + i]) * 16 for i in range(8)]
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", str(used + 350_000))
    try:
        with pytest.raises(TierFullError, match="out of memory"):
            tier.put_many(list(zip(keys, vals, strict=True)))
    finally:
        r.config_set("maxmemory", old_max)
        r.config_set("maxmemory-policy", old_policy)
    for k, v in zip(keys, vals, strict=True):
        if tier.contains(k):  # visible means complete and verified
            out = bytearray(len(v))
            assert tier.get_into(k, out) == len(v) and bytes(out) == v
    tier.put(K1, b"after the refusal")  # same pooled connection, replies all consumed
    assert tier.get(K1) == b"after the refusal"
