"""KV over NIXL: the bytes move by a NIXL WRITE between registered buffers; everything else stays on
kvport's control channel.

::

    sender (NixlSender: its KV in one registered buffer)          receiver (NixlReceiver: its inbox,
                                                                            one registered buffer)
      control: kvport TCP, HMAC handshake off loopback  ------->  TRANSFER_BEGIN {TransferMeta,
                                                                    nixl: {agent, metadata, bytes}}
                                                                  checks the contract (check_compatible:
                                                                  model, revision, dtype, layout, ranks,
                                                                  block size, token range, codec) and
                                                                  the room: the grant is the credit
      <-------  TRANSFER_ACCEPT {nixl: {agent, metadata, addr, bytes}}   or TRANSFER_REFUSE {field, ...}
      NIXL WRITEs of pieces [lo, hi) of the blocks, all posted   (UCX: cma / shared memory on one host,
      at once, each into [addr + lo*B, addr + hi*B)                TCP or RDMA between hosts)
      LAYER {lo, hi, digests: xxh3-64 of its blocks} ------->    as each piece completes, in order: the
                                                                  receiver verifies those blocks while the
                                                                  next pieces are still being written
      TRANSFER_END {}                                 ------->
      <-------  TRANSFER_COMMITTED {blocks}                        (linked, the caller's from now on)
                or TRANSFER_ABORT {reason}                         (nothing linked: a checksum failed)

The receiver only ever registers its inbox buffer and grants a region inside it; it checks each
block's checksum after the write before anything is linked, so a write that went wrong or short is
an abort, never a partial block. The sender waits on the WRITE within its deadline and raises a
typed error (TransferError family: the caller falls back to the store, or recomputes) for a refused
contract, a NIXL failure (a peer that died, metadata of an agent that is gone, a descriptor outside
the registered memory), a checksum the receiver refused, a control channel that broke or stalled.

The same NIXL agents also carry kvport's ordinary byte stream (:class:`NixlRingTransport`, the
``nixl:HOST:PORT`` links of :mod:`kvport.transfer.links` that the vLLM hand-off streams over): there
the frames, credits, checksums and commits are exactly those of every other link, and NIXL moves
the stream's bytes between the two sides' registered rings.

NIXL is ``kvport[nixl]`` (the ``nixl-cu12`` wheel, installed ``--no-deps`` beside numpy; on a CPU its
UCX backend moves DRAM by cross-memory attach or TCP: ``UCX_TLS``). Metadata a peer sends is capped
(:data:`MAX_AGENT_METADATA`) and never unpickled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvport import memops
from kvport.errors import (
    ChecksumError,
    DeadlineExceeded,
    IncompatibleSpecError,
    MissingExtraError,
    PeerError,
    ProtocolError,
    TransferError,
)
from kvport.protocol.frame import MsgType
from kvport.protocol.sync import FrameIO
from kvport.protocol.transfer import TransferMeta
from kvport.spec import KVSpec
from kvport.transfer import shm
from kvport.transfer import tcp as tcp_mod
from kvport.transfer.meta import check_compatible

MAX_AGENT_METADATA = 1 << 20  # bytes of a peer's NIXL agent metadata
MAX_AGENT_NAME = 128
PIECE_BYTES = 16 << 20  # a transfer is written in pieces of about this many bytes, each verified as it lands
WINDOW = 2  # pieces in flight at once (all at once, UCX completes them together: nothing to verify early)


def _api() -> Any:
    """NIXL's Python API (``nixl_cu12``, else the ``nixl`` meta-package's pick); MissingExtraError without.

    NIXL configures its ``nixl`` logger at import with a handler on stdout (and turns off
    ``logging.raiseExceptions`` for the whole process): its lines go to stderr instead, where logs
    belong (a ``kvport bench`` prints its JSON report on stdout), and the process's setting is kept."""
    for mod in ("nixl_cu12._api", "nixl._api"):
        raising = logging.raiseExceptions
        try:
            api = __import__(mod, fromlist=["nixl_agent"])
        except ImportError:
            continue
        finally:
            logging.raiseExceptions = raising
        for h in logging.getLogger("nixl").handlers:
            if isinstance(h, logging.StreamHandler) and h.stream is sys.stdout:
                h.setStream(sys.stderr)
        return api
    raise MissingExtraError("the NIXL transport needs the nixl extra: pip install --no-deps nixl-cu12 "
                            "(numpy beside it)", "nixl", ("nixl_cu12",))


