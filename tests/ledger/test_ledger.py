import pytest

from kvport.errors import IllegalMoveError, LeaseError, LeaseExpiredError, UnknownBlockError, UnknownPeerError
from kvport.ledger import BlockState, Ledger, Move, Owner
from kvport.lifetime import Lifetime

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16
PREFILL, DECODE, POOL = Owner.engine("prefill"), Owner.engine("decode"), Owner.pool()


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_one_owner_and_recorded_hand_off() -> None:
    led = Ledger(clock=Clock())
    led.register(A, PREFILL)
    with pytest.raises(UnknownPeerError):
        led.hand_off(A, PREFILL, DECODE)  # DECODE is nobody this ledger knows: nothing changes
    assert led.owner_of(A) == PREFILL and len(led.history) == 2
    led.add_owner(DECODE)
    with pytest.raises(IllegalMoveError):
        led.register(A, DECODE)  # never two owners
    with pytest.raises(IllegalMoveError):
        led.hand_off(A, DECODE, POOL)  # not the owner
    led.hand_off(A, PREFILL, DECODE)
    assert led.owner_of(A) == DECODE and led.state_of(A) is BlockState.COMMITTED
    led.hand_off(A, DECODE, POOL)
    assert led.state_of(A) is BlockState.SHARED
    moves = [(r.move, r.owner_from, r.owner_to) for r in led.history]
    assert moves == [(Move.REGISTER, None, PREFILL), (Move.COMMIT, PREFILL, PREFILL),
                     (Move.HAND_OFF, PREFILL, DECODE), (Move.SHARE, DECODE, POOL)]
    with pytest.raises(UnknownBlockError):
        led.owner_of(B)


def test_allocated_block_must_commit_before_moving() -> None:
    led = Ledger(owners=[DECODE])
    led.register(A, PREFILL, committed=False)
    assert led.state_of(A) is BlockState.ALLOCATED
    assert not led.is_evictable(A)
    with pytest.raises(IllegalMoveError):
        led.hand_off(A, PREFILL, DECODE)
    with pytest.raises(IllegalMoveError):
        led.commit(A, DECODE)
    led.commit(A, PREFILL)
    assert led.state_of(A) is BlockState.COMMITTED


def test_transfer_is_all_or_nothing_and_abort_returns_blocks() -> None:
    led = Ledger()
    led.register(A, PREFILL)
    led.register(B, PREFILL)
    led.register(C, DECODE)
    with pytest.raises(IllegalMoveError):
        led.begin_transfer([A, B, C], PREFILL, DECODE)
    assert {led.owner_of(k) for k in (A, B)} == {PREFILL}  # nothing moved
    tid = led.begin_transfer([A, B], PREFILL, DECODE)
    assert led.owner_of(A) == Owner.transfer(tid) and led.state_of(B) is BlockState.IN_TRANSFER
    with pytest.raises(IllegalMoveError):
        led.forget(A)
    with pytest.raises(IllegalMoveError):
        led.hand_off(A, PREFILL, DECODE)
    led.abort_transfer(tid)
    assert led.owner_of(A) == PREFILL and led.state_of(A) is BlockState.COMMITTED
    with pytest.raises(IllegalMoveError):
        led.commit_transfer(tid)  # already closed
    tid2 = led.begin_transfer([A, B], PREFILL, POOL)
    led.commit_transfer(tid2)
    assert led.owner_of(B) == POOL and led.state_of(B) is BlockState.SHARED


