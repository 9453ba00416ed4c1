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
import time
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
from kvport.protocol.frame import Flags, FrameHeader, Limits
from kvport.protocol.rejects import Rejected, RejectReason
from kvport.protocol.schema import Message
from kvport.protocol.server import Contains as ContainsReq
from kvport.protocol.server import (
    ContainsAnswer,
    CountAnswer,
    Done,
    Get,
    GetAnswer,
    LeaseAnswer,
    LookupAnswer,
    PinSpec,
    Put,
    PutAnswer,
    Request,
    decode_request,
)
from kvport.protocol.server import Delete as DeleteReq
from kvport.protocol.server import Leaks as LeaksReq
from kvport.protocol.server import Lease as LeaseReq
from kvport.protocol.server import Lookup as LookupReq
from kvport.protocol.server import Owners as OwnersReq
from kvport.protocol.server import Pin as PinReq
from kvport.protocol.server import Ping as PingReq
from kvport.protocol.server import Release as ReleaseReq
from kvport.protocol.server import Stats as StatsReq
from kvport.protocol.server import Unpin as UnpinReq
from kvport.server import reports
from kvport.server.admission import Admission, parse_networks
from kvport.server.conn import Connection
from kvport.server.held import HeldTally, account
from kvport.server.limits import ServerLimits
from kvport.server.metrics import ServerMetrics
from kvport.server.staging import StagingPool
from kvport.server.storage import HOST, Attrs
from kvport.server.tenants import Tenant, TenantTable
from kvport.store import TieredStore

Handler = Callable[[Connection, FrameHeader, Any, Tenant, Owner], Awaitable[None]]


