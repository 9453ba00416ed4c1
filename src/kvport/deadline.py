"""Deadlines: every load has one, and nothing waits past it (a late load is a miss: recompute).

::

    policy = DeadlinePolicy(min_s=1.0, factor=4.0, max_s=30.0)       # configured (KVPORT_LOAD_DEADLINE_*)
    d = policy.for_expected(planner_expected_s)                       # clamp(factor x expected, min, max)
    with within(d):                                                   # tiers that wait on a peer read
        store.get_into(key, dst, deadline=d)                          # current() for their timeouts
    d.check("load of 120 blocks")                                     # DeadlineExceeded once past it

A deadline is a point on the monotonic clock. The store acquires its lock with the deadline's
remaining time; remote tiers (the kvport server, Redis) set their socket timeouts from
:func:`current`; a caller that waits on a transfer waits at most :meth:`Deadline.remaining`.
:class:`~kvport.errors.DeadlineExceeded` is a :class:`~kvport.errors.TransferError`: the caller
recomputes, as for any failed load.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from kvport.errors import ConfigError, DeadlineExceeded


@dataclass(frozen=True, slots=True)
class Deadline:
    at: float  # time.monotonic() seconds

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + max(0.0, seconds))

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def check(self, what: str = "load") -> None:
        if self.expired:
            raise DeadlineExceeded(f"{what}: past its deadline")

    def timeout(self, default: float | None = None) -> float:
        """Seconds a blocking call may wait: the remaining time, or less when ``default`` is less."""
        left = self.remaining()
        return left if default is None else min(left, default)


@dataclass(frozen=True, slots=True)
class DeadlinePolicy:
    """How long a load may take: ``factor`` x what the planner expects, within ``[min_s, max_s]``
    (``max_s`` when nothing is expected)."""

    min_s: float = 1.0
    factor: float = 4.0
    max_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("min_s", "factor", "max_s"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ConfigError(f"deadline {name} must be a positive, finite number, got {v!r}")
        if self.min_s > self.max_s:
            raise ConfigError(f"deadline min_s {self.min_s} exceeds max_s {self.max_s}")

    @classmethod
    def parse(cls, text: object) -> DeadlinePolicy:
        """``"MIN_S:FACTOR:MAX_S"`` (e.g. ``"1:4:30"``); ConfigError saying what is wrong (callers name the key)."""
        try:
            lo, factor, hi = (float(p) for p in str(text).split(":"))
        except ValueError:
            raise ConfigError(f"expected MIN_S:FACTOR:MAX_S such as 1:4:30, got {text!r}") from None
        return cls(lo, factor, hi)

    def seconds(self, expected_s: float | None) -> float:
        if expected_s is None or not math.isfinite(expected_s) or expected_s < 0:
            return self.max_s
        return min(self.max_s, max(self.min_s, self.factor * expected_s))

    def for_expected(self, expected_s: float | None) -> Deadline:
        return Deadline.after(self.seconds(expected_s))


_CURRENT: ContextVar[Deadline | None] = ContextVar("kvport_deadline", default=None)


@contextlib.contextmanager
def within(deadline: Deadline | None) -> Iterator[None]:
    """Make ``deadline`` the one :func:`current` returns in this thread (context) for the block."""
    token = _CURRENT.set(deadline)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> Deadline | None:
    return _CURRENT.get()


def timeout_for(default: float | None) -> float | None:
    """A blocking call's timeout: ``default``, shortened to the current deadline's remaining time."""
    d = _CURRENT.get()
    return default if d is None else d.timeout(default)
