import functools
import time

import numpy as np
import pytest

from kvport.errors import BlockNotFoundError, CorruptBlockError, TierFullError, TierUnavailableError
from kvport.tiers import RedisTier

K1, K2 = b"1" * 16, b"2" * 16


def _part(tier: RedisTier, key: bytes, i: int = 0) -> bytes:
    """The Redis key that holds payload chunk i of ``key``: the head itself for a value of one chunk."""
    ver = tier._versions([key])[0]
    assert ver is not None
    return ver.chunk_keys(tier._k(key))[i] if ver.n_chunks else tier._k(key)


def _parts(tier: RedisTier, key: bytes) -> set[bytes]:
    """The Redis keys of the value ``key`` holds now: its head and its chunks."""
    ver = tier._versions([key])[0]
    return set() if ver is None else {tier._k(key), *ver.chunk_keys(tier._k(key))}


def _stored(tier: RedisTier) -> set[bytes]:
    """Every Redis key under the tier's prefix: heads, chunks and any garbage."""
    return set(tier._r.scan_iter(match=tier.prefix + b"*", count=1000))


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
    K3 = b"3" * 16
    tier.put_many([(K1, b"x" * 5000), (K2, b"y" * 500), (K3, b"z" * 500)])  # two chunks; one; one
    tier._r.setrange(_part(tier, K1, 1), 3, b"!")
    tier._r.setrange(_part(tier, K2), 3, b"!")
    tier._r.setrange(tier._k(K3), tier._r.strlen(tier._k(K3)) - 40, b"!")  # the trailer's magic
    for key, n, why in ((K1, 5000, "checksum mismatch"), (K2, 500, "checksum mismatch"), (K3, 500, "bad header")):
        with pytest.raises(CorruptBlockError, match=f"{why}; dropped"):
            tier.get_into(key, bytearray(n))
        assert not tier.contains(key)
        with pytest.raises(BlockNotFoundError):  # a clean miss from now on
            tier.get_into(key, bytearray(n))
    assert _stored(tier) == set()  # every part went with it


def test_evicted_chunk_is_a_clean_miss(tier) -> None:  # type: ignore[no-untyped-def]
    tier.put_many([(K1, b"x" * 9000), (K2, b"y" * 100)])
    tier._r.delete(_part(tier, K1, 2))  # what Redis maxmemory eviction can do to one part of a value
    a, b = bytearray(9000), bytearray(100)
    assert tier.get_many_into([(K1, a), (K2, b)]) == [None, 100]
    assert not tier.contains(K1) and bytes(b) == b"y" * 100
    assert _stored(tier) == _parts(tier, K2)  # K1's other chunks went with its head


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
    tier._r.setrange(_part(tier, keys[6]), 10, b"!")  # a value in a later group, tampered
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
    assert _stored(tier) == set().union(*(_parts(tier, k) for k in keys))  # no chunks of refused puts stay
    tier.put(K1, b"after the refusal")  # same pooled connection, replies all consumed
    assert tier.get(K1) == b"after the refusal"


def test_overwrites_leave_no_chunks_behind(tier) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(5)
    big, other, small = (rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (10_000, 9000, 100))
    for v in (big, other, small, big, big):  # chunked over chunked, one key over chunks, and back
        tier.put(K1, v)
        assert tier.get(K1) == v
        assert _stored(tier) == _parts(tier, K1) and len(_parts(tier, K1)) == (1 if v is small else 4)
    assert tier.delete(K1) and _stored(tier) == set()


