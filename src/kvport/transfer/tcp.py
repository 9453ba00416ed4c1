"""TCP transport: gather ``sendmsg`` / scatter ``recvmsg_into`` over memoryviews, tuned socket buffers.

Hot path (measured by ``kvport bench transfer`` against a raw ``sendall``/``recv_into`` socket of
the same bytes): no copies in Python; one syscall moves up to ``_IOV_MAX`` buffers. A socket timeout
(the peer stopped reading or writing) and every OSError become :class:`PeerError`.

Listeners bind 127.0.0.1 by default; binding any other address requires a shared secret, and every
accepted connection then passes the HMAC challenge-response of :mod:`kvport.transfer.auth`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import select
import socket
from collections.abc import Sequence

from kvport.errors import ConfigError, PeerError, ProtocolError
from kvport.transfer.striped import StripedTransport
from kvport.transfer.transport import Buffer, advance, as_byte_views
from kvport.transfer.wire import Limits, MsgType

_IOV_MAX = 512
_HELLO_LIMITS = Limits(max_meta_bytes=256, max_payload_bytes=1, max_chunk_bytes=1, max_chunks=1)
SOCK_BUF_BYTES = 4 << 20


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tune(sock: socket.socket, buf_bytes: int = SOCK_BUF_BYTES) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buf_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buf_bytes)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class TcpTransport:
    """One connected TCP socket. Not thread-safe for concurrent sends (or concurrent recvs)."""

    def __init__(self, sock: socket.socket, timeout_s: float | None = 30.0, name: str = "tcp") -> None:
        self.sock = sock
        self.name = name
        sock.settimeout(timeout_s)
        self._closed = False

    def settimeout(self, timeout_s: float | None) -> None:
        self.sock.settimeout(timeout_s)

    def send(self, parts: Sequence[Buffer]) -> None:
        views = as_byte_views(parts)
        i = 0
        try:
            while i < len(views):
                n = self.sock.sendmsg(views[i : i + _IOV_MAX])
                i = advance(views, i, n)  # drop finished views, slice the partial one
        except TimeoutError as exc:
            raise PeerError(f"{self.name}: send timed out (peer stopped reading)") from exc
        except OSError as exc:
            raise PeerError(f"{self.name}: send failed: {exc}") from exc

    def recv_into(self, parts: Sequence[memoryview]) -> None:
        views = as_byte_views(parts)
        i = 0
        try:
            while i < len(views):
                if len(views) - i == 1:
                    n = self.sock.recv_into(views[i])
                else:
                    n = self.sock.recvmsg_into(views[i : i + _IOV_MAX])[0]
                if n == 0:
                    raise PeerError(f"{self.name}: connection closed by peer mid-frame")
                i = advance(views, i, n)  # drop finished views, slice the partial one
        except TimeoutError as exc:
            raise PeerError(f"{self.name}: receive timed out (peer stopped sending)") from exc
        except OSError as exc:
            raise PeerError(f"{self.name}: receive failed: {exc}") from exc

    def readable(self, timeout: float) -> bool:
        if self._closed:
            return False
        try:
            r, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        except (OSError, ValueError) as exc:
            raise PeerError(f"{self.name}: select failed: {exc}") from exc
        return bool(r)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on this socket
            with contextlib.suppress(OSError):
                self.sock.close()


class TcpListener:
    """A listening socket. ``host`` other than loopback requires ``secret`` (HMAC handshake)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, secret: bytes | None = None,
                 timeout_s: float | None = 30.0, buf_bytes: int = SOCK_BUF_BYTES) -> None:
        if not is_loopback(host) and not secret:
            raise ConfigError(f"binding {host!r} (not loopback) requires a shared secret (KVPORT_AUTH_TOKEN)")
        self.secret = secret
        self.timeout_s = timeout_s
        self.buf_bytes = buf_bytes
        try:
            self.sock = socket.create_server((host, port), reuse_port=False)
        except OSError as exc:
            raise PeerError(f"cannot listen on {host}:{port}: {exc}") from exc
        self.host, self.port = self.sock.getsockname()[:2]

    def accept(self, timeout_s: float | None = 30.0) -> TcpTransport:
        from kvport.transfer.auth import server_handshake

        self.sock.settimeout(timeout_s)
        try:
            conn, addr = self.sock.accept()
        except TimeoutError as exc:
            raise PeerError("no connection within the accept timeout") from exc
        except OSError as exc:
            raise PeerError(f"accept failed: {exc}") from exc
        tune(conn, self.buf_bytes)
        t = TcpTransport(conn, self.timeout_s, name=f"tcp<-{addr[0]}:{addr[1]}")
        if self.secret:
            try:
                server_handshake(t, self.secret)
            except BaseException:
                t.close()
                raise
        return t

    def accept_striped(self, streams: int, stripe_bytes: int = 1 << 20,
                       timeout_s: float | None = 30.0) -> StripedTransport:
        """Accept the ``streams`` connections of one striped client (see :func:`connect_striped`)."""
        from kvport.transfer.framing import FrameIO

        got: dict[int, TcpTransport] = {}
        session: bytes | None = None
        try:
            while len(got) < streams:
                t = self.accept(timeout_s)
                f = FrameIO(t, _HELLO_LIMITS).expect(MsgType.PING)
                k, n, sess = f.meta.get("stripe"), f.meta.get("of"), f.meta.get("session")
                if not isinstance(k, int) or n != streams or not 0 <= k < streams or k in got \
                        or not isinstance(sess, bytes) or (session is not None and sess != session):
                    t.close()
                    raise ProtocolError(f"bad stripe hello {f.meta!r}")
                session = sess
                got[k] = t
        except BaseException:
            for t in got.values():
                t.close()
            raise
        return StripedTransport([got[k] for k in range(streams)], stripe_bytes)

    def close(self) -> None:
        self.sock.close()


def connect_striped(host: str, port: int, streams: int, stripe_bytes: int = 1 << 20, secret: bytes | None = None,
                    timeout_s: float | None = 30.0, buf_bytes: int = SOCK_BUF_BYTES) -> StripedTransport:
    """``streams`` connections carrying one byte stream in ``stripe_bytes`` stripes."""
    from kvport.transfer.framing import FrameIO

    if streams <= 0:
        raise ConfigError(f"streams must be positive, got {streams}")
    session = os.urandom(16)
    ts: list[TcpTransport] = []
    try:
        for k in range(streams):
            t = connect(host, port, secret, timeout_s, buf_bytes)
            ts.append(t)
            FrameIO(t).send(MsgType.PING, {"stripe": k, "of": streams, "session": session})
    except BaseException:
        for t in ts:
            t.close()
        raise
    return StripedTransport(ts, stripe_bytes)


def connect(host: str, port: int, secret: bytes | None = None, timeout_s: float | None = 30.0,
            buf_bytes: int = SOCK_BUF_BYTES) -> TcpTransport:
    from kvport.transfer.auth import client_handshake

    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise PeerError(f"cannot connect to {host}:{port}: {exc}") from exc
    tune(sock, buf_bytes)
    t = TcpTransport(sock, timeout_s, name=f"tcp->{host}:{port}")
    if secret:
        try:
            client_handshake(t, secret)
        except BaseException:
            t.close()
            raise
    return t
