"""Shared-memory transport for two processes on one host: a byte ring per direction.

Each side creates its *outgoing* ring (``slot_bytes x n_slots`` bytes in /dev/shm), names it to the
peer over a connected control socket, maps the peer's ring, and unlinks its own once both are
mapped (so nothing leaks if a process dies). Bytes flow as a stream::

    sender:   copy parts at head % R -> FILLED(pos, n) (at the end of send(), or every R/4 bytes)
    receiver: copy from the ring into its own buffers -> FREED(consumed_total) every R/4 bytes and
              before it blocks, so the sender never waits on space the receiver already drained

Control messages are 16 bytes ``<BxHIQ`` (kind, region, nbytes, position) on the control socket;
FILLED/DESC/REG describe the sender's memory, FREED/MAPPED answer them. The sender never overwrites
bytes the receiver has not consumed; the receiver copies out, so the destination buffers are its own.

Registered memory (:meth:`ShmTransport.register`): a producer that writes its KV into a registered
buffer sends it as descriptors (DESC region/offset/nbytes); the receiver copies straight from there
into its own buffers -- one copy in all, like NIXL registered memory. Such buffers must stay
unchanged until the transfer is committed (``Sender.end`` returned). Parts under 64 KiB always go
through the ring. EOF or a timeout on the control socket is a PeerError.

Described payloads (:meth:`describe` / :meth:`send_described`, used by
:class:`~kvport.protocol.sync.FrameIO`): when every chunk of a frame lies in one registered
region, the whole payload travels as one PAYLOAD control message -- the chunks' offsets and their
checksums -- and the receiver copies and verifies all of them in one native call
(:func:`kvport.memops.copy_verify`: non-temporal stores, hashing exactly the bytes it wrote, on
``copy_threads`` threads, GIL released)::

    PAYLOAD  <BxHIQ (7, region, n_chunks, payload_len) | <Q chunk_size | n x <Q offset | n x <Q xxh3_64

To any other reader it is the same stream bytes as ``[chunk 0][checksum 0][chunk 1]...``.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import mmap
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvport import memops
from kvport.errors import PeerError
from kvport.protocol.transport import Buffer, as_byte_views

_CTRL = struct.Struct("<BxHIQ")  # kind, slot/region, nbytes, offset
_FILLED, _FREED, _DESC, _REG, _MAPPED, _PAYLOAD = 1, 2, 3, 5, 6, 7
_INLINE = 8  # (receiver only) stream bytes held in the queue item itself: an expanded PAYLOAD's checksums
_DATA = 9  # small stream bytes inside the control message itself (transports with inline_below > 0)
_MAX_PAYLOAD_CHUNKS = 1 << 20  # the wire's Limits.max_chunks: caps a PAYLOAD message at 16 MiB
_Q = struct.Struct("<Q")
_NAME_BYTES = 64
_DESC_MIN = 64 << 10  # smaller parts are copied through the ring
_HELLO = struct.Struct("<HII")  # name length, slot_bytes, n_slots


def _sendall(sock: socket.socket, data: bytes, what: str) -> None:
    try:
        sock.sendall(data)
    except TimeoutError as exc:
        raise PeerError(f"shm: {what} timed out") from exc
    except OSError as exc:
        raise PeerError(f"shm: {what} failed: {exc}") from exc


def _recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    out = bytearray()
    try:
        while len(out) < n:
            b = sock.recv(n - len(out))
            if not b:
                raise PeerError(f"shm: peer closed during {what}")
            out += b
    except TimeoutError as exc:
        raise PeerError(f"shm: {what} timed out") from exc
    except OSError as exc:
        raise PeerError(f"shm: {what} failed: {exc}") from exc
    return bytes(out)


class _Segment:
    """A POSIX shared-memory file (/dev/shm) mapped read-write; unlinked as soon as both sides map it
    (no resource-tracker bookkeeping, nothing left behind if a process dies)."""

    DIR = "/dev/shm"

    def __init__(self, name: str, fd: int, size: int) -> None:
        self.name, self.size = name, size
        try:
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.mv = memoryview(self.map)

    @classmethod
    def create(cls, size: int) -> _Segment:
        name = f"kvport-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            fd = os.open(os.path.join(cls.DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
        except OSError as exc:
            raise PeerError(f"shm: cannot create a {size}-byte ring: {exc}") from exc
        return cls(name, fd, size)

    @classmethod
    def attach(cls, name: str, size: int) -> _Segment:
        if not name.startswith("kvport-") or "/" in name or ".." in name:
            raise PeerError(f"shm: peer named an unexpected segment {name!r}")
        try:
            fd = os.open(os.path.join(cls.DIR, name), os.O_RDWR)
            if os.fstat(fd).st_size < size:
                os.close(fd)
                raise PeerError(f"shm: segment {name} is smaller than announced")
        except OSError as exc:
            raise PeerError(f"shm: cannot map the peer's ring {name!r}: {exc}") from exc
        return cls(name, fd, size)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.DIR, self.name))

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # views still held elsewhere keep the mapping alive
            self.mv.release()
            self.map.close()


@dataclass(frozen=True, slots=True)
class Described:
    """A frame payload out of one registered region: chunk ``i`` is ``chunk_len(i)`` bytes at
    ``offsets[i]``, its checksum ``digests[8i:8i+8]`` (what :meth:`ShmTransport.describe` plans
    and a PAYLOAD message carries)."""

    region: int
    chunk_size: int
    payload_len: int
    offsets: np.ndarray  # u64, one per chunk
    digests: bytes = b""

    @property
    def n_chunks(self) -> int:
        return int(self.offsets.size)

    def chunk_len(self, i: int) -> int:
        return min(self.chunk_size, self.payload_len - i * self.chunk_size)


_Item = tuple[int, int, int, int]  # (kind, region or blob id, position, nbytes) of the incoming stream


class ShmTransport:
    inline_below = 0  # a send of up to this many bytes travels inside a DATA control message (0: never)

    def __init__(self, ctrl: socket.socket, slot_bytes: int = 1 << 20, n_slots: int = 8,
                 timeout_s: float | None = 30.0, copy_threads: int | None = None) -> None:
        """``copy_threads``: threads the receiver copies a described payload with (default: up to
        two, one per CPU; the copy out of registered memory is bound by one core's memory streams)."""
        self.name = "shm"
        self.copy_threads = max(1, min(2, os.cpu_count() or 1)) if copy_threads is None else copy_threads
        self.ctrl = ctrl
        self.timeout_s = timeout_s
        ctrl.settimeout(timeout_s)
        self.slot_bytes, self.n_slots = slot_bytes, n_slots
        self._out: _Segment | None = None  # shared memory's rings (another transport's are its own)
        self._in: _Segment | None = None
        self._out_mv, self._in_mv, self.in_slot_bytes, in_slots = self._open_rings(ctrl, slot_bytes, n_slots)
        self.ring_bytes = slot_bytes * n_slots
        self.in_ring_bytes = self.in_slot_bytes * in_slots
        # sender: bytes written into my ring (head), published to the peer, freed by the peer
        self._head = self._published = self._freed = 0
        # receiver: incoming stream in order: (kind, region, position, nbytes); bytes consumed / acked
        self._ready: collections.deque[_Item | Described] = collections.deque()
        self._cur_in: _Item | None = None
        self._blobs: dict[int, bytes] = {}  # _INLINE items' bytes, by id (an expanded PAYLOAD's checksums)
        self._blob_ids = 0
        self.described_payloads = 0  # payloads received by the one-call copy + verify
        self._cur_in_off = 0
        self._consumed = self._acked = 0
        self._regions: list[tuple[int, int, _Segment]] = []  # my registered memory: (address, size, segment)
        self._peer_regions: dict[int, _Segment] = {}
        self._rbuf = bytearray()
        self._cv = threading.Condition()  # guards _pumping; notified after each batch of control messages
        self._pumping = False
        self.silent_waits = 0  # control-channel waits that timed out with nothing from the peer
        self._send_lock = threading.Lock()
        self._ctrl_wlock = threading.Lock()
        self._txq = bytearray()  # queued FILLED / DESC messages of the current send()
        self._peer_gone = False
        self._closed = False

    def _open_rings(self, ctrl: socket.socket, slot_bytes: int,
                    n_slots: int) -> tuple[memoryview, memoryview, int, int]:
        """(my outgoing ring, the incoming ring I read, its slot bytes, its slots): shared memory, each
        side's outgoing ring mapped by the other (:class:`kvport.transfer.nixl.NixlRingTransport`
        moves them by NIXL instead)."""
        out = self._out = _Segment.create(slot_bytes * n_slots)
        try:
            name = out.name.encode()
            _sendall(ctrl, _HELLO.pack(len(name), slot_bytes, n_slots) + name, "handshake")
            ln, in_slot_bytes, in_slots = _HELLO.unpack(_recv_exact(ctrl, _HELLO.size, "handshake"))
            if ln > _NAME_BYTES or not 0 < in_slot_bytes <= (1 << 30) or not 0 < in_slots <= 4096:
                raise PeerError("shm: peer announced an implausible ring")
            peer_name = _recv_exact(ctrl, ln, "handshake").decode("ascii", "replace")
            got = self._in = _Segment.attach(peer_name, in_slot_bytes * in_slots)
            _sendall(ctrl, b"A", "handshake")
            _recv_exact(ctrl, 1, "handshake")
        finally:
            out.unlink()  # both sides mapped it (or the handshake failed): nothing left to leak
        return out.mv, got.mv, in_slot_bytes, in_slots

    def _on_ctrl(self, kind: int, ident: int, nbytes: int, pos: int) -> bool:
        """A control message of a kind this transport adds (True: handled); shared memory adds none."""
        return False

    def _push(self, pos: int, n: int) -> None:
        """Make ring bytes ``[pos, pos + n)`` of my outgoing ring visible in the peer's incoming one,
        before they are announced (shared memory: they already are)."""

    def settimeout(self, timeout_s: float | None) -> None:
        """How long a wait on the peer (the control socket, ring space) may take from now on."""
        self.timeout_s = timeout_s
        self.ctrl.settimeout(timeout_s)

    # ------------------------------------------------------------------ registered memory
    def register(self, nbytes: int) -> memoryview:
        """A buffer the peer maps too: bytes sent *from* it travel as descriptors, and the receiver
        copies them straight into its own buffers (one copy in all, like NIXL registered memory).
        The producer writes its KV here; ``send`` returns once the peer has copied them out."""
        seg = _Segment.create(nbytes)
        rid = len(self._regions)
        self._regions.append((_address(seg.mv), nbytes, seg))
        name = seg.name.encode()
        self._ctrl_send(_CTRL.pack(_REG, rid, len(name), nbytes) + name.ljust(_NAME_BYTES, b"\0"), "register")
        return seg.mv

    def _region_of(self, v: memoryview) -> tuple[int, int] | None:
        if not self._regions or v.nbytes < _DESC_MIN:
            return None
        addr = _address(v)
        for rid, (base, size, _) in enumerate(self._regions):
            if base <= addr and addr + v.nbytes <= base + size:
                return rid, addr - base
        return None

    # ------------------------------------------------------------------ control
    def _pump(self, timeout: float | None) -> bool:
        """Read available control messages (waiting up to ``timeout``); True if any arrived.
        Only the thread that set ``_pumping`` calls this (see :meth:`_until`)."""
        if self._closed:
            raise PeerError("shm: transport closed")
        try:
            r, _, _ = select.select([self.ctrl], [], [], timeout)
            if not r:
                self.silent_waits += 1
                return False
            data = self.ctrl.recv(65536)
        except OSError as exc:
            raise PeerError(f"shm: control channel failed: {exc}") from exc
        if not data:
            raise PeerError("shm: peer closed the connection")
        self._rbuf += data
        off = 0
        while len(self._rbuf) - off >= _CTRL.size:
            kind, ident, nb, pos = _CTRL.unpack_from(self._rbuf, off)
            if kind == _REG:
                if len(self._rbuf) - off < _CTRL.size + _NAME_BYTES:
                    break
                raw = bytes(self._rbuf[off + _CTRL.size : off + _CTRL.size + min(nb, _NAME_BYTES)])
                self._on_reg(ident, raw.decode("ascii", "replace"), pos)
                off += _CTRL.size + _NAME_BYTES
                continue
            if kind == _DATA:
                if not 0 < nb <= self.inline_below:
                    raise PeerError(f"shm: DATA of {nb} bytes (1..{self.inline_below})")
                if len(self._rbuf) - off < _CTRL.size + nb:
                    break
                blob = self._blob_ids
                self._blob_ids += 1
                self._blobs[blob] = bytes(self._rbuf[off + _CTRL.size : off + _CTRL.size + nb])
                self._ready.append((_INLINE, blob, 0, nb))
                off += _CTRL.size + nb
                continue
            if kind == _PAYLOAD:
                need = _CTRL.size + 8 + 16 * nb
                if nb == 0 or nb > _MAX_PAYLOAD_CHUNKS:
                    raise PeerError(f"shm: PAYLOAD of {nb} chunks (1..{_MAX_PAYLOAD_CHUNKS})")
                if len(self._rbuf) - off < need:
                    break
                self._ready.append(self._on_payload(ident, nb, pos, off + _CTRL.size))
                off += need
                continue
            off += _CTRL.size
            if kind == _FILLED and nb > 0 and pos + nb <= self.in_ring_bytes:
                self._ready.append((_FILLED, 0, pos, nb))
            elif kind == _DESC and ident in self._peer_regions and pos + nb <= self._peer_regions[ident].size:
                self._ready.append((_DESC, ident, pos, nb))
            elif kind == _FREED and self._freed <= pos <= self._published:
                self._freed = pos  # cumulative bytes of my ring the peer consumed
            elif kind == _MAPPED and ident < len(self._regions):
                self._regions[ident][2].unlink()  # the peer mapped it: nothing left to leak
            elif self._on_ctrl(kind, ident, nb, pos):
                pass
            else:
                raise PeerError(f"shm: bad control message kind={kind} id={ident} n={nb} off={pos}")
        del self._rbuf[:off]
        return True

    def _on_payload(self, rid: int, n: int, payload_len: int, at: int) -> Described:
        """Check a PAYLOAD message against the region it names before anything is copied."""
        (cs,) = _Q.unpack_from(self._rbuf, at)
        seg = self._peer_regions.get(rid)
        if seg is None or cs == 0 or not (n - 1) * cs < payload_len <= n * cs:
            raise PeerError(f"shm: bad PAYLOAD region={rid} chunks={n} chunk_size={cs} payload={payload_len}")
        offsets = np.frombuffer(self._rbuf, dtype="<u8", count=n, offset=at + 8).copy()
        digests = bytes(self._rbuf[at + 8 + 8 * n : at + 8 + 16 * n])
        d = Described(rid, cs, payload_len, offsets, digests)
        if int(offsets[-1]) > seg.size - d.chunk_len(n - 1) or (n > 1 and int(offsets[:-1].max()) > seg.size - cs):
            raise PeerError(f"shm: PAYLOAD chunks outside region {rid} ({seg.size} bytes)")
        return d

    def _on_reg(self, rid: int, name: str, size: int) -> None:
        if rid in self._peer_regions or size > (1 << 40):
            raise PeerError(f"shm: bad region registration {rid} {name!r}")
        self._peer_regions[rid] = _Segment.attach(name, size)
        self._ctrl_send(_CTRL.pack(_MAPPED, rid, 0, 0), "register")

    def _until(self, ready: Callable[[], bool], timeout_s: float | None) -> bool:
        """Wait until ``ready()`` (True) or ``timeout_s`` passed (False).

        The sending thread (waiting for ring space) and the receiving thread (waiting for data) share
        one control socket. One of them at a time reads it (``_pumping``); the other sleeps on the
        condition, which the reader notifies after every batch of messages, so neither waits on
        progress the other has already seen (a lock held across ``select`` did exactly that: up to
        one select timeout per ring turn)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        looked = False  # even with no time left, look at the control socket once (a poll)
        while True:
            with self._cv:
                while True:
                    if ready():
                        return True
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    if left == 0.0 and (looked or self._pumping):
                        return False
                    if not self._pumping:
                        break
                    self._cv.wait(0.05 if left is None else min(0.05, left))
                self._pumping = True
                looked = True
            try:
                self._pump(0.05 if left is None else min(0.05, left))
            finally:
                with self._cv:
                    self._pumping = False
                    self._cv.notify_all()

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        if not self._until(ready, self.timeout_s):
            raise PeerError(f"shm: {what} timed out (peer stopped {'reading' if what == 'send' else 'sending'})")

    # ------------------------------------------------------------------ send
    def _publish(self) -> None:
        """Announce written, unannounced ring bytes (never wrapping within one message)."""
        while self._published < self._head:
            pos = self._published % self.ring_bytes
            n = min(self._head - self._published, self.ring_bytes - pos)
            self._push(pos, n)
            self._published += n  # before the message: the peer's FREED may be handled at once
            self._txq += _CTRL.pack(_FILLED, 0, n, pos)

    def send(self, parts: Sequence[Buffer]) -> None:
        """Copy parts into the ring (or describe registered ones); returns once all are announced.
        Registered buffers must stay unchanged until the transfer commits (the peer copies later)."""
        with self._send_lock:
            if self.inline_below:  # a small send (a frame head, a credit): inside one control message
                views = as_byte_views(parts)
                n = sum(v.nbytes for v in views)
                if 0 < n <= self.inline_below:
                    self._publish()
                    self._txq += _CTRL.pack(_DATA, 0, n, 0)
                    for v in views:
                        self._txq += v
                    self._flush()
                    return
            self._write(parts)
            self._publish()
            self._flush()

    def _write(self, parts: Sequence[Buffer]) -> None:
        """Copy ``parts`` into the ring (or describe registered ones); the caller holds the send lock,
        then publishes and flushes."""
        rb = self.ring_bytes
        for v in as_byte_views(parts):
            reg = self._region_of(v)
            if reg is not None:  # zero-copy: the peer copies straight from my registered memory
                self._publish()
                self._txq += _CTRL.pack(_DESC, reg[0], v.nbytes, reg[1])
                continue
            off = 0
            while off < v.nbytes:
                space = rb - (self._head - self._freed)
                if space == 0:
                    self._publish()
                    self._flush()
                    self._wait(lambda: self._head - self._freed < rb, "send")
                    continue
                pos = self._head % rb
                n = min(v.nbytes - off, space, rb - pos)
                self._out_mv[pos : pos + n] = v[off : off + n]
                off += n
                self._head += n
                if self._head - self._published >= rb // 4:
                    self._publish()
                    self._flush()

    def describe(self, chunks: Sequence[Buffer], chunk_size: int) -> Described | None:
        """The plan to send ``chunks`` as one PAYLOAD, when every one lies in a single registered
        region (else None: the frame goes through :meth:`send`)."""
        if not self._regions or not chunks or len(chunks) > _MAX_PAYLOAD_CHUNKS:
            return None
        try:
            addrs, lens = memops.spans(chunks)
        except (TypeError, BufferError, ValueError):  # not contiguous buffers: plain stream bytes
            return None
        lo, hi = int(addrs.min()), int((addrs + lens).max())
        for rid, (base, size, _) in enumerate(self._regions):
            if base <= lo and hi <= base + size:
                return Described(rid, chunk_size, int(lens.sum()), addrs - np.uint64(base))
        return None

    def send_described(self, head: Buffer, plan: Described, digests: bytes) -> None:
        """``head`` through the ring, then the payload as one PAYLOAD message (offsets + checksums);
        the receiver copies the chunks out of the registered region (which must stay unchanged until
        the transfer commits)."""
        if len(digests) != 8 * plan.n_chunks:
            raise PeerError(f"shm: {plan.n_chunks} chunks but {len(digests)} checksum bytes")
        with self._send_lock:
            self._write([head])
            self._publish()
            self._txq += _CTRL.pack(_PAYLOAD, plan.region, plan.n_chunks, plan.payload_len)
            self._txq += _Q.pack(plan.chunk_size)
            self._txq += plan.offsets.astype("<u8", copy=False).tobytes()
            self._txq += digests
            self._flush()

    def _flush(self) -> None:
        """One write for every queued FILLED / DESC message, in stream order."""
        if self._txq:
            self._ctrl_send(bytes(self._txq), "send")
            self._txq.clear()

    def _ctrl_send(self, data: bytes, what: str) -> None:
        with self._ctrl_wlock:  # sender and receiver threads share the control socket
            _sendall(self.ctrl, data, what)

    # ------------------------------------------------------------------ receive
    def _ack(self) -> None:
        if self._consumed > self._acked and not self._peer_gone:
            try:
                self._ctrl_send(_CTRL.pack(_FREED, 0, 0, self._consumed), "receive")
            except PeerError:
                self._peer_gone = True  # what it already published is still readable; EOF comes next
            self._acked = self._consumed

    def _next_item(self) -> _Item | Described:
        if not self._ready:
            self._ack()  # never block while holding the sender's ring space
            self._wait(lambda: bool(self._ready), "receive")
        return self._ready.popleft()

    def _expand(self, d: Described) -> None:
        """Turn a PAYLOAD into the stream items it stands for (for a reader that wants plain bytes)."""
        blob = self._blob_ids
        self._blob_ids += 1
        self._blobs[blob] = d.digests
        items: list[_Item] = []
        for i, o in enumerate(d.offsets.tolist()):
            items += ((_DESC, d.region, o, d.chunk_len(i)), (_INLINE, blob, 8 * i, 8))
        self._ready.extendleft(reversed(items))

    def recv_into(self, parts: Sequence[memoryview]) -> None:
        for v in as_byte_views(parts):
            off = 0
            while off < v.nbytes:
                if self._cur_in is None:
                    item = self._next_item()
                    if isinstance(item, Described):
                        self._expand(item)
                        continue
                    self._cur_in, self._cur_in_off = item, 0
                kind, ident, pos, length = self._cur_in
                n = min(v.nbytes - off, length - self._cur_in_off)
                base = pos + self._cur_in_off
                if kind == _INLINE:
                    blob = self._blobs[ident]
                    v[off : off + n] = blob[base : base + n]
                    if base + n == len(blob):
                        del self._blobs[ident]
                else:
                    src = self._in_mv if kind == _FILLED else self._peer_regions[ident].mv
                    v[off : off + n] = src[base : base + n]
                off += n
                self._cur_in_off += n
                if kind == _FILLED:
                    self._consumed += n
                if self._cur_in_off == length:
                    self._cur_in = None
        if self._consumed - self._acked >= self.in_ring_bytes // 4:
            self._ack()

    def recv_described_into(self, views: Sequence[memoryview], trailers: memoryview, chunk_size: int,
                            payload_len: int) -> list[int] | None:
        """When the next stream bytes are one PAYLOAD of this shape (``len(views)`` chunks of
        ``chunk_size``, ``payload_len`` in all; the caller checked each view's length against it):
        copy and verify every chunk in one native call, put the checksums into ``trailers`` and
        return the indexes that failed. Otherwise consume nothing and return None."""
        if self._cur_in is not None:
            return None
        if not self._ready:
            self._ack()
            self._wait(lambda: bool(self._ready), "receive")
        d = self._ready[0]
        if not isinstance(d, Described) or d.n_chunks != len(views) or d.chunk_size != chunk_size \
                or d.payload_len != payload_len or trailers.nbytes < 8 * d.n_chunks:
            return None
        self._ready.popleft()
        self.described_payloads += 1
        trailers[: 8 * d.n_chunks] = d.digests
        try:
            return memops.copy_verify(views, self._peer_regions[d.region].mv, d.offsets, d.digests, self.copy_threads)
        except ValueError as exc:  # bounds were checked on arrival: a view that does not fit its chunk
            raise PeerError(f"shm: described payload does not fit: {exc}") from exc

    def readable(self, timeout: float) -> bool:
        try:
            return self._until(lambda: self._cur_in is not None or bool(self._ready), max(0.0, timeout))
        except PeerError:
            return True  # EOF / failure: the next read raises it

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self.ctrl.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on the control socket
        with contextlib.suppress(OSError):
            self.ctrl.close()
        for _, _, mine in self._regions:
            mine.unlink()
        for seg in [self._out, self._in, *(r[2] for r in self._regions), *self._peer_regions.values()]:
            if seg is not None:
                seg.close()
        self._close_rings()

    def _close_rings(self) -> None:
        """Release what :meth:`_open_rings` made beyond the segments (nothing, on shared memory)."""


def _address(v: memoryview) -> int:
    if not v.readonly:  # ~4x cheaper than going through numpy (called once per chunk sent)
        return ctypes.addressof(ctypes.c_char.from_buffer(v))
    return int(np.frombuffer(v, dtype=np.uint8).ctypes.data)


class ShmListener:
    """Control-channel listener: a Unix socket in the abstract namespace (same host only, never
    reachable from the network; peer exit reads as EOF after its last message, not a reset)."""

    def __init__(self, address: str | None = None) -> None:
        self.address = address or f"kvport-shm-{os.getpid()}-{secrets.token_hex(6)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind("\0" + self.address)
            self.sock.listen(16)
        except OSError as exc:
            self.sock.close()
            raise PeerError(f"shm: cannot listen on @{self.address}: {exc}") from exc

    def accept(self, slot_bytes: int = 1 << 20, n_slots: int = 8, timeout_s: float | None = 30.0) -> ShmTransport:
        self.sock.settimeout(timeout_s)
        try:
            conn, _ = self.sock.accept()
        except OSError as exc:
            raise PeerError(f"shm: accept failed: {exc}") from exc
        return ShmTransport(conn, slot_bytes, n_slots, timeout_s)

    def close(self) -> None:
        self.sock.close()


def connect(address: str, slot_bytes: int = 1 << 20, n_slots: int = 8,
            timeout_s: float | None = 30.0) -> ShmTransport:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect("\0" + address)
    except OSError as exc:
        sock.close()
        raise PeerError(f"shm: cannot connect to @{address}: {exc}") from exc
    return ShmTransport(sock, slot_bytes, n_slots, timeout_s)


def pair(slot_bytes: int = 1 << 20, n_slots: int = 8,
         timeout_s: float | None = 30.0) -> tuple[ShmTransport, ShmTransport]:
    """Two connected endpoints in one process (tests): the handshake runs on two threads."""
    a_sock, b_sock = socket.socketpair()
    out: list[ShmTransport] = []
    th = threading.Thread(target=lambda: out.append(ShmTransport(b_sock, slot_bytes, n_slots, timeout_s)))
    th.start()
    a = ShmTransport(a_sock, slot_bytes, n_slots, timeout_s)
    th.join()
    if not out:
        raise PeerError("shm: pair handshake failed")
    return a, out[0]
