"""Request handlers: one method per message type, over the block store and the tenant table.

Handlers run on the event loop; the catalog is only touched between awaits, so every plan, hold,
commit and lease is atomic with respect to other connections. A handler either consumes its
request's payload (``conn.payload_taken()``) or leaves it to :class:`Connection` to skip before an
error answer: the stream never desynchronises on a refused request.
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
    IllegalMoveError,
    LeaseError,
    ProtocolError,
    TierError,
    TierFullError,
)
from kvport.server.blocks import BlockStore
from kvport.server.catalog import Entry, Place
from kvport.server.conn import Connection
from kvport.server.limits import Rejected, RejectReason, ServerLimits
from kvport.server.metrics import ServerMetrics
from kvport.server.protocol import float_field, int_field, key_field, keys_field
from kvport.server.staging import StagingPool
from kvport.server.stats import build_stats
from kvport.server.tenants import Tenant, TenantTable
from kvport.transfer.wire import Flags, FrameHeader, Limits, MsgType

_MAX_LIST = 1 << 16  # keys listed by STATS {list_keys}: 1 MiB of metadata at most
Handler = Callable[[Connection, FrameHeader, dict[str, Any], Tenant], Awaitable[None]]


class Handlers:
    def __init__(self, store: BlockStore, tenants: TenantTable, limits: ServerLimits, metrics: ServerMetrics) -> None:
        self.store = store
        self.tenants = tenants
        self.limits = limits
        self.metrics = metrics
        self.pool = StagingPool(limits.total_inflight_bytes)
        self.scratch = memoryview(bytearray(1 << 20))  # drains refused payloads; never grows
        self.wire_limits = Limits(max_meta_bytes=limits.max_header_bytes, max_payload_bytes=limits.max_value_bytes,
                                  max_chunk_bytes=store.page_bytes,
                                  max_chunks=-(-limits.max_value_bytes // store.page_bytes))
        self.draining = False
        self.started = time.monotonic()
        self.connections: dict[int, Connection] = {}
        self.writing: set[bytes] = set()  # storage keys whose value is being received
        self._table: dict[MsgType, Handler] = {
            MsgType.PUT: self.put, MsgType.GET: self.get, MsgType.LOOKUP: self.lookup,
            MsgType.CONTAINS: self.contains, MsgType.PIN: self.pin, MsgType.UNPIN: self.unpin,
            MsgType.LEASE: self.lease, MsgType.RELEASE: self.release, MsgType.DELETE: self.delete,
            MsgType.STATS: self.stats, MsgType.PING: self.ping,
        }

    # ------------------------------------------------------------ connections
    def connection_ready(self, conn: Connection) -> None:
        self.connections[conn.id] = conn
        self.metrics.connections.set(len(self.connections))

    def connection_closed(self, conn: Connection) -> None:
        self.store.catalog.release_holder(conn.id)
        self.connections.pop(conn.id, None)
        self.metrics.connections.set(len(self.connections))

    def tick(self) -> None:
        """Periodic: expire leases, refresh gauges."""
        self.store.catalog.expire(time.monotonic())
        self.metrics.observe(self.store, self.pool)

    # ------------------------------------------------------------ dispatch
    async def dispatch(self, conn: Connection, hdr: FrameHeader, meta: dict[str, Any]) -> None:
        handler = self._table.get(hdr.msg_type)
        if handler is None or hdr.flags & Flags.RESPONSE:
            raise ProtocolError(f"{hdr.msg_type.name} is not a request this server answers")
        if hdr.payload_len and hdr.msg_type is not MsgType.PUT:
            raise ProtocolError(f"{hdr.msg_type.name} carries no payload")
        if conn.tenant is None:
            raise AuthError("request before authentication")
        await handler(conn, hdr, meta, conn.tenant)

    async def _answer(self, conn: Connection, hdr: FrameHeader, meta: dict[str, Any], result: str = "ok") -> None:
        await conn.frames.send(hdr.msg_type, meta, flags=Flags.RESPONSE, corr_id=hdr.corr_id)
        self.metrics.requests.labels(hdr.msg_type.name.lower(), result).inc()

    async def _reject(self, conn: Connection, hdr: FrameHeader, rej: Rejected) -> None:
        await conn.skip_payload()
        self.metrics.rejections.labels(rej.reason.value).inc()
        await self._answer(conn, hdr, {"rejected": rej.reason.value, "retry_after": rej.retry_after_s,
                                       "detail": rej.detail}, "rejected")

    # ------------------------------------------------------------ put
    async def put(self, conn: Connection, hdr: FrameHeader, meta: dict[str, Any], tenant: Tenant) -> None:
        key = key_field(meta)
        size = hdr.payload_len
        if size == 0 or hdr.chunk_size != self.store.page_bytes:
            raise ProtocolError(f"a PUT carries a value in chunks of page_bytes={self.store.page_bytes}")
        if self.draining:
            return await self._reject(conn, hdr, Rejected(RejectReason.SHUTTING_DOWN, None, "server is draining"))
        cat = self.store.catalog
        skey = self.tenants.storage_key(tenant.name, key)
        if skey in cat:
            await conn.skip_payload()
            self._pin_if(meta, skey)
            return await self._answer(conn, hdr, {"status": "exists"}, "exists")
        if skey in self.writing:  # the same block is arriving on another connection: ask to retry
            return await self._reject(conn, hdr, Rejected(RejectReason.BUSY, self.limits.retry_after_s,
                                                          "the same key is being written"))
        plan = cat.plan_put(tenant.name, self.store.charged(size), tenant.quota_bytes)
        if isinstance(plan, Rejected):
            return await self._reject(conn, hdr, plan)
        try:
            self.store.apply(plan)
        except TierError as exc:  # the disk tier refused a demotion (ENOSPC, its own accounting)
            return await self._reject(conn, hdr, Rejected(RejectReason.FULL, self.limits.retry_after_s, str(exc)))
        self.writing.add(skey)
        try:
            if plan.place is Place.HOST:
                ok = await self._put_host(conn, hdr, tenant, key, skey)
            else:
                ok = await self._put_disk(conn, hdr, tenant, key, skey)
        finally:
            self.writing.discard(skey)
        if ok is not None:
            return await self._reject(conn, hdr, ok)
        self._pin_if(meta, skey)
        self.metrics.bytes_in.inc(size)
        await self._answer(conn, hdr, {"status": "stored"}, "stored")

    def _pin_if(self, meta: dict[str, Any], skey: bytes) -> None:
        """PUT's ``pin`` means "pinned at least once", so a retried PUT never pins twice."""
        e = self.store.catalog.get(skey)
        if meta.get("pin") is True and e is not None and e.pins == 0:
            self.store.catalog.pin(skey)

    async def _put_host(self, conn: Connection, hdr: FrameHeader, tenant: Tenant, key: bytes,
                        skey: bytes) -> Rejected | None:
        try:
            res = self.store.reserve_host(skey, hdr.payload_len)
        except (TierFullError, IllegalMoveError):
            return Rejected(RejectReason.FULL, self.limits.retry_after_s, "host pages taken by values in flight")
        try:
            bad = await conn.frames.read_chunks_into(hdr, res.views)
            conn.payload_taken()
        except BaseException:
            self.store.abort(res)  # a client gone mid-write leaves nothing visible
            raise
        if bad is not None:
            self.store.abort(res)
            raise ChecksumError(f"chunk {bad} failed its checksum; nothing stored")
        self.store.commit(res, tenant.name, key, conn.frames.checksums(hdr.n_chunks))
        return None

    async def _put_disk(self, conn: Connection, hdr: FrameHeader, tenant: Tenant, key: bytes,
                        skey: bytes) -> Rejected | None:
        size = hdr.payload_len
        staging = self.pool.try_take(size)
        if staging is None:
            return Rejected(RejectReason.BUSY, self.limits.retry_after_s, "in-flight budget spent")
        charged = self.store.charged(size)
        try:
            self.store.catalog.hold(Place.DISK, charged)
        except IllegalMoveError:
            self.pool.give(staging)
            return Rejected(RejectReason.FULL, self.limits.retry_after_s, "disk room taken by values in flight")
        held = True  # until put_disk turns the hold into the entry
        try:
            bad = await conn.frames.read_payload_into(hdr, staging.view())
            conn.payload_taken()
            if bad is not None:
                raise ChecksumError(f"chunk {bad} failed its checksum; nothing stored")
            self.store.put_disk(skey, staging.view(), tenant.name, key, conn.frames.checksums(hdr.n_chunks))
            held = False
        finally:
            if held:
                self.store.catalog.unhold(Place.DISK, charged)
            self.pool.give(staging)
        return None

    # ------------------------------------------------------------ get
    async def get(self, conn: Connection, hdr: FrameHeader, meta: dict[str, Any], tenant: Tenant) -> None:
        skey = self.tenants.storage_key(tenant.name, key_field(meta))
        cat = self.store.catalog
        e = cat.get(skey)
        if e is None:
            return await self._answer(conn, hdr, {"found": False}, "miss")
        # outlives the frame deadline, so only the finally below (or the connection closing) ends it
        lease = cat.lease(tenant.name, conn.id, [skey], 2 * self.limits.frame_timeout_s, time.monotonic())
        try:
            if e.place is Place.HOST:
                await self._send_value(conn, hdr, e, self.store.host_views(skey, e))
            else:
                await self._get_disk(conn, hdr, skey, e)
        finally:
            with contextlib.suppress(LeaseError):  # already gone if the connection closed meanwhile
                cat.release(lease.lease_id, tenant.name)
        if skey in cat:
            cat.hit(skey)

    async def _get_disk(self, conn: Connection, hdr: FrameHeader, skey: bytes, e: Entry) -> None:
        staging = self.pool.try_take(e.length)
        if staging is None:
            return await self._reject(conn, hdr, Rejected(RejectReason.BUSY, self.limits.retry_after_s, "busy"))
        try:
            try:
                self.store.read_disk_into(skey, e, staging.view())
            except (CorruptBlockError, BlockNotFoundError):
                return await self._answer(conn, hdr, {"found": False}, "miss")
            v = staging.view()
            pb = self.store.page_bytes
            await self._send_value(conn, hdr, e, [v[i : i + pb] for i in range(0, e.length, pb)])
        finally:
            self.pool.give(staging)

    async def _send_value(self, conn: Connection, hdr: FrameHeader, e: Entry, views: list[memoryview]) -> None:
        meta = {"found": True, "length": e.length}
        if e.checksums:  # verified when the value came in: no second hash of the value
            await conn.frames.send_checksummed(hdr.msg_type, meta, views, e.checksums, self.store.page_bytes,
                                               Flags.RESPONSE, hdr.corr_id)
        else:
            await conn.frames.send(hdr.msg_type, meta, views, self.store.page_bytes, Flags.RESPONSE, hdr.corr_id)
        self.metrics.bytes_out.inc(e.length)
        self.metrics.requests.labels("get", "hit").inc()

    # ------------------------------------------------------------ lookups, pins, leases
    def _skeys(self, meta: dict[str, Any], tenant: Tenant) -> list[bytes]:
        return [self.tenants.storage_key(tenant.name, k) for k in keys_field(meta, self.limits.max_keys_per_request)]

    async def lookup(self, conn: Connection, hdr: FrameHeader, meta: dict[str, Any], tenant: Tenant) -> None:
        skeys = self._skeys(meta, tenant)
        lease_s = float_field(meta, "lease_s", 0.0, 0.0, self.limits.max_lease_ttl_s)
        cat = self.store.catalog
        hits = 0
        for sk in skeys:  # one dict probe per key, hit or miss alike
            if sk not in cat:
                break
            hits += 1
        lease_id = None
        if lease_s > 0 and hits:
            lease_id = cat.lease(tenant.name, conn.id, skeys[:hits], lease_s, time.monotonic()).lease_id
        await self._answer(conn, hdr, {"hits": hits, "lease": lease_id})

    async def contains(self, conn: Connection, hdr: FrameHeader, meta: dict[str, Any], tenant: Tenant) -> None:
        entries = [self.store.catalog.get(sk) for sk in self._skeys(meta, tenant)]
        await self._answer(conn, hdr, {"present": [e is not None for e in entries],
                                       "lengths": [None if e is None else e.length for e in entries]})

    async def pin(self, conn: Connection, hdr: FrameHeader, meta: dict[str, Any], tenant: Tenant) -> None:
        n = 0
        for sk in self._skeys(meta, tenant):
            if sk in self.store.catalog:
                self.store.catalog.pin(sk)
                n += 1
        await self._answer(conn, hdr, {"count": n})

    async def unpin(self, conn: Connection, hdr: FrameHeader, meta: dict[str, Any], tenant: Tenant) -> None:
        n = 0
        for sk in self._skeys(meta, tenant):
            e = self.store.catalog.get(sk)
            if e is not None and e.pins:
                self.store.catalog.unpin(sk)
                n += 1
        await self._answer(conn, hdr, {"count": n})

    async def lease(self, conn: Connection, hdr: FrameHeader, meta: dict[str, Any], tenant: Tenant) -> None:
        ttl = float_field(meta, "ttl_s", self.limits.lease_ttl_s, 0.001, self.limits.max_lease_ttl_s)
        lease = self.store.catalog.lease(tenant.name, conn.id, self._skeys(meta, tenant), ttl, time.monotonic())
        await self._answer(conn, hdr, {"lease": lease.lease_id, "held": len(lease.skeys)})

    async def release(self, conn: Connection, hdr: FrameHeader, meta: dict[str, Any], tenant: Tenant) -> None:
        self.store.catalog.release(int_field(meta, "lease"), tenant.name)
        await self._answer(conn, hdr, {})

    async def delete(self, conn: Connection, hdr: FrameHeader, meta: dict[str, Any], tenant: Tenant) -> None:
        n = 0
        for sk in self._skeys(meta, tenant):
            e = self.store.catalog.get(sk)
            if e is not None and e.movable:
                self.store.drop(sk)
                n += 1
        await self._answer(conn, hdr, {"deleted": n})

    async def stats(self, conn: Connection, hdr: FrameHeader, meta: dict[str, Any], tenant: Tenant) -> None:
        if meta.get("brief") is True:  # totals only: cheap enough for a store's watermark checks
            cat = self.store.catalog
            out: dict[str, Any] = {"capacity": cat.host_capacity + cat.disk_capacity,
                                   "quota": tenant.quota_bytes, "used": cat.usage.get(tenant.name, 0)}
        else:
            out = build_stats(self, None if tenant.admin else tenant.name)
        if meta.get("list_keys") is True:
            out["keys"] = [e.client_key for _, e in self.store.catalog.items() if e.tenant == tenant.name][:_MAX_LIST]
        await self._answer(conn, hdr, out)

    async def ping(self, conn: Connection, hdr: FrameHeader, meta: dict[str, Any], tenant: Tenant) -> None:
        await self._answer(conn, hdr, {})
