"""Frame I/O adapters: they only fill buffers; every check is done by :mod:`kvport.transfer.wire`.

Sync (:class:`FrameIO` over a :class:`Transport`) and asyncio (:func:`read_frame_async`,
:func:`write_frame_async` over ``StreamReader``/``StreamWriter``) share the same order of work::

    read 40 header bytes -> decode_header (caps checked) -> read meta_len bytes -> decode_meta
    -> payload: read_payload_into(caller views, one per chunk) | read_payload (bytes, small frames)

The sync reader reuses one header buffer and one meta buffer grown up to ``Limits.max_meta_bytes``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import xxhash

from kvport.errors import ChecksumError, PeerError, ProtocolError
from kvport.transfer.transport import Buffer, Transport
from kvport.transfer.wire import (
    CHECKSUM,
    CHECKSUM_BYTES,
    DEFAULT_LIMITS,
    HEADER_BYTES,
    Flags,
    Frame,
    FrameHeader,
    Limits,
    MsgType,
    decode_header,
    decode_meta,
    encode_frame,
    encode_header,
    encode_meta,
    iter_chunks,
    verify_chunk,
)

BATCH_BYTES = 512 << 10  # payload moved per syscall: hashed/verified while it is still in cache


class FrameIO:
    """Reads and writes frames on one transport (one reader thread, one writer thread at most)."""

    def __init__(self, transport: Transport, limits: Limits = DEFAULT_LIMITS, batch_bytes: int | None = None) -> None:
        self.t = transport
        self.limits = limits
        self.batch_bytes = BATCH_BYTES if batch_bytes is None else batch_bytes
        self._hdr = bytearray(HEADER_BYTES)
        self._meta = bytearray(4096)
        self._trailers = bytearray(CHECKSUM_BYTES * 1024)

    # ------------------------------------------------------------------ write
    def send(self, msg_type: MsgType, meta: dict[str, Any] | None = None, chunks: Sequence[Buffer] = (),
             chunk_size: int | None = None, flags: Flags = Flags.NONE, corr_id: int = 0) -> int:
        """Write one frame; the payload goes out in ~BATCH_BYTES pieces, each hashed just before the
        kernel copies it (the bytes are read from DRAM once, then from cache)."""
        sizes = [c.nbytes if isinstance(c, memoryview) else len(c) for c in chunks]
        payload_len = sum(sizes)
        cs = 0 if not payload_len else (chunk_size if chunk_size is not None else sizes[0])
        parts: list[Buffer] = [encode_header(msg_type, encode_meta(meta or {}), payload_len, cs, flags, corr_id)]
        pending = 0
        last = len(chunks) - 1
        for i, c in enumerate(chunks):
            if sizes[i] != cs and not (i == last and 0 < sizes[i] < cs):
                raise ProtocolError(f"chunk {i} has {sizes[i]} bytes; chunks are {cs} bytes (last may be shorter)")
            parts.append(c)
            parts.append(CHECKSUM.pack(xxhash.xxh3_64_intdigest(c)))
            pending += sizes[i]
            if pending >= self.batch_bytes:
                self.t.send(parts)
                parts, pending = [], 0
        if parts:
            self.t.send(parts)
        return payload_len

    # ------------------------------------------------------------------ read
    def read_head(self) -> tuple[FrameHeader, dict[str, Any]]:
        """Header and metadata of the next frame; its payload must then be read or skipped."""
        self.t.recv_into([memoryview(self._hdr)])
        hdr = decode_header(self._hdr, self.limits)
        if hdr.meta_len > len(self._meta):
            self._meta = bytearray(hdr.meta_len)  # capped by decode_header
        meta_mv = memoryview(self._meta)[: hdr.meta_len]
        if hdr.meta_len:
            self.t.recv_into([meta_mv])
        return hdr, decode_meta(hdr, meta_mv)

    def read_payload_into(self, hdr: FrameHeader, views: Sequence[memoryview]) -> list[int]:
        """Receive chunk i straight into ``views[i]`` (exactly chunk_len(i) bytes each), then verify.

        Returns the indexes of chunks that failed their checksum (the caller must not link them).
        """
        if len(views) != hdr.n_chunks:
            raise ProtocolError(f"frame has {hdr.n_chunks} chunks, caller gave {len(views)} buffers")
        need = hdr.n_chunks * CHECKSUM_BYTES
        if need > len(self._trailers):
            self._trailers = bytearray(need)
        tr = memoryview(self._trailers)
        bad: list[int] = []
        parts: list[memoryview] = []
        first = pending = 0
        for i, v in enumerate(views):
            if v.nbytes != hdr.chunk_len(i):
                raise ProtocolError(f"chunk {i}: buffer of {v.nbytes} bytes for {hdr.chunk_len(i)}")
            parts.append(v)
            parts.append(tr[i * CHECKSUM_BYTES : (i + 1) * CHECKSUM_BYTES])
            pending += v.nbytes
            if pending >= self.batch_bytes or i == len(views) - 1:  # receive a batch, verify it while in cache
                self.t.recv_into(parts)
                for j in range(first, i + 1):
                    try:
                        verify_chunk(views[j], tr[j * CHECKSUM_BYTES : (j + 1) * CHECKSUM_BYTES], j)
                    except ChecksumError:
                        bad.append(j)
                parts, first, pending = [], i + 1, 0
        return bad

    def read_payload(self, hdr: FrameHeader) -> bytes:
        """The verified payload as bytes (small frames: control, server values)."""
        if not hdr.payload_len:
            return b""
        buf = bytearray(hdr.wire_payload_bytes)  # capped by decode_header
        self.t.recv_into([memoryview(buf)])
        return b"".join(bytes(c) for c in iter_chunks(hdr, buf))

    def skip_payload(self, hdr: FrameHeader, scratch: memoryview) -> None:
        """Drain a payload we will not keep, through ``scratch`` (no allocation)."""
        left = hdr.wire_payload_bytes
        while left:
            n = min(left, scratch.nbytes)
            self.t.recv_into([scratch[:n]])
            left -= n

    def read_frame(self) -> Frame:
        hdr, meta = self.read_head()
        return Frame(hdr, meta, self.read_payload(hdr))

    def expect(self, *types: MsgType) -> Frame:
        f = self.read_frame()
        if f.msg_type not in types:
            raise ProtocolError(f"expected {', '.join(t.name for t in types)}, got {f.msg_type.name}")
        return f


# ---------------------------------------------------------------------- asyncio
async def read_frame_async(reader: asyncio.StreamReader, limits: Limits = DEFAULT_LIMITS) -> Frame:
    """One whole frame from an asyncio stream (payload read as bytes; lengths capped first)."""
    try:
        head = await reader.readexactly(HEADER_BYTES)
        hdr = decode_header(head, limits)
        meta = decode_meta(hdr, await reader.readexactly(hdr.meta_len) if hdr.meta_len else b"")
        if not hdr.payload_len:
            return Frame(hdr, meta, b"")
        wire = await reader.readexactly(hdr.wire_payload_bytes)
    except asyncio.IncompleteReadError as exc:
        raise PeerError(f"connection closed mid-frame ({len(exc.partial)} bytes of a part)") from exc
    except (ConnectionError, OSError) as exc:
        raise PeerError(f"receive failed: {exc}") from exc
    return Frame(hdr, meta, b"".join(bytes(c) for c in iter_chunks(hdr, wire)))


async def write_frame_async(writer: asyncio.StreamWriter, msg_type: MsgType, meta: dict[str, Any] | None = None,
                            chunks: Sequence[Buffer] = (), chunk_size: int | None = None,
                            flags: Flags = Flags.NONE, corr_id: int = 0) -> None:
    parts = encode_frame(msg_type, meta, chunks, chunk_size, flags, corr_id)
    try:
        writer.writelines(parts)
        await writer.drain()
    except (ConnectionError, OSError) as exc:
        raise PeerError(f"send failed: {exc}") from exc
