"""The catalog's plans: exact eviction order, pins and leases respected, typed rejections."""

from __future__ import annotations

import pytest

from kvport.errors import IllegalMoveError, LeaseError
from kvport.server.catalog import Catalog, Entry, Place, Placement
from kvport.server.limits import Rejected, RejectReason


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def fill(cat: Catalog, n: int, size: int, tenant: str = "a", place: Place = Place.HOST) -> None:
    for i in range(n):
        cat.add(k(i), Entry(tenant, k(i), size, place, length=size))


def test_host_victims_are_demoted_oldest_first_and_a_hit_refreshes() -> None:
    cat = Catalog(host_capacity=40, disk_capacity=100)
    fill(cat, 4, 10)
    cat.hit(k(0))  # order now 1, 2, 3, 0
    plan = cat.plan_put("a", 20, None)
    assert plan == Placement(Place.HOST, drops=(), demotes=(k(1), k(2)))


def test_disk_full_drops_oldest_disk_block_to_make_room_for_a_demotion() -> None:
    cat = Catalog(host_capacity=20, disk_capacity=20)
    cat.add(k(10), Entry("a", k(10), 10, Place.DISK, length=10))
    cat.add(k(11), Entry("a", k(11), 10, Place.DISK, length=10))
    fill(cat, 2, 10)
    plan = cat.plan_put("a", 10, None)
    assert plan == Placement(Place.HOST, drops=(k(10),), demotes=(k(0),))


def test_pinned_and_leased_blocks_never_move() -> None:
    cat = Catalog(host_capacity=30, disk_capacity=0)
    fill(cat, 3, 10)
    cat.pin(k(0))
    lease = cat.lease("a", holder=7, skeys=[k(1)], ttl_s=10, now=0.0)
    plan = cat.plan_put("a", 10, None)
    assert plan == Placement(Place.HOST, drops=(k(2),), demotes=())
    with pytest.raises(IllegalMoveError):
        cat.remove(k(1))
    assert cat.release_holder(7) == 1
    assert cat.get(k(1)).movable  # type: ignore[union-attr]
    with pytest.raises(LeaseError):
        cat.release(lease.lease_id, "a")


def test_full_of_pinned_blocks_is_a_typed_rejection_with_retry_after() -> None:
    cat = Catalog(host_capacity=20, disk_capacity=0, retry_after_s=0.25)
    fill(cat, 2, 10)
    cat.pin(k(0))
    cat.pin(k(1))
    rej = cat.plan_put("a", 10, None)
    assert rej == Rejected(RejectReason.FULL, 0.25, rej.detail)  # type: ignore[union-attr]
    assert cat.plan_put("a", 1000, None).reason is RejectReason.TOO_LARGE  # type: ignore[union-attr]


def test_quota_drops_only_the_tenants_own_blocks() -> None:
    cat = Catalog(host_capacity=100, disk_capacity=0)
    cat.add(k(0), Entry("b", k(0), 10, Place.HOST, length=10))
    cat.add(k(1), Entry("a", k(1), 10, Place.HOST, length=10))
    cat.add(k(2), Entry("a", k(2), 10, Place.HOST, length=10))
    assert cat.plan_put("a", 10, quota=20) == Placement(Place.HOST, drops=(k(1),), demotes=())
    cat.pin(k(1))
    cat.pin(k(2))
    assert cat.plan_put("a", 10, quota=20).reason is RejectReason.QUOTA  # type: ignore[union-attr]


def test_holds_count_as_used_and_leases_expire() -> None:
    cat = Catalog(host_capacity=20, disk_capacity=0)
    cat.hold(Place.HOST, 20)
    with pytest.raises(IllegalMoveError):
        cat.hold(Place.HOST, 1)
    cat.add(k(0), Entry("a", k(0), 20, Place.HOST, length=20), held=True)
    assert cat.host_used == 20 and cat.usage["a"] == 20
    cat.lease("a", 1, [k(0), k(9)], ttl_s=1.0, now=0.0)
    assert cat.expire(now=0.5) == 0 and cat.expire(now=1.0) == 1
    cat.remove(k(0))
    assert cat.host_used == 0 and cat.usage["a"] == 0
