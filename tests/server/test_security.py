"""Against a real server process: auth, malformed and oversized frames, slow-loris, tenant isolation."""

from __future__ import annotations

import socket
import struct
import time

import numpy as np
import psutil
import pytest

from kvport.cli.main import main
from kvport.errors import AuthError, TierUnavailableError, UnknownBlockError
from kvport.protocol.frame import HEADER_BYTES, MsgType, decode_header, encode_frame, frame_bytes

from .conftest import TOKENS, MiB, base_args, write_tenants
from .raw import authed_socket, closed_within, recv_frame


def test_missing_or_wrong_token_is_refused(tenant_server) -> None:  # type: ignore[no-untyped-def]
    srv = tenant_server
    for tenant, token in (("alice", None), ("alice", TOKENS["bob"]), ("mallory", TOKENS["alice"]),
                          ("bob", "wrong-token-here")):
        with pytest.raises(AuthError):
            srv.client(tenant, token, retries=0)
    ok = srv.client("alice", TOKENS["alice"])
    ok.ping()
    ok.close()
    # a raw client skipping the handshake gets an error and a closed connection, nothing else
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    recv_frame(s)
    s.sendall(frame_bytes(encode_frame(MsgType.GET, {"key": bytes(16)})))
    mt, meta = recv_frame(s)
    assert mt is MsgType.ERROR and meta["error"] == "ProtocolError"
    assert closed_within(s, 15)


def test_beyond_loopback_refuses_to_start_with_a_tokenless_tenant(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["serve", "--listen", "0.0.0.0:0", "--capacity", "384MiB"]) == 2
    assert "requires a token for every tenant" in capsys.readouterr().err


def test_oversized_and_malformed_frames_refused_before_allocation(shared_server) -> None:  # type: ignore[no-untyped-def]
    rss0 = psutil.Process(shared_server.pid).memory_info().rss
    # before auth: 1 KiB metadata cap
    s = socket.create_connection(("127.0.0.1", shared_server.port), timeout=5)
    recv_frame(s)
    head = encode_frame(MsgType.AUTH_RESPONSE, {"who": "x" * 5000})[0]
    s.sendall(head[:HEADER_BYTES])
    mt, meta = recv_frame(s)
    assert mt is MsgType.ERROR and "oversized" in meta["message"]
    assert closed_within(s, 15)
    # after auth: a PUT announcing 2 GiB, a bad magic, garbage metadata
    s = authed_socket(shared_server.port)
    big = bytearray(encode_frame(MsgType.PUT, {"key": bytes(16)}, [b"x"])[0])
    struct.pack_into("<IQ", big, 12, MiB, 2 << 30)  # chunk_size, payload_len
    s.sendall(bytes(big[:HEADER_BYTES]))
    mt, meta = recv_frame(s)
    assert mt is MsgType.ERROR and "oversized payload" in meta["message"]
    assert closed_within(s, 15)
    s = authed_socket(shared_server.port)
    s.sendall(b"HTTP" + bytes(HEADER_BYTES - 4))
    mt, meta = recv_frame(s)
    assert mt is MsgType.ERROR and "bad magic" in meta["message"]
    s = authed_socket(shared_server.port)
    garbage = bytearray(frame_bytes(encode_frame(MsgType.PUT, {"key": bytes(16)})))
    garbage[HEADER_BYTES:] = b"\xc1" * (len(garbage) - HEADER_BYTES)  # keep length, break the meta checksum
    s.sendall(bytes(garbage))
    mt, meta = recv_frame(s)
    assert mt is MsgType.ERROR and meta["error"] in ("ChecksumError", "ProtocolError")
    # a well-formed request with a wrong field is answered, and the connection stays usable
    s = authed_socket(shared_server.port)
    s.sendall(frame_bytes(encode_frame(MsgType.GET, {"key": b"short"}, corr_id=9)))
    mt, meta = recv_frame(s)
    assert mt is MsgType.GET and meta["error"] == "ProtocolError"
    s.sendall(frame_bytes(encode_frame(MsgType.PING, {}, corr_id=10)))
    assert recv_frame(s)[0] is MsgType.PING
    s.close()
    assert psutil.Process(shared_server.pid).memory_info().rss - rss0 < 32 * MiB


