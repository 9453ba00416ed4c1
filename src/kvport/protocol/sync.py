"""Frame I/O adapters: they only fill buffers; every check is done by :mod:`kvport.protocol.frame`.

The blocking shell (:class:`FrameIO` over a :class:`Transport`); the asyncio shell is
:mod:`kvport.protocol.aio` (``AsyncFrames``), and both follow the same order of work::

    read 40 header bytes -> decode_header (caps checked) -> read meta_len bytes -> decode_meta
    -> payload: read_payload_into(caller views, one per chunk) | read_payload (bytes, small frames)

The sync reader reuses one header buffer and one meta buffer grown up to ``Limits.max_meta_bytes``.

Checksums overlap the I/O (hot path, measured by ``kvport bench transfer`` against a raw socket and
memcpy of the same bytes): xxhash releases the GIL, so a payload of several batches is hashed on a
small worker pool while the calling thread is inside the transport (``sendmsg``/``recv_into``, or
the shared-memory copy)::

    send:  hash(batch 0) | send(batch 0)   send(batch 1)   ...        every batch's trailers are
                         | hash(batch 1)   hash(batch 2)   ...        ready before it is written
    recv:  recv(batch 0)   recv(batch 1)   recv(batch 2)   ...  wait   every chunk verified before
                         | verify(0)       verify(1)       ...  all    read_payload_into returns

Only checksum jobs cross threads; payload bytes go straight between the caller's buffers and the
transport. A frame of one batch is hashed inline. The overlap pays only where a core is free: the
copies of a loopback transfer already keep two cores busy (sender and receiver), and on the 2-core
bench machine the workers measured slower than inline hashing (0.59-0.68 of the raw socket against
0.73-0.78), so it is on by default only with more than two CPUs (``FrameIO(overlap=...)`` overrides).
Inline, the batch is hashed right before it is sent: the hash brings it into cache for the copy.

A transport that maps the sender's memory (shared memory, see
:class:`~kvport.protocol.transport.DescribedPayloads`) is handed whole payloads instead: the sender
describes them, the receiver copies and verifies them in one native call. A producer that already
has the chunks' checksums passes them (``send(..., digests=...)``) and nothing is hashed at send.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import xxhash

from kvport import memops
from kvport.errors import ProtocolError
from kvport.protocol.frame import (
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
    encode_header,
    encode_meta,
    iter_chunks,
)
from kvport.protocol.transport import Buffer, DescribedPayloads, Transport

# Payload moved per syscall, hashed right before it is sent and verified right after it landed, while
# it is in cache (1 MiB: the bench machine's L2). Hashing first also fetches the batch for the kernel's
# copy: there xxh3 pulls RAM at ~24 GB/s and the socket copy at ~14, so hash + copy from cache cost
# little more than the raw socket's copy from RAM. Against the raw socket (256 MiB in whole-block
# frames, loopback, sizes interleaved in one run): 512 KiB 0.85-0.87, 1 MiB 0.87-0.91, 2 MiB 0.88-0.90.
BATCH_BYTES = 1 << 20
_HASH_WORKERS = 2
B = TypeVar("B", bound=Buffer)
OVERLAP_CHECKSUMS = (os.cpu_count() or 1) > 2

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _hash_pool() -> ThreadPoolExecutor:
    """The process's checksum workers, started on first use (never at import). A forked child
    has none of the parent's threads, so it starts its own."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_HASH_WORKERS, thread_name_prefix="kvport-xxh3")
            os.register_at_fork(after_in_child=_forget_pool)
        return _pool


def _forget_pool() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


def _trailers(chunks: Sequence[Buffer]) -> list[bytes]:
    return [CHECKSUM.pack(xxhash.xxh3_64_intdigest(c)) for c in chunks]


def _interleave(head: B | None, chunks: Sequence[B], trailers: Sequence[B]) -> list[B]:
    """``[head,] chunk 0, trailer 0, chunk 1, trailer 1, ...``: one batch's iovec list (list slices,
    no loop; ``chunks`` is not empty)."""
    skip = 0 if head is None else 1
    parts = [chunks[0]] * (2 * len(chunks) + skip)
    if head is not None:
        parts[0] = head
    parts[skip::2] = chunks
    parts[skip + 1 :: 2] = trailers
    return parts


