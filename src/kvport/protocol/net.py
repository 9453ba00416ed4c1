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

from kvport.deadline import Deadline
from kvport.deadline import current as current_deadline
from kvport.errors import PeerError
from kvport.protocol.transport import Buffer, advance, as_byte_views

_IOV_MAX = 512
SOCK_BUF_BYTES = 4 << 20
# Same-host streams: a loss-based congestion control without pacing. A pacing one (BBR, the default
# on some distributions) paces a loopback stream from its own bandwidth estimate, and a sender that
# pauses between batches to checksum them reads as app-limited: on the 2-core bench machine kvport
# over BBR moved 256 MiB in ~90 ms where cubic took ~50 (kvport bench transfer). Links beyond the
# host keep the system's choice. Every socket tuned here gets it, raw baselines included.
LOOPBACK_CONGESTION = (b"cubic", b"reno")  # reno: always permitted to unprivileged processes
_TCP_CONGESTION: int | None = getattr(socket, "TCP_CONGESTION", None)  # Linux only


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
    """Socket buffers, TCP_NODELAY, and on a loopback connection a congestion control that does not
    pace (:data:`LOOPBACK_CONGESTION`, the first one the kernel lets us set)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buf_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buf_bytes)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if _TCP_CONGESTION is not None and _peer_is_loopback(sock):
        for name in LOOPBACK_CONGESTION:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, name)
                return
            except OSError:  # not built, or not in net.ipv4.tcp_allowed_congestion_control for us
                continue


def _peer_is_loopback(sock: socket.socket) -> bool:
    try:
        return is_loopback(str(sock.getpeername()[0]))
    except (OSError, IndexError):  # not connected (yet), or not an IP socket
        return False


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
        """Write every part. Under a :func:`kvport.deadline.current` deadline a write that cannot
        finish by then stops with PeerError (the frame is cut: the connection is unusable); the
        socket's own timeout is left alone (a reader thread may share it)."""
        views = as_byte_views(parts)
        i = 0
        deadline = current_deadline()
        try:
            if self._tls:
                for v in views:
                    self.sock.sendall(v)
                return
            while i < len(views):
                if deadline is None:
                    n = self.sock.sendmsg(views[i : i + _IOV_MAX])
                else:
                    n = self._send_by(deadline, views[i : i + _IOV_MAX])
                i = advance(views, i, n)  # drop finished views, slice the partial one
        except TimeoutError as exc:
            raise PeerError(f"{self.name}: send timed out (peer stopped reading)") from exc
        except OSError as exc:
            raise PeerError(f"{self.name}: send failed: {exc}") from exc
        except ValueError as exc:  # the socket was closed meanwhile (its fd is -1): the link is gone
            raise PeerError(f"{self.name}: send on a closed connection") from exc

    def _send_by(self, deadline: Deadline, views: list[memoryview]) -> int:
        """One non-blocking ``sendmsg`` once the socket is writable, waiting at most until ``deadline``
        (and the socket's timeout)."""
        poller = select.poll()
        poller.register(self.sock, select.POLLOUT)
        while True:
            wait = deadline.timeout(self.sock.gettimeout())
            if not poller.poll(wait * 1000):
                if deadline.expired:
                    raise PeerError(f"{self.name}: send past its deadline (peer stopped reading)")
                raise TimeoutError
            try:
                return self.sock.sendmsg(views, [], socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                continue

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
        except ValueError as exc:  # the socket was closed meanwhile (its fd is -1)
            raise PeerError(f"{self.name}: receive on a closed connection") from exc

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
