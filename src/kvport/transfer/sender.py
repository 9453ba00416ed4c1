"""Sender: streams one transfer at a time over a connection, layer by layer, within its credits.

::

    begin(meta)      TRANSFER_BEGIN {owner, ledger_tid} ->   <- TRANSFER_ACCEPT {budget, grant, owner}
                                                              | TRANSFER_REFUSE {error}
                     (ledger: the receiver's owner must be ``peer`` / a known peer, then
                      begin_transfer(keys, owner -> receiver owner, ledger_tid))
    send_layer(l)    LAYER {tid, layer, b0} + one chunk per block (as many blocks as credits allow)
    | send_blocks()  LAYER {tid, layer, b0, n_layers} + whole blocks, their block-layers in memory
                     order (a whole transfer: send())
                                                  <- CREDIT {grant}  (any time)
    end()            TRANSFER_END ->              <- TRANSFER_COMMITTED {owner} | TRANSFER_ABORT {error}
                     (ledger: commit_transfer -> HANDED_OFF to the receiver's owner)

A reader thread handles every frame from the receiver (grants, answers, aborts), each decoded into
its typed message (:mod:`kvport.protocol.transfer`); the producer thread only writes. Outgoing state:
BEGUN -> ACCEPTED -> ENDED -> COMMITTED, any -> ABORTED (one function, :meth:`Outgoing._move`, raises
on any other move). With a ledger the blocks belong to the transfer from the receiver's ACCEPT (before
any LAYER frame) until COMMITTED hands them to the receiver's owner; any failure gives them back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvport.deadline import Deadline, within
from kvport.deadline import current as current_deadline
from kvport.errors import (
    BackpressureTimeout,
    CodecError,
    ConfigError,
    DeadlineExceeded,
    IllegalMoveError,
    KVPortError,
    OwnershipError,
    PeerError,
    ProtocolError,
    TransferError,
    UnknownPeerError,
)
from kvport.ledger.records import new_tid
from kvport.ledger.states import Owner
from kvport.metrics import counter
from kvport.protocol.errors import remote_error
from kvport.protocol.frame import DEFAULT_LIMITS, Limits, MsgType
from kvport.protocol.rejects import Rejected, RejectReason
from kvport.protocol.schema import Message
from kvport.protocol.sync import FrameIO
from kvport.protocol.transfer import (
    Credit,
    LayerHead,
    TransferAbort,
    TransferAccept,
    TransferBegin,
    TransferCommitted,
    TransferEnd,
    TransferRefuse,
)
from kvport.protocol.transport import Buffer, Transport
from kvport.transfer.credits import Admitted, Backpressure, CreditWindow, wait_for
from kvport.transfer.meta import TransferMeta

if TYPE_CHECKING:  # types only: the ledger is used through its methods; codecs load on first use
    from kvport.codec import Codec
    from kvport.ledger import Ledger
    from kvport.transfer.linkcodec import LinkCodec

SENT_BYTES = counter("transfer_sent_bytes_total", "KV payload bytes sent", ["transport"])
OUTCOMES = counter("transfer_outcomes_total", "Transfers by outcome", ["role", "outcome"])


class OutState(enum.Enum):
    BEGUN = "begun"
    ACCEPTED = "accepted"
    ENDED = "ended"
    COMMITTED = "committed"
    ABORTED = "aborted"


_ALLOWED = {
    OutState.BEGUN: {OutState.ACCEPTED, OutState.ABORTED},
    OutState.ACCEPTED: {OutState.ENDED, OutState.ABORTED},
    OutState.ENDED: {OutState.COMMITTED, OutState.ABORTED},
    OutState.COMMITTED: set(),
    OutState.ABORTED: set(),
}


@dataclass(slots=True)
class Outgoing:
    """One transfer as the sender sees it. ``error``: why it aborted (a TransferError, or an
    OwnershipError when the ledgers disagree). ``ledger_tid`` names it in both ledgers;
    ``peer_owner`` is the owner the receiver announced in its ACCEPT; ``ledger_open`` says the
    sender's ledger holds the blocks in this transfer (begin_transfer done, not yet settled)."""

    tid: int
    meta: TransferMeta
    ledger_tid: str = ""
    state: OutState = OutState.BEGUN
    error: KVPortError | None = None
    peer_owner: str = ""
    ledger_open: bool = False
    sent_bytes: int = 0
    layers_sent: set[int] = field(default_factory=set)
    link: LinkCodec | None = None  # the link's codec: block-layers are encoded before they go out
    deadline: Deadline | None = None  # nothing of this transfer waits past it (credits, answers, writes)
    ledger: Ledger | None = None  # the ledger recording this transfer (the sender's, unless begin named one)

    def _move(self, to: OutState) -> None:
        if to not in _ALLOWED[self.state]:
            raise IllegalMoveError(f"transfer {self.tid}: {self.state.value} -> {to.value}")
        self.state = to

    @property
    def done(self) -> bool:
        return self.state in (OutState.COMMITTED, OutState.ABORTED)


