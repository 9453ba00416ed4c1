"""Authenticated transfer links named by an address: ``HOST:PORT`` (TCP), ``shm:NAME`` (shared
memory between processes of one host; an abstract Unix socket names the rings) or ``nixl:HOST:PORT``
(the stream's bytes moved by NIXL between registered rings, UCX picking the fabric: RDMA, NVLink,
cross-memory attach, TCP; its control socket is TCP to HOST:PORT; ``kvport[nixl]``).

::

    LinkListener(address, secret)       binds; .address is what it is dialled by
      .accept(timeout_s) -> Pending     the raw connection: no byte exchanged yet (an accept thread never
                                        waits on a peer)
      Pending.authenticate()            the handshake, bounded by ``handshake_s``, on the caller's thread
                                        (a server runs it on the connection's own thread) -> Transport
    dial(address, secret) -> Transport  connects and authenticates, signed for ``address``

Every link is authenticated, loopback and shared memory included (any local process can reach
both): the mutual HMAC handshake of :mod:`kvport.protocol.handshake` over the link's shared
secret, **bound to the destination** -- the dialler signs the address it dialled and the listener
accepts only its own names, so a listener that gets a dialler to connect to it cannot relay the
real one's challenge. On shared memory the handshake runs over the control socket before either
ring is created.
"""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from kvport.errors import ConfigError, KVPortError, PeerError
from kvport.protocol.handshake import client_handshake, server_handshake
from kvport.protocol.net import SocketTransport, instance_label
from kvport.protocol.sync import FrameIO
from kvport.protocol.transport import Transport
from kvport.transfer import shm, tcp

SHM_PREFIX = "shm:"
NIXL_PREFIX = "nixl:"
PRINCIPAL = tcp.TRANSFER_PRINCIPAL
MIN_SECRET_BYTES = 16
HANDSHAKE_S = 5.0  # an accepted connection that has not authenticated by then is closed
_SHM_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}")
_SERVER_NAME = "kvport-link"


def parse_address(value: object) -> str | None:
    """``value`` when it is a link address (``HOST:PORT`` with a port in 1..65535, ``shm:NAME`` or
    ``nixl:HOST:PORT``), else None."""
    if not isinstance(value, str) or len(value) > 300:
        return None
    if value.startswith(SHM_PREFIX):
        return value if _SHM_NAME.fullmatch(value[len(SHM_PREFIX):]) else None
    if value.startswith(NIXL_PREFIX):  # its control socket's HOST:PORT
        rest = value[len(NIXL_PREFIX):]
        return value if not rest.startswith((SHM_PREFIX, NIXL_PREFIX)) and parse_address(rest) == rest else None
    host, sep, port = value.rpartition(":")
    return value if sep and host and port.isdigit() and 0 < int(port) < 65536 else None


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _check_secret(secret: bytes | None) -> bytes:
    if not secret or len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"a transfer link needs a shared secret of at least {MIN_SECRET_BYTES} bytes "
                          "(KVPORT_PD_SECRET; kvport's deployments generate one)")
    return secret


@dataclass(frozen=True, slots=True)
class ShmRing:
    """The outgoing ring each side of a shared-memory link creates: ``slot_bytes x slots``."""

    slot_bytes: int = 4 << 20
    slots: int = 8


