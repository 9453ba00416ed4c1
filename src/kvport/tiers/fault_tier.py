"""FaultTier: wraps a tier and injects failures on demand (tests, chaos runs).

Faults are armed per operation (``"put" | "get" | "contains" | "delete"``) with the error to raise
and how many times (``None`` = until disarmed). The wrapped tier is untouched by a faulted call, so
a failed put leaves nothing behind, like the real failure it imitates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from kvport.errors import TierError
from kvport.tiers.base import Buffer, Tier


class FaultTier(Tier):
    def __init__(self, inner: Tier) -> None:
        self.inner = inner
        self.name = inner.name
        self.caps = dataclasses.replace(inner.caps, pool_records=False)  # put_many takes no metas here
        self._faults: dict[str, tuple[TierError, int | None]] = {}

    def arm(self, op: str, error: TierError, times: int | None = None) -> None:
        self._faults[op] = (error, times)

    def disarm(self, op: str | None = None) -> None:
        if op is None:
            self._faults.clear()
        else:
            self._faults.pop(op, None)

    def _maybe_fail(self, op: str) -> None:
        f = self._faults.get(op)
        if f is None:
            return
        err, times = f
        if times is not None:
            if times <= 1:
                del self._faults[op]
            else:
                self._faults[op] = (err, times - 1)
        raise err

    @property
    def capacity_bytes(self) -> int:
        return self.inner.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    def charge(self, nbytes: int) -> int:
        return self.inner.charge(nbytes)

    def view(self, key: bytes) -> memoryview:
        self._maybe_fail("get")
        return self.inner.view(key)

    def put(self, key: bytes, data: Buffer, *, ttl_s: float | None = None) -> None:
        self._maybe_fail("put")
        self.inner.put(key, data, ttl_s=ttl_s)

    def get_into(self, key: bytes, dst: Buffer) -> int:
        self._maybe_fail("get")
        return self.inner.get_into(key, dst)

    def size_of(self, key: bytes) -> int | None:
        self._maybe_fail("contains")
        return self.inner.size_of(key)

    def contains(self, key: bytes) -> bool:
        self._maybe_fail("contains")
        return self.inner.contains(key)

    def delete(self, key: bytes) -> bool:
        self._maybe_fail("delete")
        return self.inner.delete(key)

    def keys(self) -> Iterator[bytes]:
        return self.inner.keys()

    def close(self) -> None:
        self.inner.close()
