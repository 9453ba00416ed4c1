import contextlib
import struct
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvport.errors import ChecksumError, KVPortError, ProtocolError
from kvport.protocol.frame import (
    CHECKSUM_BYTES,
    HEADER_BYTES,
    VERSION,
    Flags,
    Limits,
    MsgType,
    decode_frame,
    decode_header,
    encode_frame,
    frame_bytes,
)


def _frame(payload: bytes = b"", chunk: int = 4, meta: dict[str, Any] | None = None, **kw: Any) -> bytes:
    chunks = [payload[i : i + chunk] for i in range(0, len(payload), chunk)]
    return frame_bytes(encode_frame(MsgType.LAYER, meta if meta is not None else {"layer": 3}, chunks, chunk, **kw))


def test_header_bytes_exact() -> None:
    buf = _frame(b"abcdefghij", chunk=4, flags=Flags.RESPONSE, corr_id=7)
    magic, ver, flags, mtype, meta_len, cs, plen, corr, check, res = struct.unpack_from("<4sBBHIIQQII", buf)
    assert (magic, ver, flags, mtype, cs, plen, corr, res) == (b"KVPT", VERSION, 1, 19, 4, 10, 7, 0)
    assert meta_len == len(buf) - HEADER_BYTES - 10 - 3 * CHECKSUM_BYTES
    assert check == xxhash.xxh32_intdigest(buf[:32] + buf[HEADER_BYTES : HEADER_BYTES + meta_len])
    # chunk 0 data then its xxh3-64 little-endian, then chunk 1 ...
    p = HEADER_BYTES + meta_len
    assert buf[p : p + 4] == b"abcd"
    assert buf[p + 4 : p + 12] == struct.pack("<Q", xxhash.xxh3_64_intdigest(b"abcd"))
    assert buf[-2 - 8 : -8] == b"ij"


def test_roundtrip() -> None:
    f = decode_frame(_frame(b"x" * 1000, chunk=64, meta={"a": [1, 2], "k": b"\x00" * 16}))
    assert f.msg_type is MsgType.LAYER
    assert f.meta == {"a": [1, 2], "k": b"\x00" * 16}
    assert f.payload == b"x" * 1000
    assert f.header.n_chunks == 16 and f.header.chunk_len(15) == 1000 - 15 * 64


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda b: b"XXXX" + b[4:], "bad magic"),
        (lambda b: b[:4] + bytes([VERSION + 1]) + b[5:], "unknown wire version"),
        (lambda b: b[:6] + struct.pack("<H", 999) + b[8:], "unknown msg_type"),
        (lambda b: b[:5] + bytes([0x80]) + b[6:], "unknown flag"),
        (lambda b: b[:20], "truncated frame header"),
        (lambda b: b[:-3], "truncated"),
        (lambda b: b + b"\x00", "trailing"),
        (lambda b: b[:36] + b"\x01\x00\x00\x00" + b[40:], "reserved"),
    ],
)
def test_decode_errors(mutate, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ProtocolError, match=match):
        decode_frame(mutate(_frame(b"payload!")))


def test_oversized_lengths_refused_before_allocation() -> None:
    lim = Limits(max_meta_bytes=64, max_payload_bytes=1000, max_chunk_bytes=100, max_chunks=4)
    big_meta = struct.pack("<4sBBHIIQQII", b"KVPT", VERSION, 0, 19, 1 << 31, 0, 0, 0, 0, 0)
    with pytest.raises(ProtocolError, match="oversized metadata"):
        decode_header(big_meta, lim)
    big_payload = struct.pack("<4sBBHIIQQII", b"KVPT", VERSION, 0, 19, 0, 10, 1 << 62, 0, 0, 0)
    with pytest.raises(ProtocolError, match="oversized payload"):
        decode_header(big_payload, lim)
    big_chunk = struct.pack("<4sBBHIIQQII", b"KVPT", VERSION, 0, 19, 0, 1000, 1000, 0, 0, 0)
    with pytest.raises(ProtocolError, match="oversized chunk"):
        decode_header(big_chunk, lim)
    many = struct.pack("<4sBBHIIQQII", b"KVPT", VERSION, 0, 19, 0, 1, 1000, 0, 0, 0)
    with pytest.raises(ProtocolError, match="too many chunks"):
        decode_header(many, lim)


def test_checksums() -> None:
    buf = bytearray(_frame(b"0123456789", chunk=4))
    meta_len = struct.unpack_from("<I", buf, 8)[0]
    bad_payload = bytearray(buf)
    bad_payload[HEADER_BYTES + meta_len + 1] ^= 0xFF
    with pytest.raises(ChecksumError, match="chunk 0"):
        decode_frame(bytes(bad_payload))
    bad_meta = bytearray(buf)
    bad_meta[HEADER_BYTES] ^= 0x01
    with pytest.raises(ChecksumError, match="header/metadata"):
        decode_frame(bytes(bad_meta))


def test_metadata_rejects_non_map_and_ext() -> None:
    import msgpack

    from kvport.protocol.frame import encode_header

    for meta in (msgpack.packb([1, 2]), msgpack.packb({"a": msgpack.ExtType(1, b"x")}), msgpack.packb({1: 2})):
        with pytest.raises(ProtocolError):
            decode_frame(encode_header(MsgType.PING, meta))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_fuzz_random_bytes(data: bytes) -> None:
    with contextlib.suppress(KVPortError):
        decode_frame(data, Limits(max_meta_bytes=4096, max_payload_bytes=4096, max_chunk_bytes=4096))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 200), st.integers(0, 255), st.binary(max_size=64))
def test_fuzz_mutated_valid_frames(pos: int, byte: int, payload: bytes) -> None:
    orig = _frame(payload, chunk=16, meta={"tid": 1, "keys": [b"k" * 16]})
    buf = bytearray(orig)
    buf[pos % len(buf)] = byte
    try:
        f = decode_frame(bytes(buf))
    except (ProtocolError, ChecksumError):
        return
    assert bytes(buf) == orig and f.payload == payload  # every surviving frame is the unmodified one


def test_advance_drops_finished_views_and_slices_the_partial_one() -> None:
    from kvport.protocol.transport import advance

    views = [memoryview(b"abc"), memoryview(b"defg"), memoryview(b"hi")]
    assert advance(views, 0, 0) == 0
    assert advance(views, 0, 5) == 1 and bytes(views[1]) == b"fg"
    assert advance(views, 1, 2) == 2 and bytes(views[2]) == b"hi"
    assert advance(views, 2, 2) == 3
