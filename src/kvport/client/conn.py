"""Client side connections to a kvport server: handshake, one request at a time, and a pool.

A :class:`ServerConn` is a blocking socket (optionally TLS) with a :class:`FrameIO` from
:mod:`kvport.transfer.framing`; it answers the challenge with the tenant's HMAC (the token never
travels) and learns the server's ``page_bytes`` and ``max_value_bytes``. A :class:`ConnPool` lends
connections to threads; a connection that saw any error is closed, never returned to the pool.
"""

from __future__ import annotations

import contextlib
import itertools
import select
import socket
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvport.errors import AuthError, ChecksumError, LeaseError, PeerError, ProtocolError, ServerError
from kvport.server.auth import compute_mac
from kvport.transfer.framing import FrameIO
from kvport.transfer.tcp import TcpTransport, tune
from kvport.transfer.transport import Buffer, as_byte_views
from kvport.transfer.wire import Flags, FrameHeader, Limits, MsgType

_REMOTE_ERRORS: dict[str, type[Exception]] = {"AuthError": AuthError, "ChecksumError": ChecksumError,
                                              "LeaseError": LeaseError}


@dataclass(frozen=True, slots=True)
class ClientConfig:
    host: str = "127.0.0.1"
    port: int = 0
    tenant: str = "default"
    token: str | None = field(default=None, repr=False)
    tls: bool = False
    tls_ca: Path | None = None  # CA bundle to verify the server (default: system store)
    tls_server_name: str | None = None
    pool_size: int = 4
    timeout_s: float = 30.0
    retries: int = 3  # reconnect-and-resend attempts after a broken connection
    backpressure_timeout_s: float = 10.0  # how long a PUT keeps retrying after Rejected(retry_after)


class TlsTransport:
    """Blocking TLS socket: sendall per part, recv_into per view (SSLSocket has no sendmsg)."""

    def __init__(self, sock: ssl.SSLSocket, name: str) -> None:
        self.sock = sock
        self.name = name

    def send(self, parts: Sequence[Buffer]) -> None:
        try:
            for p in parts:
                self.sock.sendall(p)
        except OSError as exc:
            raise PeerError(f"{self.name}: send failed: {exc}") from exc

    def recv_into(self, parts: Sequence[memoryview]) -> None:
        try:
            for v in as_byte_views(parts):
                off = 0
                while off < v.nbytes:
                    n = self.sock.recv_into(v[off:])
                    if n == 0:
                        raise PeerError(f"{self.name}: connection closed by peer")
                    off += n
        except OSError as exc:
            raise PeerError(f"{self.name}: receive failed: {exc}") from exc

    def readable(self, timeout: float) -> bool:
        if self.sock.pending():
            return True
        try:
            r, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        except (OSError, ValueError) as exc:
            raise PeerError(f"{self.name}: select failed: {exc}") from exc
        return bool(r)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def remote_error(meta: dict[str, Any]) -> Exception:
    name = str(meta.get("error", "ServerError"))
    message = str(meta.get("message", ""))
    cls = _REMOTE_ERRORS.get(name)
    if cls is not None:
        return cls(f"server: {message}")
    err = ServerError(f"server answered {name}: {message}")
    err.remote_error = name  # type: ignore[attr-defined]
    return err


class ServerConn:
    def __init__(self, cfg: ClientConfig) -> None:
        self.cfg = cfg
        name = f"kvport://{cfg.host}:{cfg.port}"
        try:
            raw = socket.create_connection((cfg.host, cfg.port), timeout=cfg.timeout_s)
        except OSError as exc:
            raise PeerError(f"cannot connect to {cfg.host}:{cfg.port}: {exc}") from exc
        tune(raw)
        if cfg.tls:
            ctx = ssl.create_default_context(cafile=str(cfg.tls_ca) if cfg.tls_ca else None)
            try:
                tsock = ctx.wrap_socket(raw, server_hostname=cfg.tls_server_name or cfg.host)
            except (OSError, ssl.SSLError) as exc:
                raw.close()
                raise PeerError(f"TLS handshake with {cfg.host}:{cfg.port} failed: {exc}") from exc
            self.t: TcpTransport | TlsTransport = TlsTransport(tsock, name)
        else:
            self.t = TcpTransport(raw, cfg.timeout_s, name)
        self.io = FrameIO(self.t, Limits(max_meta_bytes=1024, max_payload_bytes=1, max_chunk_bytes=1, max_chunks=1))
        self._corr = itertools.count(1)
        try:
            self._handshake()
        except BaseException:
            self.close()
            raise

    def _handshake(self) -> None:
        ch = self.io.expect(MsgType.AUTH_CHALLENGE)
        nonce = ch.meta.get("nonce")
        page, maxv = ch.meta.get("page_bytes"), ch.meta.get("max_value_bytes")
        if not isinstance(nonce, bytes) or not isinstance(page, int) or not isinstance(maxv, int) or page <= 0:
            raise ProtocolError("malformed AUTH_CHALLENGE")
        self.page_bytes, self.max_value_bytes = page, maxv
        token = self.cfg.token.encode() if self.cfg.token else None
        mac = compute_mac(token, nonce, self.cfg.tenant)
        self.io.send(MsgType.AUTH_RESPONSE, {"tenant": self.cfg.tenant, "mac": mac})
        hdr, meta = self.io.read_head()
        if hdr.flags & Flags.ERROR:
            raise AuthError(f"server refused tenant {self.cfg.tenant!r}: {meta.get('message', '')}")
        if hdr.msg_type is not MsgType.AUTH_OK:
            raise ProtocolError(f"expected AUTH_OK, got {hdr.msg_type.name}")
        self.io.limits = Limits(max_meta_bytes=16 << 20, max_payload_bytes=max(maxv, 1),
                                max_chunk_bytes=max(page, 1), max_chunks=1 << 16)

    def request(self, msg_type: MsgType, meta: dict[str, Any], chunks: Sequence[Buffer] = ()
                ) -> tuple[FrameHeader, dict[str, Any]]:
        """Send one request; return the answer's head (its payload, if any, is the caller's to read)."""
        corr = next(self._corr)
        self.io.send(msg_type, meta, chunks, self.page_bytes if chunks else None, corr_id=corr)
        hdr, ans = self.io.read_head()
        if hdr.flags & Flags.ERROR:
            if hdr.payload_len:
                raise ProtocolError("error answer with a payload")
            raise remote_error(ans)
        if hdr.corr_id != corr or hdr.msg_type is not msg_type:
            raise ProtocolError(f"answer {hdr.msg_type.name}#{hdr.corr_id} to request {msg_type.name}#{corr}")
        return hdr, ans

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
                if not self._cv.wait(self.cfg.timeout_s):
                    raise PeerError(f"no pooled connection free within {self.cfg.timeout_s} s")
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
