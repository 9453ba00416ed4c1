"""Asyncio byte streams and frame I/O for the server; every check is :mod:`kvport.protocol.frame`'s.

Two streams with one interface (``recv_into(views)``, ``send(parts)``, ``close()``):

- :class:`SockStream`: a plain non-blocking socket. Receives go straight into caller views with
  ``loop.sock_recv_into`` and sends are ``socket.sendmsg`` of memoryviews, waiting for writability
  only when the kernel buffer is full: no copy in Python on either side (the asyncio transport of
  Python 3.11 copies every unsent remainder into a bytearray, which is why it is not used here).
- :class:`TlsStream`: asyncio streams over ``ssl`` (optional, not the hot path: one copy per read).

Bulk I/O threads (``SockStream(io=BulkIO(n))``, like Redis's ``io-threads``): a payload of at
least :data:`OFFLOAD_BYTES` is received (and verified, group by group while in cache) or sent by a
worker thread, on the same socket, while the event loop goes on parsing and answering the other
connections. The copies into and out of the kernel release the GIL, so on a machine where the
clients share the cores a single loop thread is no longer the one thing every byte waits for. The
loop awaits the worker; a cancellation (frame deadline, shutdown) tells the worker to stop at its
next poll (within :data:`_POLL_S`) and is raised only once the worker has let go of the socket and
the buffers.

:class:`AsyncFrames` reads a frame in the order of :class:`kvport.protocol.sync.FrameIO`::

    40 header bytes -> decode_header (caps) -> meta_len bytes -> decode_meta -> payload into views

and the caller decides, between the head and the payload, whether to take, skip or refuse it.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from kvport.errors import ChecksumError, PeerError, ProtocolError
from kvport.protocol.errors import error_meta
from kvport.protocol.frame import (
    CHECKSUM_BYTES,
    HEADER_BYTES,
    Flags,
    FrameHeader,
    Limits,
    MsgType,
    decode_header,
    decode_meta,
    encode_frame,
    encode_header,
    encode_meta,
    verify_chunk,
)
from kvport.protocol.transport import Buffer, advance, as_byte_views

_IOV_MAX = 512
VERIFY_GROUP_BYTES = 512 << 10  # payload received per verify step: still in L2 when hashed
OFFLOAD_BYTES = 256 << 10  # payloads from this size go to a bulk I/O thread (when the stream has them)
_POLL_S = 0.05  # a bulk worker waiting on the socket checks for cancellation this often
T = TypeVar("T")
_Step = Callable[[socket.socket, list[memoryview], int, str], int | None]  # one non-blocking recv or send


class BulkIO:
    """The server's bulk I/O threads (one pool for every connection); ``threads=0``: none."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="kvport-io") if threads > 0 else None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


class BlockingSock:
    """The worker thread's side of a :class:`SockStream`: the same non-blocking socket, waited on
    with ``poll`` in short steps so that a cancellation from the loop is seen."""

    def __init__(self, sock: socket.socket, peer: str, cancel: threading.Event) -> None:
        self.sock, self.peer, self.cancel = sock, peer, cancel

    def _wait(self, events: int) -> None:
        p = select.poll()
        p.register(self.sock.fileno(), events)
        while not p.poll(int(_POLL_S * 1000)):
            if self.cancel.is_set():
                raise PeerError(f"{self.peer}: cancelled")
        if self.cancel.is_set():
            raise PeerError(f"{self.peer}: cancelled")

    def recv_into(self, views: Sequence[memoryview]) -> None:
        self._drive(_recv_step, as_byte_views(views), select.POLLIN)

    def send(self, parts: Sequence[Buffer]) -> None:
        self._drive(_send_step, as_byte_views(parts), select.POLLOUT)

    def _drive(self, step: _Step, vs: list[memoryview], events: int) -> None:
        i = 0
        while i < len(vs):
            j = step(self.sock, vs, i, self.peer)
            if j is None:
                self._wait(events)
            else:
                i = j


def _recv_step(sock: socket.socket, vs: list[memoryview], i: int, peer: str) -> int | None:
    """One non-blocking receive into ``vs[i:]`` (a scatter of up to 512 views): the index of the
    first unfilled view after it (the partial one sliced in place), or None if it would block."""
    try:
        n = sock.recv_into(vs[i]) if len(vs) - i == 1 else sock.recvmsg_into(vs[i : i + _IOV_MAX])[0]
    except (BlockingIOError, InterruptedError):
        return None
    except OSError as exc:
        raise PeerError(f"{peer}: receive failed: {exc}") from exc
    if n == 0:
        raise PeerError(f"{peer}: connection closed by peer")
    return advance(vs, i, n)


def _send_step(sock: socket.socket, views: list[memoryview], i: int, peer: str) -> int | None:
    """One non-blocking ``sendmsg`` of ``views[i:]``: the index after it, or None if it would block."""
    try:
        n = sock.sendmsg(views[i : i + _IOV_MAX])
    except (BlockingIOError, InterruptedError):
        return None
    except OSError as exc:
        raise PeerError(f"{peer}: send failed: {exc}") from exc
    return advance(views, i, n)


