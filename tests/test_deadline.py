"""Deadlines: the policy, the store's lock, a stalled server: no load waits past its deadline."""

from __future__ import annotations

import threading
import time

import pytest

from kvport.deadline import Deadline, DeadlinePolicy, current, timeout_for, within
from kvport.errors import ConfigError, DeadlineExceeded
from kvport.store import TieredStore
from kvport.tiers.host import HostTier


def test_policy_scales_the_expected_time_within_bounds() -> None:
    p = DeadlinePolicy(min_s=1.0, factor=4.0, max_s=30.0)
    assert p.seconds(0.1) == 1.0 and p.seconds(2.0) == 8.0 and p.seconds(100.0) == 30.0
    assert p.seconds(None) == 30.0 and p.seconds(float("nan")) == 30.0
    for bad in ({"min_s": 0.0}, {"factor": float("inf")}, {"min_s": 5.0, "max_s": 1.0}):
        with pytest.raises(ConfigError):
            DeadlinePolicy(**bad)  # type: ignore[arg-type]


def test_a_deadline_bounds_every_wait_inside_it() -> None:
    d = Deadline.after(0.2)
    assert current() is None and timeout_for(30.0) == 30.0
    with within(d):
        assert current() is d and timeout_for(30.0) <= 0.2
    time.sleep(0.25)
    with pytest.raises(DeadlineExceeded):
        d.check()


def test_a_load_does_not_wait_for_the_stores_lock_past_its_deadline() -> None:
    store = TieredStore([HostTier(4 * 64, 64, name="host")])
    store.put(b"k" * 16, b"v" * 64)
    held, done = threading.Event(), threading.Event()

    def hog() -> None:
        with store.holding():  # another thread holds the store (a long write, say)
            held.set()
            done.wait(10)

    t = threading.Thread(target=hog)
    t.start()
    held.wait(5)
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        store.get_into(b"k" * 16, bytearray(64), deadline=Deadline.after(0.3))
    assert time.monotonic() - t0 < 5.0  # gave up at its deadline, not when the lock came free
    done.set()
    t.join()
    assert store.get_into(b"k" * 16, bytearray(64), deadline=Deadline.after(5.0)) == 64
