"""Sender: streams one transfer at a time over a connection, layer by layer, within its credits.

::

    begin(meta)      TRANSFER_BEGIN ->            <- TRANSFER_ACCEPT {budget, grant} | TRANSFER_REFUSE {field}
    send_layer(l)    LAYER {tid, layer, b0} + one chunk per block (as many blocks as credits allow)
                                                  <- CREDIT {grant}  (any time)
    end()            TRANSFER_END ->              <- TRANSFER_COMMITTED | TRANSFER_ABORT {error}

A reader thread handles every frame from the receiver (grants, answers, aborts); the producer thread
only writes. Outgoing state: BEGUN -> ACCEPTED -> ENDED -> COMMITTED, any -> ABORTED (one function,
:meth:`Outgoing._move`, raises on any other move). With a ledger, ``begin`` moves the blocks to a
transfer owner; COMMITTED hands them to the receiver's owner, any failure gives them back to ours.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvport.errors import CodecError, IllegalMoveError, PeerError, ProtocolError, TransferError
from kvport.metrics import counter
from kvport.transfer.credits import Admitted, Backpressure, CreditWindow, Rejected, RejectReason, wait_for
from kvport.transfer.framing import FrameIO
from kvport.transfer.meta import TransferMeta, remote_error
from kvport.transfer.transport import Buffer, Transport
from kvport.transfer.wire import DEFAULT_LIMITS, Limits, MsgType

if TYPE_CHECKING:  # types only: the ledger is used through its methods; codecs load on first use
    from kvport.codec import Codec
    from kvport.ledger import Ledger, Owner
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
    tid: int
    meta: TransferMeta
    state: OutState = OutState.BEGUN
    error: TransferError | None = None
    ledger_tid: str | None = None
    sent_bytes: int = 0
    layers_sent: set[int] = field(default_factory=set)
    link: LinkCodec | None = None  # the link's codec: block-layers are encoded before they go out

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
                 batch_bytes: int | None = None, codec: Codec | None = None) -> None:
        """``batch_bytes``: payload per transport write (small: hashed while in cache, for sockets;
        a whole frame for shared memory, where each write is a hand-off to the peer).
        ``codec``: this link's codec (:mod:`kvport.transfer.linkcodec`); raw when None."""
        self.t = transport
        self.io = FrameIO(transport, limits, batch_bytes)
        self.bp = bp or Backpressure()
        self.window = CreditWindow(self.bp)
        self.ledger, self.owner, self.peer = ledger, owner, peer
        if ledger is not None and (owner is None or peer is None):
            raise TransferError("a Sender with a ledger needs owner and peer")
        self.credit_timeout_s = credit_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.codec = codec
        self._enc = np.empty(0, np.uint8)  # encoded chunks of the layer being sent (reused)
        self._tids = itertools.count(1)
        self._current: Outgoing | None = None
        self._cond = self.window.cond  # one condition for grants and answers
        self._wlock = threading.Lock()
        self._dead: TransferError | None = None
        self._reader = threading.Thread(target=self._read_loop, name="kvport-sender-reader", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ reader thread
    def _read_loop(self) -> None:
        try:
            while True:
                f = self.io.read_frame()
                m = f.meta
                with self._cond:
                    cur = self._current
                    if f.msg_type is MsgType.CREDIT or f.msg_type is MsgType.TRANSFER_ACCEPT:
                        grant, budget = m.get("grant"), m.get("budget")
                        if not isinstance(grant, int) or not (budget is None or isinstance(budget, int)):
                            raise ProtocolError("credit frame without an int grant")
                        self.window.on_grant(grant, budget)
                    if cur is None or m.get("tid") != cur.tid:
                        if f.msg_type is MsgType.ERROR:
                            raise remote_error(m)
                        continue  # grant only, or a late answer to an aborted transfer
                    if f.msg_type is MsgType.TRANSFER_ACCEPT:
                        cur._move(OutState.ACCEPTED)
                    elif f.msg_type is MsgType.TRANSFER_COMMITTED:
                        cur._move(OutState.COMMITTED)
                        self._ledger_commit(cur)
                    elif f.msg_type in (MsgType.TRANSFER_REFUSE, MsgType.TRANSFER_ABORT, MsgType.ERROR):
                        self._fail(cur, remote_error(m))
                    self._cond.notify_all()
        except TransferError as exc:
            self._die(exc)
        except Exception as exc:
            self._die(PeerError(f"sender reader failed: {exc!r}"))

    def _die(self, exc: TransferError) -> None:
        with self._cond:
            self._dead = exc
            if self._current is not None and not self._current.done:
                self._fail(self._current, exc)
            self.window.reset()
            self._cond.notify_all()

    def _fail(self, h: Outgoing, exc: TransferError) -> None:
        if h.done:
            return
        h.error = exc
        h._move(OutState.ABORTED)
        OUTCOMES.labels(role="sender", outcome=type(exc).__name__).inc()
        if self.ledger is not None and h.ledger_tid is not None:
            self.ledger.abort_transfer(h.ledger_tid)

    def _ledger_commit(self, h: Outgoing) -> None:
        OUTCOMES.labels(role="sender", outcome="committed").inc()
        if self.ledger is not None and h.ledger_tid is not None:
            self.ledger.commit_transfer(h.ledger_tid)

    def _wait(self, h: Outgoing, pred: Callable[[], bool], timeout: float | None, what: str) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: pred() or h.done or self._dead is not None, timeout)
            if h.error is not None:
                raise h.error
            if self._dead is not None:
                raise self._dead
            if not ok:
                err = PeerError(f"transfer {h.tid}: no {what} within {timeout} s")
                self._fail(h, err)
                raise err

    # ------------------------------------------------------------------ API
    def try_admit(self) -> Admitted | Rejected:
        """May the scheduler start new work? Never blocks (watermarks with hysteresis)."""
        if self._dead is not None:
            return Rejected(RejectReason.PEER_FAILED, 1.0, f"connection failed: {self._dead}")
        return self.window.admission()

    def begin(self, meta: TransferMeta, timeout_s: float | None = 30.0) -> Outgoing:
        """Announce a transfer and wait for the receiver's compatibility verdict (raises its refusal)."""
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
            h = Outgoing(next(self._tids), meta, link=link)
            if self.ledger is not None and self.owner is not None and self.peer is not None:
                # all-or-nothing in the ledger; an OwnershipError leaves no transfer open
                h.ledger_tid = self.ledger.begin_transfer(meta.block_keys, self.owner, self.peer)
            self._current = h
        try:
            with self._wlock:
                self.io.send(MsgType.TRANSFER_BEGIN, {"tid": h.tid, **meta.to_wire()})
        except TransferError as exc:
            with self._cond:
                self._fail(h, exc)
            raise
        self._wait(h, lambda: h.state is OutState.ACCEPTED, timeout_s, "answer to TRANSFER_BEGIN")
        return h

    def send_layer(self, h: Outgoing, layer: int, blocks: Sequence[Buffer], digests: bytes | None = None) -> None:
        """Send layer ``layer`` of every block (``blocks[i]``: that layer's bytes of block i).

        ``digests``: the blocks' checksums for this layer, 8 bytes each (``kvport.memops.xxh3_many``),
        when the producer computed them as it wrote the KV (raw links only: a codec link hashes what it
        encoded). Without them the sender hashes each chunk as it goes out."""
        if layer not in h.meta.layers or layer in h.layers_sent:
            raise TransferError(f"layer {layer} not in {h.meta.layers} or sent twice")
        if len(blocks) != h.meta.n_blocks:
            raise TransferError(f"{len(blocks)} block views for {h.meta.n_blocks} blocks")
        lb = h.meta.block_layer_bytes
        if digests is not None and len(digests) != 8 * len(blocks):
            raise TransferError(f"{len(digests)} digest bytes for {len(blocks)} blocks")
        if h.link is not None:
            blocks = self._encode_layer(h.link, layer, blocks)
            digests = None
        per_frame = max(1, self.max_frame_bytes // lb)
        i = 0
        try:
            while i < len(blocks):
                if h.error is not None or self._dead is not None:
                    raise h.error or self._dead or PeerError("connection failed")
                k = min(per_frame, len(blocks) - i)
                if self.bp.enabled:
                    wait_for(self.window, lb, self.credit_timeout_s)
                    k = max(1, min(k, self.window.available // lb))
                self.window.consume(k * lb)
                with self._wlock:
                    self.io.send(MsgType.LAYER, {"tid": h.tid, "layer": layer, "b0": i}, blocks[i : i + k], lb,
                                 digests=None if digests is None else digests[8 * i : 8 * (i + k)])
                h.sent_bytes += k * lb
                SENT_BYTES.labels(transport=self.t.name).inc(k * lb)
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
        h.layers_sent.add(layer)

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
            with self._wlock:
                self.io.send(MsgType.TRANSFER_END, {"tid": h.tid})
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

    def _send_abort(self, h: Outgoing, exc: TransferError) -> None:
        try:
            with self._wlock:
                self.io.send(MsgType.TRANSFER_ABORT, {"tid": h.tid, "error": type(exc).__name__,
                                                      "message": str(exc)})
        except TransferError:
            pass  # the connection is gone; the receiver aborts on EOF

    def send(self, meta: TransferMeta, layer_blocks: Callable[[int], Sequence[Buffer]],
             timeout_s: float | None = 60.0, layer_digests: Callable[[int], bytes] | None = None) -> Outgoing:
        """Whole transfer: begin, every layer in order (``layer_blocks(l)``, with the producer's
        ``layer_digests(l)`` when it has them, see :meth:`send_layer`), end."""
        h = self.begin(meta, timeout_s)
        for layer in meta.layers:
            self.send_layer(h, layer, layer_blocks(layer), None if layer_digests is None else layer_digests(layer))
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
        self._q.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        self.sender.end(self.h, timeout_s)
