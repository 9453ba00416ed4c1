"""Connections that never log in: a pre-login cap (TLS handshakes counted from accept), a per-peer
cap, and the rule that a pending connection gives way -- exact decisions, then a real server."""

from __future__ import annotations

import selectors
import socket
import time
from pathlib import Path

import pytest

from kvport.errors import ConfigError
from kvport.server.admission import Admission, AdmissionDecision, parse_networks
from kvport.server.limits import ServerLimits

from .conftest import base_args, make_cert
from .raw import authed_socket, closed_within, connect


def test_admission_decisions() -> None:
    a = Admission(max_connections=6, max_pending=3, max_per_peer=3, exempt=parse_networks(("127.0.0.0/8",)))
    assert a.admit(1, "10.0.0.1") == AdmissionDecision(True)
    assert a.admit(2, "10.0.0.2") == AdmissionDecision(True)
    assert a.admit(3, "10.0.0.1") == AdmissionDecision(True)
    # pending full: the oldest attempt of the peer holding the most pending gives way
    assert a.admit(4, "10.0.0.3") == AdmissionDecision(True, gave_way=1)
    a.logged_in(3)
    a.logged_in(4)
    assert a.pending == 1 and a.total == 3
    assert a.admit(5, "10.0.0.1") == AdmissionDecision(True)
    assert a.admit(6, "10.0.0.1") == AdmissionDecision(True)
    assert a.admit(7, "10.0.0.1") == AdmissionDecision(False, refused="per_peer")  # 3 from 10.0.0.1 (3 logged in, 5, 6)
    for cid in (5, 6):
        a.logged_in(cid)
    assert a.admit(8, "127.0.0.1") == AdmissionDecision(True)  # exempt from the per-peer cap
    assert a.total == 6
    # all full: a pending one gives way (a tie: oldest)
    assert a.admit(9, "127.0.0.1") == AdmissionDecision(True, gave_way=2)
    assert a.admit(10, "127.0.0.1") == AdmissionDecision(True, gave_way=8)
    for cid in (9, 10):
        a.logged_in(cid)
    assert a.admit(11, "10.0.0.4") == AdmissionDecision(False, refused="full")  # all logged in: nobody gives way
    a.closed(3)
    a.closed(3)  # twice, or a gave-way one again: ignored
    a.closed(1)
    assert a.admit(12, "10.0.0.4") == AdmissionDecision(True)
    assert a.admit(13, "10.0.0.4", draining=True) == AdmissionDecision(False, refused="draining")


def test_bad_limits_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="not an address"):
        ServerLimits(per_peer_exempt=("10.0.0.0/33",))
    with pytest.raises(ConfigError, match="max_pending"):
        ServerLimits(max_pending=0)


def _closed(socks: list[socket.socket], want: int, within_s: float) -> int:
    """How many of ``socks`` the server closed (EOF or reset), polling until ``want`` or ``within_s``."""
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    closed = 0
    end = time.monotonic() + within_s
    while closed < want and time.monotonic() < end:
        for key, _ in sel.select(0.5):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                data = s.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                sel.unregister(s)
                closed += 1
    sel.close()
    return closed


def test_connections_that_never_log_in_do_not_lock_clients_out(server_factory) -> None:  # type: ignore[no-untyped-def]
    """More silent connections than --max-connections (default 1024): a client logged in before
    keeps working, and a new one logs in at its first try (default limits)."""
    srv = server_factory(*base_args())
    before = srv.client(retries=0, pool_size=1)
    before.ping()
    silent = [connect(srv.port) for _ in range(1100)]
    try:
        before.ping()
        late = srv.client(retries=0, pool_size=1)
        late.ping()
        late.close()
        before.ping()
    finally:
        for s in silent:
            s.close()
    before.close()


def test_tls_handshakes_count_from_accept(server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Peers that connect to a TLS server and never start the TLS handshake are pending from
    accept: beyond --max-pending they give way at once (long before the 60 s login deadline),
    and a TLS client logs in meanwhile."""
    cert, key = make_cert(tmp_path)
    srv = server_factory(*base_args("384MiB", "--tls-cert", str(cert), "--tls-key", str(key), "--max-pending", "16",
                                    "--handshake-timeout", "60"))
    silent = [connect(srv.port) for _ in range(200)]
    try:
        assert _closed(silent, 200 - 16, 30) >= 200 - 16
        c = srv.client(tls=True, tls_ca=cert, retries=0, pool_size=1)
        c.ping()
        c.close()
    finally:
        for s in silent:
            s.close()


def test_per_peer_cap(server_factory) -> None:  # type: ignore[no-untyped-def]
    """--max-per-peer counts every connection of an address, logged in or not; here loopback is
    not exempt (--per-peer-exempt '')."""
    srv = server_factory(*base_args("384MiB", "--max-per-peer", "3", "--per-peer-exempt", ""))
    held = [authed_socket(srv.port), authed_socket(srv.port), connect(srv.port)]
    extra = connect(srv.port)
    extra.settimeout(10)
    assert extra.recv(1) == b""  # closed at accept: not even a challenge
    extra.close()
    held.pop().close()  # a slot comes free once the server has seen the close
    end = time.monotonic() + 20
    while True:
        try:
            held.append(authed_socket(srv.port))
            break
        except (ConnectionError, AssertionError, OSError):
            assert time.monotonic() < end
            time.sleep(0.1)
    for s in held:
        assert not closed_within(s, 0.2)
        s.close()
