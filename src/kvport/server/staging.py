"""Staging buffers for values in flight (received but not yet committed, or being sent).

Buffers come in power-of-two size classes from 1 MiB and are reused: a fresh large allocation
page-faults at about 1 GB/s, a reused one is already resident. The pool never holds more than
``limit`` bytes in all (free + lent), which is the server's ``total_inflight_bytes``; when a new
class is needed and the pool is at its limit, free buffers of other classes are released first.
``try_take`` returns None when the limit cannot be met: the caller answers Rejected(BUSY).
"""

from __future__ import annotations

from dataclasses import dataclass

_MIN_CLASS = 1 << 20


def size_class(n: int) -> int:
    return max(_MIN_CLASS, 1 << max(0, n - 1).bit_length())


@dataclass(slots=True)
class StagingBuffer:
    buf: bytearray
    size: int  # requested bytes; view() is exactly this long

    @property
    def class_bytes(self) -> int:
        return len(self.buf)

    def view(self) -> memoryview:
        return memoryview(self.buf)[: self.size]


class StagingPool:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free: dict[int, list[bytearray]] = {}
        self.allocated = 0  # free + lent
        self.lent = 0
        self.peak_allocated = 0

    def try_take(self, n: int) -> StagingBuffer | None:
        cls = size_class(n)
        free = self._free.get(cls)
        if free:
            buf = free.pop()
        else:
            if cls > self.limit:
                return None
            self._release_free_until(self.limit - cls)
            if self.allocated + cls > self.limit:
                return None
            buf = bytearray(cls)
            self.allocated += cls
            self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.lent += cls
        return StagingBuffer(buf, n)

    def give(self, s: StagingBuffer) -> None:
        self.lent -= s.class_bytes
        self._free.setdefault(s.class_bytes, []).append(s.buf)

    def _release_free_until(self, target: int) -> None:
        for cls in sorted(self._free, reverse=True):
            bufs = self._free[cls]
            while bufs and self.allocated > target:
                bufs.pop()
                self.allocated -= cls
