"""Asyncio byte streams and frame I/O for the server; every check is :mod:`kvport.protocol.frame`'s.

Two streams with one interface (``start()``, ``recv_into(views)``, ``send(parts)``, ``close()``,
``stalled``):

- :class:`SockStream`: a plain non-blocking socket. Receives go straight into caller views with
  ``recvmsg_into`` and sends are ``socket.sendmsg`` of memoryviews, waiting for readiness on the
  loop's selector only when the kernel buffer is empty (full): no copy in Python on either side (the
  asyncio transport of Python 3.11 copies every unsent remainder into a bytearray, which is why it
  is not used here).
- :class:`TlsStream`: asyncio streams over ``ssl`` on an accepted socket (optional, not the hot
  path: one copy per read). Its :meth:`TlsStream.start` runs the TLS handshake, so a server counts
  the connection from ``accept`` and puts the TLS handshake under its login deadline.

Write deadline: a send that makes no progress (the socket never takes another byte) for
``send_stall_s`` raises :class:`PeerError` and sets ``stalled``; the caller closes the connection.

Bulk I/O threads (``SockStream(io=BulkIO(n))``, like Redis's ``io-threads``): a payload of at
least :data:`OFFLOAD_BYTES` is received (and verified, group by group while in cache) or sent by a
worker thread, on the same socket, while the event loop goes on parsing and answering the other
connections. The copies into and out of the kernel release the GIL, so on a machine where the
clients share the cores a single loop thread is no longer the one thing every byte waits for.
The threads are shared fairly: a job holds a thread only while its socket moves bytes::

    loop: submit job ------------> worker: move bytes while the socket takes (gives) them
      ^                              | would block for longer than _GRACE_S, or
      |                              | held _SLICE_S while other jobs wait
      +-- readiness (selector; <-----+ hand the job back (its position kept)
          the write deadline runs)

so a peer that stops reading (or sending) holds no thread: it waits on the selector like any idle
socket, and its send is cut at the write deadline. The loop awaits each turn; a cancellation
(frame deadline, shutdown) tells the worker to stop at its next step (within :data:`_GRACE_S`) and
is raised only once the worker has let go of the socket and the buffers.

:class:`AsyncFrames` reads a frame in the order of :class:`kvport.protocol.sync.FrameIO`::

    40 header bytes -> decode_header (caps) -> meta_len bytes -> decode_meta -> payload into views

and the caller decides, between the head and the payload, whether to take, skip or refuse it.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
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
_GRACE_S = 0.005  # a worker waits this long on a socket that would block, then hands the job back
_SLICE_S = 0.05  # a job that held a worker this long goes to the back of the queue when others wait
_TLS_PIECE = 1 << 20  # a TLS send is written and drained in pieces of this size
T = TypeVar("T")
_Step = Callable[[socket.socket, list[memoryview], int, str], int | None]  # one non-blocking recv or send


class BulkIO:
    """The server's bulk I/O threads ("kvport-io-N"), one FIFO queue for every connection;
    ``threads=0``: none. Jobs take turns (:class:`_Transfer`): see the module docstring."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._q: queue.SimpleQueue[tuple[futures.Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._workers = [threading.Thread(target=self._work, name=f"kvport-io-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._workers:
            t.start()

    def submit(self, fn: Callable[[], T]) -> futures.Future[T]:
        fut: futures.Future[T] = futures.Future()
        self._q.put((fut, fn))
        return fut

    def waiting(self) -> int:
        """Jobs queued for a thread now."""
        return self._q.qsize()

    def _work(self) -> None:
        while (item := self._q.get()) is not None:
            fut, fn = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the awaiting loop
                fut.set_exception(exc)

    def close(self) -> None:
        for _ in self._workers:
            self._q.put(None)
        for t in self._workers:
            t.join()
        self._workers = []


