"""Credit-based backpressure: the receiver grants bytes from its free buffer space.

Counters are cumulative per connection, so a grant is idempotent and order-safe::

    receiver: granted_total = budget + released_total      (sent in ACCEPT / CREDIT frames)
    sender:   sent_total <= granted_total                   (checked before every LAYER frame)
              available  = granted_total - sent_total       (= free space at the receiver, as seen here)
              in_use     = budget - available

Admission (a prefill scheduler asking "may I start another prompt?") uses watermarks with
hysteresis: once ``in_use > high * budget`` new work is :class:`Rejected` until ``in_use < low * budget``.
``Backpressure(enabled=False)`` is the ablation switch: the sender ignores credits, the receiver does
not enforce them (and then overflows or drops, which is what the benchmark shows).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from kvport.errors import BackpressureTimeout, ConfigError, ProtocolError
from kvport.metrics import counter, gauge, histogram
from kvport.protocol.rejects import Rejected, RejectReason

CREDIT_WAITS = counter("transfer_credit_waits_total", "Sends that had to wait for receiver credits")
CREDIT_WAIT_S = histogram("transfer_credit_wait_seconds", "Time a send waited for credits",
                          buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 30))
REJECTIONS = counter("transfer_admission_rejections_total", "Admissions rejected by watermarks", ["reason"])
IN_FLIGHT = gauge("transfer_credit_in_use_bytes", "Receiver buffer bytes in use, as seen by the sender")


@dataclass(frozen=True, slots=True)
class Backpressure:
    enabled: bool = True
    high_watermark: float = 0.9
    low_watermark: float = 0.5
    # the receiver batches grants until this much of the budget is free, or the sender holds less
    min_grant_fraction: float = 0.125

    def __post_init__(self) -> None:
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ConfigError(f"need 0 < low <= high <= 1, got {self.low_watermark}, {self.high_watermark}")
        if not 0.0 < self.min_grant_fraction <= 1.0:
            raise ConfigError(f"min_grant_fraction must be in (0, 1], got {self.min_grant_fraction}")


@dataclass(frozen=True, slots=True)
class Admitted:
    available_bytes: int


class CreditWindow:
    """Sender side. Pure bookkeeping plus a condition to wait on; grants arrive via :meth:`on_grant`."""

    def __init__(self, cfg: Backpressure) -> None:
        self.cfg = cfg
        self.budget = 0
        self.granted_total = 0
        self.sent_total = 0
        self._paused = False
        self._rate = 0.0  # EWMA of granted bytes/s (drain speed of the receiver)
        self._last_grant_t = time.monotonic()
        self.cond = threading.Condition()

    @property
    def available(self) -> int:
        return self.granted_total - self.sent_total

    @property
    def in_use(self) -> int:
        return self.budget - self.available

    def on_grant(self, granted_total: int, budget: int | None = None) -> None:
        with self.cond:
            if budget is not None:
                self.budget = budget
            if granted_total < self.granted_total:
                raise ProtocolError(f"credit grant went backwards: {granted_total} < {self.granted_total}")
            now = time.monotonic()
            delta, dt = granted_total - self.granted_total, now - self._last_grant_t
            if delta and dt > 0 and self.granted_total:
                inst = delta / dt
                self._rate = inst if self._rate == 0 else 0.7 * self._rate + 0.3 * inst
            self._last_grant_t = now
            self.granted_total = granted_total
            IN_FLIGHT.set(self.in_use)
            self.cond.notify_all()

    def can_send(self, n: int) -> bool:
        return not self.cfg.enabled or n <= self.available

    def consume(self, n: int) -> None:
        with self.cond:
            if self.cfg.enabled and n > self.available:
                raise BackpressureTimeout(f"send of {n} bytes with only {self.available} bytes of credit")
            self.sent_total += n
            IN_FLIGHT.set(self.in_use)

    def reset(self) -> None:
        """The connection is gone: every credit is void (nothing may be sent)."""
        with self.cond:
            self.granted_total = self.sent_total
            self.cond.notify_all()

    def admission(self) -> Admitted | Rejected:
        """Watermark gate with hysteresis; never blocks."""
        with self.cond:
            if not self.cfg.enabled or self.budget <= 0:
                return Admitted(self.available)
            used = self.in_use
            if self._paused and used < self.cfg.low_watermark * self.budget:
                self._paused = False
            elif not self._paused and used > self.cfg.high_watermark * self.budget:
                self._paused = True
            if not self._paused:
                return Admitted(self.available)
            excess = used - self.cfg.low_watermark * self.budget
            retry = excess / self._rate if self._rate > 0 else 0.05
            REJECTIONS.labels(reason="high_watermark").inc()
            return Rejected(RejectReason.BUSY, round(min(max(retry, 0.001), 10.0), 4),
                            f"receiver buffers {used}/{self.budget} bytes in use (above the high watermark)")


class CreditPool:
    """Receiver side: budget bytes of buffer; grants what is free, checks the sender keeps to it."""

    def __init__(self, budget: int, cfg: Backpressure) -> None:
        if budget <= 0:
            raise ConfigError(f"credit budget must be positive, got {budget}")
        self.cfg = cfg
        self.budget = budget
        self.released_total = 0
        self.received_total = 0
        self.announced_total = budget  # last granted_total sent to the sender
        self._lock = threading.Lock()

    @property
    def granted_total(self) -> int:
        return self.budget + self.released_total

    @property
    def in_use(self) -> int:
        return self.received_total - self.released_total

    def on_received(self, n: int) -> None:
        with self._lock:
            if self.cfg.enabled and self.received_total + n > self.granted_total:
                raise ProtocolError(f"sender overran its credits: {self.received_total + n} > {self.granted_total}")
            self.received_total += n

    def release(self, n: int) -> int | None:
        """Buffer space freed; returns a new granted_total to announce, or None to batch it."""
        with self._lock:
            if n < 0 or self.released_total + n > self.received_total:
                raise ProtocolError(f"release of {n} bytes exceeds what was received")
            self.released_total += n
            step = self.cfg.min_grant_fraction * self.budget
            unannounced = self.granted_total - self.announced_total
            sender_left = self.announced_total - self.received_total  # credit the sender still holds
            if unannounced > 0 and (unannounced >= step or sender_left < step):
                self.announced_total = self.granted_total
                return self.announced_total
            return None


def wait_for(window: CreditWindow, n: int, timeout: float | None) -> None:
    """Block until ``n`` bytes of credit are available (grants arrive from another thread)."""
    if window.can_send(n):
        return
    CREDIT_WAITS.inc()
    t0 = time.monotonic()
    with window.cond:
        ok = window.cond.wait_for(lambda: window.can_send(n), timeout)
    CREDIT_WAIT_S.observe(time.monotonic() - t0)
    if not ok:
        raise BackpressureTimeout(f"no credit for {n} bytes within {timeout} s ({window.available} available)")


__all__ = ["Admitted", "Backpressure", "CreditPool", "CreditWindow", "RejectReason", "Rejected", "wait_for"]
