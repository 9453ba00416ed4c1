"""TCP links for transfers: a listener, ``connect``, and striping over several connections.

The byte stream itself is :class:`kvport.protocol.net.SocketTransport` (gather ``sendmsg`` /
scatter ``recvmsg_into``, tuned socket buffers). Listeners bind 127.0.0.1 by default; binding any
other address requires a shared secret, and every connection then passes the one handshake of
:mod:`kvport.protocol.handshake` (mutual HMAC over the secret) before any frame of a transfer.
"""

from __future__ import annotations

import os
import socket

from kvport.errors import ConfigError, PeerError, ProtocolError
from kvport.protocol.frame import Limits, MsgType
from kvport.protocol.handshake import client_handshake, server_handshake
from kvport.protocol.net import (
    LOOPBACK_CONGESTION,
    SOCK_BUF_BYTES,
    SocketTransport,
    connect_socket,
    instance_label,
    is_loopback,
    tune,
)
from kvport.protocol.sync import FrameIO
from kvport.transfer.striped import StripedTransport

TRANSFER_PRINCIPAL = "transfer"  # the principal a transfer link's shared secret belongs to

_HELLO_LIMITS = Limits(max_meta_bytes=256, max_payload_bytes=1, max_chunk_bytes=1, max_chunks=1)
TcpTransport = SocketTransport  # the transfer's name for a connected socket


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

    def accept_socket(self, timeout_s: float | None = 30.0) -> tuple[socket.socket, str]:
        """The next connected socket (tuned) and the peer's address, before any byte is exchanged:
        the caller authenticates it (:mod:`kvport.transfer.links` does, on the connection's thread)."""
        self.sock.settimeout(timeout_s)
        try:
            conn, addr = self.sock.accept()
        except TimeoutError as exc:
            raise PeerError("no connection within the accept timeout") from exc
        except OSError as exc:
            raise PeerError(f"accept failed: {exc}") from exc
        tune(conn, self.buf_bytes)
        return conn, f"{addr[0]}:{addr[1]}"

    def accept(self, timeout_s: float | None = 30.0) -> TcpTransport:
        conn, peer = self.accept_socket(timeout_s)
        t = TcpTransport(conn, self.timeout_s, name=f"tcp<-{peer}")
        if self.secret:
            secret = self.secret
            try:
                server_handshake(FrameIO(t), "kvport-transfer", lambda who: (who == TRANSFER_PRINCIPAL, secret))
            except BaseException:
                t.close()
                raise
        return t

    def accept_striped(self, streams: int, stripe_bytes: int = 1 << 20,
                       timeout_s: float | None = 30.0) -> StripedTransport:
        """Accept the ``streams`` connections of one striped client (see :func:`connect_striped`)."""
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
    t = connect_socket(host, port, timeout_s, buf_bytes)
    if secret:
        try:
            client_handshake(FrameIO(t), TRANSFER_PRINCIPAL, secret, instance_label())
        except BaseException:
            t.close()
            raise
    return t


__all__ = ["LOOPBACK_CONGESTION", "SOCK_BUF_BYTES", "TRANSFER_PRINCIPAL", "TcpListener", "TcpTransport", "connect",
           "connect_striped", "is_loopback", "tune"]
