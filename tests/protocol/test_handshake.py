"""The one handshake: the key proves itself without travelling, both ways, and refuses alike."""

from __future__ import annotations

import threading

import pytest

from kvport.errors import AuthError
from kvport.protocol import handshake as hs
from kvport.protocol.net import is_loopback
from kvport.protocol.sync import FrameIO
from kvport.transfer.inproc import pair

KEYS = {"a": b"token-of-a", "open": None}


def lookup(who: str) -> tuple[bool, bytes | None]:
    return (who in KEYS, KEYS.get(who))


def run(who: str, key: bytes | None, server_keys=lookup, dest: str = "",  # type: ignore[no-untyped-def]
        names: frozenset[str] | None = None) -> tuple[object, object]:
    """One handshake over an in-process pair: the client's answer signed for ``dest``, the server
    dialled by ``names`` (None: unbound)."""
    a, b = pair()
    out: dict[str, object] = {}

    def server() -> None:
        try:
            out["server"] = hs.server_handshake(FrameIO(b), "srv", server_keys, {"page_bytes": 4096}, names=names)
        except AuthError as exc:
            out["server"] = exc

    t = threading.Thread(target=server)
    t.start()
    try:
        client: object = hs.client_handshake(FrameIO(a), who, key, "inst-1", dest=dest)
    except AuthError as exc:
        client = exc
    t.join(5)
    a.close()
    b.close()
    return client, out["server"]


def test_the_key_proves_itself_both_ways_and_names_the_client() -> None:
    client, server = run("a", b"token-of-a")
    assert isinstance(client, hs.Peer) and client.client == "srv" and client.info == {"page_bytes": 4096}
    assert isinstance(server, hs.Peer) and (server.who, server.client) == ("a", "inst-1")


@pytest.mark.parametrize(("who", "key"), [("a", b"wrong"), ("a", None), ("nobody", b"token-of-a"),
                                          ("open", b"anything")])
def test_wrong_missing_or_unknown_is_refused_alike(who: str, key: bytes | None) -> None:
    client, server = run(who, key)
    assert isinstance(client, AuthError) and isinstance(server, AuthError)
    assert str(server) == "authentication failed"  # one message whatever was wrong


def test_a_principal_without_a_key_passes_with_an_empty_mac() -> None:
    client, server = run("open", None)
    assert isinstance(client, hs.Peer) and isinstance(server, hs.Peer) and server.who == "open"


def test_a_mac_is_bound_to_both_nonces_and_the_principal() -> None:
    ns, nc = b"s" * 32, b"c" * 32
    mac = hs.client_mac(b"k", ns, nc, "a")
    assert b"k" not in mac and len(mac) == hs.MAC_BYTES
    assert mac != hs.client_mac(b"k", b"x" * 32, nc, "a") != hs.client_mac(b"k", ns, nc, "b")
    assert hs.server_mac(b"k", ns, nc, "a") != mac  # the direction byte: a reflected answer fails
    assert not is_loopback("0.0.0.0") and is_loopback("127.0.0.1") and is_loopback("::1")


def test_a_server_that_does_not_know_the_key_is_caught_by_the_client() -> None:
    ns, nc = b"s" * 32, b"c" * 32
    hs.check_welcome(b"k", ns, nc, "a", hs.Welcome("a", hs.server_mac(b"k", ns, nc, "a")))
    with pytest.raises(AuthError):
        hs.check_welcome(b"k", ns, nc, "a", hs.Welcome("a", hs.server_mac(b"other", ns, nc, "a")))
    with pytest.raises(AuthError):
        hs.check_welcome(b"k", ns, nc, "a", hs.Welcome("a", b""))


def bound(dest: str, names: frozenset[str] | None) -> tuple[object, object]:
    return run("a", b"token-of-a", dest=dest, names=names)


def test_an_answer_bound_to_the_server_s_own_address_is_accepted() -> None:
    client, server = bound("127.0.0.1:7000", frozenset({"127.0.0.1:7000", "shm:x"}))
    assert isinstance(client, hs.Peer) and isinstance(server, hs.Peer)


@pytest.mark.parametrize("dest", ["127.0.0.1:7001", ""])
def test_an_answer_signed_for_another_address_is_refused_like_a_wrong_key(dest: str) -> None:
    """A relay: the client dialled 127.0.0.1:7001 (the relay), which passed the real server's challenge
    through; the server is dialled as 127.0.0.1:7000 and refuses, with the one message."""
    client, server = bound(dest, frozenset({"127.0.0.1:7000"}))
    assert isinstance(client, AuthError) and isinstance(server, AuthError)
    assert str(server) == "authentication failed"


def test_the_bound_address_is_covered_by_the_mac() -> None:
    n_s, n_c = b"s" * 32, b"c" * 32
    assert hs.client_mac(b"k", n_s, n_c, "a", "h:1") != hs.client_mac(b"k", n_s, n_c, "a", "h:2")
    assert hs.client_mac(b"k", n_s, n_c, "a", "") == hs.client_mac(b"k", n_s, n_c, "a")  # unbound: as before
    assert hs.server_mac(b"k", n_s, n_c, "a", "h:1") != hs.server_mac(b"k", n_s, n_c, "a")
