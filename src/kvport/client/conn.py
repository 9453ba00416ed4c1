"""Client side connections to a kvport server: handshake, one typed request at a time, and a pool.

A :class:`ServerConn` is a blocking socket (optionally TLS) with a
:class:`~kvport.protocol.sync.FrameIO`; it passes the one handshake of
:mod:`kvport.protocol.handshake` as ``tenant`` (the token signs, never travels; the server proves
it knows the token too) and names this client instance, the holder of the leases and pins it
takes. It learns the server's ``page_bytes`` and ``max_value_bytes``. A :class:`ConnPool` lends
connections to threads; a connection that saw any error is closed, never returned to the pool.
"""

from __future__ import annotations

import itertools
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvport.deadline import timeout_for
from kvport.errors import ConfigError, PeerError, ProtocolError, ServerError
from kvport.protocol.errors import remote_error
from kvport.protocol.frame import Flags, FrameHeader, Limits
from kvport.protocol.handshake import HANDSHAKE_LIMITS, client_handshake
from kvport.protocol.net import SocketTransport, connect_socket, instance_label
from kvport.protocol.schema import Message, decode
from kvport.protocol.sync import FrameIO
from kvport.protocol.transport import Buffer

M = TypeVar("M", bound=Message)


@dataclass(frozen=True, slots=True)
class ClientConfig:
    host: str = "127.0.0.1"
    port: int = 0
    tenant: str = "default"
    token: str | None = field(default=None, repr=False)
    client: str = field(default_factory=instance_label)  # this instance: the holder of its leases and pins
    tls: bool = False
    tls_ca: Path | None = None  # CA bundle to verify the server (default: system store)
    tls_server_name: str | None = None
    pool_size: int = 4
    timeout_s: float = 30.0
    retries: int = 3  # reconnect-and-resend attempts after a broken connection
    backpressure_timeout_s: float = 10.0  # how long a PUT keeps retrying after Rejected(retry_after)


def _tls_context(cfg: ClientConfig) -> ssl.SSLContext:
    try:
        return ssl.create_default_context(cafile=str(cfg.tls_ca) if cfg.tls_ca else None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"TLS CA bundle {cfg.tls_ca}: {exc}") from exc


class ServerConn:
    def __init__(self, cfg: ClientConfig) -> None:
        self.cfg = cfg
        tls = _tls_context(cfg) if cfg.tls else None
        connect_s = max(0.001, timeout_for(cfg.timeout_s) or cfg.timeout_s)  # within a load's deadline
        self.t: SocketTransport = connect_socket(cfg.host, cfg.port, connect_s, tls=tls,
                                                 server_name=cfg.tls_server_name)
        self.io = FrameIO(self.t, HANDSHAKE_LIMITS)
        self._corr = itertools.count(1)
        try:
            peer = client_handshake(self.io, cfg.tenant, cfg.token.encode() if cfg.token else None, cfg.client)
            page, maxv = peer.info.get("page_bytes"), peer.info.get("max_value_bytes")
            if not isinstance(page, int) or not isinstance(maxv, int) or page <= 0 or maxv <= 0:
                raise ProtocolError("the server's challenge lacks page_bytes / max_value_bytes")
        except BaseException:
            self.close()
            raise
        self.t.settimeout(cfg.timeout_s)  # the handshake ran within the load's deadline, if any
        self.page_bytes, self.max_value_bytes = page, maxv
        self.io.limits = Limits(max_meta_bytes=16 << 20, max_payload_bytes=maxv, max_chunk_bytes=page,
                                max_chunks=-(-maxv // page))

    def request(self, req: Message, chunks: Sequence[Buffer] = ()) -> tuple[FrameHeader, dict[str, Any]]:
        """Send one request; the answer's head and metadata (its payload, if any, is the caller's to read)."""
        corr = next(self._corr)
        self.io.send(req.TYPE, req.to_meta(), chunks, self.page_bytes if chunks else None, corr_id=corr)
        hdr, ans = self.io.read_head()
        if hdr.flags & Flags.ERROR:
            if hdr.payload_len:
                raise ProtocolError("error answer with a payload")
            raise remote_error(ans, ServerError)
        if hdr.corr_id != corr or hdr.msg_type is not req.TYPE:
            raise ProtocolError(f"answer {hdr.msg_type.name}#{hdr.corr_id} to request {req.TYPE.name}#{corr}")
        return hdr, ans

    def call(self, req: Message, answer: type[M]) -> M:
        """A request without payloads both ways, and its typed answer."""
        hdr, ans = self.request(req)
        if hdr.payload_len:
            raise ProtocolError(f"{req.TYPE.name} answered with a payload")
        return decode(answer, ans)

    def stale(self) -> bool:
        """An idle connection with something to read holds only EOF or an error: unusable."""
        try:
            return self.t.readable(0.0)
        except PeerError:
            return True

    def close(self) -> None:
        self.t.close()


class ConnPool:
    def __init__(self, cfg: ClientConfig) -> None:
        self.cfg = cfg
        self._idle: list[ServerConn] = []
        self._open = 0
        self._cv = threading.Condition()
        self._closed = False

    def take(self) -> ServerConn:
        with self._cv:
            while True:
                if self._closed:
                    raise PeerError("connection pool is closed")
                while self._idle:
                    conn = self._idle.pop()
                    if not conn.stale():
                        return conn
                    conn.close()  # the server closed it (idle timeout, restart): never send on it
                    self._open -= 1
                if self._open < self.cfg.pool_size:
                    self._open += 1
                    break
                wait_s = timeout_for(self.cfg.timeout_s)  # a load's deadline shortens the wait
                if not self._cv.wait(wait_s):
                    raise PeerError(f"no pooled connection free within {wait_s} s")
        try:
            return ServerConn(self.cfg)
        except BaseException:
            with self._cv:
                self._open -= 1
                self._cv.notify()
            raise

    def give(self, conn: ServerConn, healthy: bool) -> None:
        with self._cv:
            if healthy and not self._closed:
                self._idle.append(conn)
            else:
                conn.close()
                self._open -= 1
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for c in self._idle:
                c.close()
            self._open -= len(self._idle)
            self._idle.clear()
            self._cv.notify_all()