class _Transfer:
    """A payload moved by bulk I/O threads in turns: ``segments`` of views filled (``POLLIN``) or
    drained (``POLLOUT``) in order, ``after(lo, hi)`` called once a segment is complete (a receive
    verifies its chunks ``lo..hi-1`` there). The position survives between turns."""

    def __init__(self, sock: socket.socket, peer: str, step: _Step, events: int,
                 segments: list[tuple[list[memoryview], int, int]],
                 after: Callable[[int, int], None] | None, io: BulkIO) -> None:
        self.sock, self.peer, self.step, self.events = sock, peer, step, events
        self.segments, self.after, self.io = segments, after, io
        self.seg = self.i = 0
        self.blocked = False  # the last turn ended because the socket would block
        self.cancel = threading.Event()

    @property
    def done(self) -> bool:
        return self.seg >= len(self.segments)

    def turn(self) -> bool:
        """On a worker: move bytes until done (True) or until the job must hand its thread back
        (False; ``blocked`` says whether to wait for readiness first)."""
        start = time.monotonic()
        self.blocked = False
        while self.seg < len(self.segments):
            vs, lo, hi = self.segments[self.seg]
            while self.i < len(vs):
                if self.cancel.is_set():
                    raise PeerError(f"{self.peer}: cancelled")
                j = self.step(self.sock, vs, self.i, self.peer)
                if j is None:
                    if not self._ready_within(_GRACE_S):
                        self.blocked = True
                        return False
                    continue
                self.i = j
                if time.monotonic() - start > _SLICE_S and self.io.waiting():
                    return False
            if self.after is not None:
                self.after(lo, hi)
            self.seg, self.i = self.seg + 1, 0
        return True

    def _ready_within(self, seconds: float) -> bool:
        p = select.poll()
        p.register(self.sock.fileno(), self.events)
        return bool(p.poll(max(1, int(seconds * 1000))))


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
    stalled: bool  # a send was cut at the write deadline

    async def start(self) -> None: ...

    async def recv_into(self, views: Sequence[memoryview]) -> None: ...

    async def send(self, parts: Sequence[Buffer]) -> None: ...

    def close(self) -> None: ...


