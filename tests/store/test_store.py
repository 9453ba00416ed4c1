import numpy as np
import pytest

from kvport.errors import BlockNotFoundError, CorruptBlockError, TierFullError
from kvport.ledger import Ledger, Owner
from kvport.metrics import sample
from kvport.store import Lifetime, LifetimePolicy, LifetimeRule, TieredStore, TierPolicy, WriteMode
from kvport.tiers import DiskTier, FaultTier, HostTier

EXACT = TierPolicy(high_watermark=1.0, low_watermark=1.0)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def val(i: int, n: int = 32) -> bytes:
    return bytes([i % 256]) * n


def chain(store: TieredStore, ids: range, **kw: object) -> None:
    parent = None
    for i in ids:
        store.put(k(i), val(i), parent=parent, **kw)  # type: ignore[arg-type]
        parent = k(i)


def test_lookup_reports_prefix_and_tier_and_get_reads_exact_bytes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    host = HostTier(3 * 64, 64, name="host")
    disk = DiskTier(tmp_path, 1 << 20, name="disk")
    s = TieredStore([host, disk], tier_policies={"host": EXACT})
    chain(s, range(5))
    res = s.lookup([k(0), k(1), k(2), k(3), k(4), k(99), k(5)])
    assert res.prefix_blocks == 5 and not res.complete
    assert res.tiers.count("host") == 3 and res.tiers.count("disk") == 2
    assert res.miss_keys == (k(99), k(5))
    assert res.sizes == (32,) * 5
    for i in range(5):
        dst = bytearray(40)
        assert s.get_into(k(i), dst) == 32
        assert dst[:32] == val(i)
    with pytest.raises(BlockNotFoundError):
        s.get_into(k(99), bytearray(40))


def test_consume_hands_a_zero_copy_view_from_host_and_a_scratch_copy_from_disk(tmp_path) -> None:  # type: ignore[no-untyped-def]
    host = HostTier(2 * 64, 64, name="host")
    disk = DiskTier(tmp_path, 1 << 20, name="disk")
    s = TieredStore([host, disk], tier_policies={"host": EXACT})
    chain(s, range(3))  # two in host, the third demoted to disk
    seen: list[tuple[bytes, bool]] = []
    scratch = np.zeros(64, dtype=np.uint8)

    def fn(view: memoryview) -> None:  # (bytes, whether they sit in the scratch buffer)
        seen.append((bytes(view), np.frombuffer(view, dtype=np.uint8).ctypes.data == scratch.ctypes.data))

    holder = s.lookup([k(0), k(1), k(2)]).tiers
    for i in range(3):
        assert s.consume(k(i), fn, scratch) == 32
    assert [b for b, _ in seen] == [val(0), val(1), val(2)]
    in_scratch = [r for _, r in seen]
    assert in_scratch == [t == "disk" for t in holder]  # host: a view of its own pages; disk: the scratch copy
    assert bytes(scratch[:32]) == val(holder.index("disk"))
    with pytest.raises(BlockNotFoundError):
        s.consume(k(99), fn, scratch)
    out = bytearray(40)
    s.get_into(k(0), out)
    assert out[:32] == val(0)  # the view was only read


def test_demotion_is_leaf_first_and_drops_at_the_bottom_without_orphans() -> None:
    host = HostTier(2 * 64, 64, name="host")
    low = HostTier(3 * 64, 64, name="low")
    s = TieredStore([host, low], tier_policies={"host": EXACT, "low": EXACT})
    chain(s, range(4))  # 0 <- 1 <- 2 <- 3
    s.put(k(10), val(10))
    s.put(k(11), val(11))
    # 5 of 6 slots used; every eviction took a leaf of its tier's tree, and the store never dropped
    # a block whose child is still cached
    for i in (1, 2, 3):
        if k(i) in s:
            assert k(i - 1) in s, f"block {i} stranded without its parent"
    s.put(k(12), val(12))
    s.put(k(13), val(13))
    for i in (1, 2, 3):
        if k(i) in s:
            assert k(i - 1) in s
    assert s.stats().drops >= 1
    assert s.stats().demotions["host"] >= 1