class Handlers:
    def __init__(self, store: TieredStore, tenants: TenantTable, limits: ServerLimits, metrics: ServerMetrics,
                 page_bytes: int, held_budget_bytes: int, server_name: str = "kvport-serve") -> None:
        self.store = store
        self.ledger = store.ledger
        self.tenants = tenants
        self.limits = limits
        self.metrics = metrics
        self.page_bytes = page_bytes
        self.server_name = server_name
        self.pool = StagingPool(limits.total_inflight_bytes)
        self.scratch = memoryview(bytearray(1 << 20))  # drains refused payloads; never grows
        self.wire_limits = Limits(max_meta_bytes=limits.max_header_bytes, max_payload_bytes=limits.max_value_bytes,
                                  max_chunk_bytes=page_bytes, max_chunks=-(-limits.max_value_bytes // page_bytes))
        self.draining = False
        self.started = time.monotonic()
        self.connections: dict[int, Connection] = {}  # logged in
        self.held = HeldTally(self.ledger, limits.max_held_per_client, limits.max_held_per_tenant, held_budget_bytes)
        self.admission = Admission(limits.max_connections, limits.max_pending, limits.max_per_peer,
                                   parse_networks(limits.per_peer_exempt))
        self.hits = reports.HitCounts(store)  # GETs served per stored block (inspect's top prefixes)
        self._table: dict[type[Message], Handler] = {
            Put: self.put, Get: self.get, LookupReq: self.lookup, ContainsReq: self.contains, PinReq: self.pin,
            UnpinReq: self.unpin, LeaseReq: self.lease, ReleaseReq: self.release, DeleteReq: self.delete,
            StatsReq: self.stats, OwnersReq: self.owners, LeaksReq: self.leaks, PingReq: self.ping,
        }

    # ------------------------------------------------------------ connections
    def connection_ready(self, conn: Connection) -> None:
        self.connections[conn.id] = conn
        self.admission.logged_in(conn.id)
        self._count_connections()

    def connection_closed(self, conn: Connection) -> None:
        self.connections.pop(conn.id, None)  # its client's leases and pins lapse at their TTL
        self.admission.closed(conn.id)
        self._count_connections()

    def _count_connections(self) -> None:
        self.metrics.connections.set(len(self.connections))
        self.metrics.pending.set(self.admission.pending)

    def tick(self) -> None:
        """Periodic: lifetimes (store), leases and pins past their TTL (ledger), gauges."""
        self.store.expire()
        self.ledger.expire()
        self.held.sweep()
        self.metrics.observe(self.store, self.pool, self.held)

    # ------------------------------------------------------------ dispatch
    async def dispatch(self, conn: Connection, hdr: FrameHeader, meta: dict[str, Any]) -> None:
        if hdr.flags & Flags.RESPONSE:
            raise ProtocolError(f"{hdr.msg_type.name} with the RESPONSE flag is not a request")
        req: Request = decode_request(hdr.msg_type, meta)
        if hdr.payload_len and not isinstance(req, Put):
            raise ProtocolError(f"{hdr.msg_type.name} carries no payload")
        if conn.tenant is None or conn.holder is None:
            raise AuthError("request before authentication")
        keys = getattr(req, "keys", ())
        if len(keys) > self.limits.max_keys_per_request:
            raise ProtocolError(f"{len(keys)} keys in one request; at most {self.limits.max_keys_per_request}")
        await self._table[type(req)](conn, hdr, req, conn.tenant, conn.holder)

    async def _answer(self, conn: Connection, hdr: FrameHeader, msg: Message | dict[str, Any],
                      result: str = "ok") -> None:
        meta = msg if isinstance(msg, dict) else msg.to_meta()
        await conn.frames.send(hdr.msg_type, meta, flags=Flags.RESPONSE, corr_id=hdr.corr_id)
        self.metrics.requests.labels(hdr.msg_type.name.lower(), result).inc()

    async def _reject(self, conn: Connection, hdr: FrameHeader, rej: Rejected) -> None:
        await conn.skip_payload()
        self.metrics.rejections.labels(rej.reason.value).inc()
        await self._answer(conn, hdr, rej.to_meta(), "rejected")

    def _skey(self, tenant: Tenant, key: bytes) -> bytes:
        return self.tenants.storage_key(tenant.name, key)

    def _charge_held(self, conn: Connection, tenant: Tenant, n: int, nbytes: int) -> str:
        """Leases and pins are charged before anything is recorded, to the connection and its tenant
        (never to the client's own label), and in record bytes to the server's budget for them
        (LeaseError past a cap, :mod:`kvport.server.held`); returns the account to record them with."""
        acct = account(tenant.name, conn.id)
        self.held.charge(tenant.name, acct, n, nbytes)
        return acct

    def _noted(self, conn: Connection, tenant: Tenant) -> None:
        self.held.note(tenant.name, account(tenant.name, conn.id))

    def _ttl(self, asked: float, default: float, cap: float) -> float:
        return min(asked, cap) if asked > 0 else default

    # ------------------------------------------------------------ put
    async def put(self, conn: Connection, hdr: FrameHeader, req: Put, tenant: Tenant, holder: Owner) -> None:
        size = hdr.payload_len
        if size == 0 or hdr.chunk_size != self.page_bytes:
            raise ProtocolError(f"a PUT carries a value in chunks of page_bytes={self.page_bytes}")
        if self.draining:
            return await self._reject(conn, hdr, Rejected(RejectReason.SHUTTING_DOWN, None, "server is draining"))
        store, skey = self.store, self._skey(tenant, req.key)
        if skey in store:
            await conn.skip_payload()
            store.lookup([skey])  # a hit: the block stays longer
            self._pin_if(conn, req.pin, skey, tenant, holder)
            return await self._answer(conn, hdr, PutAnswer("exists"), "exists")
        if store.writing(skey):  # the same block is arriving on another connection: ask to retry
            return await self._reject(conn, hdr, Rejected(RejectReason.BUSY, self.limits.retry_after_s,
                                                          "the same key is being written"))
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
            return await self._reject(conn, hdr, Rejected(RejectReason.QUOTA, self.limits.retry_after_s, str(exc)))
        except TierFullError as exc:
            return await self._reject(conn, hdr, Rejected(RejectReason.BUSY, self.limits.retry_after_s, str(exc)))
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
        self.metrics.bytes_in.inc(size)
        await self._answer(conn, hdr, PutAnswer("stored"), "stored")

    def _lifetime_ttl(self, req: Put) -> float | None:
        cap = self.limits.max_lease_ttl_s * 1000
        if req.lifetime is Lifetime.SESSION:
            return self._ttl(req.ttl_s, self.limits.session_ttl_s, cap)
        if req.lifetime is Lifetime.REQUEST:
            return self._ttl(req.ttl_s, self.limits.request_ttl_s, cap)
        return req.ttl_s if req.ttl_s > 0 else None

    async def _put_staged(self, conn: Connection, hdr: FrameHeader, req: Put, tenant: Tenant, holder: Owner,
                          skey: bytes, sparent: bytes | None, ttl: float | None) -> Rejected | None:
        """No room in the pool: receive into a bounded staging buffer, then let the store place it."""
        size = hdr.payload_len
        staging = self.pool.try_take(size)
        if staging is None:
            return Rejected(RejectReason.BUSY, self.limits.retry_after_s, "in-flight budget spent")
        try:
            bad = await conn.frames.read_payload_into(hdr, staging.view())
            conn.payload_taken()
            if bad is not None:
                raise ChecksumError(f"chunk {bad} failed its checksum; nothing stored")
            if self.store.writing(skey) or skey in self.store:
                return Rejected(RejectReason.BUSY, self.limits.retry_after_s, "the same key was written meanwhile")
            if sparent is not None and sparent not in self.store:
                return Rejected(RejectReason.NO_PARENT, None, "the parent block left while the value arrived")
            try:
                self.store.put(skey, staging.view(), lifetime=req.lifetime, parent=sparent, account=tenant.name,
                               ttl_s=ttl, attrs=Attrs(req.key, conn.frames.checksums(hdr.n_chunks)).encode(),
                               origin=holder)
            except QuotaExceededError as exc:
                return Rejected(RejectReason.QUOTA, self.limits.retry_after_s, str(exc))
            except TierFullError as exc:
                return Rejected(RejectReason.FULL, self.limits.retry_after_s, str(exc))
            return None
        finally:
            self.pool.give(staging)

    def _pin_if(self, conn: Connection, spec: PinSpec | None, skey: bytes, tenant: Tenant, holder: Owner) -> None:
        """PUT's ``pin`` means "pinned by this client at least once", so a retried PUT never pins twice."""
        if spec is None or holder in self.ledger.pins_of(skey):
            return
        acct = self._charge_held(conn, tenant, 1, PIN_BYTES)
        self.ledger.pin(skey, holder, spec.reason, self._ttl(spec.ttl_s, self.limits.pin_ttl_s,
                                                             self.limits.max_pin_ttl_s), acct)
        self._noted(conn, tenant)

    # ------------------------------------------------------------ get
    async def get(self, conn: Connection, hdr: FrameHeader, req: Get, tenant: Tenant, holder: Owner) -> None:
        skey = self._skey(tenant, req.key)
        if skey not in self.store:
            return await self._answer(conn, hdr, GetAnswer(False), "miss")
        # the read's own lease outlives the frame deadline: only the finally below ends it
        reading = self.ledger.lease(skey, holder, 2 * self.limits.frame_timeout_s + 1)
        try:
            kept: Lease | None = None
            if req.lease_s > 0:
                acct = self._charge_held(conn, tenant, 1, lease_bytes(1))
                kept = self.ledger.lease(skey, holder, min(req.lease_s, self.limits.max_lease_ttl_s), acct)
                self._noted(conn, tenant)
            await self._send_value(conn, hdr, skey, None if kept is None else kept.lease_id)
        finally:
            with contextlib.suppress(LeaseError, UnknownBlockError):
                self.ledger.release(reading)
        self.hits.hit(skey)

    async def _send_value(self, conn: Connection, hdr: FrameHeader, skey: bytes, lease_id: int | None) -> None:
        meta = self.store.meta_of(skey)
        attrs = Attrs.decode(meta.attrs if meta is not None else b"")
        pb = self.page_bytes
        try:
            rv = self.store.read_views(skey)
        except BlockNotFoundError:
            return await self._answer(conn, hdr, GetAnswer(False), "miss")
        if rv is not None:
            return await self._send(conn, hdr, list(rv.views), rv.length, attrs.checksums, lease_id)
        n = self.store.size_of(skey) or 0
        staging = self.pool.try_take(n)
        if staging is None:
            return await self._reject(conn, hdr, Rejected(RejectReason.BUSY, self.limits.retry_after_s, "busy"))
        try:
            try:
                n = self.store.get_into(skey, staging.view())
            except (CorruptBlockError, BlockNotFoundError):
                return await self._answer(conn, hdr, GetAnswer(False), "miss")
            v = staging.view()[:n]
            await self._send(conn, hdr, [v[i : i + pb] for i in range(0, n, pb)], n, attrs.checksums, lease_id)
        finally:
            self.pool.give(staging)

    async def _send(self, conn: Connection, hdr: FrameHeader, views: list[memoryview], length: int, checksums: bytes,
                    lease_id: int | None) -> None:
        meta = GetAnswer(True, length, lease_id).to_meta()
        if len(checksums) == 8 * len(views):  # verified when the value came in: no second hash of it
            await conn.frames.send_checksummed(hdr.msg_type, meta, views, checksums, self.page_bytes,
                                               Flags.RESPONSE, hdr.corr_id)
        else:
            await conn.frames.send(hdr.msg_type, meta, views, self.page_bytes, Flags.RESPONSE, hdr.corr_id)
        self.metrics.bytes_out.inc(length)
        self.metrics.requests.labels("get", "hit").inc()

    # ------------------------------------------------------------ lookups, pins, leases
    def _distinct(self, tenant: Tenant, keys: tuple[bytes, ...]) -> list[bytes]:
        """The storage keys of ``keys``, each once, in order: a key named twice in one request is
        leased, pinned or unpinned once (and charged once)."""
        return list(dict.fromkeys(self._skey(tenant, k) for k in keys))

    def _present(self, tenant: Tenant, keys: tuple[bytes, ...]) -> list[bytes]:
        return [sk for sk in self._distinct(tenant, keys) if sk in self.store]

    async def lookup(self, conn: Connection, hdr: FrameHeader, req: LookupReq, tenant: Tenant, holder: Owner) -> None:
        skeys = [self._skey(tenant, k) for k in req.keys]
        hits = self.store.lookup(skeys).prefix_blocks  # one probe per key, hit or miss alike; hits touched
        lease_id = None
        if req.lease_s > 0 and hits:
            held = list(dict.fromkeys(skeys[:hits]))
            acct = self._charge_held(conn, tenant, len(held), lease_bytes(len(held)))
            lease_id = self.ledger.lease_many(held, holder, min(req.lease_s, self.limits.max_lease_ttl_s),
                                              acct).lease_id
            self._noted(conn, tenant)
        await self._answer(conn, hdr, LookupAnswer(hits, lease_id))

    async def contains(self, conn: Connection, hdr: FrameHeader, req: ContainsReq, tenant: Tenant,
                       holder: Owner) -> None:
        sizes = [self.store.size_of(self._skey(tenant, k)) for k in req.keys]
        await self._answer(conn, hdr, ContainsAnswer(tuple(n is not None for n in sizes), tuple(sizes)))

    async def pin(self, conn: Connection, hdr: FrameHeader, req: PinReq, tenant: Tenant, holder: Owner) -> None:
        present = self._present(tenant, req.keys)
        acct = self._charge_held(conn, tenant, len(present), len(present) * PIN_BYTES)
        ttl = self._ttl(req.ttl_s, self.limits.pin_ttl_s, self.limits.max_pin_ttl_s)
        for sk in present:
            self.ledger.pin(sk, holder, req.reason, ttl, acct)
        self._noted(conn, tenant)
        await self._answer(conn, hdr, CountAnswer(len(present)))

    async def unpin(self, conn: Connection, hdr: FrameHeader, req: UnpinReq, tenant: Tenant, holder: Owner) -> None:
        n = 0
        for sk in self._present(tenant, req.keys):
            if holder in self.ledger.pins_of(sk):
                self.ledger.unpin(sk, holder)
                n += 1
        self._noted(conn, tenant)  # a pin another connection took is seen again at the next sweep
        await self._answer(conn, hdr, CountAnswer(n))

    async def lease(self, conn: Connection, hdr: FrameHeader, req: LeaseReq, tenant: Tenant, holder: Owner) -> None:
        wanted = self._distinct(tenant, req.keys)
        present = [sk for sk in wanted if sk in self.store]
        if len(present) != len(wanted):
            raise UnknownBlockError(f"{len(wanted) - len(present)} of {len(wanted)} blocks are not stored for "
                                    f"{tenant.name}: nothing leased")
        lease_id = None
        if present:  # an empty list leases nothing and records nothing
            acct = self._charge_held(conn, tenant, len(present), lease_bytes(len(present)))
            ttl = self._ttl(req.ttl_s, self.limits.lease_ttl_s, self.limits.max_lease_ttl_s)
            lease_id = self.ledger.lease_many(present, holder, ttl, acct).lease_id
            self._noted(conn, tenant)
        await self._answer(conn, hdr, LeaseAnswer(lease_id, len(present)))

    async def release(self, conn: Connection, hdr: FrameHeader, req: ReleaseReq, tenant: Tenant,
                      holder: Owner) -> None:
        gone = self.ledger.release_id(req.lease, holder)  # someone else's, released twice or lapsed: LeaseError
        self.held.note(tenant.name, gone.account)  # the connection that took it, maybe another one
        await self._answer(conn, hdr, Done())

    async def delete(self, conn: Connection, hdr: FrameHeader, req: DeleteReq, tenant: Tenant, holder: Owner) -> None:
        n = sum(1 for sk in self._present(tenant, req.keys) if self.store.delete(sk))
        await self._answer(conn, hdr, CountAnswer(n))

    # ------------------------------------------------------------ reports
    async def stats(self, conn: Connection, hdr: FrameHeader, req: StatsReq, tenant: Tenant, holder: Owner) -> None:
        await self._answer(conn, hdr, reports.stats(self, tenant, req.brief, req.list_keys))

    async def owners(self, conn: Connection, hdr: FrameHeader, req: OwnersReq, tenant: Tenant, holder: Owner) -> None:
        await self._answer(conn, hdr, reports.owners(self, tenant, req.keys, req.prefix))

    async def leaks(self, conn: Connection, hdr: FrameHeader, req: LeaksReq, tenant: Tenant, holder: Owner) -> None:
        await self._answer(conn, hdr, reports.leaks(self, tenant))

    async def ping(self, conn: Connection, hdr: FrameHeader, req: PingReq, tenant: Tenant, holder: Owner) -> None:
        await self._answer(conn, hdr, Done())