class SockStream:
    def __init__(self, sock: socket.socket, peer: str, io: BulkIO | None = None,
                 send_stall_s: float | None = None) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.peer = peer
        self.send_stall_s = send_stall_s
        self.stalled = False
        self._loop = asyncio.get_running_loop()
        self._io = io if io is not None and io.threads > 0 else None

    @property
    def offloads(self) -> bool:
        return self._io is not None

    async def start(self) -> None:
        """Nothing to set up on a plain socket."""

    async def move(self, segments: list[tuple[list[memoryview], int, int]], send: bool,
                   after: Callable[[int, int], None] | None = None) -> None:
        """Receive into (or send) ``segments`` on the bulk I/O threads, turn by turn (see the module
        docstring); on cancellation, stop the worker and wait for it before re-raising."""
        if self._io is None:
            raise ProtocolError("this stream has no bulk I/O threads")
        step, events = (_send_step, select.POLLOUT) if send else (_recv_step, select.POLLIN)
        job = _Transfer(self.sock, self.peer, step, events, segments, after, self._io)
        add, remove = (self._loop.add_writer, self._loop.remove_writer) if send else \
            (self._loop.add_reader, self._loop.remove_reader)
        while not job.done:
            fut = self._io.submit(job.turn)
            try:
                await asyncio.wrap_future(fut)
            except asyncio.CancelledError:
                job.cancel.set()
                if not fut.cancel():  # running: it sees the flag at its next step (<= _GRACE_S) and
                    futures.wait([fut])  # lets go of the socket and the caller's buffers before we go on
                raise
            if job.blocked:
                await self._ready(add, remove, self.send_stall_s if send else None)

    async def recv_into(self, views: Sequence[memoryview]) -> None:
        """Fill every view in order: one ``recvmsg_into`` scatters into up to 512 views per call,
        and the loop waits for readability only when the kernel buffer is empty."""
        await self._drive(_recv_step, as_byte_views(views), self._loop.add_reader, self._loop.remove_reader, None)

    async def send(self, parts: Sequence[Buffer]) -> None:
        views = as_byte_views(parts)
        if self._io is not None and sum(v.nbytes for v in views) >= OFFLOAD_BYTES:
            await self.move([(views, 0, 0)], send=True)
            return
        await self._drive(_send_step, views, self._loop.add_writer, self._loop.remove_writer, self.send_stall_s)

    async def _drive(self, step: _Step, vs: list[memoryview], add: Callable[..., Any],
                     remove: Callable[[int], bool], stall_s: float | None) -> None:
        i = 0
        while i < len(vs):
            j = step(self.sock, vs, i, self.peer)
            if j is None:
                await self._ready(add, remove, stall_s)
            else:
                i = j

    async def _ready(self, add: Callable[..., Any], remove: Callable[[int], bool], stall_s: float | None) -> None:
        """Wait for readiness on the selector; a send waits at most ``stall_s`` (the write deadline)."""
        fut: asyncio.Future[None] = self._loop.create_future()
        fd = self.sock.fileno()
        if fd < 0:
            raise PeerError(f"{self.peer}: socket closed")

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        add(fd, ready)
        try:
            if stall_s is None:
                await fut
                return
            try:
                async with asyncio.timeout(stall_s):
                    await fut
            except TimeoutError as exc:
                self.stalled = True
                raise PeerError(f"{self.peer}: the peer took no bytes for {stall_s} s (write deadline)") from exc
        finally:
            remove(fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class TlsStream:
    """asyncio streams over ``ssl`` on an accepted socket; :meth:`start` is the TLS handshake."""

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, peer: str, send_stall_s: float | None = None,
                 handshake_timeout_s: float = 60.0) -> None:
        self.sock = sock
        self.ctx = ctx
        self.peer = peer
        self.send_stall_s = send_stall_s
        self.handshake_timeout_s = handshake_timeout_s
        self.stalled = False
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def start(self) -> None:
        """The server side of the TLS handshake on the accepted socket (the caller's deadline holds)."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        protocol = asyncio.StreamReaderProtocol(reader)
        try:
            transport, _ = await loop.connect_accepted_socket(
                lambda: protocol, self.sock, ssl=self.ctx, ssl_handshake_timeout=self.handshake_timeout_s)
        except (OSError, ssl.SSLError) as exc:  # ConnectionError included
            raise PeerError(f"{self.peer}: TLS handshake failed: {exc}") from exc
        self._reader, self._writer = reader, asyncio.StreamWriter(transport, protocol, reader, loop)

    def _streams(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._reader is None or self._writer is None:
            raise PeerError(f"{self.peer}: TLS handshake not done")
        return self._reader, self._writer

    async def recv_into(self, views: Sequence[memoryview]) -> None:
        reader, _ = self._streams()
        for v in views:
            off = 0
            while off < v.nbytes:
                try:
                    data = await reader.read(min(v.nbytes - off, 1 << 20))
                except (ConnectionError, OSError) as exc:
                    raise PeerError(f"{self.peer}: receive failed: {exc}") from exc
                if not data:
                    raise PeerError(f"{self.peer}: connection closed by peer")
                v[off : off + len(data)] = data
                off += len(data)

    async def send(self, parts: Sequence[Buffer]) -> None:
        """Written in pieces (each encrypted right away: the transport keeps no view of ``parts``),
        drained after each within the write deadline."""
        _, writer = self._streams()
        try:
            for v in as_byte_views(parts):
                for off in range(0, v.nbytes, _TLS_PIECE):
                    writer.write(v[off : off + _TLS_PIECE])
                    try:
                        async with asyncio.timeout(self.send_stall_s):
                            await writer.drain()
                    except TimeoutError as exc:
                        self.stalled = True
                        raise PeerError(f"{self.peer}: the peer took no bytes for {self.send_stall_s} s "
                                        "(write deadline)") from exc
        except (ConnectionError, OSError) as exc:
            raise PeerError(f"{self.peer}: send failed: {exc}") from exc

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        else:
            with contextlib.suppress(OSError):
                self.sock.close()


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


class _Verifier:
    """Verifies chunks ``lo..hi-1`` once they have landed; ``bad``: the first that failed."""

    def __init__(self, views: Sequence[memoryview], tr: memoryview) -> None:
        self.views, self.tr = views, tr
        self.bad: int | None = None

    def __call__(self, lo: int, hi: int) -> None:
        self.bad = _verify(self.views, self.tr, lo, hi, self.bad)


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
            check = _Verifier(views, tr)
            await stream.move(list(_groups(views, tr)), send=False, after=check)
            return check.bad
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

