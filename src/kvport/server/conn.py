"""One client connection: a state machine, the handshake, and the request loop with its deadlines.

::

    HANDSHAKE --auth ok--> READY --request--> BUSY --answered--> READY
        |                    |                  |
        +--------------------+------------------+--> CLOSING --> CLOSED
                 (auth failure, timeout, protocol error, peer gone, server draining)

:meth:`Connection.move` is the only place the state changes; an illegal move raises
:class:`IllegalMoveError`. Deadlines: the whole handshake within ``handshake_timeout_s``; in READY
the first byte of the next frame within ``idle_timeout_s``; from that byte, the rest of the
frame *and its answer* within ``frame_timeout_s`` (a slow-loris client that trickles a frame, or
a reader that stops reading an answer, is closed). Before AUTH_OK the caps are tiny (1 KiB of
metadata, no payload), so an unauthenticated peer cannot make the server allocate anything.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import TYPE_CHECKING

from kvport.errors import AuthError, ChecksumError, IllegalMoveError, KVPortError, PeerError, ProtocolError
from kvport.server import auth
from kvport.server.aio import AsyncFrames, AsyncStream
from kvport.server.protocol import bytes_field, str_field
from kvport.server.tenants import Tenant
from kvport.transfer.wire import Flags, FrameHeader, Limits, MsgType

if TYPE_CHECKING:
    from kvport.server.handlers import Handlers

log = logging.getLogger(__name__)
_PRE_AUTH = Limits(max_meta_bytes=1024, max_payload_bytes=1, max_chunk_bytes=1, max_chunks=1)


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


class Connection:
    def __init__(self, conn_id: int, stream: AsyncStream, handlers: Handlers) -> None:
        self.id = conn_id
        self.stream = stream
        self.h = handlers
        self.frames = AsyncFrames(stream, _PRE_AUTH)
        self.state = ConnState.HANDSHAKE
        self.tenant: Tenant | None = None
        self.pending: FrameHeader | None = None  # a request whose payload is still unread

    def move(self, to: ConnState) -> None:
        if to not in _MOVES[self.state]:
            raise IllegalMoveError(f"connection {self.id}: {self.state.value} -> {to.value}")
        self.state = to

    # ------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        try:
            async with asyncio.timeout(self.h.limits.handshake_timeout_s):
                await self._handshake()
            self.frames.limits = self.h.wire_limits
            while not self.h.draining:
                try:
                    async with asyncio.timeout(self.h.limits.idle_timeout_s):
                        await self.frames.wait_frame()
                except TimeoutError:
                    self.h.metrics.timeouts.labels("idle").inc()
                    break
                self.move(ConnState.BUSY)
                try:
                    async with asyncio.timeout(self.h.limits.frame_timeout_s):
                        await self._one_request()
                except TimeoutError:
                    self.h.metrics.timeouts.labels("frame").inc()
                    break
                self.move(ConnState.READY)
        except TimeoutError:
            self.h.metrics.timeouts.labels("handshake").inc()
        except (AuthError, ProtocolError, ChecksumError) as exc:
            log.info("closing %s: %s", self.stream.peer, exc)
            await self._try_error(MsgType.ERROR, exc, 0)
        except PeerError as exc:
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
        self.h.connection_closed(self)
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
        nonce = auth.new_nonce()
        await self.frames.send(MsgType.AUTH_CHALLENGE, {
            "nonce": nonce, "auth": "hmac-sha256", "page_bytes": self.h.store.page_bytes,
            "max_value_bytes": self.h.limits.max_value_bytes})
        await self.frames.wait_frame()
        hdr = await self.frames.read_header()
        meta = await self.frames.read_meta(hdr)
        if hdr.msg_type is not MsgType.AUTH_RESPONSE or hdr.payload_len:
            raise ProtocolError(f"expected AUTH_RESPONSE, got {hdr.msg_type.name}")
        name = str_field(meta, "tenant")
        tenant = auth.verify(self.h.tenants, name, nonce, bytes_field(meta, "mac", auth.MAC_BYTES))
        if tenant is None:
            self.h.metrics.auth_failures.inc()
            raise AuthError("authentication failed")
        self.tenant = tenant
        self.move(ConnState.READY)
        self.h.connection_ready(self)
        await self.frames.send(MsgType.AUTH_OK, {"tenant": tenant.name}, flags=Flags.RESPONSE,
                               corr_id=hdr.corr_id)

    # ------------------------------------------------------------ requests
    async def _one_request(self) -> None:
        hdr = await self.frames.read_header()
        self.pending = hdr if hdr.payload_len else None
        meta = await self.frames.read_meta(hdr)
        try:
            await self.h.dispatch(self, hdr, meta)
        except (PeerError, TimeoutError):
            raise
        except KVPortError as exc:
            if self.pending is not None:
                await self.skip_payload()
            await self.frames.send_error(hdr.msg_type, exc, hdr.corr_id)
            self.h.metrics.requests.labels(hdr.msg_type.name.lower(), "error").inc()

    async def skip_payload(self) -> None:
        hdr, self.pending = self.pending, None
        if hdr is not None:
            await self.frames.skip_payload(hdr, self.h.scratch)

    def payload_taken(self) -> None:
        self.pending = None