class AsyncStream(Protocol):
    peer: str

    async def recv_into(self, views: Sequence[memoryview]) -> None: ...

    async def send(self, parts: Sequence[Buffer]) -> None: ...

    def close(self) -> None: ...


class SockStream:
    def __init__(self, sock: socket.socket, peer: str, io: BulkIO | None = None) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.peer = peer
        self._loop = asyncio.get_running_loop()
        self._pool = io.pool if io is not None else None

    @property
    def offloads(self) -> bool:
        return self._pool is not None

    async def offload(self, fn: Callable[[BlockingSock], T]) -> T:
        """Run ``fn`` (blocking I/O on this socket) on a bulk I/O thread and await it; on
        cancellation, stop the worker and wait for it before re-raising."""
        if self._pool is None:
            raise ProtocolError("this stream has no bulk I/O threads")
        cancel = threading.Event()
        job = self._pool.submit(fn, BlockingSock(self.sock, self.peer, cancel))
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            cancel.set()
            if not job.cancel():  # running: it sees the flag at its next poll (<= _POLL_S) and
                futures.wait([job])  # lets go of the socket and the caller's buffers before we go on
            raise

    async def recv_into(self, views: Sequence[memoryview]) -> None:
        """Fill every view in order: one ``recvmsg_into`` scatters into up to 512 views per call,
        and the loop waits for readability only when the kernel buffer is empty."""
        await self._drive(_recv_step, as_byte_views(views), self._loop.add_reader, self._loop.remove_reader)

    async def send(self, parts: Sequence[Buffer]) -> None:
        views = as_byte_views(parts)
        if self._pool is not None and sum(v.nbytes for v in views) >= OFFLOAD_BYTES:
            await self.offload(lambda b: b.send(views))
            return
        await self._drive(_send_step, views, self._loop.add_writer, self._loop.remove_writer)

    async def _drive(self, step: _Step, vs: list[memoryview], add: Callable[..., Any],
                     remove: Callable[[int], bool]) -> None:
        i = 0
        while i < len(vs):
            j = step(self.sock, vs, i, self.peer)
            if j is None:
                await self._ready(add, remove)
            else:
                i = j

    async def _ready(self, add: Callable[..., Any], remove: Callable[[int], bool]) -> None:
        fut: asyncio.Future[None] = self._loop.create_future()
        fd = self.sock.fileno()
        if fd < 0:
            raise PeerError(f"{self.peer}: socket closed")

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        add(fd, ready)
        try:
            await fut
        finally:
            remove(fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class TlsStream:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        self.reader = reader
        self.writer = writer
        self.peer = peer

    async def recv_into(self, views: Sequence[memoryview]) -> None:
        for v in views:
            off = 0
            while off < v.nbytes:
                try:
                    data = await self.reader.read(min(v.nbytes - off, 1 << 20))
                except (ConnectionError, OSError) as exc:
                    raise PeerError(f"{self.peer}: receive failed: {exc}") from exc
                if not data:
                    raise PeerError(f"{self.peer}: connection closed by peer")
                v[off : off + len(data)] = data
                off += len(data)

    async def send(self, parts: Sequence[Buffer]) -> None:
        try:
            self.writer.writelines(parts)
            await self.writer.drain()
        except (ConnectionError, OSError) as exc:
            raise PeerError(f"{self.peer}: send failed: {exc}") from exc

    def close(self) -> None:
        self.writer.close()


def _groups(views: Sequence[memoryview], tr: memoryview) -> Iterator[tuple[list[memoryview], int, int]]:
    """The payload's receive steps: (scatter list, first chunk, end chunk) of about
    :data:`VERIFY_GROUP_BYTES` each (at least one chunk), chunk j followed by its checksum."""
    parts: list[memoryview] = []
    first = pending = 0
    last = len(views) - 1
    for i, v in enumerate(views):
        parts += (v, tr[i * CHECKSUM_BYTES : (i + 1) * CHECKSUM_BYTES])
        pending += v.nbytes
        if pending >= VERIFY_GROUP_BYTES or i == last:
            yield parts, first, i + 1
            parts, first, pending = [], i + 1, 0


def _verify(views: Sequence[memoryview], tr: memoryview, lo: int, hi: int, bad: int | None) -> int | None:
    """The first bad chunk so far: ``bad`` if already set, else the first of ``lo..hi-1`` that fails."""
    for j in range(lo, hi):
        if bad is not None:
            return bad
        try:
            verify_chunk(views[j], tr[j * CHECKSUM_BYTES : (j + 1) * CHECKSUM_BYTES], j)
        except ChecksumError:
            bad = j
    return bad


class AsyncFrames:
    """Frame reads/writes on one stream; one reader and one writer task at a time."""

    def __init__(self, stream: AsyncStream, limits: Limits) -> None:
        self.stream = stream
        self.limits = limits
        self._hdr = bytearray(HEADER_BYTES)
        self._meta = bytearray(4096)
        self._trailers = bytearray(CHECKSUM_BYTES * 64)

    async def wait_frame(self) -> None:
        """Wait for the first byte of the next frame (the idle wait; the rest has a deadline)."""
        await self.stream.recv_into([memoryview(self._hdr)[:1]])

    async def read_header(self) -> FrameHeader:
        """The rest of the header after :meth:`wait_frame`, cap-checked before anything is allocated."""
        await self.stream.recv_into([memoryview(self._hdr)[1:]])
        return decode_header(self._hdr, self.limits)

    async def read_chunks_into(self, hdr: FrameHeader, views: Sequence[memoryview]) -> int | None:
        """Receive chunk ``i`` into ``views[i]`` (each exactly ``chunk_len(i)``), verifying every chunk.

        Chunks arrive in groups of about :data:`VERIFY_GROUP_BYTES` (at least one chunk), each group
        verified right after it landed, while it is still in cache (a value of 32 MiB verified after
        the whole of it arrived costs a second pass over memory). Reads the whole payload even past a
        bad chunk (the stream stays in sync) and returns the index of the first chunk that failed its
        checksum, or None."""
        n = hdr.n_chunks
        if len(views) != n:
            raise ProtocolError(f"frame has {n} chunks, expected {len(views)}")
        for i, v in enumerate(views):
            if v.nbytes != hdr.chunk_len(i):
                raise ProtocolError(f"chunk {i} has {hdr.chunk_len(i)} bytes, expected {v.nbytes}")
        need = n * CHECKSUM_BYTES
        if need > len(self._trailers):
            self._trailers = bytearray(need)  # n_chunks is capped by the wire limits
        tr = memoryview(self._trailers)
        stream = self.stream
        if isinstance(stream, SockStream) and stream.offloads and hdr.payload_len >= OFFLOAD_BYTES:
            def work(b: BlockingSock) -> int | None:
                bad: int | None = None
                for parts, lo, hi in _groups(views, tr):
                    b.recv_into(parts)
                    bad = _verify(views, tr, lo, hi, bad)
                return bad

            return await stream.offload(work)
        bad: int | None = None
        for parts, lo, hi in _groups(views, tr):
            await stream.recv_into(parts)  # scatter: chunk j -> views[j], checksum j -> trailers
            bad = _verify(views, tr, lo, hi, bad)
        return bad

    async def read_meta(self, hdr: FrameHeader) -> dict[str, Any]:
        if hdr.meta_len > len(self._meta):
            self._meta = bytearray(hdr.meta_len)  # capped by decode_header
        mv = memoryview(self._meta)[: hdr.meta_len]
        if hdr.meta_len:
            await self.stream.recv_into([mv])
        return decode_meta(hdr, mv)

    async def read_payload_into(self, hdr: FrameHeader, dst: memoryview) -> int | None:
        """Receive the payload contiguously into ``dst[:payload_len]``; see :meth:`read_chunks_into`."""
        if dst.nbytes < hdr.payload_len:
            raise ProtocolError(f"payload of {hdr.payload_len} bytes for a {dst.nbytes}-byte buffer")
        views = [dst[i * hdr.chunk_size : i * hdr.chunk_size + hdr.chunk_len(i)] for i in range(hdr.n_chunks)]
        return await self.read_chunks_into(hdr, views)

    async def skip_payload(self, hdr: FrameHeader, scratch: memoryview) -> None:
        left = hdr.wire_payload_bytes
        while left:
            n = min(left, scratch.nbytes)
            await self.stream.recv_into([scratch[:n]])
            left -= n

    async def send(self, msg_type: MsgType, meta: dict[str, Any] | None = None, chunks: Sequence[Buffer] = (),
                   chunk_size: int | None = None, flags: Flags = Flags.NONE, corr_id: int = 0) -> None:
        await self.stream.send(encode_frame(msg_type, meta, chunks, chunk_size, flags, corr_id))

    def checksums(self, n_chunks: int) -> bytes:
        """The checksum trailers of the payload just read by :meth:`read_chunks_into` (kept with
        the value, so a GET resends them instead of hashing the value again)."""
        return bytes(self._trailers[: n_chunks * CHECKSUM_BYTES])

    async def send_checksummed(self, msg_type: MsgType, meta: dict[str, Any], chunks: Sequence[memoryview],
                               checksums: bytes, chunk_size: int, flags: Flags, corr_id: int) -> None:
        """A frame whose chunk checksums are already known (the ones verified when the value came in)."""
        if len(checksums) != len(chunks) * CHECKSUM_BYTES:
            raise ProtocolError(f"{len(chunks)} chunks but {len(checksums)} checksum bytes")
        payload_len = sum(c.nbytes for c in chunks)
        parts: list[Buffer] = [encode_header(msg_type, encode_meta(meta), payload_len, chunk_size, flags, corr_id)]
        cs = memoryview(checksums)
        for i, c in enumerate(chunks):
            parts += (c, cs[i * CHECKSUM_BYTES : (i + 1) * CHECKSUM_BYTES])
        await self.stream.send(parts)

    async def send_error(self, msg_type: MsgType, exc: BaseException, corr_id: int) -> None:
        await self.send(msg_type, error_meta(exc), flags=Flags.RESPONSE | Flags.ERROR, corr_id=corr_id)