def test_format_1_values_read_as_before(tier) -> None:  # type: ignore[no-untyped-def]
    """Values that older kvport wrote (a 24-byte head, chunks <head>:<i>) read as before; a bad one
    is dropped whole, and an overwrite leaves none of their chunks behind."""
    import struct

    import xxhash

    rng = np.random.default_rng(11)
    vals = {K1: rng.integers(0, 256, 10_000, dtype=np.uint8).tobytes(), K2: b"tiny"}
    for key, v in vals.items():
        head = tier._k(key)
        for i in range(0, len(v), 4096):
            tier._r.set(b"%s:%d" % (head, i // 4096), v[i : i + 4096])
        tier._r.set(head, struct.pack("<4sIQQ", b"KVPR", 1, len(v), xxhash.xxh3_64_intdigest(v)))
    assert tier.size_of(K1) == 10_000 and len(_parts(tier, K1)) == 4
    outs = [bytearray(10_000), bytearray(4)]
    assert tier.get_many_into([(K1, outs[0]), (K2, outs[1])]) == [10_000, 4]
    assert [bytes(o) for o in outs] == list(vals.values())
    tier._r.setrange(_part(tier, K2), 0, b"!")
    assert tier.get_many_into([(K2, outs[1])]) == [None]
    assert _stored(tier) == _parts(tier, K1)  # K2 dropped, head and chunk
    tier.put(K1, b"now format 2")
    assert tier.get(K1) == b"now format 2" and _stored(tier) == {tier._k(K1)}


@pytest.fixture()
def pair(redis_server, request):  # type: ignore[no-untyped-def]
    """Two clients of one Redis under one prefix: a reader and a writer (two processes, in effect)."""
    make = functools.partial(RedisTier, redis_server.url, prefix=f"t-{request.node.name}:", chunk_bytes=4096,
                             socket_timeout_s=2)
    writer = make()
    yield (lambda verify: make(verify=verify)), writer
    for k in list(writer.keys()):
        writer.delete(k)
    writer.close()


@pytest.mark.parametrize("verify", [True, False])
def test_get_racing_an_overwrite_never_mixes_and_keeps_the_newer_value(pair, monkeypatch, verify: bool) -> None:  # type: ignore[no-untyped-def]
    """Issue 17 #10: an overwrite acknowledged between a get's header read and its chunk read. The
    get answers the old value, the new one or a miss (never a mix of both), and the new value stays."""
    make_reader, writer = pair
    reader = make_reader(verify)
    rng = np.random.default_rng(17)
    old, new = (rng.integers(0, 256, 10_000, dtype=np.uint8).tobytes() for _ in range(2))  # 3 chunks each
    writer.put(K1, old)
    trips = 0
    real_pipeline = reader._r.pipeline

    def pipeline(*a, **kw):  # type: ignore[no-untyped-def]
        pipe = real_pipeline(*a, **kw)
        real_execute = pipe.execute

        def execute(*a2, **kw2):  # type: ignore[no-untyped-def]
            nonlocal trips
            trips += 1
            if trips == 2:  # the get's second round trip: the header was read, the chunks were not
                writer.put(K1, new)
            return real_execute(*a2, **kw2)

        pipe.execute = execute
        return pipe

    monkeypatch.setattr(reader._r, "pipeline", pipeline)
    out = bytearray(10_000)
    try:
        got: int | None = reader.get_into(K1, out)
    except CorruptBlockError:
        got = None
    monkeypatch.undo()
    assert trips >= 2
    assert got is None or bytes(out) in (old, new)
    assert writer.get(K1) == new  # the acknowledged overwrite survived the reader's cleanup
    reader.close()


def test_a_mismatch_drops_only_the_version_that_was_read(pair, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A get finds a checksum mismatch (a byte flipped on the way) while another client overwrites
    the key: the cleanup removes the version that failed, never the acknowledged newer one."""
    from kvport.tiers import redis_tier as rt

    make_reader, writer = pair
    reader = make_reader(True)
    writer.put(K1, b"old value " * 50)  # one chunk
    real = rt._verify_and_copy

    def flip_then_overwrite(singles, verify):  # type: ignore[no-untyped-def]
        writer.put(K1, b"new value " * 50)
        flipped = [(i, k, d, memoryview(bytes(c[:-1]) + bytes([c[-1] ^ 1])), h) for i, k, d, c, h in singles]
        return real(flipped, verify)

    monkeypatch.setattr(rt, "_verify_and_copy", flip_then_overwrite)
    with pytest.raises(CorruptBlockError):
        reader.get_into(K1, bytearray(500))
    monkeypatch.undo()
    assert writer.get(K1) == b"new value " * 50
    reader.close()


def test_sizes_of_answers_a_chain_in_one_pipeline(tier) -> None:  # type: ignore[no-untyped-def]
    tier.put(b"s" * 16, b"x" * 1000)
    tier.put(b"t" * 16, b"y" * 3)
    assert tier.sizes_of([b"s" * 16, b"u" * 16, b"t" * 16]) == [1000, None, 3]
    assert tier.sizes_of([]) == []
    assert [tier.size_of(k) for k in (b"s" * 16, b"u" * 16)] == [1000, None]
