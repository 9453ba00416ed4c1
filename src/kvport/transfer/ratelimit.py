"""A token-bucket rate limit, and a transport wrapper that keeps to it (emulates a slow link)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kvport.errors import ConfigError
from kvport.protocol.transport import Buffer, Transport, nbytes


class TokenBucket:
    """``rate`` bytes/s with a ``burst``-byte bucket; ``take(n)`` sleeps until n bytes are allowed.

    A take larger than the bucket is allowed and leaves a debt that later takes wait off, so the
    long-run rate is exact for any message size.
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: int = 1 << 20) -> None:
        if rate_bytes_per_s <= 0 or burst_bytes <= 0:
            raise ConfigError(f"rate limit needs rate > 0 and burst > 0, got {rate_bytes_per_s}, {burst_bytes}")
        self.rate = float(rate_bytes_per_s)
        self.burst = float(burst_bytes)
        self._tokens = float(burst_bytes)
        self._t = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> float:
        """Consume n tokens, sleeping as needed; returns seconds slept."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
            self._t = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
        return wait


class RateLimited:
    """Wraps a transport; its ``send`` never exceeds the bucket's rate (emulates a slow link)."""

    def __init__(self, inner: Transport, bucket: TokenBucket) -> None:
        self.inner = inner
        self.bucket = bucket
        self.name = f"{inner.name}@{bucket.rate / 1e6:.0f}MB/s"

    def send(self, parts: Sequence[Buffer]) -> None:
        self.bucket.take(nbytes(parts))
        self.inner.send(parts)

    def recv_into(self, parts: Sequence[memoryview]) -> None:
        self.inner.recv_into(parts)

    def readable(self, timeout: float) -> bool:
        return self.inner.readable(timeout)

    def close(self) -> None:
        self.inner.close()
