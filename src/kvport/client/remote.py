"""RemoteTier: the kvport server as a :class:`~kvport.tiers.base.Tier` for the TieredStore.

The store receives a ``RemoteTier`` by dependency injection and sees only the Tier interface; the
extra calls (``lookup``, ``pin``, ``lease``, ``stats``) are for callers that know they talk to a
server. Keys are the caller's block keys; the server salts them with the tenant, so two tenants
never share or observe each other's blocks.

Retries never duplicate or corrupt a write: a PUT is idempotent by key (a retried PUT of a value
that was committed before the connection broke answers ``exists``), the server makes a value
visible only after every chunk passed its checksum, and a connection that saw any error is
closed, never reused. A PUT refused with a retry-after (BUSY, FULL, QUOTA) is retried after that
delay for up to ``backpressure_timeout_s``; then ``put`` raises :class:`TierFullError` and
``put_value`` returns the :class:`Rejected` value. GETs, lookups and deletes are retried the same
way; PIN/UNPIN/LEASE are not resent once sent (they are not idempotent).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from kvport.errors import (
    BlockNotFoundError,
    BufferMismatchError,
    ChecksumError,
    PeerError,
    ProtocolError,
    TierFullError,
    TierUnavailableError,
)
from kvport.server.limits import Rejected, RejectReason
from kvport.server.pool import ClientConfig, ConnPool, ServerConn
from kvport.tiers.base import Buffer, Tier, TierCaps, byte_view, writable_view
from kvport.transfer.wire import MsgType

T = TypeVar("T")
_RETRYABLE = (PeerError, ProtocolError, ChecksumError)


@dataclass(frozen=True, slots=True)
class LookupResult:
    hits: int  # the first ``hits`` keys are present (longest cached prefix)
    lease_id: int | None  # a lease on those blocks when one was asked for


@dataclass(frozen=True, slots=True)
class Stored:
    existed: bool  # True when the server already held this key (an idempotent retry, or a duplicate)


def _rejected(ans: dict[str, Any]) -> Rejected | None:
    if "rejected" not in ans:
        return None
    try:
        reason = RejectReason(ans["rejected"])
    except ValueError as exc:
        raise ProtocolError(f"unknown rejection {ans['rejected']!r}") from exc
    ra = ans.get("retry_after")
    return Rejected(reason, float(ra) if isinstance(ra, int | float) else None, str(ans.get("detail", "")))


def _chunk_ranges_as_bytes(on_verified: Callable[[int, int], None], chunk_size: int, total: int
                           ) -> Callable[[int, int], None]:
    """Adapt a ``(first, end)`` chunk-range callback to ``(offset, nbytes)`` of the value."""

    def report(first: int, end: int) -> None:
        lo = first * chunk_size
        on_verified(lo, min(end * chunk_size, total) - lo)

    return report


class RemoteTier(Tier):
    def __init__(self, cfg: ClientConfig, name: str = "remote") -> None:
        self.cfg = cfg
        self.name = name
        self._pool = ConnPool(cfg)
        conn = self._take()
        self.page_bytes, max_value = conn.page_bytes, conn.max_value_bytes
        self._pool.give(conn, True)
        self.caps = TierCaps(persistent=True, shared=True, zero_copy_read=False, max_value_bytes=max_value)
        self._scratch = memoryview(bytearray(1 << 16))

    # ------------------------------------------------------------ plumbing
    def _take(self) -> ServerConn:
        last: Exception | None = None
        for i in range(self.cfg.retries + 1):
            try:
                return self._pool.take()
            except PeerError as exc:
                last = exc
                time.sleep(min(0.05 * 2**i, 1.0))
        raise TierUnavailableError(f"{self.name}: server unreachable: {last}") from last

    def _call(self, fn: Callable[[ServerConn], T], idempotent: bool = True) -> T:
        attempts = self.cfg.retries + 1 if idempotent else 1
        last: Exception | None = None
        for i in range(attempts):
            conn = self._take()
            try:
                out = fn(conn)
            except _RETRYABLE as exc:
                self._pool.give(conn, False)
                last = exc
                time.sleep(min(0.02 * 2**i, 0.5))
                continue
            except BaseException:
                self._pool.give(conn, False)
                raise
            self._pool.give(conn, True)
            return out
        if isinstance(last, ChecksumError):
            raise last
        raise TierUnavailableError(f"{self.name}: request failed after {attempts} attempts: {last}") from last

    def _with_backpressure(self, fn: Callable[[ServerConn], T | Rejected]) -> T | Rejected:
        deadline = time.monotonic() + self.cfg.backpressure_timeout_s
        while True:
            out = self._call(fn)
            if not isinstance(out, Rejected):
                return out
            if out.retry_after_s is None or time.monotonic() + out.retry_after_s > deadline:
                return out
            time.sleep(out.retry_after_s)

    # ------------------------------------------------------------ Tier: sizes
    def _brief(self) -> dict[str, Any]:
        _, ans = self._call(lambda c: c.request(MsgType.STATS, {"brief": True}))
        return ans

    @property
    def capacity_bytes(self) -> int:
        """This tenant's quota, else the server's host + disk capacity (one round trip)."""
        s = self._brief()
        return int(s["quota"] or s["capacity"])

    @property
    def used_bytes(self) -> int:
        """Charged bytes (whole pages) this tenant holds on the server (one round trip)."""
        return int(self._brief()["used"])

    # ------------------------------------------------------------ Tier: values
    def put_value(self, key: bytes, data: Buffer, pin: bool = False) -> Stored | Rejected:
        """Store ``data`` under ``key``; backpressure comes back as a value after the retry window."""
        mv = byte_view(data)
        if not 0 < mv.nbytes <= self.caps.max_value_bytes:
            raise BufferMismatchError(f"{self.name}: value of {mv.nbytes} bytes (1..{self.caps.max_value_bytes})")
        pb = self.page_bytes
        chunks = [mv[i : i + pb] for i in range(0, mv.nbytes, pb)]

        def op(c: ServerConn) -> Stored | Rejected:
            _, ans = c.request(MsgType.PUT, {"key": key, "pin": pin}, chunks)
            rej = _rejected(ans)
            return rej if rej is not None else Stored(ans.get("status") == "exists")

        return self._with_backpressure(op)

    def put(self, key: bytes, data: Buffer, *, ttl_s: float | None = None) -> None:
        out = self.put_value(key, data)
        if isinstance(out, Rejected):
            raise TierFullError(f"{self.name}: server refused the write ({out.reason.value}: {out.detail})")

    def get_into(self, key: bytes, dst: Buffer, *, on_verified: Callable[[int, int], None] | None = None) -> int:
        """Read the value into ``dst``; its length. ``on_verified(offset, nbytes)``, if given, is
        called in order for each byte range of ``dst`` as soon as it has passed its checksum (right
        after it arrived, still in cache), so a consumer can use the value while the rest arrives.
        After a reconnect and retry the ranges are reported again from offset 0; after a failed
        checksum, not at all (the call raises :class:`ChecksumError`)."""

        def op(c: ServerConn) -> int | Rejected | None:
            hdr, ans = c.request(MsgType.GET, {"key": key})
            rej = _rejected(ans)
            if rej is not None or not ans.get("found"):
                return rej
            try:
                out = writable_view(dst, hdr.payload_len)
            except BufferMismatchError:
                c.io.skip_payload(hdr, self._scratch)
                raise
            cs = hdr.chunk_size
            views = [out[i * cs : i * cs + hdr.chunk_len(i)] for i in range(hdr.n_chunks)]
            report = None if on_verified is None else _chunk_ranges_as_bytes(on_verified, cs, hdr.payload_len)
            if c.io.read_payload_into(hdr, views, report):
                raise ChecksumError(f"{self.name}: value {key.hex()} failed its checksum in transit")
            return hdr.payload_len

        out = self._with_backpressure(op)
        if out is None:
            raise BlockNotFoundError(f"{self.name}: no block {key.hex()}")
        if isinstance(out, Rejected):
            raise TierUnavailableError(f"{self.name}: server busy ({out.detail})")
        return out

    def _contains(self, keys: list[bytes]) -> tuple[list[bool], list[int | None]]:
        _, ans = self._call(lambda c: c.request(MsgType.CONTAINS, {"keys": keys}))
        return list(ans["present"]), list(ans["lengths"])

    def size_of(self, key: bytes) -> int | None:
        return self._contains([key])[1][0]

    def contains_many(self, keys: Iterable[bytes]) -> list[bool]:
        return self._contains(list(keys))[0]

    def delete(self, key: bytes) -> bool:
        return self.delete_many([key]) == 1

    def delete_many(self, keys: Iterable[bytes]) -> int:
        _, ans = self._call(lambda c: c.request(MsgType.DELETE, {"keys": list(keys)}))
        return int(ans["deleted"])

    def keys(self) -> Iterator[bytes]:
        _, ans = self._call(lambda c: c.request(MsgType.STATS, {"brief": True, "list_keys": True}))
        return iter(list(ans.get("keys", [])))

    def close(self) -> None:
        self._pool.close()

    # ------------------------------------------------------------ server extras
    def lookup(self, keys: list[bytes], lease_s: float = 0.0) -> LookupResult:
        """Longest prefix of ``keys`` present; with ``lease_s`` those blocks stay until released."""
        _, ans = self._call(lambda c: c.request(MsgType.LOOKUP, {"keys": keys, "lease_s": lease_s}),
                            idempotent=lease_s == 0)
        lease = ans.get("lease")
        return LookupResult(int(ans["hits"]), int(lease) if lease is not None else None)

    def pin(self, keys: list[bytes]) -> int:
        _, ans = self._call(lambda c: c.request(MsgType.PIN, {"keys": keys}), idempotent=False)
        return int(ans["count"])

    def unpin(self, keys: list[bytes]) -> int:
        _, ans = self._call(lambda c: c.request(MsgType.UNPIN, {"keys": keys}), idempotent=False)
        return int(ans["count"])

    def lease(self, keys: list[bytes], ttl_s: float) -> tuple[int, int]:
        """(lease id, blocks held): present blocks stay until release, expiry or connection close."""
        _, ans = self._call(lambda c: c.request(MsgType.LEASE, {"keys": keys, "ttl_s": ttl_s}), idempotent=False)
        return int(ans["lease"]), int(ans["held"])

    def release(self, lease_id: int) -> None:
        self._call(lambda c: c.request(MsgType.RELEASE, {"lease": lease_id}))

    def stats(self) -> dict[str, Any]:
        _, ans = self._call(lambda c: c.request(MsgType.STATS, {}))
        return ans

    def ping(self) -> None:
        self._call(lambda c: c.request(MsgType.PING, {}))