def _bad_chunks(views: Sequence[memoryview], trailers: memoryview, first: int) -> list[int]:
    """Indexes (``first`` + i) of the chunks whose xxh3-64 differs from their trailer."""
    want = struct.unpack_from(f"<{len(views)}Q", trailers, first * CHECKSUM_BYTES)
    digest = xxhash.xxh3_64_intdigest
    return [first + i for i, (v, w) in enumerate(zip(views, want, strict=True)) if digest(v) != w]


def _report_verified(on_verified: Callable[[int, int], None] | None, first: int, end: int) -> None:
    if on_verified is not None and end > first:
        on_verified(first, end)


class FrameIO:
    """Reads and writes frames on one transport (one reader thread, one writer thread at most)."""

    def __init__(self, transport: Transport, limits: Limits = DEFAULT_LIMITS, batch_bytes: int | None = None,
                 overlap: bool | None = None) -> None:
        self.t = transport
        self.limits = limits
        self.batch_bytes = BATCH_BYTES if batch_bytes is None else batch_bytes
        self.overlap = OVERLAP_CHECKSUMS if overlap is None else overlap
        self._hdr = bytearray(HEADER_BYTES)
        self._meta = bytearray(4096)
        self._trailers = bytearray(CHECKSUM_BYTES * 1024)
        self._described = transport if isinstance(transport, DescribedPayloads) else None

    # ------------------------------------------------------------------ write
    def send(self, msg_type: MsgType, meta: dict[str, Any] | None = None, chunks: Sequence[Buffer] = (),
             chunk_size: int | None = None, flags: Flags = Flags.NONE, corr_id: int = 0,
             digests: bytes | None = None) -> int:
        """Write one frame; the payload goes out in ~batch_bytes pieces. Batch k+1 is hashed by a
        worker while batch k is in the transport; a single-batch payload is hashed inline.

        ``digests``: the chunks' checksums (u64 LE xxh3-64, 8 bytes a chunk) when the producer already
        computed them (when it wrote the chunks, still in cache); they go on the wire as they are, so a
        wrong one makes the receiver refuse that chunk, never accept wrong bytes."""
        n = len(chunks)
        if digests is not None and len(digests) != CHECKSUM_BYTES * n:
            raise ProtocolError(f"{n} chunks but {len(digests)} digest bytes")
        sizes = [c.nbytes if type(c) is memoryview else len(c) for c in chunks]
        payload_len = sum(sizes)
        cs = 0 if not payload_len else (chunk_size if chunk_size is not None else sizes[0])
        if n and sizes.count(cs) + (0 < sizes[-1] < cs) != n:  # every chunk cs bytes, the last may be shorter
            i = next(i for i, z in enumerate(sizes) if z != cs and not (i == n - 1 and 0 < z < cs))
            raise ProtocolError(f"chunk {i} has {sizes[i]} bytes; chunks are {cs} bytes (last may be shorter)")
        per = max(1, -(-self.batch_bytes // cs)) if cs else 1  # chunks per batch
        head = encode_header(msg_type, encode_meta(meta or {}), payload_len, cs, flags, corr_id)
        described = self._described
        plan = described.describe(chunks, cs) if described is not None and payload_len else None
        if described is not None and plan is not None:  # the peer maps these chunks: one message for all
            described.send_described(head, plan, digests if digests is not None else memops.xxh3_many(chunks))
            return payload_len
        if not payload_len:  # no chunk carries a byte: no payload, no checksums
            self.t.send([head])
            return payload_len
        starts = range(0, n, per)
        if digests is not None:
            known = memoryview(digests)
            trailers: Sequence[Buffer] = [known[i : i + CHECKSUM_BYTES] for i in range(0, len(known), CHECKSUM_BYTES)]
            for a in starts:
                self.t.send(_interleave(head if a == 0 else None, chunks[a : a + per], trailers[a : a + per]))
            return payload_len
        if len(starts) == 1 or not self.overlap:  # inline: hash a batch, then send it while it is in cache
            for a in starts:
                batch = chunks[a : a + per]
                self.t.send(_interleave(head if a == 0 else None, batch, _trailers(batch)))
            return payload_len
        pool = _hash_pool()
        futs = [pool.submit(_trailers, chunks[a : a + per]) for a in starts]
        try:
            for a, fut in zip(starts, futs, strict=True):
                self.t.send(_interleave(head if a == 0 else None, chunks[a : a + per], fut.result()))
        except BaseException:
            for fut in futs:  # no worker reads the caller's buffers once send() has returned
                if not fut.cancel():
                    fut.exception()
            raise
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

    def read_payload_into(self, hdr: FrameHeader, views: Sequence[memoryview],
                          on_verified: Callable[[int, int], None] | None = None) -> list[int]:
        """Receive chunk i straight into ``views[i]`` (exactly chunk_len(i) bytes each), then verify.

        Batch k is verified by a worker while batch k+1 is received; returns (after every check
        finished) the indexes of chunks that failed their checksum (the caller must not link them).

        ``on_verified(first, end)``, if given, is called in chunk order for each run of chunks
        ``[first, end)`` that passed its checksum, as soon as it has (inline: right after that
        batch's recv, while its bytes are still in cache), so a consumer can use them while the
        rest arrives. After a failed chunk it is not called again. An exception it raises
        propagates once the payload is off the wire or the stream is broken (nothing is left
        half-read silently).
        """
        n = hdr.n_chunks
        if len(views) != n:
            raise ProtocolError(f"frame has {n} chunks, caller gave {len(views)} buffers")
        need = n * CHECKSUM_BYTES
        if need > len(self._trailers):
            self._trailers = bytearray(need)
        tr = memoryview(self._trailers)
        cs, last = hdr.chunk_size, n - 1
        last_len = hdr.payload_len - last * cs if n else 0
        sizes = [v.nbytes for v in views]
        if n and (sizes.count(cs) - (last_len == cs) != last or sizes[-1] != last_len):
            i = next(i for i, z in enumerate(sizes) if z != (cs if i < last else last_len))
            raise ProtocolError(f"chunk {i}: buffer of {sizes[i]} bytes for {cs if i < last else last_len}")
        if self._described is not None and n:
            described = self._described.recv_described_into(views, tr, cs, hdr.payload_len)
            if described is not None:
                bad_set = sorted(described)
                _report_verified(on_verified, 0, bad_set[0] if bad_set else n)
                return bad_set
        per = max(1, -(-self.batch_bytes // cs)) if cs else 1  # chunks per batch
        trs = [tr[i : i + CHECKSUM_BYTES] for i in range(0, need, CHECKSUM_BYTES)]
        futs: list[tuple[int, int, Future[list[int]]]] = []
        bad: list[int] = []
        fail: list[Exception] = []  # from on_verified: raised once the payload is read

        def checked(lo: int, hi: int, failed: list[int]) -> None:
            """Record batch [lo, hi)'s bad chunks; report its good run, unless an earlier batch
            failed or the consumer already raised."""
            if not bad and not fail:
                try:
                    _report_verified(on_verified, lo, failed[0] if failed else hi)
                except Exception as exc:
                    fail.append(exc)
            bad.extend(failed)

        try:
            for first in range(0, n, per):
                end = min(n, first + per)
                batch = views[first:end]
                self.t.recv_into(_interleave(None, batch, trs[first:end]))
                if not self.overlap or (end == n and not futs):
                    checked(first, end, _bad_chunks(batch, tr, first))  # inline, still in cache
                else:
                    futs.append((first, end, _hash_pool().submit(_bad_chunks, batch, tr, first)))
        except BaseException:
            for _, _, fut in futs:  # never raise while a worker still reads the caller's buffers
                if not fut.cancel():
                    fut.exception()
            raise
        for lo, hi, fut in futs:  # every chunk is verified before the caller may link anything
            checked(lo, hi, fut.result())
        if fail:
            raise fail[0]
        return sorted(bad)

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