def test_exact_lru_demotion_order() -> None:
    host = HostTier(2 * 64, 64, name="host")
    low = HostTier(8 * 64, 64, name="low")
    s = TieredStore([host, low], eviction="lru", tier_policies={"host": EXACT})
    s.put(k(1), val(1))
    s.put(k(2), val(2))
    s.lookup([k(1)])  # 2 is now the least recent
    s.put(k(3), val(3))
    assert s.where(k(2)) == ("low",) and s.where(k(1)) == ("host",)
    s.put(k(4), val(4))
    assert s.where(k(1)) == ("low",) and s.where(k(3)) == ("host",)
    dst = bytearray(32)
    s.get_into(k(2), dst)  # a hit below the top is promoted
    assert "host" in s.where(k(2))


def test_pinned_and_leased_blocks_are_never_evicted() -> None:
    clock = Clock()
    led = Ledger(clock=clock)
    host = HostTier(2 * 64, 64, name="host")
    s = TieredStore([host], led, tier_policies={"host": EXACT}, clock=clock)
    s.put(k(1), val(1))
    s.put(k(2), val(2))
    led.pin(k(1), Owner.engine("e"))
    lease = led.lease(k(2), Owner.engine("e"), ttl_s=10)
    with pytest.raises(TierFullError):
        s.put(k(3), val(3))
    assert k(1) in s and k(2) in s
    led.release(lease)
    s.put(k(3), val(3))
    assert k(2) not in s and k(1) in s
    assert not led.knows(k(2))  # dropped from the store = forgotten by the ledger


def test_lifetimes_request_session_prefix(tmp_path) -> None:  # type: ignore[no-untyped-def]
    clock = Clock()
    led = Ledger(clock=clock)
    policy = LifetimePolicy().with_rule(Lifetime.SESSION, LifetimeRule(ttl_s=60))
    s = TieredStore([HostTier(16 * 64, 64, name="host")], led, policy, clock=clock)
    chain(s, range(0, 3), lifetime=Lifetime.PREFIX)
    chain(s, range(10, 13), lifetime=Lifetime.REQUEST, request_id="r1")
    s.put(k(20), val(20), lifetime=Lifetime.REQUEST, request_id="r2")
    s.promote(k(20), Lifetime.SESSION)
    s.put(k(30), val(30), lifetime=Lifetime.SESSION)
    assert s.end_request("r1") == 3
    assert all(k(i) not in s for i in range(10, 13))
    assert s.end_request("r2") == 0 and k(20) in s  # promoted: survives its request
    clock.t += 50
    assert s.lookup([k(30)]).prefix_blocks == 1  # a hit renews the session TTL
    clock.t += 50
    assert s.expire() == 1  # k(20) idle for 100 s > 60 s; k(30) idle for 50 s
    assert k(20) not in s and k(30) in s
    clock.t += 61
    s.expire()
    assert k(30) not in s
    led.pin(k(2), Owner.engine("reader"))
    clock.t += 10_000
    s.expire()
    assert all(k(i) in s for i in range(3))  # prefix blocks have no TTL


def test_write_through_and_restart_adoption(tmp_path) -> None:  # type: ignore[no-untyped-def]
    host = HostTier(4 * 64, 64, name="host")
    disk = DiskTier(tmp_path, 1 << 20, name="disk")
    s = TieredStore([host, disk], tier_policies={"disk": TierPolicy(write=WriteMode.THROUGH)})
    chain(s, range(3))
    assert all(s.where(k(i)) == ("host", "disk") for i in range(3))
    s2 = TieredStore([HostTier(4 * 64, 64, name="host"), DiskTier(tmp_path, 1 << 20, name="disk")])
    res = s2.lookup([k(0), k(1), k(2)])
    assert res.prefix_blocks == 3 and set(res.tiers) == {"disk"}
    assert s2.ledger.owner_of(k(0)) == Owner.pool()


