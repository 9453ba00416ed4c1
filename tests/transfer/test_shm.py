"""Shared-memory described payloads: the same stream bytes for any reader, checked on arrival."""

from __future__ import annotations

import numpy as np
import pytest

from kvport import memops
from kvport.errors import PeerError
from kvport.protocol.frame import MsgType, encode_frame, frame_bytes
from kvport.protocol.sync import FrameIO
from kvport.transfer import shm as shm_mod

CHUNK = 4096


def _registered_pair(nbytes: int = 16 * CHUNK) -> tuple[shm_mod.ShmTransport, shm_mod.ShmTransport, np.ndarray]:
    a, b = shm_mod.pair(1 << 16, 4, timeout_s=5)
    region = np.frombuffer(a.register(nbytes), dtype=np.uint8)
    region[:] = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)
    return a, b, region


def _chunks(region: np.ndarray, order: list[int]) -> list[memoryview]:
    mv = region.data.cast("B")
    return [mv[i * CHUNK : (i + 1) * CHUNK] for i in order]


def test_a_described_payload_reads_as_plain_frame_bytes() -> None:
    """A reader that does not take the described path (read_frame, skip_payload) sees exactly the
    bytes of the equivalent plain frame: chunk, checksum, chunk, checksum..."""
    a, b, region = _registered_pair()
    order = [5, 0, 9, 3]
    chunks = _chunks(region, order)
    FrameIO(a).send(MsgType.LAYER, {"layer": 0}, chunks, CHUNK, corr_id=4)
    f = FrameIO(b).read_frame()
    assert f.msg_type is MsgType.LAYER and f.meta == {"layer": 0} and f.header.corr_id == 4
    assert f.payload == b"".join(bytes(c) for c in chunks)
    # the raw stream, byte for byte, equals what encode_frame would have put on a socket
    FrameIO(a).send(MsgType.LAYER, {"layer": 1}, chunks, CHUNK)
    want = frame_bytes(encode_frame(MsgType.LAYER, {"layer": 1}, chunks, CHUNK))
    got = memoryview(bytearray(len(want)))
    b.recv_into([got])
    assert bytes(got) == want
    # and a skipped payload leaves the stream in step for the next frame
    io_b = FrameIO(b)
    FrameIO(a).send(MsgType.LAYER, {"layer": 2}, chunks, CHUNK)
    FrameIO(a).send(MsgType.PING, {"n": 1})
    hdr, _ = io_b.read_head()
    io_b.skip_payload(hdr, memoryview(bytearray(1000)))
    assert io_b.read_frame().meta == {"n": 1}
    assert b.described_payloads == 0
    a.close()
    b.close()


def test_a_described_payload_is_copied_and_verified_in_one_call() -> None:
    a, b, region = _registered_pair()
    chunks = _chunks(region, [2, 4, 6])
    FrameIO(a).send(MsgType.LAYER, {}, chunks, CHUNK)
    io_b = FrameIO(b)
    hdr, _ = io_b.read_head()
    dst = np.zeros(3 * CHUNK, dtype=np.uint8)
    views = [dst.data.cast("B")[i * CHUNK : (i + 1) * CHUNK] for i in range(3)]
    assert io_b.read_payload_into(hdr, views) == []
    assert b.described_payloads == 1
    assert dst.tobytes() == b"".join(bytes(c) for c in chunks)
    a.close()
    b.close()


def test_a_payload_whose_digest_does_not_match_names_the_chunk() -> None:
    a, b, region = _registered_pair()
    chunks = _chunks(region, [1, 2, 3])
    digests = bytearray(memops.xxh3_many(chunks))
    digests[8] ^= 0xFF
    FrameIO(a).send(MsgType.LAYER, {}, chunks, CHUNK, digests=bytes(digests))
    io_b = FrameIO(b)
    hdr, _ = io_b.read_head()
    views = [memoryview(bytearray(CHUNK)) for _ in range(3)]
    assert io_b.read_payload_into(hdr, views) == [1]
    a.close()
    b.close()


@pytest.mark.parametrize(("n", "chunk", "payload", "offset", "match"), [
    (2, CHUNK, 2 * CHUNK, 16 * CHUNK - 100, "outside region"),  # the last chunk runs past the region
    (1, CHUNK, CHUNK, 2**63, "outside region"),
    (2, CHUNK, 3 * CHUNK, 0, "bad PAYLOAD"),  # payload longer than its chunks
    (1, 0, 0, 0, "bad PAYLOAD"),
    (0, CHUNK, 0, 0, "PAYLOAD of 0 chunks"),
    ((1 << 20) + 1, CHUNK, CHUNK, 0, "PAYLOAD of"),  # more chunks than the wire allows: refused unread
])
def test_a_malformed_payload_message_is_refused_before_any_copy(n: int, chunk: int, payload: int, offset: int,
                                                                match: str) -> None:
    a, b, _ = _registered_pair()
    body = shm_mod._Q.pack(chunk) + (offset.to_bytes(8, "little") * min(n, 2)) + bytes(8 * min(n, 2))
    a._ctrl_send(shm_mod._CTRL.pack(shm_mod._PAYLOAD, 0, n, payload) + body, "test")
    with pytest.raises(PeerError, match=match):
        b.recv_into([memoryview(bytearray(8))])
    a.close()
    b.close()


def test_chunks_outside_any_registered_region_travel_through_the_ring() -> None:
    a, b, region = _registered_pair()
    private = np.arange(2 * CHUNK, dtype=np.uint8) % 251
    chunks = [*_chunks(region, [0]), private.data.cast("B")[:CHUNK]]  # one registered, one not
    assert a.describe(chunks, CHUNK) is None
    FrameIO(a).send(MsgType.LAYER, {}, chunks, CHUNK)
    assert FrameIO(b).read_frame().payload == b"".join(bytes(c) for c in chunks)
    a.close()
    b.close()