def test_slow_loris_and_idle_connections_time_out(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = server_factory(*base_args("384MiB", "--frame-timeout", "1", "--idle-timeout", "2"))
    pooled = srv.client(retries=0)
    pooled.put(b"p" * 16, b"pinned later")
    loris = authed_socket(srv.port)
    frame = frame_bytes(encode_frame(MsgType.PING, {}))
    loris.sendall(frame[:5])  # starts a frame, then trickles
    dripping = True
    for b in frame[5:12]:
        try:
            loris.sendall(bytes([b]))
        except OSError:
            break
        time.sleep(0.3)
    else:
        dripping = False
    assert dripping or closed_within(loris, 15)  # a deadline, not a timing: it returns at the close
    idle = authed_socket(srv.port)
    assert closed_within(idle, 15)
    fresh = srv.client()
    fresh.ping()  # the server is fine
    fresh.close()
    # the pooled connection was closed by the idle timeout: the pool notices before sending, so
    # even a request that is never resent (PIN) goes out on a fresh connection
    assert pooled.pin([b"p" * 16]) == 1
    pooled.close()


@pytest.mark.parametrize("io_threads", ["0", "4"])
def test_a_writer_that_stalls_mid_payload_is_cut_at_the_frame_deadline(server_factory, io_threads) -> None:  # type: ignore[no-untyped-def]
    """A PUT whose payload stops arriving halfway (large: it is on a bulk I/O thread, or on the
    loop with 0 threads) is closed at the frame deadline; nothing of it is visible, the server
    and its other clients go on."""
    srv = server_factory(*base_args("384MiB", "--frame-timeout", "1", "--io-threads", io_threads))
    key = b"stalled-put-key!"
    value = np.random.default_rng(9).integers(0, 256, 8 * MiB, dtype=np.uint8).tobytes()
    wire = frame_bytes(encode_frame(MsgType.PUT, {"key": key}, [value[i : i + MiB] for i in range(0, len(value), MiB)],
                                    MiB, corr_id=1))
    s = authed_socket(srv.port)
    s.sendall(wire[: len(wire) // 2])  # half the payload, then nothing
    assert closed_within(s, 15)
    tier = srv.client()
    assert tier.size_of(key) is None
    tier.put(key, value)  # the same key from a well-behaved client
    out = bytearray(8 * MiB)
    assert tier.get_into(key, out) == len(value) and bytes(out) == value
    tier.close()


def test_a_tenant_probing_another_tenants_prefix_gets_misses(tenant_server) -> None:  # type: ignore[no-untyped-def]
    srv = tenant_server
    alice = srv.client("alice", TOKENS["alice"])
    bob = srv.client("bob", TOKENS["bob"])
    keys = [bytes([i]) * 16 for i in range(4)]
    value = np.arange(3 * MiB, dtype=np.uint8)
    for k in keys:
        alice.put(k, value)
    assert alice.lookup(keys).hits == 4
    assert bob.lookup(keys).hits == 0
    assert bob.contains_many(keys) == [False] * 4
    assert bob.size_of(keys[0]) is None
    assert list(bob.keys()) == []
    assert bob.delete_many(keys) == 0
    assert bob.pin(keys) == 0
    bob.put(keys[0], np.zeros(MiB, dtype=np.uint8))  # same client key, bob's own block
    assert bob.lookup(keys).hits == 1
    out = bytearray(4 * MiB)
    n = alice.get_into(keys[0], out)
    assert bytes(out[:n]) == value.tobytes()
    assert bob.get_into(keys[0], out) == MiB and not any(out[:MiB])
    with pytest.raises(UnknownBlockError):
        bob.lease(keys[1:], ttl_s=30)  # alice's blocks: bob cannot see them, nothing is leased
    assert bob.owners(keys[1:2]).blocks == () and bob.owners(prefix=keys[1].hex()[:8]).blocks == ()
    assert [r.tenant for r in alice.owners(keys[1:2]).blocks] == ["alice"]
    bob_stats = bob.stats()
    assert [t.name for t in bob_stats.tenants] == ["bob"]  # non-admin sees itself only
    assert bob_stats.used == MiB and all(p.key != keys[1].hex() for p in bob_stats.pins)
    assert bob_stats.server is not None and bob_stats.server.connections == 1  # its own connections only
    assert {t.name for t in alice.stats().tenants} == {"alice", "bob", "small", "big"}  # admin
    alice.close()
    bob.close()
    with pytest.raises((AuthError, TierUnavailableError)):
        srv.client("bob", TOKENS["alice"], retries=0)


def test_a_tenant_sees_its_own_use_of_each_tier_and_an_admin_the_servers(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Per-tier used bytes and block counts, and the staging in flight, answered to a tenant are its
    own: another tenant's blocks never show in them (a side channel on what others store); an admin
    tenant sees the server's."""
    f = write_tenants(tmp_path / "tenants.json", [{"name": "boss", "admin": True}, {"name": "x"}, {"name": "y"}])
    srv = server_factory(*base_args("256MiB", "--tenants", str(f)))
    x, y, boss = srv.client("x"), srv.client("y"), srv.client("boss")

    def host(c) -> tuple[int, int]:  # type: ignore[no-untyped-def]
        st = c.stats()
        assert st.server is not None
        (t,) = [t for t in st.server.tiers if t.name == "host"]
        assert t.capacity > 0 and st.server.staging_bytes == 0
        return t.used, t.blocks

    for i in range(3):
        x.put(bytes([i]) * 16, np.ones(MiB, dtype=np.uint8))
    assert host(y) == (0, 0)
    y.put(b"y" * 16, np.ones(MiB, dtype=np.uint8))
    assert host(y) == (MiB, 1)
    assert host(x) == (3 * MiB, 3)
    assert host(boss) == (4 * MiB, 4)
    for c in (x, y, boss):
        c.close()


def test_put_with_a_corrupt_chunk_in_a_later_group_stores_nothing(shared_server) -> None:  # type: ignore[no-untyped-def]
    """The server verifies a value group by group as it arrives; a bad chunk after several good
    groups still leaves no visible block, and the connection stays in sync for the next request."""
    key = b"corrupt-late-grp"
    value = np.random.default_rng(3).integers(0, 256, 6 * MiB, dtype=np.uint8).tobytes()
    wire = bytearray(frame_bytes(encode_frame(MsgType.PUT, {"key": key}, [value[i : i + MiB] for i in
                                                                          range(0, len(value), MiB)], MiB, corr_id=3)))
    hdr = decode_header(wire)
    chunk5 = HEADER_BYTES + hdr.meta_len + 5 * (MiB + 8)  # the last chunk's data
    wire[chunk5 + 1000] ^= 0xFF
    s = authed_socket(shared_server.port)
    s.sendall(bytes(wire))
    mt, meta = recv_frame(s)
    assert mt is MsgType.PUT and meta["error"] == "ChecksumError" and "chunk 5" in meta["message"]
    s.sendall(frame_bytes(encode_frame(MsgType.PING, {}, corr_id=4)))
    assert recv_frame(s)[0] is MsgType.PING
    s.close()
    tier = shared_server.client()
    assert tier.size_of(key) is None
    tier.put(key, value)  # the same key is writable afterwards: nothing was left reserved
    out = bytearray(len(value))
    assert tier.get_into(key, out) == len(value) and bytes(out) == value
    tier.delete(key)
    tier.close()