def test_leases_and_pins_block_eviction_until_released_or_expired() -> None:
    clock = Clock()
    led = Ledger(clock=clock)
    led.register(A, POOL)
    lease = led.lease(A, DECODE, ttl_s=5)
    assert not led.is_evictable(A)
    with pytest.raises(IllegalMoveError):
        led.forget(A)
    clock.t += 6
    assert led.is_evictable(A)  # an expired lease no longer protects the block
    with pytest.raises(LeaseExpiredError):
        led.release(lease)  # it lapsed at its TTL: releasing it changes nothing
    assert led.leases() == [lease]
    assert led.expire().leases == 1 and led.leases() == []
    with pytest.raises(LeaseError):
        led.release(lease)  # reaped: not held any more
    live = led.lease(A, DECODE, ttl_s=5)
    led.release(live)
    with pytest.raises(LeaseError):
        led.release(live)  # double release
    led.pin(A, DECODE)
    led.pin(A, DECODE)
    led.unpin(A, DECODE)
    assert not led.is_evictable(A)
    led.unpin(A, DECODE)
    with pytest.raises(LeaseError):
        led.unpin(A, DECODE)
    assert led.is_evictable(A)
    led.forget(A)
    assert not led.knows(A)
    assert led.history[-1].state_to is BlockState.FREED


def test_leak_report() -> None:
    clock = Clock()
    led = Ledger(clock=clock)
    led.register(A, PREFILL)  # prefill dies holding A
    led.register(B, POOL)
    led.pin(B, PREFILL)  # and holding a pin on B
    lease = led.lease(B, DECODE, ttl_s=1)
    led.register(C, DECODE)
    led.add_peer(Owner.engine("other"))
    tid = led.begin_transfer([C], DECODE, Owner.engine("other"))
    assert led.leak_report(live_owners=[PREFILL, DECODE]).clean
    clock.t += 2
    rep = led.leak_report(live_owners=[DECODE])
    assert rep.orphaned == ((A, PREFILL),)
    assert [(p.key, p.holder) for p in rep.stale_pins] == [(B, PREFILL)]
    assert rep.expired_leases == (lease,)
    assert led.transfer(tid) is not None  # the transfer's source is live: not a leak
    rep2 = led.leak_report(live_owners=[])
    assert (C, Owner.transfer(tid)) in rep2.orphaned


def test_hand_off_across_processes_is_recorded_on_both_sides_with_the_transfer_id() -> None:
    sender, receiver = Ledger(clock=Clock()), Ledger(clock=Clock())
    sender.register(A, PREFILL)
    sender.register(B, PREFILL)
    with pytest.raises(UnknownPeerError):
        sender.begin_transfer([A, B], PREFILL, DECODE)  # not introduced yet
    assert sender.state_of(A) is BlockState.COMMITTED
    sender.add_peer(DECODE)
    receiver.add_peer(PREFILL)
    tid = sender.begin_transfer([A, B], PREFILL, DECODE)
    receiver.acquire([A, B], DECODE, PREFILL, tid)
    sender.commit_transfer(tid)
    assert not sender.knows(A) and not sender.knows(B)  # the blocks left this process
    handed = [r for r in sender.history if r.move is Move.HANDED_OFF]
    assert [(r.key, r.owner_to, r.tid, r.state_to) for r in handed] == [
        (A, DECODE, tid, BlockState.HANDED_OFF), (B, DECODE, tid, BlockState.HANDED_OFF)]
    got = [r for r in receiver.history if r.move is Move.ACQUIRE]
    assert [(r.key, r.owner_from, r.owner_to, r.tid) for r in got] == [(A, PREFILL, DECODE, tid),
                                                                        (B, PREFILL, DECODE, tid)]
    rec = receiver.record(A)
    assert rec.owner == DECODE and rec.origin == PREFILL and rec.tid == tid and rec.state is BlockState.COMMITTED


def test_acquire_is_all_or_nothing_and_refuses_a_second_owner_or_a_stranger() -> None:
    led = Ledger(peers=[PREFILL])
    led.register(B, POOL)
    with pytest.raises(IllegalMoveError):
        led.acquire([A, B], DECODE, PREFILL, "t1")  # B already has an owner
    assert not led.knows(A)  # nothing changed
    with pytest.raises(UnknownPeerError):
        led.acquire([A], DECODE, Owner.engine("stranger"), "t2")
    assert not led.knows(A)
    with pytest.raises(IllegalMoveError):
        led.acquire([A, A], DECODE, PREFILL, "t3")
    led.acquire([A], DECODE, PREFILL, "t4")
    assert led.owner_of(A) == DECODE


