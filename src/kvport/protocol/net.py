"""Blocking sockets as transports: plain TCP (gather ``sendmsg`` / scatter ``recvmsg_into``) or TLS.

Hot path (measured by ``kvport bench transfer`` against a raw ``sendall``/``recv_into`` socket of
the same bytes): no copies in Python; one syscall moves up to ``_IOV_MAX`` buffers. A TLS socket
has no ``sendmsg``: it sends part by part (TLS is not the hot path). A socket timeout (the peer
stopped reading or writing) and every OSError become :class:`PeerError`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import select
import socket
import ssl
from collections.abc import Sequence

from kvport.errors import PeerError
from kvport.protocol.transport import Buffer, advance, as_byte_views

_IOV_MAX = 512
SOCK_BUF_BYTES = 4 << 20


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost'; anything else (0.0.0.0, "", a NIC) is beyond loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def instance_label() -> str:
    """This process as a client instance: ``host:pid`` (the holder name of its leases and pins)."""
    return f"{socket.gethostname()[:40]}:{os.getpid()}"


def tune(sock: socket.socket, buf_bytes: int = SOCK_BUF_BYTES) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buf_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buf_bytes)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class SocketTransport:
    """One connected socket (plain or TLS). Not thread-safe for concurrent sends (or concurrent recvs)."""

    def __init__(self, sock: socket.socket, timeout_s: float | None = 30.0, name: str = "tcp") -> None:
        self.sock = sock
        self.name = name
        self._tls = isinstance(sock, ssl.SSLSocket)
        sock.settimeout(timeout_s)
        self._closed = False

    def settimeout(self, timeout_s: float | None) -> None:
        self.sock.settimeout(timeout_s)

    def send(self, parts: Sequence[Buffer]) -> None:
        views = as_byte_views(parts)
        i = 0
        try:
            if self._tls:
                for v in views:
                    self.sock.sendall(v)
                return
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
                if self._tls or len(views) - i == 1:
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
        if self._tls and self.sock.pending():  # type: ignore[attr-defined]
            return True
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


def connect_socket(host: str, port: int, timeout_s: float | None = 30.0, buf_bytes: int = SOCK_BUF_BYTES,
                   tls: ssl.SSLContext | None = None, server_name: str | None = None) -> SocketTransport:
    """A connected, tuned socket transport (TLS when ``tls`` is given); PeerError when it cannot."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise PeerError(f"cannot connect to {host}:{port}: {exc}") from exc
    tune(sock, buf_bytes)
    if tls is not None:
        try:
            sock = tls.wrap_socket(sock, server_hostname=server_name or host)
        except (OSError, ssl.SSLError) as exc:
            sock.close()
            raise PeerError(f"TLS handshake with {host}:{port} failed: {exc}") from exc
    return SocketTransport(sock, timeout_s, name=f"{'tls' if tls else 'tcp'}->{host}:{port}")
