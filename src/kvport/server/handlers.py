"""Request handlers: one method per typed request, over the server's store and its ledger.

Handlers run on the event loop; the store and the ledger are only touched between awaits, so every
reservation, commit, lease and pin is atomic with respect to other connections. A handler either
consumes its request's payload (``conn.payload_taken()``) or leaves it to :class:`Connection` to
skip before an error answer: the stream never desynchronises on a refused request.

A PUT, with room in the host pool (the store's first zero-copy tier)::

    store.reserve(skey, n, parent, lifetime, ttl, account=tenant)   room made (quota, eviction)
    chunk i --recv_into--> page i of the reservation                invisible
    every chunk verified --> store.commit(res, attrs)               visible; the ledger records the
                                                                    hand-off to the pool (client, lifetime)
    client gone / bad chunk --> store.abort(res)                    never visible

Without room there (pinned or leased blocks, or a value larger than the pool), the value is staged
in a bounded buffer and ``store.put`` places it below (disk). A GET holds a lease while it sends
(from the pool's own pages when the block is in host: zero copy), and may leave one to the client.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from kvport.errors import (
    AuthError,
    BlockNotFoundError,
    ChecksumError,
    CorruptBlockError,
    LeaseError,
    ProtocolError,
    QuotaExceededError,
    TierFullError,
    UnknownBlockError,
)
from kvport.ledger import PIN_BYTES, Lease, Owner, lease_bytes
from kvport.lifetime import Lifetime
from kvport.protocol.frame import Flags, FrameHeader
from kvport.protocol.rejects import Rejected, RejectReason
from kvport.protocol.schema import Message
from kvport.protocol.server import (
    ContainsAnswer,
    ContainsRequest,
    CountAnswer,
    DeleteRequest,
    Done,
    GetAnswer,
    GetRequest,
    LeaksRequest,
    LeaseAnswer,
    LeaseRequest,
    LookupAnswer,
    LookupRequest,
    OwnersRequest,
    PingRequest,
    PinRequest,
    PinSpec,
    PutAnswer,
    PutRequest,
    ReleaseRequest,
    Request,
    StatsRequest,
    UnpinRequest,
    decode_request,
)
from kvport.server import reports
from kvport.server.connection import Connection
from kvport.server.held import account
from kvport.server.state import ServerState
from kvport.server.storage import HOST, Attrs
from kvport.server.tenants import Tenant

Handler = Callable[[Connection, FrameHeader, Any, Tenant, Owner], Awaitable[None]]


class Handlers:
    """One method per typed request, over ``server`` (:class:`~kvport.server.state.ServerState`: the
    store, the ledger, the tenants, the limits, the held tally, ...); :meth:`dispatch` is what each
    :class:`Connection` calls with a request it read. The handlers keep no state of their own."""

    def __init__(self, server: ServerState) -> None:
        self.server = server
        self._table: dict[type[Message], Handler] = {
            PutRequest: self.put, GetRequest: self.get, LookupRequest: self.lookup, ContainsRequest: self.contains,
            PinRequest: self.pin, UnpinRequest: self.unpin, LeaseRequest: self.lease, ReleaseRequest: self.release,
            DeleteRequest: self.delete, StatsRequest: self.stats, OwnersRequest: self.owners, LeaksRequest: self.leaks,
            PingRequest: self.ping,
        }

    # ------------------------------------------------------------ dispatch
    async def dispatch(self, conn: Connection, hdr: FrameHeader, meta: dict[str, Any]) -> None:
        if hdr.flags & Flags.RESPONSE:
            raise ProtocolError(f"{hdr.msg_type.name} with the RESPONSE flag is not a request")
        req: Request = decode_request(hdr.msg_type, meta)
        if hdr.payload_len and not isinstance(req, PutRequest):
            raise ProtocolError(f"{hdr.msg_type.name} carries no payload")
        if conn.tenant is None or conn.holder is None:
            raise AuthError("request before authentication")
        keys, cap = getattr(req, "keys", ()), self.server.limits.max_keys_per_request
        if len(keys) > cap:
            raise ProtocolError(f"{len(keys)} keys in one request; at most {cap}")
        await self._table[type(req)](conn, hdr, req, conn.tenant, conn.holder)

    async def _answer(self, conn: Connection, hdr: FrameHeader, msg: Message | dict[str, Any],
                      result: str = "ok") -> None:
        meta = msg if isinstance(msg, dict) else msg.to_meta()
        await conn.frames.send(hdr.msg_type, meta, flags=Flags.RESPONSE, corr_id=hdr.corr_id)
        self.server.metrics.requests.labels(hdr.msg_type.name.lower(), result).inc()

    async def _reject(self, conn: Connection, hdr: FrameHeader, rej: Rejected) -> None:
        await conn.skip_payload()
        self.server.metrics.rejections.labels(rej.reason.value).inc()
        await self._answer(conn, hdr, rej.to_meta(), "rejected")

    def _skey(self, tenant: Tenant, key: bytes) -> bytes:
        return self.server.tenants.storage_key(tenant.name, key)

    def _charge_held(self, conn: Connection, tenant: Tenant, n: int, nbytes: int) -> str:
        """Leases and pins are charged before anything is recorded, to the connection and its tenant
        (never to the client's own label), and in record bytes to the server's budget for them
        (LeaseError past a cap, :mod:`kvport.server.held`); returns the account to record them with."""
        acct = account(tenant.name, conn.id)
        self.server.held.charge(tenant.name, acct, n, nbytes)
        return acct

    def _noted(self, conn: Connection, tenant: Tenant) -> None:
        self.server.held.note(tenant.name, account(tenant.name, conn.id))

    def _ttl(self, asked: float, default: float, cap: float) -> float:
        return min(asked, cap) if asked > 0 else default

    # ------------------------------------------------------------ put
    async def put(self, conn: Connection, hdr: FrameHeader, req: PutRequest, tenant: Tenant, holder: Owner) -> None:
        size = hdr.payload_len
        if size == 0 or hdr.chunk_size != self.server.page_bytes:
            raise ProtocolError(f"a PUT carries a value in chunks of page_bytes={self.server.page_bytes}")
        if self.server.draining:
            return await self._reject(conn, hdr, Rejected(RejectReason.SHUTTING_DOWN, None, "server is draining"))
        store, skey, retry = self.server.store, self._skey(tenant, req.key), self.server.limits.retry_after_s
        if skey in store:
            await conn.skip_payload()
            store.lookup([skey])  # a hit: the block stays longer
            self._pin_if(conn, req.pin, skey, tenant, holder)
            return await self._answer(conn, hdr, PutAnswer("exists"), "exists")
        if store.writing(skey):  # the same block is arriving on another connection: ask to retry
            return await self._reject(conn, hdr, Rejected(RejectReason.BUSY, retry, "the same key is being written"))
        sparent = None if req.parent is None else self._skey(tenant, req.parent)
        if sparent is not None and sparent not in store:
            return await self._reject(conn, hdr, Rejected(RejectReason.NO_PARENT, None,
                                                          "the parent block is not stored; put it first"))
        if tenant.quota_bytes is not None and store.tiers[HOST].charge(size) > tenant.quota_bytes:
            return await self._reject(conn, hdr, Rejected(RejectReason.TOO_LARGE, None, "larger than the quota"))
        ttl = self._lifetime_ttl(req)
        try:
            res = store.reserve(skey, size, lifetime=req.lifetime, parent=sparent, account=tenant.name, ttl_s=ttl,
                                origin=holder)
        except QuotaExceededError as exc:
            return await self._reject(conn, hdr, Rejected(RejectReason.QUOTA, retry, str(exc)))
        except TierFullError as exc:
            return await self._reject(conn, hdr, Rejected(RejectReason.BUSY, retry, str(exc)))
        if res is not None:
            try:
                bad = await conn.frames.read_chunks_into(hdr, res.views)
                conn.payload_taken()
            except BaseException:
                store.abort(res)  # a client gone mid-write leaves nothing visible
                raise
            if bad is not None:
                store.abort(res)
                raise ChecksumError(f"chunk {bad} failed its checksum; nothing stored")
            store.commit(res, Attrs(req.key, conn.frames.checksums(hdr.n_chunks)).encode())
        else:
            rej = await self._put_staged(conn, hdr, req, tenant, holder, skey, sparent, ttl)
            if rej is not None:
                return await self._reject(conn, hdr, rej)
        self._pin_if(conn, req.pin, skey, tenant, holder)
        self.server.metrics.bytes_in.inc(size)
        await self._answer(conn, hdr, PutAnswer("stored"), "stored")

    def _lifetime_ttl(self, req: PutRequest) -> float | None:
        limits = self.server.limits
        cap = limits.max_lease_ttl_s * 1000
        if req.lifetime is Lifetime.SESSION:
            return self._ttl(req.ttl_s, limits.session_ttl_s, cap)
        if req.lifetime is Lifetime.REQUEST:
            return self._ttl(req.ttl_s, limits.request_ttl_s, cap)
        return req.ttl_s if req.ttl_s > 0 else None

    async def _put_staged(self, conn: Connection, hdr: FrameHeader, req: PutRequest, tenant: Tenant, holder: Owner,
                          skey: bytes, sparent: bytes | None, ttl: float | None) -> Rejected | None:
        """No room in the pool: receive into a bounded staging buffer, then let the store place it."""
        size, store, pool = hdr.payload_len, self.server.store, self.server.pool
        retry = self.server.limits.retry_after_s
        staging = pool.try_take(size)
        if staging is None:
            return Rejected(RejectReason.BUSY, retry, "in-flight budget spent")
        try:
            bad = await conn.frames.read_payload_into(hdr, staging.view())
            conn.payload_taken()
            if bad is not None:
                raise ChecksumError(f"chunk {bad} failed its checksum; nothing stored")
            if store.writing(skey) or skey in store:
                return Rejected(RejectReason.BUSY, retry, "the same key was written meanwhile")
            if sparent is not None and sparent not in store:
                return Rejected(RejectReason.NO_PARENT, None, "the parent block left while the value arrived")
            try:
                store.put(skey, staging.view(), lifetime=req.lifetime, parent=sparent, account=tenant.name,
                          ttl_s=ttl, attrs=Attrs(req.key, conn.frames.checksums(hdr.n_chunks)).encode(),
                          origin=holder)
            except QuotaExceededError as exc:
                return Rejected(RejectReason.QUOTA, retry, str(exc))
            except TierFullError as exc:
                return Rejected(RejectReason.FULL, retry, str(exc))
            return None
        finally:
            pool.give(staging)

    def _pin_if(self, conn: Connection, spec: PinSpec | None, skey: bytes, tenant: Tenant, holder: Owner) -> None:
        """PUT's ``pin`` means "pinned by this client at least once", so a retried PUT never pins twice."""
        ledger, limits = self.server.ledger, self.server.limits
        if spec is None or holder in ledger.pins_of(skey):
            return
        acct = self._charge_held(conn, tenant, 1, PIN_BYTES)
        ledger.pin(skey, holder, spec.reason, self._ttl(spec.ttl_s, limits.pin_ttl_s, limits.max_pin_ttl_s), acct)
        self._noted(conn, tenant)

    # ------------------------------------------------------------ get
    async def get(self, conn: Connection, hdr: FrameHeader, req: GetRequest, tenant: Tenant, holder: Owner) -> None:
        skey, ledger, limits = self._skey(tenant, req.key), self.server.ledger, self.server.limits
        if skey not in self.server.store:
            return await self._answer(conn, hdr, GetAnswer(False), "miss")
        # the read's own lease outlives the frame deadline: only the finally below ends it
        reading = ledger.lease(skey, holder, 2 * limits.frame_timeout_s + 1)
        try:
            kept: Lease | None = None
            if req.lease_s > 0:
                acct = self._charge_held(conn, tenant, 1, lease_bytes(1))
                kept = ledger.lease(skey, holder, min(req.lease_s, limits.max_lease_ttl_s), acct)
                self._noted(conn, tenant)
            await self._send_value(conn, hdr, skey, None if kept is None else kept.lease_id)
        finally:
            with contextlib.suppress(LeaseError, UnknownBlockError):
                ledger.release(reading)
        self.server.hits.hit(skey)

    async def _send_value(self, conn: Connection, hdr: FrameHeader, skey: bytes, lease_id: int | None) -> None:
        meta = self.server.store.meta_of(skey)
        attrs = Attrs.decode(meta.attrs if meta is not None else b"")
        pb, store, pool = self.server.page_bytes, self.server.store, self.server.pool
        try:
            rv = store.read_views(skey)
        except BlockNotFoundError:
            return await self._answer(conn, hdr, GetAnswer(False), "miss")
        if rv is not None:
            return await self._send(conn, hdr, list(rv.views), rv.length, attrs.checksums, lease_id)
        n = store.size_of(skey) or 0
        staging = pool.try_take(n)
        if staging is None:
            return await self._reject(conn, hdr, Rejected(RejectReason.BUSY, self.server.limits.retry_after_s, "busy"))
        try:
            try:
                n = store.get_into(skey, staging.view())
            except (CorruptBlockError, BlockNotFoundError):
                return await self._answer(conn, hdr, GetAnswer(False), "miss")
            v = staging.view()[:n]
            await self._send(conn, hdr, [v[i : i + pb] for i in range(0, n, pb)], n, attrs.checksums, lease_id)
        finally:
            pool.give(staging)

    async def _send(self, conn: Connection, hdr: FrameHeader, views: list[memoryview], length: int, checksums: bytes,
                    lease_id: int | None) -> None:
        meta, pb = GetAnswer(True, length, lease_id).to_meta(), self.server.page_bytes
        if len(checksums) == 8 * len(views):  # verified when the value came in: no second hash of it
            await conn.frames.send_checksummed(hdr.msg_type, meta, views, checksums, pb, Flags.RESPONSE, hdr.corr_id)
        else:
            await conn.frames.send(hdr.msg_type, meta, views, pb, Flags.RESPONSE, hdr.corr_id)
        self.server.metrics.bytes_out.inc(length)
        self.server.metrics.requests.labels("get", "hit").inc()

    # ------------------------------------------------------------ lookups, pins, leases
    def _distinct(self, tenant: Tenant, keys: tuple[bytes, ...]) -> list[bytes]:
        """The storage keys of ``keys``, each once, in order: a key named twice in one request is
        leased, pinned or unpinned once (and charged once)."""
        return list(dict.fromkeys(self._skey(tenant, k) for k in keys))

    def _present(self, tenant: Tenant, keys: tuple[bytes, ...]) -> list[bytes]:
        return [sk for sk in self._distinct(tenant, keys) if sk in self.server.store]

    async def lookup(self, conn: Connection, hdr: FrameHeader, req: LookupRequest, tenant: Tenant,
                     holder: Owner) -> None:
        skeys = [self._skey(tenant, k) for k in req.keys]
        hits = self.server.store.lookup(skeys).prefix_blocks  # one probe per key, hit or miss alike; hits touched
        lease_id = None
        if req.lease_s > 0 and hits:
            held = list(dict.fromkeys(skeys[:hits]))
            acct = self._charge_held(conn, tenant, len(held), lease_bytes(len(held)))
            ttl = min(req.lease_s, self.server.limits.max_lease_ttl_s)
            lease_id = self.server.ledger.lease_many(held, holder, ttl, acct).lease_id
            self._noted(conn, tenant)
        await self._answer(conn, hdr, LookupAnswer(hits, lease_id))

    async def contains(self, conn: Connection, hdr: FrameHeader, req: ContainsRequest, tenant: Tenant,
                       holder: Owner) -> None:
        sizes = [self.server.store.size_of(self._skey(tenant, k)) for k in req.keys]
        await self._answer(conn, hdr, ContainsAnswer(tuple(n is not None for n in sizes), tuple(sizes)))

    async def pin(self, conn: Connection, hdr: FrameHeader, req: PinRequest, tenant: Tenant, holder: Owner) -> None:
        present = self._present(tenant, req.keys)
        acct = self._charge_held(conn, tenant, len(present), len(present) * PIN_BYTES)
        limits = self.server.limits
        ttl = self._ttl(req.ttl_s, limits.pin_ttl_s, limits.max_pin_ttl_s)
        for sk in present:
            self.server.ledger.pin(sk, holder, req.reason, ttl, acct)
        self._noted(conn, tenant)
        await self._answer(conn, hdr, CountAnswer(len(present)))

    async def unpin(self, conn: Connection, hdr: FrameHeader, req: UnpinRequest, tenant: Tenant, holder: Owner) -> None:
        n = 0
        for sk in self._present(tenant, req.keys):
            if holder in self.server.ledger.pins_of(sk):
                self.server.ledger.unpin(sk, holder)
                n += 1
        self._noted(conn, tenant)  # a pin another connection took is seen again at the next sweep
        await self._answer(conn, hdr, CountAnswer(n))

    async def lease(self, conn: Connection, hdr: FrameHeader, req: LeaseRequest, tenant: Tenant, holder: Owner) -> None:
        wanted = self._distinct(tenant, req.keys)
        present = [sk for sk in wanted if sk in self.server.store]
        if len(present) != len(wanted):
            raise UnknownBlockError(f"{len(wanted) - len(present)} of {len(wanted)} blocks are not stored for "
                                    f"{tenant.name}: nothing leased")
        lease_id = None
        if present:  # an empty list leases nothing and records nothing
            acct = self._charge_held(conn, tenant, len(present), lease_bytes(len(present)))
            limits = self.server.limits
            ttl = self._ttl(req.ttl_s, limits.lease_ttl_s, limits.max_lease_ttl_s)
            lease_id = self.server.ledger.lease_many(present, holder, ttl, acct).lease_id
            self._noted(conn, tenant)
        await self._answer(conn, hdr, LeaseAnswer(lease_id, len(present)))

    async def release(self, conn: Connection, hdr: FrameHeader, req: ReleaseRequest, tenant: Tenant,
                      holder: Owner) -> None:
        gone = self.server.ledger.release_id(req.lease, holder)  # another's, released twice or lapsed: LeaseError
        self.server.held.note(tenant.name, gone.account)  # the connection that took it, maybe another one
        await self._answer(conn, hdr, Done())

    async def delete(self, conn: Connection, hdr: FrameHeader, req: DeleteRequest, tenant: Tenant,
                     holder: Owner) -> None:
        n = sum(1 for sk in self._present(tenant, req.keys) if self.server.store.delete(sk))
        await self._answer(conn, hdr, CountAnswer(n))

    # ------------------------------------------------------------ reports
    async def stats(self, conn: Connection, hdr: FrameHeader, req: StatsRequest, tenant: Tenant, holder: Owner) -> None:
        await self._answer(conn, hdr, reports.stats(self.server, tenant, req.brief, req.list_keys))

    async def owners(self, conn: Connection, hdr: FrameHeader, req: OwnersRequest, tenant: Tenant,
                     holder: Owner) -> None:
        await self._answer(conn, hdr, reports.owners(self.server, tenant, req.keys, req.prefix))

    async def leaks(self, conn: Connection, hdr: FrameHeader, req: LeaksRequest, tenant: Tenant, holder: Owner) -> None:
        await self._answer(conn, hdr, reports.leaks(self.server, tenant))

    async def ping(self, conn: Connection, hdr: FrameHeader, req: PingRequest, tenant: Tenant, holder: Owner) -> None:
        await self._answer(conn, hdr, Done())
