"""Checksums computed/verified on worker threads (payloads of several batches) give the same bytes
on the wire as the inline path and still catch every corrupted chunk, in any batch."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvport import memops
from kvport.errors import ProtocolError
from kvport.protocol.frame import CHECKSUM_BYTES, HEADER_BYTES, MsgType, decode_frame, encode_frame, frame_bytes
from kvport.protocol.sync import FrameIO
from kvport.transfer import inproc

CHUNK = 4096
N_CHUNKS = 40  # with batch_bytes = 4 chunks: 10 batches


def _chunks() -> list[memoryview]:
    data = np.random.default_rng(7).integers(0, 256, CHUNK * N_CHUNKS, dtype=np.uint8)
    return [data[i * CHUNK : (i + 1) * CHUNK].data for i in range(N_CHUNKS)]


def _send(batch_bytes: int, chunks: list[memoryview], overlap: bool = True, digests: bytes | None = None) -> bytes:
    a, b = inproc.pair(capacity=1 << 22)
    FrameIO(a, batch_bytes=batch_bytes, overlap=overlap).send(MsgType.LAYER, {"layer": 1}, chunks, CHUNK,
                                                              digests=digests)
    a.close()
    out = bytearray()
    buf = memoryview(bytearray(1))
    while b.readable(0.5):
        try:
            b.recv_into([buf])
        except Exception:
            break
        out += buf
    return bytes(out)


@pytest.mark.parametrize("how", ["overlap", "inline", "digests"])
@pytest.mark.parametrize("batch_bytes", [4 * CHUNK, 3 * CHUNK + 1, 1 << 30])
@pytest.mark.parametrize("short_last", [False, True])
def test_pipelined_send_writes_exactly_the_encoded_frame(batch_bytes: int, how: str, short_last: bool) -> None:
    chunks = _chunks()
    if short_last:
        chunks[-1] = chunks[-1][:1000]
    digests = memops.xxh3_many(chunks) if how == "digests" else None
    wire = _send(batch_bytes, chunks, how == "overlap", digests)
    assert wire == frame_bytes(encode_frame(MsgType.LAYER, {"layer": 1}, chunks, CHUNK))
    assert decode_frame(wire).payload == b"".join(bytes(c) for c in chunks)


def test_send_refuses_chunks_of_the_wrong_size_and_sends_an_empty_payload_as_a_head() -> None:
    a, b = inproc.pair()
    io = FrameIO(a)
    with pytest.raises(ProtocolError, match="chunk 1 has 5 bytes"):
        io.send(MsgType.LAYER, {}, [b"abcdefgh", b"abcde", b"abcdefgh"], 8)
    io.send(MsgType.PING, {"n": 1}, [b"", b""], 8)  # nothing to carry: the head alone
    io.send(MsgType.PING, {"n": 2})
    rd = FrameIO(b)
    assert rd.read_frame().meta == {"n": 1} and rd.read_frame().meta == {"n": 2}


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("corrupt", [0, 5, 22, N_CHUNKS - 1])
def test_pipelined_verify_reports_the_corrupted_chunk(corrupt: int, overlap: bool) -> None:
    chunks = _chunks()
    wire = bytearray(frame_bytes(encode_frame(MsgType.LAYER, {"layer": 1}, chunks, CHUNK)))
    meta_len = int.from_bytes(wire[8:12], "little")
    wire[HEADER_BYTES + meta_len + corrupt * (CHUNK + CHECKSUM_BYTES) + 17] ^= 0x01
    a, b = inproc.pair(capacity=1 << 22)
    th = threading.Thread(target=lambda: a.send([bytes(wire)]))
    th.start()
    io = FrameIO(b, batch_bytes=4 * CHUNK, overlap=overlap)
    hdr, meta = io.read_head()
    dst = np.zeros((N_CHUNKS, CHUNK), dtype=np.uint8)
    bad = io.read_payload_into(hdr, [dst[i].data for i in range(N_CHUNKS)])
    th.join()
    assert meta == {"layer": 1} and bad == [corrupt]
    ok = [i for i in range(N_CHUNKS) if i != corrupt]
    assert all(bytes(dst[i].data) == bytes(chunks[i]) for i in ok)


def test_forked_child_gets_its_own_checksum_workers() -> None:
    import os
    import time

    chunks = _chunks()
    expected = frame_bytes(encode_frame(MsgType.LAYER, {"layer": 1}, chunks, CHUNK))
    assert _send(4 * CHUNK, chunks) == expected  # the parent's workers exist now
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        ok = _send(4 * CHUNK, chunks) == expected
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child hung on the parent's (dead) checksum workers")


def _feed(wire: bytes, extra: bytes = b"") -> tuple[threading.Thread, FrameIO, inproc.InprocTransport]:
    a, b = inproc.pair(capacity=1 << 22)
    th = threading.Thread(target=lambda: a.send([wire + extra]))
    th.start()
    return th, FrameIO(b, batch_bytes=4 * CHUNK, overlap=False), b


@pytest.mark.parametrize("overlap", [True, False])
def test_on_verified_reports_every_chunk_once_in_order(overlap: bool) -> None:
    chunks = _chunks()
    wire = frame_bytes(encode_frame(MsgType.LAYER, {"layer": 1}, chunks, CHUNK))
    th, io, _ = _feed(wire)
    io.overlap = overlap
    hdr, _ = io.read_head()
    dst = np.zeros((N_CHUNKS, CHUNK), dtype=np.uint8)
    seen: list[tuple[int, int]] = []
    copies: list[bytes] = []

    def on_verified(first: int, end: int) -> None:
        seen.append((first, end))
        copies.append(dst[first:end].tobytes())  # the bytes are there when it is called

    assert io.read_payload_into(hdr, [dst[i].data for i in range(N_CHUNKS)], on_verified) == []
    th.join()
    assert seen[0][0] == 0 and seen[-1][1] == N_CHUNKS
    assert all(seen[i][1] == seen[i + 1][0] for i in range(len(seen) - 1))  # contiguous, in order
    assert len(seen) == N_CHUNKS // 4  # one call per batch of 4 chunks
    assert b"".join(copies) == b"".join(bytes(c) for c in chunks)


@pytest.mark.parametrize("overlap", [True, False])
def test_on_verified_stops_at_the_first_bad_chunk(overlap: bool) -> None:
    chunks = _chunks()
    wire = bytearray(frame_bytes(encode_frame(MsgType.LAYER, {"layer": 1}, chunks, CHUNK)))
    meta_len = int.from_bytes(wire[8:12], "little")
    wire[HEADER_BYTES + meta_len + 9 * (CHUNK + CHECKSUM_BYTES) + 3] ^= 0x01  # chunk 9, in the third batch
    th, io, _ = _feed(bytes(wire))
    io.overlap = overlap
    hdr, _ = io.read_head()
    dst = np.zeros((N_CHUNKS, CHUNK), dtype=np.uint8)
    seen: list[tuple[int, int]] = []
    bad = io.read_payload_into(hdr, [dst[i].data for i in range(N_CHUNKS)], lambda a, b: seen.append((a, b)))
    th.join()
    assert bad == [9]
    assert seen == [(0, 4), (4, 8), (8, 9)]  # the good chunks before it, nothing after


def test_an_on_verified_error_is_raised_after_the_payload_is_read() -> None:
    chunks = _chunks()
    wire = frame_bytes(encode_frame(MsgType.LAYER, {"layer": 1}, chunks, CHUNK))
    ping = frame_bytes(encode_frame(MsgType.PING, {"n": 2}))
    th, io, _ = _feed(wire, ping)
    hdr, _ = io.read_head()
    dst = np.zeros((N_CHUNKS, CHUNK), dtype=np.uint8)
    calls: list[int] = []

    def consumer(first: int, end: int) -> None:
        calls.append(first)
        raise ValueError("consumer is full")

    with pytest.raises(ValueError, match="consumer is full"):
        io.read_payload_into(hdr, [dst[i].data for i in range(N_CHUNKS)], consumer)
    assert calls == [0]  # not called again once it failed
    hdr2, meta2 = io.read_head()  # the stream is still in sync: the next frame reads cleanly
    th.join()
    assert hdr2.msg_type is MsgType.PING and meta2 == {"n": 2}
