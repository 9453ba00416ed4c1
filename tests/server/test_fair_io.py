"""Against a real server process: readers that stop reading hold no bulk I/O thread, and are cut;
a client that pipelines its requests does not hold the event loop."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np

from kvport.protocol.frame import HEADER_BYTES, MsgType, decode_header, encode_frame, frame_bytes
from kvport.protocol.server import GetRequest, PingRequest

from .conftest import MiB, ServerProc, base_args
from .raw import authed_socket, closed_within, recv_exact, recv_frame

STALLED = 4  # twice the server's I/O threads below


def _stall_readers(srv: ServerProc, key: bytes, n: int) -> list[socket.socket]:
    """``n`` connections that ask for ``key`` and never read a byte of the answer."""
    out = []
    for i in range(n):
        s = authed_socket(srv.port, rcvbuf=64 << 10)
        s.sendall(frame_bytes(encode_frame(MsgType.GET, GetRequest(key).to_meta(), corr_id=i + 1)))
        out.append(s)
    return out


def _connections(srv: ServerProc) -> int:
    c = srv.client(pool_size=1)
    try:
        st = c.stats().server
        assert st is not None
        return st.connections - 1  # not this one
    finally:
        c.close()


def _wait_connections(srv: ServerProc, n: int, within_s: float) -> bool:
    """Poll until the server has ``n`` connections besides the asking one (a bound, not a timing)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if _connections(srv) == n:
            return True
        time.sleep(0.2)
    return False


def test_readers_that_stop_reading_do_not_hold_the_io_threads(server_factory) -> None:  # type: ignore[no-untyped-def]
    """More stalled 32 MiB reads than I/O threads: another client's GET of a payload the threads
    move (1 MiB) is answered while the stalled ones are still stalled (it did not wait for them:
    they are still open when it completes), and the stalled ones are closed by the frame deadline."""
    frame_s = 12.0
    srv = server_factory(*base_args("400MiB", "--io-threads", "2", "--frame-timeout", str(frame_s)))
    c = srv.client(pool_size=1)
    big, small = b"B" * 16, b"s" * 16
    c.put(big, np.random.default_rng(5).integers(0, 256, 32 * MiB, dtype=np.uint8))
    value = np.random.default_rng(6).integers(0, 256, MiB, dtype=np.uint8)
    c.put(small, value)
    stalled = _stall_readers(srv, big, STALLED)
    time.sleep(1.0)  # ordering only: the stalled answers have started and filled the socket buffers
    t0 = time.monotonic()
    out = bytearray(MiB)
    assert c.get_into(small, out) == MiB and out == value.tobytes()
    took = time.monotonic() - t0
    still_open = _connections(srv) - 1  # c's own connection
    assert still_open == STALLED, f"the stalled readers were closed before the GET completed ({took:.1f} s)"
    assert took < frame_s
    assert _wait_connections(srv, 1, frame_s + 20)  # every stalled reader cut (c stays)
    for s in stalled:
        assert closed_within(s, 10)  # the buffered part of the answer, then EOF
        s.close()
    c.get_into(big, bytearray(32 * MiB))  # the server and the value are fine
    c.close()


def test_a_send_without_progress_is_cut_at_the_write_timeout(server_factory) -> None:  # type: ignore[no-untyped-def]
    """``--write-timeout``: a reader that takes nothing for that long is closed long before the
    frame deadline; a reader that keeps taking bytes, however slowly, gets its whole answer."""
    srv = server_factory(*base_args("400MiB", "--io-threads", "2", "--frame-timeout", "120", "--write-timeout", "5"))
    c = srv.client(pool_size=1)
    big = b"W" * 16
    c.put(big, np.random.default_rng(7).integers(0, 256, 32 * MiB, dtype=np.uint8))
    c.close()
    slow = authed_socket(srv.port, rcvbuf=64 << 10)
    slow.sendall(frame_bytes(encode_frame(MsgType.GET, GetRequest(big).to_meta(), corr_id=7)))
    got: list[int] = []

    def read_slowly() -> None:  # a few MB/s: 64 KiB at a time with pauses
        head = recv_exact(slow, HEADER_BYTES)
        hdr = decode_header(head)
        left = hdr.meta_len + hdr.wire_payload_bytes
        while left:
            part = slow.recv(min(left, 64 << 10))
            if not part:
                return
            left -= len(part)
            time.sleep(0.01)
        got.append(hdr.payload_len)

    reader = threading.Thread(target=read_slowly)
    reader.start()
    stalled = _stall_readers(srv, big, 2)
    assert _wait_connections(srv, 1, 60)  # the stalled ones cut by the write timeout (frame deadline 120 s)
    for s in stalled:
        assert closed_within(s, 10)
        s.close()
    reader.join(120)
    assert got == [32 * MiB]  # never cut: it kept taking bytes
    slow.close()


def test_a_pipelining_client_does_not_hold_the_server(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A client queues 2,000 GETs in one write and reads the answers as they come; another client's
    PING, sent right after, is answered before the first client has half of its answers (the
    connections take turns, one request each; nothing here is timed)."""
    srv = server_factory(*base_args("400MiB"))
    c = srv.client(pool_size=1)
    key = b"p" * 16
    c.put(key, np.full(1024, 3, dtype=np.uint8))
    n = 2000
    piped, other = authed_socket(srv.port), authed_socket(srv.port)
    answered: list[int] = []

    def read_answers() -> None:
        for _ in range(n):
            hdr = decode_header(recv_exact(piped, HEADER_BYTES))
            recv_exact(piped, hdr.meta_len + hdr.wire_payload_bytes)
            answered.append(1)

    reader = threading.Thread(target=read_answers)
    reader.start()
    frame = frame_bytes(encode_frame(MsgType.GET, GetRequest(key).to_meta(), corr_id=1))
    piped.sendall(frame * n)
    other.sendall(frame_bytes(encode_frame(MsgType.PING, PingRequest().to_meta(), corr_id=2)))
    mt, _ = recv_frame(other)
    seen = len(answered)
    reader.join(60)
    assert mt is MsgType.PING and len(answered) == n
    assert seen < n // 2, f"the PING waited for {seen} of the {n} pipelined GETs"
    for s in (piped, other):
        s.close()
    c.close()
