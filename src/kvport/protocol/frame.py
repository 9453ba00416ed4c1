"""The kvport frame: pure encode/decode, no I/O (docs/wire-format.md is the byte-level reference).

A frame is a fixed 40-byte header, a msgpack metadata map, then an optional payload cut in chunks,
each chunk followed by its xxh3-64 checksum::

    offset size  field
    0      4     magic          b"KVPT"
    4      1     version        1
    5      1     flags          Flags bits (RESPONSE, ERROR, LAST)
    6      2     msg_type       MsgType (u16)
    8      4     meta_len       bytes of msgpack metadata that follow the header (<= Limits.max_meta_bytes)
    12     4     chunk_size     payload bytes per chunk, last chunk may be shorter (0 iff payload_len == 0)
    16     8     payload_len    payload bytes, checksums excluded (<= Limits.max_payload_bytes)
    24     8     corr_id        correlation id: a response carries its request's id
    32     4     header_check   xxh32(header[0:32] + meta), seed 0
    36     4     reserved       0
    40     ...   meta           msgpack map, str keys, no ext types
    ...          payload        [chunk 0 data][xxh3_64(chunk 0) u64 LE][chunk 1 data][...]...

All integers are little-endian. Every length is checked against :class:`Limits` by
:func:`decode_header` *before* the caller allocates anything; readers only fill buffers and call
these functions, so the sync socket path and the asyncio path share one parser.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash

from kvport.errors import ChecksumError, ProtocolError

MAGIC = b"KVPT"
VERSION = 2
HEADER = struct.Struct("<4sBBHIIQQII")
HEADER_BYTES = HEADER.size  # 40
CHECKSUM = struct.Struct("<Q")
CHECKSUM_BYTES = CHECKSUM.size  # 8

Buffer = bytes | bytearray | memoryview


class MsgType(enum.IntEnum):
    """Frame types. 1-15 connection, 16-47 KV transfer, 64-127 shared-tier server (see docs)."""

    # connection
    AUTH_CHALLENGE = 1
    AUTH_RESPONSE = 2
    AUTH_OK = 3
    ERROR = 4
    PING = 5
    # KV transfer (sender -> receiver unless noted)
    TRANSFER_BEGIN = 16
    TRANSFER_ACCEPT = 17  # receiver -> sender, carries the first credit grant
    TRANSFER_REFUSE = 18  # receiver -> sender, names the mismatched field
    LAYER = 19  # payload: one chunk per block of one layer
    CREDIT = 20  # receiver -> sender: cumulative bytes granted
    TRANSFER_END = 21
    TRANSFER_COMMITTED = 22  # receiver -> sender: blocks linked, ownership moved
    TRANSFER_ABORT = 23  # either way: the transfer is void, nothing linked
    HANDOFF_RECORDS = 24  # asker -> receiver: the newest ownership moves of its ledger
    HANDOFF_RECORDS_ANSWER = 25  # receiver -> asker
    # shared-tier server (requests; answers use the same type with Flags.RESPONSE)
    PUT = 64
    GET = 65
    LOOKUP = 66
    PIN = 67
    UNPIN = 68
    LEASE = 69
    RELEASE = 70
    DELETE = 71
    STATS = 72
    CONTAINS = 73
    OWNERS = 74
    LEAKS = 75


class Flags(enum.IntFlag):
    NONE = 0
    RESPONSE = 1  # an answer to the request with the same corr_id
    ERROR = 2  # an error answer: meta {"error": class name, "message": str, ...}
    LAST = 4  # the last frame of a multi-frame answer


@dataclass(frozen=True, slots=True)
class Limits:
    """Caps on every length read from a peer, checked before any allocation."""

    max_meta_bytes: int = 1 << 20
    max_payload_bytes: int = 1 << 30
    max_chunk_bytes: int = 64 << 20
    max_chunks: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("max_meta_bytes", "max_payload_bytes", "max_chunk_bytes", "max_chunks"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ProtocolError(f"Limits.{name} must be a positive integer, got {v!r}")


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class FrameHeader:
    msg_type: MsgType
    flags: Flags
    meta_len: int
    chunk_size: int
    payload_len: int
    corr_id: int
    header_check: int

    @property
    def n_chunks(self) -> int:
        return 0 if self.payload_len == 0 else -(-self.payload_len // self.chunk_size)

    @property
    def wire_payload_bytes(self) -> int:
        """Payload bytes on the wire, checksums included."""
        return self.payload_len + self.n_chunks * CHECKSUM_BYTES

    def chunk_len(self, i: int) -> int:
        if not 0 <= i < self.n_chunks:
            raise ProtocolError(f"chunk {i} out of range [0, {self.n_chunks})")
        return min(self.chunk_size, self.payload_len - i * self.chunk_size)


@dataclass(frozen=True, slots=True)
class Frame:
    """A decoded frame whose payload (if any) was read into ``payload`` (small frames only)."""

    header: FrameHeader
    meta: dict[str, Any]
    payload: bytes = b""

    @property
    def msg_type(self) -> MsgType:
        return self.header.msg_type


# ---------------------------------------------------------------------- header
def decode_header(buf: Buffer, limits: Limits = DEFAULT_LIMITS) -> FrameHeader:
    """Parse and cap-check the fixed header; the meta checksum is verified by :func:`decode_meta`."""
    if len(buf) < HEADER_BYTES:
        raise ProtocolError(f"truncated frame header: {len(buf)} of {HEADER_BYTES} bytes")
    magic, version, flags, mtype, meta_len, chunk_size, payload_len, corr_id, check, reserved = (
        HEADER.unpack_from(buf, 0))
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ProtocolError(f"unknown wire version {version}, this side speaks {VERSION}")
    if reserved != 0:
        raise ProtocolError(f"reserved header field is {reserved}, expected 0")
    try:
        msg_type = MsgType(mtype)
    except ValueError as exc:
        raise ProtocolError(f"unknown msg_type {mtype}") from exc
    if flags & ~int(Flags.RESPONSE | Flags.ERROR | Flags.LAST):
        raise ProtocolError(f"unknown flag bits {flags:#x}")
    if meta_len > limits.max_meta_bytes:
        raise ProtocolError(f"oversized metadata: {meta_len} > {limits.max_meta_bytes} bytes")
    if payload_len > limits.max_payload_bytes:
        raise ProtocolError(f"oversized payload: {payload_len} > {limits.max_payload_bytes} bytes")
    if (payload_len == 0) != (chunk_size == 0):
        raise ProtocolError(f"chunk_size {chunk_size} inconsistent with payload_len {payload_len}")
    if chunk_size > limits.max_chunk_bytes:
        raise ProtocolError(f"oversized chunk: {chunk_size} > {limits.max_chunk_bytes} bytes")
    hdr = FrameHeader(msg_type, Flags(flags), meta_len, chunk_size, payload_len, corr_id, check)
    if hdr.n_chunks > limits.max_chunks:
        raise ProtocolError(f"too many chunks: {hdr.n_chunks} > {limits.max_chunks}")
    return hdr


def _check_of(prefix: Buffer, meta: Buffer) -> int:
    h = xxhash.xxh32(prefix)
    h.update(meta)
    return int(h.intdigest())


def encode_header(msg_type: MsgType, meta: bytes, payload_len: int = 0, chunk_size: int = 0,
                  flags: Flags = Flags.NONE, corr_id: int = 0) -> bytes:
    """Header + meta bytes of one frame (the payload chunks follow, see :func:`payload_parts`)."""
    if payload_len < 0 or chunk_size < 0 or (payload_len == 0) != (chunk_size == 0):
        raise ProtocolError(f"bad payload_len {payload_len} / chunk_size {chunk_size}")
    prefix = struct.pack("<4sBBHIIQQ", MAGIC, VERSION, int(flags), int(msg_type), len(meta), chunk_size,
                         payload_len, corr_id)
    return prefix + struct.pack("<II", _check_of(prefix, meta), 0) + meta


# ---------------------------------------------------------------------- metadata
def encode_meta(meta: dict[str, Any]) -> bytes:
    try:
        out: bytes = msgpack.packb(meta, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"metadata not encodable: {exc}") from exc
    return out


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack ext type {code} not allowed in metadata")


def decode_meta(header: FrameHeader, meta: Buffer) -> dict[str, Any]:
    """Verify the header check over header + meta, then unpack the msgpack map (str keys, no ext)."""
    if len(meta) != header.meta_len:
        raise ProtocolError(f"truncated metadata: {len(meta)} of {header.meta_len} bytes")
    prefix = struct.pack("<4sBBHIIQQ", MAGIC, VERSION, int(header.flags), int(header.msg_type), header.meta_len,
                         header.chunk_size, header.payload_len, header.corr_id)
    if _check_of(prefix, meta) != header.header_check:
        raise ChecksumError("frame header/metadata checksum mismatch")
    if header.meta_len == 0:
        return {}
    n = header.meta_len
    try:
        obj = msgpack.unpackb(bytes(meta), raw=False, strict_map_key=True, ext_hook=_no_ext,
                              max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n, max_ext_len=0)
    except ProtocolError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            RecursionError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"malformed metadata: {exc}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(f"metadata must be a map, got {type(obj).__name__}")
    return obj


# ---------------------------------------------------------------------- payload
def checksum(data: Buffer) -> bytes:
    return CHECKSUM.pack(xxhash.xxh3_64_intdigest(data))


def verify_chunk(data: Buffer, trailer: Buffer, index: int = 0) -> None:
    if xxhash.xxh3_64_intdigest(data) != CHECKSUM.unpack_from(trailer)[0]:
        raise ChecksumError(f"payload chunk {index} failed its checksum")


def payload_parts(chunks: Sequence[Buffer], chunk_size: int) -> list[Buffer]:
    """The iovec list of a payload: each chunk followed by its checksum (zero-copy views)."""
    parts: list[Buffer] = []
    last = len(chunks) - 1
    for i, c in enumerate(chunks):
        n = len(c) if not isinstance(c, memoryview) else c.nbytes
        if n != chunk_size and not (i == last and 0 < n < chunk_size):
            raise ProtocolError(f"chunk {i} has {n} bytes; chunks are {chunk_size} bytes (last may be shorter)")
        parts.append(c)
        parts.append(CHECKSUM.pack(xxhash.xxh3_64_intdigest(c)))
    return parts


def _nbytes(b: Buffer) -> int:
    return b.nbytes if isinstance(b, memoryview) else len(b)


def encode_frame(msg_type: MsgType, meta: dict[str, Any] | None = None, chunks: Sequence[Buffer] = (),
                 chunk_size: int | None = None, flags: Flags = Flags.NONE, corr_id: int = 0) -> list[Buffer]:
    """A whole frame as an iovec list (header+meta bytes, then chunk views and checksums)."""
    payload_len = sum(_nbytes(c) for c in chunks)
    cs = 0 if payload_len == 0 else (chunk_size if chunk_size is not None else _nbytes(chunks[0]))
    head = encode_header(msg_type, encode_meta(meta or {}), payload_len, cs, flags, corr_id)
    return [head, *payload_parts(chunks, cs)] if payload_len else [head]


def frame_bytes(parts: Sequence[Buffer]) -> bytes:
    return b"".join(bytes(p) for p in parts)


def iter_chunks(header: FrameHeader, payload: Buffer) -> Iterator[memoryview]:
    """Verify every chunk of a payload held in one buffer (wire form) and yield the data views."""
    mv = memoryview(payload).cast("B")
    if mv.nbytes != header.wire_payload_bytes:
        raise ProtocolError(f"truncated payload: {mv.nbytes} of {header.wire_payload_bytes} bytes")
    off = 0
    for i in range(header.n_chunks):
        n = header.chunk_len(i)
        data = mv[off : off + n]
        verify_chunk(data, mv[off + n : off + n + CHECKSUM_BYTES], i)
        off += n + CHECKSUM_BYTES
        yield data


def decode_frame(buf: Buffer, limits: Limits = DEFAULT_LIMITS) -> Frame:
    """Decode one complete frame held in ``buf`` (tests, fuzzing, small control frames)."""
    mv = memoryview(buf).cast("B")
    hdr = decode_header(mv, limits)
    end_meta = HEADER_BYTES + hdr.meta_len
    if mv.nbytes < end_meta:
        raise ProtocolError(f"truncated frame: {mv.nbytes} bytes, header says meta ends at {end_meta}")
    meta = decode_meta(hdr, mv[HEADER_BYTES:end_meta])
    total = end_meta + hdr.wire_payload_bytes
    if mv.nbytes < total:
        raise ProtocolError(f"truncated frame: {mv.nbytes} of {total} bytes")
    if mv.nbytes > total:
        raise ProtocolError(f"{mv.nbytes - total} trailing bytes after the frame")
    payload = b"".join(bytes(c) for c in iter_chunks(hdr, mv[end_meta:total]))
    return Frame(hdr, meta, payload)


def split_chunks(payload: Buffer, chunk_size: int) -> list[memoryview]:
    """Zero-copy chunk views of one contiguous payload (for :func:`encode_frame`)."""
    if chunk_size <= 0:
        raise ProtocolError(f"chunk_size must be positive, got {chunk_size}")
    mv = memoryview(payload).cast("B")
    return [mv[i : i + chunk_size] for i in range(0, mv.nbytes, chunk_size)]