def available() -> str | None:
    """Why NIXL cannot run here (None: it can)."""
    try:
        _api()
    except MissingExtraError as exc:
        return str(exc)
    return None


class _Agent:
    """One NIXL agent with one registered DRAM buffer (``buf``: contiguous uint8). ``progress_thread``:
    NIXL's own progress thread, which polls without pause (a whole core per agent, measured here, idle
    or not); without it the agent progresses only when its owner polls it.

    The agent is made thread-safe (NIXL's strict sync mode: every call under the agent's lock, a
    UCX worker in multi-thread mode): a ring link's sending thread posts and polls its writes while
    its receiving thread progresses the same agent for the peer's, and NIXL's default mode (no
    locking) let the two corrupt the worker (a segfault, or UCX's arbiter assertion at teardown)."""

    def __init__(self, role: str, buf: np.ndarray, *, progress_thread: bool = True) -> None:
        if buf.dtype != np.uint8 or not buf.flags.c_contiguous:
            raise ProtocolError("a NIXL buffer must be contiguous uint8")
        api = _api()
        self.name = f"kvport-{role}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self.agent = api.nixl_agent(self.name, api.nixl_agent_config(
                enable_prog_thread=progress_thread, backends=["UCX"],
                sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
            self.addr, self.nbytes = int(buf.ctypes.data), int(buf.nbytes)
            self._reg = self.agent.register_memory([(self.addr, self.nbytes, 0, "")], "DRAM")
        except Exception as exc:  # NIXL's own errors (nixlBackendError, ...): no kvport type below
            raise TransferError(f"NIXL agent {self.name} could not start: {type(exc).__name__}: {exc}") from exc
        self.buf = buf

    def metadata(self) -> bytes:
        md: bytes = self.agent.get_agent_metadata()
        return md

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.agent.deregister_memory(self._reg)


@dataclass(frozen=True, slots=True)
class Received:
    meta: TransferMeta
    nbytes: int  # bytes written at the start of the receiver's buffer, every block verified


def _refuse(io: FrameIO, field: str, expected: Any, got: Any) -> None:
    with contextlib.suppress(TransferError):
        io.send(MsgType.TRANSFER_REFUSE, {"field": field, "expected": str(expected)[:256], "got": str(got)[:256]})


def _nixl_part(m: dict[str, Any], *, needs_addr: bool) -> tuple[str, bytes, int, int]:
    """(agent name, metadata, addr, bytes) of a peer's ``nixl`` map, every field checked."""
    n = m.get("nixl")
    if not isinstance(n, dict):
        raise ProtocolError("the frame lacks its nixl map")
    name, md, nbytes, addr = n.get("agent"), n.get("metadata"), n.get("bytes"), n.get("addr", 0)
    if not isinstance(name, str) or not 0 < len(name) <= MAX_AGENT_NAME:
        raise ProtocolError(f"nixl agent name must be 1-{MAX_AGENT_NAME} characters")
    if not isinstance(md, bytes) or not 0 < len(md) <= MAX_AGENT_METADATA:
        raise ProtocolError(f"nixl metadata must be 1-{MAX_AGENT_METADATA} bytes")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 < nbytes <= 1 << 40:
        raise ProtocolError(f"nixl bytes must be a positive int, got {nbytes!r}")
    if needs_addr and (not isinstance(addr, int) or isinstance(addr, bool) or not 0 < addr < 1 << 64):
        raise ProtocolError(f"nixl addr must be an address, got {addr!r}")
    return name, md, int(addr), nbytes