class Pending:
    """An accepted connection before its handshake; :meth:`authenticate` or :meth:`close` it."""

    def __init__(self, listener: LinkListener, sock: socket.socket, peer: str) -> None:
        self.listener, self.sock, self.peer = listener, sock, peer

    def authenticate(self) -> Transport:
        """The handshake (AuthError, PeerError past ``handshake_s``), then the link; closed on failure."""
        ln = self.listener
        secret = ln.secret
        raw = SocketTransport(self.sock, ln.handshake_s, name=f"{ln.kind}<-{self.peer}")
        try:
            server_handshake(FrameIO(raw), _SERVER_NAME, lambda who: (who == PRINCIPAL, secret), names=ln.names)
            t: SocketTransport | shm.ShmTransport
            if ln.kind == "shm":
                t = shm.ShmTransport(self.sock, ln.ring.slot_bytes, ln.ring.slots, ln.handshake_s)
            elif ln.kind == "nixl":
                t = _nixl_ring(self.sock, ln.ring, ln.handshake_s)
            else:
                t = raw
            t.settimeout(ln.idle_timeout_s)
            return t
        except OSError as exc:  # the socket closed under us (the listener is shutting down)
            self.close()
            raise PeerError(f"{ln.kind}: connection from {self.peer} failed: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _nixl_ring(sock: socket.socket, ring: ShmRing, timeout_s: float | None) -> shm.ShmTransport:
    from kvport.transfer.nixl import NixlRingTransport  # kvport[nixl]: MissingExtraError without it

    return NixlRingTransport(sock, ring.slot_bytes, ring.slots, timeout_s)


class LinkListener:
    """Listens on ``address`` (``HOST:PORT``, port 0 for any, ``shm:NAME`` or ``nixl:HOST:PORT``).
    ``names``: further addresses dialling peers may use for it (a public address, when it binds a
    wildcard)."""

    def __init__(self, address: str, secret: bytes | None, names: Iterable[str] = (),
                 idle_timeout_s: float | None = 3600.0, handshake_s: float = HANDSHAKE_S,
                 ring: ShmRing | None = None) -> None:
        self.secret = _check_secret(secret)
        self.idle_timeout_s, self.handshake_s = idle_timeout_s, handshake_s
        self.ring = ring or ShmRing()
        self._tcp: tcp.TcpListener | None = None
        self._shm: shm.ShmListener | None = None
        if address.startswith(SHM_PREFIX):
            if parse_address(address) is None:
                raise ConfigError(f"a shared-memory link is shm:NAME (letters, digits, . _ -), got {address!r}")
            self.kind = "shm"
            self._shm = shm.ShmListener(address[len(SHM_PREFIX):])
            self.address = address
        else:
            prefix = NIXL_PREFIX if address.startswith(NIXL_PREFIX) else ""
            if prefix:
                from kvport.transfer.nixl import available

                why = available()
                if why is not None:
                    raise ConfigError(f"{address}: {why}")
            host, sep, port = address[len(prefix):].rpartition(":")
            if not sep or not host or not port.isdigit() or int(port) > 65535:
                raise ConfigError(f"a link listens on HOST:PORT, shm:NAME or nixl:HOST:PORT, got {address!r}")
            if host.strip("[]") in ("0.0.0.0", "::") and not names:
                raise ConfigError(f"a link bound to every address ({address}) must be told the addresses its "
                                  "peers dial (names): the handshake is bound to them")
            self.kind = "nixl" if prefix else "tcp"
            self._tcp = tcp.TcpListener(host.strip("[]"), int(port), secret=self.secret, timeout_s=idle_timeout_s)
            self.address = f"{prefix}{host}:{self._tcp.port}"
        # the handshake accepts answers signed for these; an address given with port 0 is not one
        self.names = frozenset({self.address, *names} | (set() if address.endswith(":0") else {address}))

    def accept(self, timeout_s: float | None = 0.5) -> Pending:
        """The next connection, unauthenticated (PeerError when none came within ``timeout_s``)."""
        if self._shm is not None:
            self._shm.sock.settimeout(timeout_s)
            try:
                conn, _ = self._shm.sock.accept()
            except OSError as exc:
                raise PeerError(f"shm: accept failed: {exc}") from exc
            return Pending(self, conn, self.address)
        assert self._tcp is not None
        conn, peer = self._tcp.accept_socket(timeout_s)
        return Pending(self, conn, peer)

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
        if self._tcp is not None:
            self._tcp.close()


def dial(address: str, secret: bytes | None, timeout_s: float = 5.0, idle_timeout_s: float | None = 3600.0,
         ring: ShmRing | None = None) -> Transport:
    """Connect to ``address`` and authenticate, the answer signed for ``address`` itself."""
    key = _check_secret(secret)
    if parse_address(address) is None:
        raise ConfigError(f"a link address is HOST:PORT, shm:NAME or nixl:HOST:PORT, got {address!r}")
    ring = ring or ShmRing()
    if address.startswith(SHM_PREFIX):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect("\0" + address[len(SHM_PREFIX):])
        except OSError as exc:
            sock.close()
            raise PeerError(f"shm: cannot connect to {address}: {exc}") from exc
        raw = SocketTransport(sock, timeout_s, name=f"shm->{address}")
    else:
        host, port = _host_port(address.removeprefix(NIXL_PREFIX))
        raw = tcp.connect(host, port, timeout_s=timeout_s)
        sock = raw.sock
    try:
        client_handshake(FrameIO(raw), PRINCIPAL, key, instance_label(), dest=address)
        t: SocketTransport | shm.ShmTransport = raw
        if address.startswith(SHM_PREFIX):
            t = shm.ShmTransport(sock, ring.slot_bytes, ring.slots, timeout_s)
        elif address.startswith(NIXL_PREFIX):
            t = _nixl_ring(sock, ring, timeout_s)
    except (KVPortError, OSError):
        with contextlib.suppress(OSError):
            sock.close()
        raise
    t.settimeout(idle_timeout_s)
    return t


__all__ = ["HANDSHAKE_S", "MIN_SECRET_BYTES", "NIXL_PREFIX", "SHM_PREFIX", "LinkListener", "Pending", "ShmRing", "dial",
           "parse_address"]
