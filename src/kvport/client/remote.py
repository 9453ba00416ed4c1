"""RemoteTier: the kvport server as a :class:`~kvport.tiers.base.Tier` for the TieredStore.

The store receives a ``RemoteTier`` by dependency injection and sees only the Tier interface; the
block's metadata it passes to ``put_block`` (parent, lifetime class, TTL: ``caps.block_meta``)
travels with the PUT, so the pool records the hand-off with the block's lifetime and evicts
prefix-aware (a parent never leaves before its children; a child whose parent is not stored is
refused). The extra calls (``lookup``, ``pin``, ``lease``, ``owners``, ``leaks``, ``stats``) are for
callers that know they talk to a server. Keys are the caller's block keys; the server salts them
with the tenant, so two tenants never share or observe each other's blocks.

Retries never duplicate or corrupt a write: a PUT is idempotent by key (a retried PUT of a value
that was committed before the connection broke answers ``exists``), the server makes a value
visible only after every chunk passed its checksum, and a connection that saw any error is
closed, never reused. A PUT refused with a retry-after (BUSY, FULL, QUOTA) is retried after that
delay for up to ``backpressure_timeout_s``; then ``put_value`` returns the :class:`Rejected` value
as the server sent it and ``put`` raises :class:`TierFullError` carrying its reason and
``retry_after_s``. GETs, lookups and deletes are retried the same way; PIN/UNPIN/LEASE are not
resent once sent (they are not idempotent).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvport.client.conn import ClientConfig, ConnPool, ServerConn
from kvport.deadline import current as current_deadline
from kvport.deadline import timeout_for
from kvport.errors import (
    BlockNotFoundError,
    BufferMismatchError,
    ChecksumError,
    DeadlineExceeded,
    PeerError,
    ProtocolError,
    TierFullError,
    TierUnavailableError,
)
from kvport.lifetime import Lifetime
from kvport.protocol.rejects import Rejected
from kvport.protocol.schema import decode
from kvport.protocol.server import (
    ContainsAnswer,
    ContainsRequest,
    CountAnswer,
    DeleteRequest,
    Done,
    GetAnswer,
    GetRequest,
    LeaksAnswer,
    LeaksRequest,
    LeaseAnswer,
    LeaseRequest,
    LookupAnswer,
    LookupRequest,
    OwnersAnswer,
    OwnersRequest,
    PingRequest,
    PinRequest,
    PinSpec,
    PutAnswer,
    PutRequest,
    ReleaseRequest,
    StatsAnswer,
    StatsRequest,
    UnpinRequest,
)
from kvport.tiers.base import BlockMeta, Buffer, Tier, TierCaps, byte_view, writable_view

T = TypeVar("T")
_RETRYABLE = (PeerError, ProtocolError, ChecksumError)


@dataclass(frozen=True, slots=True)
class RemoteLookup:
    hits: int  # the first ``hits`` keys are present (longest cached prefix)
    lease_id: int | None  # a lease on those blocks when one was asked for


@dataclass(frozen=True, slots=True)
class Stored:
    existed: bool  # True when the server already held this key (an idempotent retry, or a duplicate)


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
        self.caps = TierCaps(persistent=True, shared=True, zero_copy_read=False, max_value_bytes=max_value,
                             block_meta=True)
        self._scratch = memoryview(bytearray(1 << 16))

    # ------------------------------------------------------------ plumbing
    def _take(self) -> ServerConn:
        last: Exception | None = None
        deadline = current_deadline()
        for i in range(self.cfg.retries + 1):
            try:
                return self._pool.take()
            except PeerError as exc:
                last = exc
                if deadline is not None and deadline.expired:
                    raise DeadlineExceeded(f"{self.name}: server unreachable within the load's deadline") from exc
                time.sleep(min(0.05 * 2**i, 1.0, deadline.remaining() if deadline is not None else 1.0))
        raise TierUnavailableError(f"{self.name}: server unreachable: {last}") from last

    def _call(self, fn: Callable[[ServerConn], T], idempotent: bool = True) -> T:
        """One request on a pooled connection; retried on a broken connection when idempotent. Under
        a current deadline (:func:`kvport.deadline.current`: a load's) every wait on the server is
        cut to the time left, and no retry starts past it (DeadlineExceeded)."""
        attempts = self.cfg.retries + 1 if idempotent else 1
        last: Exception | None = None
        deadline = current_deadline()
        for i in range(attempts):
            if deadline is not None:
                deadline.check(f"{self.name} request")
            conn = self._take()
            conn.t.settimeout(max(0.001, timeout_for(self.cfg.timeout_s) or self.cfg.timeout_s))
            try:
                out = fn(conn)
            except _RETRYABLE as exc:
                self._pool.give(conn, False)
                last = exc
                if deadline is not None and deadline.expired:
                    raise DeadlineExceeded(f"{self.name}: no answer within the load's deadline ({exc})") from exc
                time.sleep(min(0.02 * 2**i, 0.5, deadline.remaining() if deadline is not None else 0.5))
                continue
            except BaseException:
                self._pool.give(conn, False)
                raise
            if deadline is not None:
                conn.t.settimeout(self.cfg.timeout_s)
            self._pool.give(conn, True)
            return out
        if isinstance(last, ChecksumError):
            raise last
        raise TierUnavailableError(f"{self.name}: request failed after {attempts} attempts: {last}") from last

    def _with_backpressure(self, fn: Callable[[ServerConn], T | Rejected]) -> T | Rejected:
        deadline = time.monotonic() + self.cfg.backpressure_timeout_s
        load_deadline = current_deadline()
        if load_deadline is not None:
            deadline = min(deadline, load_deadline.at)
        while True:
            out = self._call(fn)
            if not isinstance(out, Rejected):
                return out
            if out.retry_after_s is None or time.monotonic() + out.retry_after_s > deadline:
                return out
            time.sleep(out.retry_after_s)

    # ------------------------------------------------------------ Tier: sizes
    def _brief(self) -> StatsAnswer:
        return self._call(lambda c: c.call(StatsRequest(brief=True), StatsAnswer))

    @property
    def capacity_bytes(self) -> int:
        """This tenant's quota, else the server's capacity (one round trip)."""
        s = self._brief()
        return int(s.quota or s.capacity)

    @property
    def used_bytes(self) -> int:
        """Charged bytes (whole pages) this tenant holds on the server (one round trip)."""
        return int(self._brief().used)

    # ------------------------------------------------------------ Tier: values
    def put_value(self, key: bytes, data: Buffer | Sequence[Buffer], *, parent: bytes | None = None,
                  lifetime: Lifetime = Lifetime.PREFIX, ttl_s: float | None = None,
                  pin: PinSpec | bool | None = None) -> Stored | Rejected:
        """Store ``data`` (a buffer, or pages of ``page_bytes``) under ``key`` as the child of
        ``parent``; backpressure comes back as the server's :class:`Rejected` after the retry window.
        ``pin``: pin it for this client once stored (``True``: no reason, the server's pin TTL)."""
        pb = self.page_bytes
        parts = [byte_view(p) for p in data] if isinstance(data, list | tuple) else [byte_view(data)]  # type: ignore[arg-type]
        n = sum(p.nbytes for p in parts)
        if not 0 < n <= self.caps.max_value_bytes:
            raise BufferMismatchError(f"{self.name}: value of {n} bytes (1..{self.caps.max_value_bytes})")
        if len(parts) > 1 and all(p.nbytes == pb for p in parts[:-1]) and parts[-1].nbytes <= pb:
            chunks = parts
        else:
            mv = parts[0] if len(parts) == 1 else memoryview(b"".join(parts))
            chunks = [mv[i : i + pb] for i in range(0, mv.nbytes, pb)]
        spec = PinSpec() if pin is True else (pin or None)
        req = PutRequest(key, parent, lifetime, float(ttl_s or 0.0), spec)

        def op(c: ServerConn) -> Stored | Rejected:
            _, ans = c.request(req, chunks)
            rej = Rejected.from_meta(ans)
            return rej if rej is not None else Stored(decode(PutAnswer, ans).existed)

        return self._with_backpressure(op)

    def put(self, key: bytes, data: Buffer, *, ttl_s: float | None = None) -> None:
        self._raise_if_rejected(self.put_value(key, data, ttl_s=ttl_s))

    def put_block(self, key: bytes, parts: Sequence[Buffer], meta: BlockMeta, *, ttl_s: float | None = None) -> None:
        out = self.put_value(key, list(parts), parent=meta.parent, lifetime=meta.lifetime or Lifetime.PREFIX,
                             ttl_s=meta.ttl_s if meta.ttl_s is not None else ttl_s)
        self._raise_if_rejected(out)

    def _raise_if_rejected(self, out: Stored | Rejected) -> None:
        if isinstance(out, Rejected):
            raise TierFullError(f"{self.name}: server refused the write ({out.reason.value}: {out.detail})",
                                reason=out.reason.value, retry_after_s=out.retry_after_s)

    def get_into(self, key: bytes, dst: Buffer, *, on_verified: Callable[[int, int], None] | None = None) -> int:
        """Read the value into ``dst``; its length. ``on_verified(offset, nbytes)``, if given, is
        called in order for each byte range of ``dst`` as soon as it has passed its checksum (right
        after it arrived, still in cache), so a consumer can use the value while the rest arrives.
        After a reconnect and retry the ranges are reported again from offset 0; after a failed
        checksum, not at all (the call raises :class:`ChecksumError`)."""
        return self.get_leased(key, dst, 0.0, on_verified=on_verified)[0]

    def get_leased(self, key: bytes, dst: Buffer, lease_s: float,
                   on_verified: Callable[[int, int], None] | None = None) -> tuple[int, int | None]:
        """:meth:`get_into`, leaving a lease of ``lease_s`` on the block (its id; None when 0)."""

        def op(c: ServerConn) -> tuple[int, int | None] | Rejected | None:
            hdr, ans = c.request(GetRequest(key, lease_s))
            rej = Rejected.from_meta(ans)
            if rej is not None:
                return rej
            got = decode(GetAnswer, ans)
            if not got.found:
                return None
            if got.length != hdr.payload_len:
                raise ProtocolError(f"GET answer says {got.length} bytes, carries {hdr.payload_len}")
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
            return hdr.payload_len, got.lease

        out = self._with_backpressure(op)
        if out is None:
            raise BlockNotFoundError(f"{self.name}: no block {key.hex()}")
        if isinstance(out, Rejected):
            raise TierUnavailableError(f"{self.name}: server busy ({out.detail})")
        return out

    def _contains(self, keys: list[bytes]) -> ContainsAnswer:
        return self._call(lambda c: c.call(ContainsRequest(tuple(keys)), ContainsAnswer))

    def size_of(self, key: bytes) -> int | None:
        return self._contains([key]).lengths[0]

    def contains_many(self, keys: Iterable[bytes]) -> list[bool]:
        return list(self._contains(list(keys)).present)

    def sizes_of(self, keys: Iterable[bytes]) -> list[int | None]:
        ans = self._contains(list(keys))
        return [n if ok else None for ok, n in zip(ans.present, ans.lengths, strict=True)]

    def delete(self, key: bytes) -> bool:
        return self.delete_many([key]) == 1

    def delete_many(self, keys: Iterable[bytes]) -> int:
        ks = tuple(keys)
        return self._call(lambda c: c.call(DeleteRequest(ks), CountAnswer)).count

    def keys(self) -> Iterator[bytes]:
        return iter(self._call(lambda c: c.call(StatsRequest(brief=True, list_keys=True), StatsAnswer)).keys)

    def close(self) -> None:
        self._pool.close()

    # ------------------------------------------------------------ server extras
    def lookup(self, keys: list[bytes], lease_s: float = 0.0) -> RemoteLookup:
        """Longest prefix of ``keys`` present; with ``lease_s`` those blocks stay until released."""
        ans = self._call(lambda c: c.call(LookupRequest(tuple(keys), lease_s), LookupAnswer), idempotent=lease_s == 0)
        return RemoteLookup(ans.hits, ans.lease)

    def pin(self, keys: list[bytes], reason: str = "", ttl_s: float = 0.0) -> int:
        """Pin the present blocks of ``keys`` for this client (``ttl_s`` 0: the server's default)."""
        return self._call(lambda c: c.call(PinRequest(tuple(keys), reason, ttl_s), CountAnswer), idempotent=False).count

    def unpin(self, keys: list[bytes]) -> int:
        return self._call(lambda c: c.call(UnpinRequest(tuple(keys)), CountAnswer), idempotent=False).count

    def lease(self, keys: list[bytes], ttl_s: float) -> tuple[int | None, int]:
        """(lease id, blocks held): every block stays until release or expiry (a block the tenant
        does not hold is an error and nothing is leased)."""
        ans = self._call(lambda c: c.call(LeaseRequest(tuple(keys), ttl_s), LeaseAnswer), idempotent=False)
        return ans.lease, ans.held

    def release(self, lease_id: int) -> None:
        self._call(lambda c: c.call(ReleaseRequest(lease_id), Done))

    def stats(self) -> StatsAnswer:
        return self._call(lambda c: c.call(StatsRequest(), StatsAnswer))

    def owners(self, keys: Sequence[bytes] = (), prefix: str = "") -> OwnersAnswer:
        return self._call(lambda c: c.call(OwnersRequest(tuple(keys), prefix), OwnersAnswer))

    def leaks(self) -> LeaksAnswer:
        return self._call(lambda c: c.call(LeaksRequest(), LeaksAnswer))

    def ping(self) -> None:
        self._call(lambda c: c.call(PingRequest(), Done))