class NixlReceiver:
    """The inbox side: a control listener and one registered buffer of ``capacity_blocks`` blocks of
    ``spec`` (block-major: block ``i`` at ``i * bytes_per_block``). One transfer at a time."""

    def __init__(self, spec: KVSpec, capacity_blocks: int, *, host: str = "127.0.0.1", port: int = 0,
                 secret: bytes | None = None, timeout_s: float = 30.0) -> None:
        if capacity_blocks <= 0:
            raise ProtocolError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.spec = spec
        self.buf = np.zeros((capacity_blocks, spec.bytes_per_block), dtype=np.uint8)  # faulted once, reused
        # its progress thread stays: UCX on one host moves a large WRITE only as fast as the target
        # progresses (measured here without it, polled from Python: 0.34 GB/s instead of 8)
        self._agent = _Agent("inbox", self.buf)
        self.listener = tcp_mod.TcpListener(host, port, secret=secret, timeout_s=timeout_s)
        self.timeout_s = timeout_s
        self.tamper_addr = 0  # tests: offset added to the granted address (a receiver's bug, out of bounds)

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.host, self.listener.port

    def receive(self, timeout_s: float | None = None) -> Received:
        """Serve one transfer: accept, check, grant, verify; the KV is then in ``buf`` (its first
        ``nbytes``). Raises the typed error that ended it (the sender was told)."""
        t = self.listener.accept(timeout_s=timeout_s or self.timeout_s)
        io = FrameIO(t)
        try:
            return self._serve(io)
        finally:
            t.close()

    def _serve(self, io: FrameIO) -> Received:
        begin = io.expect(MsgType.TRANSFER_BEGIN)
        meta = TransferMeta.from_wire(begin.meta)
        peer, _md, _, nbytes = _nixl_part(begin.meta, needs_addr=False)
        try:
            check_compatible(self.spec, meta)
        except IncompatibleSpecError as exc:
            _refuse(io, exc.field, exc.expected, exc.got)
            raise
        want = meta.n_blocks * self.spec.bytes_per_block
        if meta.layers != range(self.spec.num_layers) or nbytes != want:
            _refuse(io, "bytes", want, nbytes)
            raise IncompatibleSpecError("bytes", want, nbytes)
        if nbytes > self.buf.nbytes:  # the credit: the room this inbox has
            _refuse(io, "capacity", self.buf.nbytes, nbytes)
            raise IncompatibleSpecError("capacity", self.buf.nbytes, nbytes)
        io.send(MsgType.TRANSFER_ACCEPT, {"nixl": {"agent": self._agent.name, "metadata": self._agent.metadata(),
                                                   "addr": self._agent.addr + self.tamper_addr, "bytes": nbytes}})
        checked, bad = 0, []  # pieces arrive in order: blocks [0, checked) verified so far
        while True:
            f = io.expect(MsgType.LAYER, MsgType.TRANSFER_END, MsgType.TRANSFER_ABORT)
            if f.msg_type == MsgType.TRANSFER_ABORT:
                raise PeerError(f"the sender {peer} aborted: {str(f.meta.get('reason', ''))[:256]}")
            if f.msg_type == MsgType.TRANSFER_END:
                break
            lo, hi, digests = f.meta.get("lo"), f.meta.get("hi"), f.meta.get("digests")
            if lo != checked or not isinstance(hi, int) or isinstance(hi, bool) or not lo < hi <= meta.n_blocks \
                    or not isinstance(digests, bytes) or len(digests) != 8 * (hi - lo):
                raise ProtocolError(f"a piece must name blocks [{checked}, hi <= {meta.n_blocks}) and their "
                                    "checksums (u64 LE)")
            got = np.frombuffer(memops.xxh3_many([self.buf[i].data for i in range(lo, hi)]), "<u8")
            bad += (lo + np.flatnonzero(got != np.frombuffer(digests, "<u8"))).tolist()
            checked = hi
        if checked != meta.n_blocks:
            raise ProtocolError(f"the transfer ended after {checked} of {meta.n_blocks} blocks: nothing linked")
        if bad:
            with contextlib.suppress(TransferError):
                io.send(MsgType.TRANSFER_ABORT, {"reason": f"{len(bad)} blocks failed their checksum"})
            raise ChecksumError(f"NIXL transfer {meta.request_id}: blocks {bad[:8]} failed their checksum; "
                                "nothing linked")
        io.send(MsgType.TRANSFER_COMMITTED, {"blocks": meta.n_blocks})
        return Received(meta, nbytes)

    def close(self) -> None:
        self.listener.close()
        self._agent.close()

    def __enter__(self) -> NixlReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NixlSender:
    """The producer side: its KV in one registered buffer (``src``: blocks, block-major)."""

    def __init__(self, src: np.ndarray) -> None:
        flat = src.reshape(-1) if src.flags.c_contiguous else None
        if flat is None:
            raise ProtocolError("the NIXL source must be one contiguous buffer")
        self.src = src
        self._agent = _Agent("sender", flat.view(np.uint8), progress_thread=False)  # it polls its writes itself
        self._remotes: dict[str, bytes] = {}  # peers added to the agent: name -> the metadata added
        self.last_grant: tuple[str, bytes, int, int] | None = None  # (agent, metadata, addr, bytes) last granted

    def send(self, host: str, port: int, meta: TransferMeta, *, secret: bytes | None = None,
             deadline_s: float = 30.0, digests: bytes | None = None) -> int:
        """Move ``meta``'s blocks (the first ``n_blocks`` of ``src``) to the receiver; returns bytes
        moved once it committed them. ``digests``: the blocks' xxh3-64 the producer already has
        (u64 LE, :func:`kvport.memops.xxh3_many`)."""
        end_by = time.monotonic() + deadline_s
        nbytes = meta.n_blocks * meta.spec.bytes_per_block
        if nbytes > self._agent.nbytes:
            raise ProtocolError(f"{meta.n_blocks} blocks are more than the registered {self._agent.nbytes} bytes")
        t = tcp_mod.connect(host, port, secret=secret, timeout_s=deadline_s)
        io = FrameIO(t)
        try:
            io.send(MsgType.TRANSFER_BEGIN, {**meta.to_wire(), "nixl": {
                "agent": self._agent.name, "metadata": self._agent.metadata(), "bytes": nbytes}})
            ans = io.expect(MsgType.TRANSFER_ACCEPT, MsgType.TRANSFER_REFUSE)
            if ans.msg_type == MsgType.TRANSFER_REFUSE:
                m = ans.meta
                raise IncompatibleSpecError(str(m.get("field", "?"))[:64], str(m.get("expected", ""))[:256],
                                            str(m.get("got", ""))[:256])
            peer, md, addr, granted = _nixl_part(ans.meta, needs_addr=True)
            if granted != nbytes:
                raise ProtocolError(f"the receiver granted {granted} bytes of {nbytes}")
            self.last_grant = (peer, md, addr, nbytes)
            bpb = meta.spec.bytes_per_block
            flat = self._agent.buf
            step = max(1, PIECE_BYTES // bpb)
            pieces = [(lo, min(meta.n_blocks, lo + step)) for lo in range(0, meta.n_blocks, step)]

            def landed(lo: int, hi: int) -> None:  # a piece is in the receiver's memory: its checksums go
                sums = digests[8 * lo : 8 * hi] if digests is not None else \
                    memops.xxh3_many([flat[i * bpb : (i + 1) * bpb].data for i in range(lo, hi)])
                io.send(MsgType.LAYER, {"lo": lo, "hi": hi, "digests": bytes(sums)})

            try:
                self._write(peer, md, addr, nbytes, end_by, [(lo * bpb, hi * bpb) for lo, hi in pieces],
                            lambda k: landed(*pieces[k]))
            except TransferError as exc:
                with contextlib.suppress(TransferError):
                    io.send(MsgType.TRANSFER_ABORT, {"reason": str(exc)[:256]})
                raise
            io.send(MsgType.TRANSFER_END, {})
            t.settimeout(max(0.1, end_by - time.monotonic()))
            done = io.expect(MsgType.TRANSFER_COMMITTED, MsgType.TRANSFER_ABORT)
            if done.msg_type == MsgType.TRANSFER_ABORT:
                raise ChecksumError(f"the receiver aborted: {str(done.meta.get('reason', ''))[:256]}")
            return nbytes
        finally:
            t.close()

    def write_granted(self, deadline_s: float = 30.0) -> int:
        """The last granted region written again by NIXL alone (no contract, no checksums, no
        commit): bare NIXL between the same buffers, the benchmark's limit."""
        if self.last_grant is None:
            raise ProtocolError("no region was granted yet")
        peer, md, addr, nbytes = self.last_grant
        self._write(peer, md, addr, nbytes, time.monotonic() + deadline_s, [(0, nbytes)], lambda k: None)
        return nbytes

    def _write(self, peer: str, md: bytes, addr: int, nbytes: int, end_by: float,
               pieces: list[tuple[int, int]], on_done: Callable[[int], None]) -> None:
        """WRITE each piece ``[lo, hi)`` (bytes) of the source to ``addr + lo``: all posted at once,
        ``on_done(k)`` as piece k completes, in order."""
        a = self._agent.agent
        try:
            if self._remotes.get(peer) != md:  # a new peer, or one that restarted: its current metadata
                if peer in self._remotes:
                    a.remove_remote_agent(peer)
                    del self._remotes[peer]
                name = a.add_remote_agent(md)
                name = name.decode() if isinstance(name, bytes) else name
                if name != peer:
                    raise ProtocolError(f"the receiver's metadata names agent {name!r}, not {peer!r}")
                self._remotes[peer] = md
        except TransferError:
            raise
        except Exception as exc:  # NIXL refused the peer's metadata
            raise PeerError(f"NIXL could not reach {peer}: {type(exc).__name__}: {exc}") from exc
        handles: list[Any] = []

        def post(k: int) -> None:
            lo, hi = pieces[k]
            local = a.get_xfer_descs([(self._agent.addr + lo, hi - lo, 0)], "DRAM")
            remote = a.get_xfer_descs([(addr + lo, hi - lo, 0)], "DRAM")
            handles.append(a.initialize_xfer("WRITE", local, remote, peer, b"kvport"))
            if a.transfer(handles[-1]) == "ERR":
                raise PeerError(f"NIXL write of bytes [{lo}, {hi}) to {peer} failed to start")

        try:
            for k in range(min(WINDOW, len(pieces))):
                post(k)
            for k in range(len(pieces)):  # WINDOW pieces in flight: they land in order, one after the other
                h = handles[k]
                while (state := a.check_xfer_state(h)) not in ("DONE", "ERR"):
                    if time.monotonic() > end_by:
                        raise DeadlineExceeded(f"NIXL write of {nbytes} bytes to {peer} past its deadline")
                if state == "ERR":
                    raise PeerError(f"NIXL write of piece {k} to {peer} failed")
                if k + WINDOW < len(pieces):
                    post(k + WINDOW)
                on_done(k)
        except TransferError:
            raise
        except Exception as exc:  # NIXL refused a descriptor (outside the registered memory) or the peer died
            raise PeerError(f"NIXL write to {peer} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            for h in handles:
                with contextlib.suppress(Exception):
                    a.release_xfer_handle(h)

    def close(self) -> None:
        self._agent.close()

    def __enter__(self) -> NixlSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- the byte stream over NIXL
_RING_HELLO = struct.Struct("<II")  # slot bytes, slots: the ring each side sends from
_RING_AGENT = struct.Struct("<IIQ")  # agent name length, metadata length, address of the incoming ring
MAX_RING_BYTES = 1 << 30
WRITE_S = 10.0  # one ring write completes within this (or the link's timeout, when shorter)
_POSTED = 10  # control kind: a WRITE into the receiver's ring is posted (the receiver progresses until it lands)


class NixlRingTransport(shm.ShmTransport):
    """kvport's byte stream (:class:`~kvport.protocol.transport.Transport`) between two NIXL agents,
    over an authenticated control socket; the ring protocol of :class:`~kvport.transfer.shm.ShmTransport`
    with NIXL in place of shared memory::

        each side: one registered buffer  [ outgoing staging: R | incoming: the peer's R ]
        sender:    copy parts into its staging at head % R -> NIXL WRITE of those bytes into the
                   peer's incoming ring at the same position, wait for it -> FILLED(pos, n) on the
                   control socket; a send of up to 64 KiB (a frame head, a credit) goes inside the
                   control message instead (DATA): one socket write, no NIXL round trip
        receiver:  copy out of its incoming ring into its own buffers -> FREED, as on shared memory

    The handshake runs on the control socket after kvport's link handshake: each side names its ring
    (slot bytes, slots; at most 1 GiB), then its agent (name, metadata, capped and never unpickled)
    and where its incoming ring is registered. A WRITE that fails or does not complete within the
    transport's timeout is a PeerError, like a reset socket; what was announced before it is whole.

    The agents run without NIXL's progress thread (it polls a core per agent, idle or not: an open
    inbox link would take a core from the engines for as long as it is pooled). Each side progresses
    its own agent only while a write is under way: the sender polls its WRITE to completion, and
    announces it first (POSTED on the control socket), so that the receiver polls its agent until the
    write's notification arrives (UCX over TCP needs the target to progress; cross-memory attach does
    not, but the notification still does). Idle links cost nothing."""

    inline_below = 64 << 10

    def _open_rings(self, ctrl: socket.socket, slot_bytes: int,
                    n_slots: int) -> tuple[memoryview, memoryview, int, int]:
        self.name = "nixl"
        shm._sendall(ctrl, _RING_HELLO.pack(slot_bytes, n_slots), "nixl handshake")
        in_slot_bytes, in_slots = _RING_HELLO.unpack(shm._recv_exact(ctrl, _RING_HELLO.size, "nixl handshake"))
        out_bytes, in_bytes = slot_bytes * n_slots, in_slot_bytes * in_slots
        if not (0 < in_bytes <= MAX_RING_BYTES and in_slot_bytes > 0 and 0 < out_bytes <= MAX_RING_BYTES):
            raise PeerError(f"nixl: a ring of {in_slot_bytes} x {in_slots} bytes (at most {MAX_RING_BYTES} in all)")
        self._mem = np.empty(out_bytes + in_bytes, dtype=np.uint8)
        self._mem.fill(0)  # every page faulted now, not in the stream
        self._agent = _Agent("link", self._mem, progress_thread=False)
        self._peer = ""
        self._posted = self._notified = 0  # the peer's writes announced to me / whose notification came
        try:
            name, md = self._agent.name.encode(), self._agent.metadata()
            shm._sendall(ctrl, _RING_AGENT.pack(len(name), len(md), self._agent.addr + out_bytes) + name + md,
                         "nixl handshake")
            ln, lm, self._peer_in = _RING_AGENT.unpack(shm._recv_exact(ctrl, _RING_AGENT.size, "nixl handshake"))
            if not 0 < ln <= MAX_AGENT_NAME or not 0 < lm <= MAX_AGENT_METADATA or not 0 < self._peer_in < 1 << 64:
                raise PeerError("nixl: the peer's agent announcement is out of bounds")
            peer = shm._recv_exact(ctrl, ln, "nixl handshake").decode("ascii", "replace")
            peer_md = shm._recv_exact(ctrl, lm, "nixl handshake")
            try:
                added = self._agent.agent.add_remote_agent(peer_md)
            except Exception as exc:  # NIXL refused the metadata
                raise PeerError(f"nixl: the peer's agent metadata was refused: {type(exc).__name__}: {exc}") from exc
            added = added.decode() if isinstance(added, bytes) else added
            if added != peer:
                raise PeerError(f"nixl: the peer's metadata names agent {added!r}, not {peer!r}")
            self._peer = peer
        except BaseException:
            self._agent.close()
            raise
        mv = self._mem.data.cast("B")
        return mv[:out_bytes], mv[out_bytes:], in_slot_bytes, in_slots

    def _write_s(self) -> float:
        """How long one write (at most a ring, 32 MiB by default) may take to complete: the link's
        timeout, never more than :data:`WRITE_S` (a link's timeout is its idle timeout, an hour for
        a pooled hand-off link; both sides poll while they wait, so a peer gone mid-write must end
        the wait soon)."""
        return min(self.timeout_s or WRITE_S, WRITE_S)

    def _on_ctrl(self, kind: int, ident: int, nbytes: int, pos: int) -> bool:
        if kind != _POSTED or not 0 < nbytes <= self.in_ring_bytes:
            return False
        self._posted += 1  # progress my agent until that write's notification came (it lands meanwhile)
        a = self._agent.agent
        end_by = time.monotonic() + self._write_s()
        try:
            while self._notified < self._posted:
                got = a.get_new_notifs()
                self._notified += len(got.get(self._peer, ())) if got else 0
                if self._notified < self._posted and time.monotonic() > end_by:
                    raise PeerError(f"nixl: a write of {nbytes} bytes from {self._peer} never completed")
        except PeerError:
            raise
        except Exception as exc:  # NIXL's own errors
            raise PeerError(f"nixl: progress failed: {type(exc).__name__}: {exc}") from exc
        return True

    def _push(self, pos: int, n: int) -> None:
        a = self._agent.agent
        h = None
        end_by = time.monotonic() + self._write_s()
        self._ctrl_send(shm._CTRL.pack(_POSTED, 0, n, pos), "send")  # the peer progresses its agent
        try:
            local = a.get_xfer_descs([(self._agent.addr + pos, n, 0)], "DRAM")
            remote = a.get_xfer_descs([(self._peer_in + pos, n, 0)], "DRAM")
            h = a.initialize_xfer("WRITE", local, remote, self._peer, b"kvport-ring")
            state = a.transfer(h)
            while state not in ("DONE", "ERR"):
                if time.monotonic() > end_by:
                    raise PeerError(f"nixl: a write of {n} bytes to {self._peer} did not complete in time")
                state = a.check_xfer_state(h)
            if state == "ERR":
                raise PeerError(f"nixl: a write of {n} bytes to {self._peer} failed")
        except PeerError:
            raise
        except Exception as exc:  # NIXL's own errors: the peer died, its memory is gone
            raise PeerError(f"nixl: a write to {self._peer} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            if h is not None:
                with contextlib.suppress(Exception):
                    a.release_xfer_handle(h)

    def register(self, nbytes: int) -> memoryview:
        raise ProtocolError("nixl links carry the stream through their rings: no registered regions")

    def _close_rings(self) -> None:
        if self._peer:
            with contextlib.suppress(Exception):
                self._agent.agent.remove_remote_agent(self._peer)
        self._agent.close()
