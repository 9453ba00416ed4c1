"""One client connection: a state machine, the handshake, and the request loop with its deadlines.

::

    HANDSHAKE --auth ok--> READY --request--> BUSY --answered--> READY
        |                    |                  |
        +--------------------+------------------+--> CLOSING --> CLOSED
                 (auth failure, timeout, protocol error, peer gone, server draining)

:meth:`Connection.move` is the only place the state changes; an illegal move raises
:class:`IllegalMoveError`. Deadlines: the whole handshake -- the TLS handshake, when the server
speaks TLS, then the kvport one -- within ``handshake_timeout_s`` of ``accept``; in READY the first
byte of the next frame within ``idle_timeout_s``; from that byte, the rest of the frame *and its
answer* within ``frame_timeout_s`` (a slow-loris client that trickles a frame, or a reader that
stops reading an answer, is closed), and no ``write_timeout_s`` without the peer taking a byte of
an answer (the stream's write deadline). Before AUTH_OK the caps are tiny (1 KiB of metadata, no
payload), so an unauthenticated peer cannot make the server allocate anything; how many may be in
HANDSHAKE at once is :mod:`kvport.server.admission`'s.

Connections take turns, one request each: a read or a send that the kernel's buffers satisfy at
once never suspends, so without the yield after every request a client that pipelines frames
would hold the event loop until its pipeline ran dry, and every other connection, the accept loop
and the tick (lease and pin expiry) would wait for it.

The handshake is the one of :mod:`kvport.protocol.handshake`: the client names its tenant (the
principal whose token signs) and its instance; ``tenant/instance`` is the holder of the leases and
pins it takes (they belong to the client, not to this connection, and lapse at their TTL). What
they cost is charged to what was authenticated, the tenant and this connection, never to the
instance label the client chose (:mod:`kvport.server.held`).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kvport.errors import AuthError, ChecksumError, IllegalMoveError, KVPortError, PeerError, ProtocolError
from kvport.ledger import Owner
from kvport.protocol.aio import AsyncFrames, AsyncStream
from kvport.protocol.frame import FrameHeader, MsgType
from kvport.protocol.handshake import HANDSHAKE_LIMITS, server_handshake_async
from kvport.server.state import ServerState
from kvport.server.tenants import Tenant

log = logging.getLogger(__name__)


class ConnState(enum.Enum):
    HANDSHAKE = "handshake"
    READY = "ready"
    BUSY = "busy"
    CLOSING = "closing"
    CLOSED = "closed"


_MOVES: dict[ConnState, frozenset[ConnState]] = {
    ConnState.HANDSHAKE: frozenset({ConnState.READY, ConnState.CLOSING}),
    ConnState.READY: frozenset({ConnState.BUSY, ConnState.CLOSING}),
    ConnState.BUSY: frozenset({ConnState.READY, ConnState.CLOSING}),
    ConnState.CLOSING: frozenset({ConnState.CLOSED}),
    ConnState.CLOSED: frozenset(),
}

Dispatch = Callable[["Connection", FrameHeader, dict[str, Any]], Awaitable[None]]


class Connection:
    """One connection to ``server`` (the state it reads and reports to); ``dispatch(conn, hdr, meta)``
    answers one request (:meth:`kvport.server.handlers.Handlers.dispatch`)."""

    def __init__(self, conn_id: int, stream: AsyncStream, server: ServerState, dispatch: Dispatch) -> None:
        self.id = conn_id
        self.stream = stream
        self.server = server
        self._dispatch = dispatch
        self.frames = AsyncFrames(stream, HANDSHAKE_LIMITS)
        self.state = ConnState.HANDSHAKE
        self.tenant: Tenant | None = None
        self.holder: Owner | None = None  # client:tenant/instance, once authenticated
        self.pending: FrameHeader | None = None  # a request whose payload is still unread

    def move(self, to: ConnState) -> None:
        if to not in _MOVES[self.state]:
            raise IllegalMoveError(f"connection {self.id}: {self.state.value} -> {to.value}")
        self.state = to

    # ------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        try:
            async with asyncio.timeout(self.server.limits.handshake_timeout_s):
                await self.stream.start()  # the TLS handshake, if any: part of the login's deadline
                await self._handshake()
            self.frames.limits = self.server.wire_limits
            while not self.server.draining:
                try:
                    async with asyncio.timeout(self.server.limits.idle_timeout_s):
                        await self.frames.wait_frame()
                except TimeoutError:
                    self.server.metrics.timeouts.labels("idle").inc()
                    break
                self.move(ConnState.BUSY)
                try:
                    async with asyncio.timeout(self.server.limits.frame_timeout_s):
                        await self._one_request()
                except TimeoutError:
                    self.server.metrics.timeouts.labels("frame").inc()
                    break
                self.move(ConnState.READY)
                await asyncio.sleep(0)  # turn by turn: see the module docstring
        except TimeoutError:
            self.server.metrics.timeouts.labels("handshake").inc()
        except AuthError as exc:
            self.server.metrics.auth_failures.inc()
            log.info("closing %s: %s", self.stream.peer, exc)
        except (ProtocolError, ChecksumError) as exc:
            log.info("closing %s: %s", self.stream.peer, exc)
            await self._try_error(MsgType.ERROR, exc, 0)
        except PeerError as exc:
            if self.stream.stalled:
                self.server.metrics.timeouts.labels("write").inc()
            log.debug("peer %s gone: %s", self.stream.peer, exc)
        except KVPortError as exc:  # a server-side failure outside a request: log it, close the connection
            log.warning("closing %s after %s: %s", self.stream.peer, type(exc).__name__, exc)
        finally:
            self.close()

    def close(self) -> None:
        if self.state is ConnState.CLOSED:
            return
        if self.state is not ConnState.CLOSING:
            self.move(ConnState.CLOSING)
        self.server.connection_closed(self.id)
        self.stream.close()
        self.move(ConnState.CLOSED)

    async def _try_error(self, msg_type: MsgType, exc: BaseException, corr_id: int) -> None:
        try:
            async with asyncio.timeout(1.0):
                await self.frames.send_error(msg_type, exc, corr_id)
        except (TimeoutError, PeerError):
            pass

    # ------------------------------------------------------------ handshake
    async def _handshake(self) -> None:
        srv = self.server
        peer = await server_handshake_async(self.frames, srv.server_name, srv.tenants.key_lookup, {
            "page_bytes": srv.page_bytes, "max_value_bytes": srv.limits.max_value_bytes})
        tenant = srv.tenants.get(peer.who)
        if tenant is None:  # pragma: no cover - the handshake already refused unknown tenants
            raise AuthError("authentication failed")
        self.tenant = tenant
        self.holder = Owner.client(f"{tenant.name}/{peer.client}")
        self.move(ConnState.READY)
        srv.connection_ready(self.id, tenant)

    # ------------------------------------------------------------ requests
    async def _one_request(self) -> None:
        hdr = await self.frames.read_header()
        self.pending = hdr if hdr.payload_len else None
        meta = await self.frames.read_meta(hdr)
        try:
            await self._dispatch(self, hdr, meta)
        except (PeerError, TimeoutError):
            raise
        except KVPortError as exc:
            if self.pending is not None:
                await self.skip_payload()
            await self.frames.send_error(hdr.msg_type, exc, hdr.corr_id)
            self.server.metrics.requests.labels(hdr.msg_type.name.lower(), "error").inc()

    async def skip_payload(self) -> None:
        hdr, self.pending = self.pending, None
        if hdr is not None:
            await self.frames.skip_payload(hdr, self.server.scratch)

    def payload_taken(self) -> None:
        self.pending = None
