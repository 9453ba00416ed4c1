"""Who may hold a connection: a cap on all of them, a cap on those still logging in, a cap per peer.

A connection counts from ``accept``: TCP accepted, TLS handshake (when the server speaks TLS) and
the kvport handshake are one *pending* phase with one deadline (``handshake_timeout_s``); AUTH_OK
makes it *logged in*::

    accept(peer) --> draining?                                      --> refuse ("draining")
                 --> peer not exempt and holding max_per_peer?      --> refuse ("per_peer")
                 --> max_pending pending, or max_connections in all?
                        a pending one gives way: the oldest of the peer holding the most pending
                                                                    --> that one is closed ("gave_way")
                        none pending (all logged in)                --> refuse ("full")
                 --> PENDING --AUTH_OK--> LOGGED IN --> closed
                        +------ deadline, failure, gave way ---------^

Why a pending connection gives way instead of the new one being refused: a peer that opens
connections and never logs in could otherwise hold every pending slot, re-opening each as its
deadline closes it, and keep every client out. Here it only ever pushes out its own oldest
attempts (it holds the most), and a client's handshake, which takes a few round trips, finishes
long before ``max_pending`` newer connections arrive from that peer. The per-peer cap keeps one
address from taking all ``max_connections``; loopback is exempt by default (engines on the same
host share 127.0.0.1) but the pending cap holds for every peer, loopback included.

I/O-free: the server asks :meth:`Admission.admit` at accept and closes what the answer names.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from kvport.errors import ConfigError

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(cidrs: tuple[str, ...]) -> tuple[Network, ...]:
    out = []
    for c in cidrs:
        try:
            out.append(ipaddress.ip_network(c.strip(), strict=False))
        except ValueError as exc:
            raise ConfigError(f"--per-peer-exempt: {c!r} is not an address or network: {exc}") from exc
    return tuple(out)


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """``admit``: the new connection may go on (as pending); ``gave_way``: a pending connection to
    close now to make room; ``refused``: why the new one is closed (None when admitted)."""

    admit: bool
    gave_way: int | None = None
    refused: str | None = None


class Admission:
    def __init__(self, max_connections: int, max_pending: int, max_per_peer: int,
                 exempt: tuple[Network, ...] = ()) -> None:
        self.max_connections = max_connections
        self.max_pending = max_pending
        self.max_per_peer = max_per_peer  # 0: no per-peer cap
        self.exempt = exempt
        self._pending: dict[int, str] = {}  # conn id -> peer address, oldest first
        self._ready: dict[int, str] = {}
        self._per_peer: dict[str, int] = {}  # every connection (pending or logged in) per address
        self._pending_per_peer: dict[str, int] = {}

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def total(self) -> int:
        return len(self._pending) + len(self._ready)

    def exempt_peer(self, peer: str) -> bool:
        try:
            ip = ipaddress.ip_address(peer)
        except ValueError:
            return False
        return any(ip.version == n.version and ip in n for n in self.exempt)

    def admit(self, conn_id: int, peer: str, draining: bool = False) -> AdmissionDecision:
        """A connection from ``peer`` was accepted: may it go on, and who gives way for it."""
        if draining:
            return AdmissionDecision(False, refused="draining")
        if self.max_per_peer and self._per_peer.get(peer, 0) >= self.max_per_peer and not self.exempt_peer(peer):
            return AdmissionDecision(False, refused="per_peer")
        victim = None
        if len(self._pending) >= self.max_pending or self.total >= self.max_connections:
            victim = self._victim()
            if victim is None:
                return AdmissionDecision(False, refused="full")
            self.closed(victim)
        self._pending[conn_id] = peer
        self._count(self._per_peer, peer, 1)
        self._count(self._pending_per_peer, peer, 1)
        return AdmissionDecision(True, gave_way=victim)

    def logged_in(self, conn_id: int) -> None:
        peer = self._pending.pop(conn_id, None)
        if peer is not None:
            self._count(self._pending_per_peer, peer, -1)
            self._ready[conn_id] = peer

    def closed(self, conn_id: int) -> None:
        """The connection is gone (any phase; unknown ids are ignored: a gave-way one is forgotten
        at once, before its task has ended)."""
        peer = self._pending.pop(conn_id, None)
        if peer is not None:
            self._count(self._pending_per_peer, peer, -1)
        else:
            peer = self._ready.pop(conn_id, None)
        if peer is not None:
            self._count(self._per_peer, peer, -1)

    def _victim(self) -> int | None:
        """The oldest pending connection of the peer holding the most pending ones."""
        if not self._pending:
            return None
        worst = max(self._pending_per_peer, key=lambda p: self._pending_per_peer[p])
        return next(cid for cid, p in self._pending.items() if p == worst)

    @staticmethod
    def _count(d: dict[str, int], peer: str, n: int) -> None:
        v = d.get(peer, 0) + n
        if v > 0:
            d[peer] = v
        else:
            d.pop(peer, None)