def test_pins_carry_holder_reason_since_and_lapse_at_their_ttl() -> None:
    clock = Clock()
    led = Ledger(clock=clock)
    led.register(A, POOL, lifetime=Lifetime.SESSION, origin=Owner.client("t/c1"))
    holder = Owner.client("t/c1")
    p = led.pin(A, holder, "system prompt", ttl_s=10)
    assert (p.holder, p.reason, p.since, p.expires_at, p.count) == (holder, "system prompt", 100.0, 110.0, 1)
    rec = led.record(A)
    assert rec.lifetime is Lifetime.SESSION and rec.origin == holder and rec.pins == (p,)
    clock.t += 5
    p2 = led.pin(A, holder, ttl_s=10)  # renewed: same reason, later expiry
    assert (p2.count, p2.reason, p2.since, p2.expires_at) == (2, "system prompt", 105.0, 115.0)
    assert not led.is_evictable(A)
    clock.t += 11
    assert led.is_evictable(A)  # lapsed: protects nothing, even before it is reaped
    assert [x.holder for x in led.leak_report().stale_pins] == [holder]
    assert led.expire().pins == 1 and led.pins_of(A) == {}
    assert led.leak_report().clean
    with pytest.raises(LeaseError):
        led.pin(A, holder, ttl_s=-1)


def test_a_lease_on_a_block_that_leaves_holds_nothing_more() -> None:
    led = Ledger(clock=Clock())
    led.register(A, POOL)
    led.register(B, POOL)
    lease = led.lease_many([A, B], Owner.client("x"), ttl_s=5)
    led.release_id(lease.lease_id, Owner.client("x"))
    assert led.is_evictable(A) and led.is_evictable(B)
    with pytest.raises(UnknownBlockError):
        led.lease_many([A, C], Owner.client("x"), ttl_s=5)  # all or nothing
    assert led.leases() == []


def test_records_are_charged_to_their_account_and_their_footprint_bounds_their_memory() -> None:
    """Leases and pins are charged to the account the caller names (the holder's name by default),
    however another connection of the same holder releases them; the footprint is an upper bound of
    what the records really allocate (tracemalloc, worst case: a fresh table per block) and falls
    back to 0 when they are gone (release, unpin, lapse)."""
    import gc
    import tracemalloc

    from kvport.ledger import PIN_BYTES, lease_bytes

    clock = Clock()
    led = Ledger(clock=clock)
    keys = [i.to_bytes(16, "little") for i in range(3000)]
    for key in keys:
        led.register(key, POOL)
    holder = Owner.client("t/x")
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    leases = [led.lease(key, holder, 10, account="t#1") for key in keys[:1000]]
    leases.append(led.lease_many(keys[1000:2000], holder, 10, account="t#2"))
    for key in keys[2000:]:
        led.pin(key, holder, ttl_s=5)  # charged to the holder's name
    grew = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert led.footprint() == 1000 * lease_bytes(1) + lease_bytes(1000) + 1000 * PIN_BYTES
    assert grew <= led.footprint(), f"{grew} bytes allocated, {led.footprint()} charged"
    assert (led.held_by("t#1"), led.held_by("t#2"), led.held_by(holder)) == (1000, 1000, 1000)
    led.pin(keys[2000], Owner.client("t/y"), account="t#2")  # another holder's pin on the same block
    assert led.held_by("t#2") == 1001
    for lease in leases[:500]:
        led.release(lease)
    assert led.held_by("t#1") == 500
    led.unpin(keys[2000], Owner.client("t/y"))
    clock.t += 6  # the holder's pins lapse
    led.expire()
    assert led.held_by(holder) == 0 and led.held_by("t#2") == 1000
    led.release(leases[-1])
    clock.t += 5  # the rest of the leases lapse
    led.expire()
    assert led.footprint() == 0 and led.held_by("t#1") == 0