def test_corrupt_lower_copy_is_a_clean_miss(tmp_path) -> None:  # type: ignore[no-untyped-def]
    disk = DiskTier(tmp_path, 1 << 20, name="disk")
    s = TieredStore([disk])
    s.put(k(1), val(1, 100))
    p, off, _ = disk.locate(k(1))
    raw = bytearray(p.read_bytes())
    raw[off] ^= 1
    p.write_bytes(raw)
    dst = bytearray(b"\x00" * 100)
    with pytest.raises(BlockNotFoundError):
        s.get_into(k(1), dst)
    assert k(1) not in s and not disk.contains(k(1))  # the bad file is gone: next time a plain miss
    with pytest.raises(BlockNotFoundError):
        disk.get_into(k(1), dst)


def test_disk_tier_reports_corruption_to_direct_callers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    disk = DiskTier(tmp_path, 1 << 20, name="disk")
    disk.put(k(1), val(1, 100))
    p, off, n = disk.locate(k(1))
    raw = bytearray(p.read_bytes())
    raw[off + n - 1] ^= 1
    p.write_bytes(raw)
    with pytest.raises(CorruptBlockError):
        disk.get_into(k(1), bytearray(100))


def test_full_tier_falls_through_to_the_next(tmp_path) -> None:  # type: ignore[no-untyped-def]
    host = FaultTier(HostTier(4 * 64, 64, name="host"))
    disk = DiskTier(tmp_path, 1 << 20, name="disk")
    s = TieredStore([host, disk])
    host.arm("put", TierFullError("injected ENOSPC"), times=1)
    assert s.put(k(1), val(1)) == "disk"
    assert s.put(k(2), val(2)) == "host"


def test_prefetch_promotes_lower_hits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    host = HostTier(4 * 64, 64, name="host")
    disk = DiskTier(tmp_path, 1 << 20, name="disk")
    disk.put(k(1), val(1))
    disk.put(k(2), val(2))
    s = TieredStore([host, disk])
    assert s.prefetch([k(1), k(2), k(3)]).result(timeout=10) == 2
    assert s.where(k(1)) == ("host", "disk")
    s.close()


def test_broken_tier_is_skipped_reported_and_recovers(redis_server, caplog) -> None:  # type: ignore[no-untyped-def]
    from kvport.tiers import RedisTier

    caplog.set_level("WARNING", logger="kvport.store.health")
    clock = Clock()
    host = HostTier(4 * 64, 64, name="host")
    red = RedisTier(redis_server.url, prefix="store-broken:", socket_timeout_s=2, name="redis")
    s = TieredStore([host, red], tier_policies={"redis": TierPolicy(write=WriteMode.THROUGH)}, clock=clock,
                    retry_broken_s=5)
    chain(s, range(6))  # host holds 4 (after demoting leaves), redis holds all 6
    before = s.lookup([k(i) for i in range(6)])
    assert before.prefix_blocks == 6 and "redis" in before.tiers
    redis_server.stop()
    try:
        dst = bytearray(32)
        on_host = [i for i in range(6) if "host" in s.where(k(i))]
        only_redis = [i for i in range(6) if s.where(k(i)) == ("redis",)]
        assert only_redis
        with pytest.raises(BlockNotFoundError):
            s.get_into(k(only_redis[0]), dst)  # a miss, not a crash
        assert s.stats().broken == ("redis",)
        assert sample("tier_broken", {"tier": "redis"}) == 1
        down = [r for r in caplog.records if "tier redis is down" in r.getMessage()]
        assert len(down) == 1 and down[0].levelname == "WARNING"  # said once, not only a gauge
        for i in on_host:
            assert s.get_into(k(i), dst) == 32 and dst == val(i)  # still served from the host
        assert s.lookup([k(only_redis[0])]).prefix_blocks == 0
        s.put(k(50), val(50))  # puts keep working on the healthy tier
        assert s.where(k(50)) == ("host",)
    finally:
        redis_server.start()
    clock.t += 6  # past retry_broken_s: the next call probes and recovers
    s.put(k(60), val(60))
    assert s.stats().broken == ()
    assert sample("tier_broken", {"tier": "redis"}) == 0
    assert sum("tier redis is down" in r.getMessage() for r in caplog.records) == 1  # each change once
    assert any("tier redis is back" in r.getMessage() for r in caplog.records)
    assert "redis" in s.where(k(60))
    red.close()


