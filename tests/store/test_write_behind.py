"""Write-behind (WriteMode.BEHIND): a put returns once the top tier has the blocks; the store's writer
thread copies them into the tier below, in order, bounded, best effort."""

import threading
from collections.abc import Iterator

import pytest

from kvport.client.port import StoreConfig, open_store
from kvport.errors import ConfigError, TierUnavailableError
from kvport.metrics import sample
from kvport.store import TieredStore, TierPolicy, WriteMode
from kvport.tiers import FaultTier, HostTier
from kvport.tiers.base import Buffer

BLOCK = 4096


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def val(i: int) -> bytes:
    return bytes([i % 251]) * BLOCK


class GatedTier(FaultTier):
    """Puts wait until the gate opens: a slow tier below, on demand."""

    def __init__(self, inner: HostTier) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)

    def put(self, key: bytes, data: Buffer, *, ttl_s: float | None = None) -> None:
        self.entered.release()
        self.gate.wait(30)
        super().put(key, data, ttl_s=ttl_s)


def two_tiers(below: HostTier | FaultTier) -> TieredStore:
    top = HostTier(64 * BLOCK, BLOCK, name="host")
    return TieredStore([top, below], tier_policies={below.name: TierPolicy(write=WriteMode.BEHIND)})


Gated = tuple[GatedTier, TieredStore]


@pytest.fixture
def gated() -> Iterator[Gated]:
    """A host tier over a gated one written behind; the gate opens and the store closes at the end."""
    below = GatedTier(HostTier(64 * BLOCK, BLOCK, name="shared"))
    store = two_tiers(below)
    yield below, store
    below.gate.set()
    store.close()


def test_puts_return_before_the_tier_below_has_them_then_it_gets_every_byte(gated: Gated) -> None:
    below, store = gated
    store.put_many([(k(i), val(i)) for i in range(8)])  # returns with the writer stuck at the gate
    assert below.entered.acquire(timeout=10)
    assert all(store.where(k(i)) == ("host",) for i in range(8))
    order: list[bool] = []
    store.after_writes(lambda: order.append(all(store.where(k(i)) == ("host", "shared") for i in range(8))))
    assert order == []  # queued behind the blocks, not run yet
    below.gate.set()
    assert store.flush_behind(10)
    assert order == [True]  # ran after every block queued before it was written
    for i in range(8):
        dst = bytearray(BLOCK)
        assert below.get_into(k(i), dst) == BLOCK and bytes(dst) == val(i)


def test_the_queue_is_bounded_a_put_past_it_waits_for_the_writer(gated: Gated) -> None:
    below, store = gated
    assert store._behind is not None
    store._behind.max_pending_bytes = 4 * BLOCK
    done = threading.Event()
    store.put_many([(k(i), val(i)) for i in range(4)])  # fills the bound
    assert below.entered.acquire(timeout=10)

    def more() -> None:
        store.put(k(100), val(100))
        done.set()

    t = threading.Thread(target=more)
    t.start()
    assert not done.wait(0.5)  # waits: the writer is stuck, the queue is full
    assert store._behind.pending_bytes <= 4 * BLOCK + BLOCK
    below.gate.set()
    assert done.wait(10)
    t.join(10)
    assert store.flush_behind(10)
    assert store.where(k(100)) == ("host", "shared")


def test_a_put_waits_no_longer_than_max_wait_then_the_newest_copies_are_dropped_callbacks_kept(gated: Gated) -> None:
    below, store = gated
    assert store._behind is not None
    store._behind.max_pending_bytes, store._behind.max_wait_s = 2 * BLOCK, 0.3
    ran: list[int] = []
    before = sample("store_behind_dropped_total", {"tier": "shared"}) or 0.0
    store.put_many([(k(i), val(i)) for i in range(2)])  # the writer sticks on k(0)
    assert below.entered.acquire(timeout=10)
    store.after_writes(lambda: ran.append(1))
    store.put(k(7), val(7))  # over the bound with the writer stuck: waits 0.3 s, then sheds k(7)'s copy
    assert (sample("store_behind_dropped_total", {"tier": "shared"}) or 0.0) - before == 1
    dst = bytearray(BLOCK)
    assert store.get_into(k(7), dst) == BLOCK and bytes(dst) == val(7)  # the put itself is whole
    below.gate.set()
    assert store.flush_behind(10)
    assert ran == [1]  # the callback queued before the shed still ran, after the blocks before it
    assert store.where(k(1)) == ("host", "shared") and store.where(k(7)) == ("host",)


def test_a_tier_below_that_fails_loses_only_its_copy_counted() -> None:
    below = FaultTier(HostTier(64 * BLOCK, BLOCK, name="shared"))
    store = two_tiers(below)
    try:
        before = sample("store_behind_dropped_total", {"tier": "shared"}) or 0.0
        below.arm("put", TierUnavailableError("down"), times=None)
        store.put_many([(k(i), val(i)) for i in range(3)])
        assert store.flush_behind(10)
        assert (sample("store_behind_dropped_total", {"tier": "shared"}) or 0.0) - before == 3
        dst = bytearray(BLOCK)
        assert store.get_into(k(1), dst) == BLOCK and bytes(dst) == val(1)  # still served from the top
        below.disarm()
    finally:
        store.close()


def test_a_block_gone_before_its_turn_is_skipped(gated: Gated) -> None:
    below, store = gated
    store.put_many([(k(1), val(1)), (k(2), val(2))])
    assert below.entered.acquire(timeout=10)  # k(1) is being written; k(2) waits its turn
    store.delete(k(2))
    below.gate.set()
    assert store.flush_behind(10)
    assert not below.contains(k(2)) and store.where(k(2)) == ()


def test_config_refuses_a_top_tier_behind_and_a_tier_both_ways(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="top tier"):
        TieredStore([HostTier(4 * BLOCK, BLOCK, name="host")],
                    tier_policies={"host": TierPolicy(write=WriteMode.BEHIND)})
    with pytest.raises(ConfigError, match="both"):
        StoreConfig(block_bytes=BLOCK, host_bytes=4 * BLOCK, disk_dir=tmp_path, disk_bytes=8 * BLOCK,
                    write_through=("disk",), write_behind=("disk",))
    with pytest.raises(ConfigError, match="does not have"):
        open_store(StoreConfig(block_bytes=BLOCK, host_bytes=4 * BLOCK, write_behind=("shared",)))
    store = open_store(StoreConfig(block_bytes=BLOCK, host_bytes=4 * BLOCK, disk_dir=tmp_path, disk_bytes=8 * BLOCK,
                                   write_behind=("disk",)))
    try:
        store.put(k(1), val(1))
        assert store.flush_behind(10) and store.where(k(1)) == ("host", "disk")
    finally:
        store.close()
