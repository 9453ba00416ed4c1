"""The server's store (host pages + journaled disk, one ledger): exact eviction and demotion order,
prefix-aware eviction, pins and leases respected, quotas as a store policy, restart from the journal."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvport.errors import BlockNotFoundError, QuotaExceededError, TierFullError
from kvport.ledger import Owner
from kvport.lifetime import Lifetime
from kvport.server.storage import DISK, HOST, open_storage
from kvport.store import TieredStore

PAGE = 4096
CLIENT = Owner.client("a/test")


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def val(i: int, n: int = PAGE) -> bytes:
    return bytes([i % 251]) * n


def storage(tmp: Path | None, host_pages: int = 4, disk_bytes: int = 4 * PAGE,
            quotas: dict[str, int] | None = None) -> TieredStore:
    return open_storage(host_pages * PAGE, PAGE, tmp, disk_bytes, quotas or {}, 16 * PAGE)


def put(s: TieredStore, i: int, parent: int | None = None, account: str = "a", n: int = PAGE) -> str:
    return s.put(k(i), val(i, n), parent=None if parent is None else k(parent), account=account, origin=CLIENT)


def test_host_victims_are_demoted_oldest_first_and_a_hit_refreshes(tmp_path: Path) -> None:
    s = storage(tmp_path, host_pages=4, disk_bytes=8 * PAGE)
    for i in range(4):
        put(s, i)
    s.lookup([k(0)])  # a hit: 0 is now the most recent
    put(s, 4)
    put(s, 5)
    assert [s.where(k(i)) for i in range(6)] == [(HOST,), (DISK,), (DISK,), (HOST,), (HOST,), (HOST,)]
    out = bytearray(PAGE)
    assert s.get_into(k(1), out) == PAGE and out == val(1)  # read back from disk, checksummed
    s.close()


def test_a_parent_never_leaves_before_its_children(tmp_path: Path) -> None:
    """Prefix-aware eviction: with host and disk full, the pool drops leaves of the chain, never a
    block whose child is still stored (such a child could never be hit)."""
    s = storage(tmp_path, host_pages=2, disk_bytes=3 * PAGE)
    put(s, 0)
    for i in range(1, 5):  # a chain 0 <- 1 <- 2 <- 3 <- 4, oldest first: the parents are the LRU victims
        put(s, i, parent=i - 1)
    for j in range(10, 14):
        put(s, j)
        for i in range(1, 5):
            if k(i) in s:
                assert k(i - 1) in s, f"block {i} kept without its parent"
    assert s.stats().drops >= 1
    s.close()


def test_pinned_and_leased_blocks_never_move_and_a_full_store_is_typed(tmp_path: Path) -> None:
    s = storage(None, host_pages=2)
    put(s, 0)
    put(s, 1)
    s.ledger.pin(k(0), CLIENT, "system prompt", ttl_s=60)
    lease = s.ledger.lease(k(1), CLIENT, ttl_s=60)
    with pytest.raises(TierFullError):
        put(s, 2)
    assert k(0) in s and k(1) in s
    assert s.reserve(k(3), PAGE, account="a") is None  # no zero-copy room either: the caller stages
    s.ledger.release(lease)
    put(s, 2)
    assert k(1) not in s and k(0) in s  # the leased block could go once released; the pinned one stays
    s.close()


def test_quota_drops_only_the_tenants_own_blocks(tmp_path: Path) -> None:
    s = storage(None, host_pages=8, quotas={"a": 2 * PAGE})
    put(s, 0, account="b")
    put(s, 1, account="a")
    put(s, 2, account="a")
    put(s, 3, account="a")  # over a's quota: a's least recent block goes, b's stays
    assert k(0) in s and k(1) not in s and k(2) in s and k(3) in s
    assert s.usage("a") == (2 * PAGE, 2) and s.usage("b") == (PAGE, 1)
    s.ledger.pin(k(2), CLIENT)
    s.ledger.pin(k(3), CLIENT)
    with pytest.raises(QuotaExceededError):
        put(s, 4, account="a")
    with pytest.raises(QuotaExceededError):
        put(s, 5, account="a", n=3 * PAGE)  # can never fit
    s.close()


def test_reserved_room_counts_and_its_parent_cannot_leave(tmp_path: Path) -> None:
    s = storage(None, host_pages=3)
    put(s, 0)
    res = s.reserve(k(1), 2 * PAGE, parent=k(0), account="a", origin=CLIENT)
    assert res is not None and len(res.views) == 2
    with pytest.raises(TierFullError):
        put(s, 9)  # the pool is full: one committed page + two reserved; the parent may not leave
    for v, i in zip(res.views, (7, 8), strict=True):
        v[:] = val(i)
    assert k(1) not in s  # invisible until committed
    s.commit(res, attrs=b"x")
    out = bytearray(2 * PAGE)
    assert s.get_into(k(1), out) == 2 * PAGE and out == val(7) + val(8)
    rec = s.ledger.record(k(1))
    assert rec.owner == Owner.pool() and rec.origin == CLIENT
    res2 = s.reserve(k(2), PAGE)
    assert res2 is None or res2.key == k(2)
    if res2 is not None:
        s.abort(res2)
    assert k(2) not in s
    s.close()


def test_restart_finds_every_disk_block_with_its_parent_tenant_and_lifetime(tmp_path: Path) -> None:
    s = storage(tmp_path, host_pages=4, disk_bytes=16 * PAGE)
    s.put(k(0), val(0), account="a", lifetime=Lifetime.SESSION, ttl_s=300.0, attrs=b"attrs-0")
    s.put(k(1), val(1), parent=k(0), account="a", lifetime=Lifetime.SESSION, ttl_s=300.0)
    s.put(k(2), val(2), account="b")
    moved, stayed = s.spill(HOST)
    assert (moved, stayed) == (3, 0)
    for t in s.tiers.values():
        t.close()
    s2 = storage(tmp_path, host_pages=4, disk_bytes=16 * PAGE)
    assert all(s2.where(k(i)) == (DISK,) for i in range(3))
    assert s2.parent_of(k(1)) == k(0) and s2.lifetime_of(k(1)) is Lifetime.SESSION
    assert s2.meta_of(k(0)).attrs == b"attrs-0"  # type: ignore[union-attr]
    assert s2.usage("a") == (2 * PAGE, 2) and s2.usage("b") == (PAGE, 1)
    assert s2.ledger.owner_of(k(1)) == Owner.pool()
    with pytest.raises(Exception, match="in use by another process"):
        storage(tmp_path)  # one server per folder: the second is refused at start
    for t in s2.tiers.values():
        t.close()


def test_a_child_whose_parent_did_not_survive_is_dropped_at_restart(tmp_path: Path) -> None:
    s = storage(tmp_path, host_pages=4, disk_bytes=16 * PAGE)
    put(s, 0)
    put(s, 1, parent=0)
    s.spill(HOST)
    disk = s.tiers[DISK]
    disk.delete(k(0))  # the parent's bytes and record are gone (say, a crash between two deletes)
    for t in s.tiers.values():
        t.close()
    s2 = storage(tmp_path, host_pages=4, disk_bytes=16 * PAGE)
    assert k(1) not in s2 and s2.orphans_dropped == 1
    for t in s2.tiers.values():
        t.close()


def _close(s: TieredStore) -> None:
    for t in s.tiers.values():
        t.close()


def test_a_graceful_shutdown_finds_room_on_a_full_disk_for_every_host_block(tmp_path: Path) -> None:
    """A hot parent (a system prompt hit by every request) stays on host while its children go down
    until the disk is full. The disk keeps room for the host pool that eviction does not use, so
    the shutdown's spill moves every host block down and the restart finds every block (before,
    the parent found no room, stayed, died with the process, and the restart dropped its children)."""
    s = storage(tmp_path, host_pages=4, disk_bytes=16 * PAGE)
    put(s, 0)
    for i in range(1, 40):
        put(s, i, parent=0)
        s.lookup([k(0)])  # the shared prefix: always the most recent
    assert s.where(k(0)) == (HOST,)
    before = {key: s.where(key) for key in s.blocks()}
    assert sum(1 for w in before.values() if w == (DISK,)) >= 8  # the disk filled up to what eviction may use
    moved, stayed = s.spill(HOST)
    assert stayed == 0 and moved == sum(1 for w in before.values() if w == (HOST,))
    assert all(s.where(key) == (DISK,) for key in before)  # the spill evicted nothing below
    _close(s)
    s2 = storage(tmp_path, host_pages=4, disk_bytes=16 * PAGE)
    assert s2.orphans_dropped == 0 and sorted(s2.blocks()) == sorted(before)
    _close(s2)


def test_with_too_little_room_the_spill_moves_the_parents_of_disk_blocks_first(tmp_path: Path) -> None:
    """No reserve, one free page on disk, two host blocks: the parent of blocks already on disk goes
    down (it keeps them reachable), not the newest block (the order of a spill otherwise)."""
    def open_(reserve: bool) -> TieredStore:
        return open_storage(2 * PAGE, PAGE, tmp_path, 4 * PAGE, {}, 16 * PAGE, spill_reserve=reserve)

    s = open_(False)
    put(s, 0)
    for i in (1, 2, 3):
        put(s, i, parent=0)
        s.lookup([k(0)])
    put(s, 9)  # the newest host block, unrelated
    assert s.where(k(0)) == (HOST,) and s.where(k(9)) == (HOST,)
    on_disk = [key for key in s.blocks() if s.where(key) == (DISK,)]
    assert on_disk and all(s.parent_of(key) == k(0) for key in on_disk)
    free_pages = (s.tiers[DISK].capacity_bytes - s.tiers[DISK].used_bytes) // PAGE
    assert free_pages == 1
    assert s.spill(HOST) == (1, 1)
    assert s.where(k(0)) == (DISK,) and s.where(k(9)) == (HOST,)
    _close(s)
    s2 = open_(False)
    assert s2.orphans_dropped == 0 and all(key in s2 for key in [k(0), *on_disk])
    _close(s2)


def test_a_block_whose_bytes_are_lost_takes_only_unheld_descendants_with_it(tmp_path: Path) -> None:
    """Block 0's bytes vanish (a damaged disk file). Its descendants go with it, except a chain that
    leads to a pinned block: those bytes are intact and a client holds them. When 0 is stored again
    (an engine recomputed it), the kept chain hangs under it again."""
    s = storage(tmp_path, host_pages=8, disk_bytes=32 * PAGE)
    put(s, 0)
    for i, parent in ((1, 0), (2, 1), (3, 2), (5, 0), (6, 5)):
        put(s, i, parent=parent)
    s.ledger.pin(k(2), CLIENT, "a client keeps it", ttl_s=60)
    assert s.spill(HOST)[1] == 0
    s.tiers[DISK].delete(k(0))  # the bytes are gone; the store does not know yet
    with pytest.raises(BlockNotFoundError):
        s.get_into(k(0), bytearray(PAGE))
    assert k(0) not in s and k(5) not in s and k(6) not in s  # nobody held these
    assert all(k(i) in s for i in (1, 2, 3))  # the path to the pinned block and below it
    out = bytearray(PAGE)
    assert s.get_into(k(2), out) == PAGE and out == val(2)
    put(s, 0)  # recomputed and saved again
    assert s.children_of(k(0)) == 1 and s.parent_of(k(1)) == k(0)
    assert s.lookup([k(i) for i in range(4)]).prefix_blocks == 4
    _close(s)