class Sender:
    def __init__(self, transport: Transport, bp: Backpressure | None = None, limits: Limits = DEFAULT_LIMITS,
                 ledger: Ledger | None = None, owner: Owner | None = None, peer: Owner | None = None,
                 credit_timeout_s: float | None = 30.0, max_frame_bytes: int = 32 << 20,
                 batch_bytes: int | None = None, codec: Codec | None = None,
                 admit_peer: Callable[[Owner], bool] | None = None) -> None:
        """``batch_bytes``: payload per transport write (small: hashed while in cache, for sockets;
        a whole frame for shared memory, where each write is a hand-off to the peer).
        ``codec``: this link's codec (:mod:`kvport.transfer.linkcodec`); raw when None.
        ``ledger`` / ``owner``: record every transfer as a hand-off of ``owner``'s blocks to the
        receiver's owner, which must be ``peer`` (added to the ledger as a peer) or, without
        ``peer``, a peer the ledger already knows or one ``admit_peer`` admits (it adds it: a
        receiver reached over an authenticated link, :mod:`kvport.transfer.handoff`)."""
        if ledger is not None and owner is None:
            raise ConfigError("a Sender with a ledger needs its owner")
        if peer is not None and ledger is None:
            raise ConfigError("a peer is known to a ledger: pass ledger= with it")
        self.t = transport
        self.io = FrameIO(transport, limits, batch_bytes)
        self._sent_bytes = SENT_BYTES.labels(transport=transport.name)
        self.bp = bp or Backpressure()
        self.window = CreditWindow(self.bp)
        self.ledger, self.owner, self.peer = ledger, owner, peer
        self.admit_peer = admit_peer
        if ledger is not None and peer is not None:
            ledger.add_peer(peer)
        self.credit_timeout_s = credit_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.codec = codec
        self._enc = np.empty(0, np.uint8)  # encoded chunks of the layer being sent (reused)
        self._tids = itertools.count(1)
        self._current: Outgoing | None = None
        self._cond = self.window.cond  # one condition for grants and answers
        self._wlock = threading.Lock()
        self._dead: KVPortError | None = None
        self._reader = threading.Thread(target=self._read_loop, name="kvport-sender-reader", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ reader thread
    def _read_loop(self) -> None:
        try:
            while True:
                f = self.io.read_frame()
                self._on_frame(f.msg_type, f.meta)
        except KVPortError as exc:
            self._die(exc)
        except Exception as exc:
            self._die(PeerError(f"sender reader failed: {exc!r}"))

    def _on_frame(self, mt: MsgType, m: dict[str, Any]) -> None:
        """Decode one frame from the receiver (ProtocolError on a bad field) and act on it."""
        if mt is MsgType.CREDIT:
            self.window.on_grant(Credit.from_meta(m).grant)
            return
        if mt is MsgType.ERROR:  # the receiver closes the connection after it
            raise remote_error(m, TransferError)
        if mt is MsgType.TRANSFER_ACCEPT:
            acc = TransferAccept.from_meta(m)
            self.window.on_grant(acc.grant, acc.budget)
            tid = acc.tid
        elif mt is MsgType.TRANSFER_COMMITTED:
            done = TransferCommitted.from_meta(m)
            tid = done.tid
        elif mt is MsgType.TRANSFER_REFUSE or mt is MsgType.TRANSFER_ABORT:
            failed = (TransferRefuse if mt is MsgType.TRANSFER_REFUSE else TransferAbort).from_meta(m)
            tid = failed.tid
        else:
            raise ProtocolError(f"unexpected {mt.name} from a receiver")
        with self._cond:
            cur = self._current
            if cur is None or tid != cur.tid or cur.done:
                return  # a late answer to a transfer already aborted here
            if mt is MsgType.TRANSFER_ACCEPT:
                cur.peer_owner = acc.owner
                cur._move(OutState.ACCEPTED)
            elif mt is MsgType.TRANSFER_COMMITTED:
                self._committed(cur, done)
            else:
                self._fail(cur, failed.error)
            self._cond.notify_all()

    def _die(self, exc: KVPortError) -> None:
        with self._cond:
            self._dead = exc
            if self._current is not None and not self._current.done:
                self._fail(self._current, exc)
            self.window.reset()
            self._cond.notify_all()

    def _fail(self, h: Outgoing, exc: KVPortError) -> None:
        """Abort ``h`` here (callers hold ``_cond``): the ledger gives its blocks back to our owner."""
        if h.done:
            return
        h.error = exc
        h._move(OutState.ABORTED)
        OUTCOMES.labels(role="sender", outcome=type(exc).__name__).inc()
        if h.ledger is not None and h.ledger_open:
            h.ledger_open = False
            h.ledger.abort_transfer(h.ledger_tid)

    def _committed(self, h: Outgoing, done: TransferCommitted) -> None:
        """TRANSFER_COMMITTED (callers hold ``_cond``): the owner that acquired the blocks must be the
        one that accepted them; the ledger then records HANDED_OFF to it."""
        if h.ledger is not None and done.owner != h.peer_owner:
            self._fail(h, ProtocolError(f"transfer {h.tid} committed by {done.owner[:80]!r}, accepted by "
                                        f"{h.peer_owner[:80]!r}"))
            return
        h._move(OutState.COMMITTED)
        OUTCOMES.labels(role="sender", outcome="committed").inc()
        if h.ledger is not None and h.ledger_open:
            h.ledger_open = False
            h.ledger.commit_transfer(h.ledger_tid)

    def _wait(self, h: Outgoing, pred: Callable[[], bool], timeout: float | None, what: str) -> None:
        limit = timeout if h.deadline is None else h.deadline.timeout(timeout)
        with self._cond:
            ok = self._cond.wait_for(lambda: pred() or h.done or self._dead is not None, limit)
            if h.error is not None:
                raise h.error
            if self._dead is not None:
                raise self._dead
            if not ok:
                err: TransferError = PeerError(f"transfer {h.tid}: no {what} within {timeout} s")
                if h.deadline is not None and h.deadline.expired:
                    err = DeadlineExceeded(f"transfer {h.tid}: no {what} before its deadline")
                self._fail(h, err)
                raise err

    def _send(self, msg: Message, chunks: Sequence[Buffer] = (), chunk_size: int | None = None,
              digests: bytes | None = None, deadline: Deadline | None = None) -> None:
        """One frame; with a ``deadline`` the socket writes stop at it (PeerError: the stream is cut)."""
        with self._wlock, within(deadline):
            self.io.send(msg.TYPE, msg.to_meta(), chunks, chunk_size, digests=digests)

    # ------------------------------------------------------------------ API
    def try_admit(self) -> Admitted | Rejected:
        """May the scheduler start new work? Never blocks (watermarks with hysteresis)."""
        if self._dead is not None:
            return Rejected(RejectReason.PEER_FAILED, 1.0, f"connection failed: {self._dead}")
        return self.window.admission()

    def begin(self, meta: TransferMeta, timeout_s: float | None = 30.0, deadline: Deadline | None = None,
              ledger: Ledger | None = None) -> Outgoing:
        """Announce a transfer and wait for the receiver's verdict (raises its refusal). With a ledger,
        the receiver's owner is checked and the blocks move to the transfer before this returns
        (UnknownPeerError / IllegalMoveError abort it: nothing changes in the ledger). ``ledger``:
        this transfer's own, instead of the sender's (a sender made with one only; the same owner).

        ``deadline`` (default: the caller's :func:`kvport.deadline.current`) bounds the whole
        transfer: every wait for an answer or for credits, and every socket write. Past it the
        transfer aborts with DeadlineExceeded (a write cut short breaks the connection: PeerError)."""
        deadline = deadline if deadline is not None else current_deadline()
        with self._cond:
            if self._dead is not None:
                raise self._dead
            if self._current is not None and not self._current.done:
                raise TransferError(f"transfer {self._current.tid} still open on this connection")
            link = None
            if self.codec is not None and meta.codec_id == "raw":
                from kvport.transfer.linkcodec import LinkCodec

                link = LinkCodec(self.codec, meta.spec)
                meta = dataclasses.replace(meta, codec_id=self.codec.codec_id, codec_params=self.codec.params,
                                           chunk_bytes=link.chunk_bytes)
            if ledger is not None and self.ledger is None:
                raise ConfigError("a transfer's own ledger needs a sender made with a ledger and its owner")
            h = Outgoing(next(self._tids), meta, new_tid(), link=link, deadline=deadline,
                         ledger=ledger if ledger is not None else self.ledger)
            self._current = h
        try:
            self._send(TransferBegin(h.tid, meta, "" if self.owner is None else str(self.owner), h.ledger_tid),
                       deadline=h.deadline)
        except TransferError as exc:
            with self._cond:
                self._fail(h, exc)
            raise
        self._wait(h, lambda: h.state is OutState.ACCEPTED, timeout_s, "answer to TRANSFER_BEGIN")
        if h.ledger is not None and self.owner is not None:
            self._hand_to_transfer(h, h.ledger, self.owner)
        return h

    def _hand_to_transfer(self, h: Outgoing, ledger: Ledger, owner: Owner) -> None:
        """After ACCEPT: the receiver's owner must be our peer; the ledger moves every block to the
        transfer (all or nothing), before any LAYER frame. A failure aborts the transfer."""
        with self._cond:
            if h.error is not None:
                raise h.error
            try:
                dst = self._accepted_owner(h.peer_owner, ledger)
                ledger.begin_transfer(h.meta.block_keys, owner, dst, tid=h.ledger_tid)
                h.ledger_open = True
                return
            except OwnershipError as exc:
                self._fail(h, exc)
                err: KVPortError = exc
        self._send_abort(h, err)
        raise err

    def _accepted_owner(self, name: str, ledger: Ledger) -> Owner:
        try:
            dst = Owner.parse(name)
        except IllegalMoveError as exc:
            raise UnknownPeerError(f"the receiver accepted as {name[:80]!r}, not a known peer") from exc
        if self.peer is not None and dst != self.peer:
            raise UnknownPeerError(f"the receiver accepted as {dst}, this sender hands off to {self.peer}")
        if dst not in ledger.peers:
            if self.admit_peer is None or not self.admit_peer(dst):
                raise UnknownPeerError(f"the receiver accepted as {dst}, not a known peer of this ledger")
            ledger.add_peer(dst)  # admitted (into the sender's ledger): a transfer's own ledger knows it too
        return dst

    def send_layer(self, h: Outgoing, layer: int, blocks: Sequence[Buffer], digests: bytes | None = None) -> None:
        """Send layer ``layer`` of every block (``blocks[i]``: that layer's bytes of block i).

        ``digests``: the blocks' checksums for this layer, 8 bytes each (``kvport.memops.xxh3_many``),
        when the producer computed them as it wrote the KV (raw links only: a codec link hashes what it
        encoded). Without them the sender hashes each chunk as it goes out."""
        if layer not in h.meta.layers or layer in h.layers_sent:
            raise TransferError(f"layer {layer} not in {h.meta.layers} or sent twice")
        if len(blocks) != h.meta.n_blocks:
            raise TransferError(f"{len(blocks)} block views for {h.meta.n_blocks} blocks")
        if digests is not None and len(digests) != 8 * len(blocks):
            raise TransferError(f"{len(digests)} digest bytes for {len(blocks)} blocks")
        if h.link is not None:
            blocks = self._encode_layer(h.link, layer, blocks)
            digests = None
        self._send_rectangle(h, layer, 1, blocks, digests)
        h.layers_sent.add(layer)

    def send_blocks(self, h: Outgoing, layers: Sequence[Sequence[Buffer]],
                    digests: Sequence[bytes] | None = None) -> None:
        """Send every layer of every block, block by block (``layers[j][i]``: layer ``lo + j`` of
        block i): each LAYER frame carries whole blocks, their block-layers in memory order, so a
        block-contiguous KV (LKHTD) is read front to back and lands front to back. For a transfer whose
        layers all exist already; layer-wise streaming is :meth:`send_layer`. Raw links only, and a
        block's layers must fit one frame and the receiver's budget (else: one frame per layer)."""
        meta = h.meta
        lo, nl, nb = meta.layers.start, len(meta.layers), meta.n_blocks
        if len(layers) != nl or any(len(v) != nb for v in layers):
            raise TransferError(f"send_blocks needs {nl} layers of {nb} block views")
        if digests is not None and (len(digests) != nl or any(len(d) != 8 * nb for d in digests)):
            raise TransferError(f"send_blocks needs {nl} digest strings of {8 * nb} bytes")
        unit = nl * meta.block_layer_bytes
        if h.link is not None or h.layers_sent or unit > self.max_frame_bytes \
                or (self.bp.enabled and unit > self.window.budget):
            for j, layer in enumerate(meta.layers):
                self.send_layer(h, layer, layers[j], None if digests is None else digests[j])
            return
        chunks = [v for block in zip(*layers, strict=True) for v in block]  # block-major
        known = None
        if digests is not None:  # per layer -> per block, in the chunks' order
            known = np.frombuffer(b"".join(digests), dtype="<u8").reshape(nl, nb).T.tobytes()
        self._send_rectangle(h, lo, nl, chunks, known)
        h.layers_sent.update(meta.layers)

    def _send_rectangle(self, h: Outgoing, layer: int, n_layers: int, chunks: Sequence[Buffer],
                        digests: bytes | None) -> None:
        """LAYER frames of whole units (one block's ``n_layers`` consecutive block-layers from
        ``layer``; ``chunks`` unit after unit), as many units a frame as the frame size and the
        credits allow."""
        lb = h.meta.block_layer_bytes
        unit = n_layers * lb
        n_units = len(chunks) // n_layers
        per_frame = max(1, self.max_frame_bytes // unit)
        i = 0
        try:
            while i < n_units:
                if h.error is not None or self._dead is not None:
                    raise h.error or self._dead or PeerError("connection failed")
                k = min(per_frame, n_units - i)
                if self.bp.enabled:
                    self._wait_credit(h, unit)
                    k = max(1, min(k, self.window.available // unit))
                self.window.consume(k * unit)
                a, b = i * n_layers, (i + k) * n_layers
                self._send(LayerHead(h.tid, layer, i, n_layers), chunks[a:b], lb,
                           None if digests is None else digests[8 * a : 8 * b], h.deadline)
                h.sent_bytes += k * unit
                self._sent_bytes.inc(k * unit)
                i += k
        except PeerError as exc:  # a frame may be half written: the stream is unusable
            self._die(exc)
            self.t.close()
            raise
        except TransferError as exc:
            with self._cond:
                self._fail(h, exc)
            self._send_abort(h, exc)
            raise

    def _wait_credit(self, h: Outgoing, unit: int) -> None:
        if h.deadline is None:
            wait_for(self.window, unit, self.credit_timeout_s)
            return
        try:
            wait_for(self.window, unit, h.deadline.timeout(self.credit_timeout_s))
        except BackpressureTimeout:
            h.deadline.check(f"transfer {h.tid}: waiting for credit")
            raise

    def _encode_layer(self, link: LinkCodec, layer: int, blocks: Sequence[Buffer]) -> list[memoryview]:
        cb = link.chunk_bytes
        if self._enc.nbytes < cb * len(blocks):
            self._enc = np.empty(cb * len(blocks), np.uint8)
        mv = self._enc.data.cast("B")
        out = [mv[i * cb : (i + 1) * cb] for i in range(len(blocks))]
        try:
            for b, o in zip(blocks, out, strict=True):
                link.encode_into(b, o, layer)
        except CodecError as exc:
            raise TransferError(f"layer {layer}: {link.codec.codec_id} could not encode a block: {exc}") from exc
        return out

    def end(self, h: Outgoing, timeout_s: float | None = 60.0) -> None:
        """Finish; returns when the receiver linked every block (raises its error otherwise)."""
        with self._cond:
            if h.error is not None:
                raise h.error
            h._move(OutState.ENDED)
        try:
            self._send(TransferEnd(h.tid), deadline=h.deadline)
        except TransferError as exc:
            with self._cond:
                self._fail(h, exc)
            raise
        self._wait(h, lambda: h.state is OutState.COMMITTED, timeout_s, "TRANSFER_COMMITTED")

    def abort(self, h: Outgoing, reason: str = "aborted by sender") -> None:
        exc = TransferError(reason)
        with self._cond:
            self._fail(h, exc)
        self._send_abort(h, exc)

    def _send_abort(self, h: Outgoing, exc: KVPortError) -> None:
        # a small frame, bounded like the transfer (a second past its deadline at most); when the
        # connection is gone or stuck, the receiver aborts on EOF or on its own deadline
        with contextlib.suppress(KVPortError):  # the link may be gone already: the abort is best effort
            self._send(TransferAbort(h.tid, exc), deadline=None if h.deadline is None else Deadline.after(1.0))

    def send(self, meta: TransferMeta, layer_blocks: Callable[[int], Sequence[Buffer]],
             timeout_s: float | None = 60.0, layer_digests: Callable[[int], bytes] | None = None,
             deadline: Deadline | None = None) -> Outgoing:
        """Whole transfer: begin, every block with all its layers (:meth:`send_blocks`; the views of
        every layer, ``layer_blocks(l)``, and the producer's ``layer_digests(l)`` when it has them),
        end; within ``deadline`` (see :meth:`begin`)."""
        h = self.begin(meta, timeout_s, deadline)
        layers = [layer_blocks(layer) for layer in h.meta.layers]
        self.send_blocks(h, layers, None if layer_digests is None else [layer_digests(la) for la in h.meta.layers])
        self.end(h, timeout_s)
        return h

    def close(self) -> None:
        self.t.close()
        self._reader.join(5)


class LayerStreamer:
    """Overlap production and transfer: ``push(layer, blocks)`` returns at once, a thread sends the
    layers in order; ``finish()`` sends TRANSFER_END and re-raises the first send error. The
    producer must not modify a pushed layer's buffers until ``finish`` returns."""

    def __init__(self, sender: Sender, h: Outgoing) -> None:
        self.sender, self.h = sender, h
        self._q: queue.Queue[tuple[int, Sequence[Buffer]] | None] = queue.Queue()
        self._error: TransferError | None = None
        self._thread = threading.Thread(target=self._run, name="kvport-layer-streamer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            if self._error is not None:
                continue
            try:
                self.sender.send_layer(self.h, *item)
            except TransferError as exc:
                self._error = exc

    def push(self, layer: int, blocks: Sequence[Buffer]) -> None:
        if self._error is not None:
            raise self._error
        self._q.put((layer, blocks))

    def finish(self, timeout_s: float | None = 60.0) -> None:
        """Send TRANSFER_END once every pushed layer went out; ``timeout_s`` bounds each of the two
        waits (the layers still queued, then the receiver's commit): PeerError past it."""
        self._q.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise PeerError(f"transfer {self.h.tid}: layers still unsent after {timeout_s} s")
        if self._error is not None:
            raise self._error
        self.sender.end(self.h, timeout_s)
