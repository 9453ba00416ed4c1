import pytest

from kvport.errors import IllegalMoveError, LeaseError, UnknownBlockError
from kvport.ledger import BlockState, Ledger, Move, Owner

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
    led = Ledger()
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
    led.release(lease)
    with pytest.raises(LeaseError):
        led.release(lease)  # double release
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
    tid = led.begin_transfer([C], DECODE, Owner.engine("other"))
    assert led.leak_report(live_owners=[PREFILL, DECODE]).clean
    clock.t += 2
    rep = led.leak_report(live_owners=[DECODE])
    assert rep.orphaned == ((A, PREFILL),)
    assert rep.stale_pins == ((B, PREFILL),)
    assert rep.expired_leases == (lease,)
    assert led.transfer(tid) is not None  # the transfer's source is live: not a leak
    rep2 = led.leak_report(live_owners=[])
    assert (C, Owner.transfer(tid)) in rep2.orphaned