def test_store_rejects_wrong_buffers() -> None:
    from kvport.errors import BufferMismatchError

    s = TieredStore([HostTier(2 * 64, 64, name="host")])
    s.put(k(1), np.arange(32, dtype=np.uint8))
    with pytest.raises(BufferMismatchError):
        s.get_into(k(1), bytearray(31))
    with pytest.raises(BufferMismatchError):
        s.get_into(k(1), b"x" * 64)


def test_ending_a_request_never_drops_a_pinned_descendant() -> None:
    led = Ledger()
    s = TieredStore([HostTier(8 * 64, 64, name="host")], led)
    s.put(k(1), val(1), lifetime=Lifetime.REQUEST, request_id="r")
    s.put(k(2), val(2), lifetime=Lifetime.PREFIX, parent=k(1))
    led.pin(k(2), Owner.engine("reader"))
    assert s.end_request("r") == 0
    assert k(1) in s and k(2) in s
    led.unpin(k(2), Owner.engine("reader"))
    assert s.end_request("r") == 1
    assert k(1) not in s and k(2) not in s  # the orphan goes with its parent
    assert not led.knows(k(2))


def test_put_many_writes_one_batch_per_tier_and_keeps_the_chain(tmp_path) -> None:  # type: ignore[no-untyped-def]
    host = HostTier(2 * 64, 64, name="host")
    disk = DiskTier(tmp_path, 1 << 20, name="disk")
    s = TieredStore([host, disk], tier_policies={"host": EXACT})
    assert s.put_many([(k(i), val(i)) for i in range(3)]) == ["disk"] * 3  # 3 blocks never fit 2 pages
    assert disk.slab_count == 1
    assert s.put_many([(k(i), val(i)) for i in range(3, 5)], parent=k(2)) == ["host"] * 2
    res = s.lookup([k(i) for i in range(5)])
    assert res.prefix_blocks == 5 and res.tiers == ("disk",) * 3 + ("host",) * 2
    s.put(k(9), val(9))  # host full: its leaf k(4) is demoted, never its parent k(3) first
    assert s.where(k(4)) == ("disk",) and s.where(k(3)) == ("host",)
    assert s.put_many([(k(0), val(0)), (k(7), val(7))]) == ["disk", "host"]  # k(0) held: block by block
    dst = bytearray(32)
    for i in (0, 1, 2, 3, 4, 7, 9):
        assert s.get_into(k(i), dst) == 32 and dst == val(i)


def test_a_shared_tier_is_asked_again_for_what_another_process_removed(redis_server) -> None:  # type: ignore[no-untyped-def]
    """A shared tier's blocks come and go with other processes: a lookup asks it about what this store
    found there before, ends the prefix at the first block gone, and a save can put it back under
    its parent (nothing is deleted there on this store's behalf)."""
    from kvport.tiers import RedisTier

    red = RedisTier(redis_server.url, prefix="store-stale:", socket_timeout_s=2, name="redis")
    other = RedisTier(redis_server.url, prefix="store-stale:", socket_timeout_s=2, name="redis")
    s = TieredStore([red])
    try:
        chain(s, range(6))
        keys = [k(i) for i in range(6)]
        assert s.lookup(keys).prefix_blocks == 6
        for i in (3, 4, 5):  # another process (an evicting pool, a load that found it damaged)
            other.delete(k(i))
        assert s.lookup(keys).prefix_blocks == 3
        assert s.where(k(4)) == () and s.where(k(2)) == ("redis",)
        s.put(k(3), val(3), parent=k(2))
        assert s.lookup(keys).prefix_blocks == 4 and other.contains_many(keys[:4]) == [True] * 4
        dst = bytearray(32)
        assert s.get_into(k(3), dst) == 32 and dst == val(3)
    finally:
        red.close()
        other.close()


def test_a_delete_that_fails_past_a_deadline_leaves_the_index_whole() -> None:
    """A shared tier's delete can fail with the caller's deadline (a stopped server): the block and
    its descendants leave this store's index all the same, never half (an entry without its record
    made every later lookup crash)."""
    from kvport.errors import DeadlineExceeded

    class Stalled(HostTier):
        def delete(self, key: bytes) -> bool:
            raise DeadlineExceeded("server unreachable within the load's deadline")

    s = TieredStore([Stalled(8 * 64, 64, name="host")])
    chain(s, range(4))
    keys = [k(i) for i in range(4)]
    assert s.delete(k(1))
    assert s.lookup(keys).prefix_blocks == 1
    assert all(s.where(k(i)) == () for i in (1, 2, 3))
    s.put(k(1), val(1), parent=k(0))
    assert s.lookup(keys).prefix_blocks == 2


def test_contains_many_finds_what_another_process_wrote_to_a_shared_folder(tmp_path) -> None:  # type: ignore[no-untyped-def]
    writer = TieredStore([DiskTier(tmp_path, 1 << 20, name="disk", shared=True, refresh_s=0.0)])
    reader = TieredStore([DiskTier(tmp_path, 1 << 20, name="disk", shared=True, refresh_s=0.0)])
    chain(writer, range(4))
    keys = [k(i) for i in range(6)]
    assert reader.contains_many(keys) == [True] * 4 + [False] * 2  # found by one probe of the shared folder
    assert reader.lookup(keys).prefix_blocks == 4  # adopted: indexed here now
    writer.delete(k(1))  # a gap: block 1 and its descendants go
    fresh = TieredStore([DiskTier(tmp_path, 1 << 20, name="disk", shared=True)])
    assert fresh.contains_many(keys) == [True] + [False] * 5
    assert reader.contains_many([]) == []


class Roomy(HostTier):
    """A lower tier on a "filesystem" of which another process leaves it ``room`` bytes in all."""

    room = 1 << 20

    def shortfall(self, nbytes: int, values: int) -> int:
        return max(0, nbytes - (self.room - self.used_bytes))


def test_keep_spillable_evicts_the_disk_first_then_host_leaves_and_a_refused_write_costs_none() -> None:
    """keep_spillable: a write to host is taken only while the disk could take every host block with
    it. Room comes from the disk's own victims first, then from host leaves in LRU order -- but
    only when their leaving makes it: a write refused anyway (the pinned block and it would not fit
    with every host leaf gone) drops none of them."""
    host, disk = HostTier(4 * 64, 64, name="host"), Roomy(16 * 64, 64, name="disk")
    s = TieredStore([host, disk], tier_policies={"host": EXACT}, keep_spillable=("host", "disk"))
    s.put(k(9), val(9))
    assert s.demote(k(9), "host") == "disk"
    s.put(k(0), val(0))
    s.ledger.pin(k(0), Owner.engine("e"))
    s.put(k(1), val(1))
    s.put(k(2), val(2))
    disk.room = disk.used_bytes + 32  # free 32 (96 once k9 left): k0 and k3 need 128 even without k1, k2
    with pytest.raises(TierFullError):
        s.put(k(3), val(3))
    assert [s.where(k(i)) for i in (9, 0, 1, 2, 3)] == [(), ("host",), ("host",), ("host",), ()]
    disk.room = 3 * 64  # free 192: k0, k2 and k3
    s.put(k(3), val(3))
    assert [s.where(k(i)) for i in (0, 1, 2, 3)] == [("host",), (), ("host",), ("host",)]
