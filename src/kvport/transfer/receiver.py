"""Receiver: checks compatibility before any payload, receives straight into destination buffers,
links blocks only after every checksum passed, and grants credits from its free buffer space.

One serve loop per connection (:meth:`Receiver.serve`, or a thread via :meth:`start`) handles::

    TRANSFER_BEGIN  parse + check_compatible -> REFUSE {field} | destination(meta) -> ACCEPT {budget, grant}
    LAYER           views = destination.view(b, layer) -> recv_into(views) -> verify -> layer/block counts
    TRANSFER_END    all (block, layer) verified -> destination.commit() -> COMMITTED, else abort
    TRANSFER_ABORT  destination.abort(), bytes released (credits returned)

Incoming state: RECEIVING -> COMMITTED | ABORTED (:meth:`Incoming._finish` is the one place that
moves it; a second move raises). Any failure -- checksum, protocol, lost blocks, EOF or reset from the
sender -- aborts the destination (no partial block linked), releases the transfer's bytes, wakes
``wait_for_layer`` waiters with the typed error and tells the sender when the connection still works.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvport.errors import (
    BufferMismatchError,
    ChecksumError,
    CodecError,
    IllegalMoveError,
    KVPortError,
    PeerError,
    ProtocolError,
    TierError,
    TierFullError,
    TransferError,
)
from kvport.metrics import counter
from kvport.spec import KVSpec
from kvport.transfer.credits import Backpressure, CreditPool
from kvport.transfer.destination import Destination, DestinationFactory
from kvport.transfer.framing import FrameIO
from kvport.transfer.meta import TransferMeta, check_compatible
from kvport.transfer.sender import OUTCOMES
from kvport.transfer.transport import Transport
from kvport.transfer.wire import DEFAULT_LIMITS, FrameHeader, Limits, MsgType, error_meta

if TYPE_CHECKING:
    from kvport.transfer.linkcodec import LinkCodec

RECV_BYTES = counter("transfer_received_bytes_total", "KV payload bytes received", ["transport"])
LOST_BLOCKS = counter("transfer_lost_blocks_total", "Blocks dropped for want of a buffer (backpressure off)")


class InState(enum.Enum):
    RECEIVING = "receiving"
    COMMITTED = "committed"
    ABORTED = "aborted"


class Incoming:
    """One transfer as the receiver sees it; decode engines wait on its layers."""

    def __init__(self, tid: int, meta: TransferMeta, dest: Destination, link: LinkCodec | None = None) -> None:
        self.tid, self.meta, self.dest = tid, meta, dest
        self.state = InState.RECEIVING
        self.error: TransferError | None = None
        self.bytes_received = 0
        self.bytes_held = 0  # received, not yet released to the credit pool
        self.lost_blocks: set[int] = set()
        self._layer_blocks = {layer: 0 for layer in meta.layers}  # verified blocks per layer
        self._cond = threading.Condition()
        self.t_begin = time.monotonic()
        self.t_done: float | None = None
        self.link = link  # the link's codec (None: raw block-layers)

    def _finish(self, to: InState, error: TransferError | None = None) -> bool:
        with self._cond:
            if self.state is not InState.RECEIVING:
                if to is InState.ABORTED and self.state is InState.ABORTED:
                    return False
                raise IllegalMoveError(f"incoming {self.tid}: {self.state.value} -> {to.value}")
            self.state, self.error, self.t_done = to, error, time.monotonic()
            self._cond.notify_all()
            return True

    def _arrived(self, layer: int, n_blocks: int) -> None:
        with self._cond:
            self._layer_blocks[layer] += n_blocks
            self._cond.notify_all()

    def layer_ready(self, layer: int) -> bool:
        return self._layer_blocks.get(layer, -1) == self.meta.n_blocks

    @property
    def complete(self) -> bool:
        return all(n == self.meta.n_blocks for n in self._layer_blocks.values())

    def wait_for_layer(self, layer: int, timeout: float | None = None) -> None:
        """Return once every block's ``layer`` arrived and passed its checksum; raise the transfer's
        error if it aborts first, PeerError on timeout."""
        if layer not in self._layer_blocks:
            raise TransferError(f"layer {layer} is not part of transfer {self.tid} ({self.meta.layers})")
        with self._cond:
            ok = self._cond.wait_for(lambda: self.layer_ready(layer) or self.state is not InState.RECEIVING,
                                     timeout)
            if self.state is InState.ABORTED and self.error is not None:
                raise self.error
            if not ok or not self.layer_ready(layer):
                raise PeerError(f"layer {layer} of transfer {self.tid} did not arrive within {timeout} s")

    def wait(self, timeout: float | None = None) -> Incoming:
        """Until committed (returns self) or aborted (raises the error)."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self.state is not InState.RECEIVING, timeout)
            if self.error is not None:
                raise self.error
            if not ok:
                raise PeerError(f"transfer {self.tid} not finished within {timeout} s")
        return self


class Receiver:
    def __init__(self, transport: Transport, spec: KVSpec, destinations: DestinationFactory, budget_bytes: int,
                 bp: Backpressure | None = None, limits: Limits = DEFAULT_LIMITS, codecs: Iterable[str] = ("raw",),
                 auto_release: bool = True) -> None:
        """``auto_release``: bytes are released as soon as they landed and verified (the destination is
        the caller's own memory; credits then bound bytes in flight); otherwise the consumer calls
        :meth:`release` once it has freed committed KV (credits then bound the buffer it holds)."""
        self.t = transport
        self.io = FrameIO(transport, limits)
        self.spec = spec
        self.destinations = destinations
        self.bp = bp or Backpressure()
        self.pool = CreditPool(budget_bytes, self.bp)
        self.codecs = tuple(codecs)
        self.auto_release = auto_release
        self.incoming: queue.Queue[Incoming] = queue.Queue()
        self.current: Incoming | None = None
        self.error: TransferError | None = None
        self.refusals: list[KVPortError] = []  # every refused TRANSFER_BEGIN, newest last
        self._scratch = memoryview(bytearray(1 << 20))
        self._enc = memoryview(bytearray(0))  # encoded chunks of one LAYER frame (codec links), reused
        self._wlock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.closed = threading.Event()

    # ------------------------------------------------------------------ API
    def start(self) -> threading.Thread:
        self._thread = threading.Thread(target=self.serve, name="kvport-receiver", daemon=True)
        self._thread.start()
        return self._thread

    def next_transfer(self, timeout: float | None = None) -> Incoming:
        """The next accepted transfer (in arrival order), as soon as its BEGIN was accepted."""
        try:
            return self.incoming.get(timeout=timeout)
        except queue.Empty as exc:
            if self.error is not None:
                raise self.error from exc
            raise PeerError(f"no transfer within {timeout} s") from exc

    def release(self, nbytes: int) -> None:
        """The consumer freed ``nbytes`` of received KV: grant them back to the sender."""
        grant = self.pool.release(nbytes)
        if grant is not None and self.bp.enabled:
            self._send(MsgType.CREDIT, {"grant": grant})

    def close(self) -> None:
        self.t.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        try:
            while True:
                hdr, meta = self.io.read_head()
                self._dispatch(hdr, meta)
        except Exception as exc:  # every failure ends the connection with a typed error
            err = exc if isinstance(exc, TransferError) else TransferError(f"receiver failed: {exc!r}")
            if not isinstance(exc, KVPortError):
                err.__cause__ = exc
            self.error = err
            if self.current is not None and self.current.state is InState.RECEIVING:
                self._abort(self.current, err, tell_sender=not isinstance(exc, PeerError))
            if isinstance(exc, ProtocolError):
                self._send(MsgType.ERROR, error_meta(exc))
        finally:
            self.closed.set()
            self.t.close()

    def _send(self, mtype: MsgType, meta: dict[str, object]) -> None:
        try:
            with self._wlock:
                self.io.send(mtype, meta)
        except TransferError:
            pass  # the sender is gone; the serve loop sees EOF and aborts

    def _dispatch(self, hdr: FrameHeader, m: dict[str, object]) -> None:
        mt = hdr.msg_type
        if mt is MsgType.LAYER:
            self._on_layer(hdr, m)
            return
        if hdr.payload_len:
            raise ProtocolError(f"{mt.name} frames carry no payload")
        if mt is MsgType.TRANSFER_BEGIN:
            self._on_begin(m)
        elif mt is MsgType.TRANSFER_END:
            self._on_end(m)
        elif mt is MsgType.TRANSFER_ABORT:
            cur = self._cur(m)
            if cur is not None:
                self._abort(cur, TransferError(f"sender aborted: {m.get('message', '')}"), tell_sender=False)
        elif mt is not MsgType.PING:
            raise ProtocolError(f"unexpected {mt.name} on a transfer connection")

    def _cur(self, m: dict[str, object]) -> Incoming | None:
        cur = self.current
        if cur is None or m.get("tid") != cur.tid:
            return None
        return cur

    def _on_begin(self, m: dict[str, object]) -> None:
        tid = m.get("tid")
        if not isinstance(tid, int):
            raise ProtocolError("TRANSFER_BEGIN without an int tid")
        if self.current is not None and self.current.state is InState.RECEIVING:
            raise ProtocolError(f"TRANSFER_BEGIN {tid} while {self.current.tid} is open")
        try:
            meta = TransferMeta.from_wire(dict(m))
            check_compatible(self.spec, meta, self.codecs)
            link = None
            if meta.codec_id != "raw":  # the codecs (torch, numba) load only when a link uses one
                from kvport.transfer.linkcodec import LinkCodec

                link = LinkCodec.for_peer(meta.codec_id, meta.codec_params, self.spec, meta.block_layer_bytes)
            if meta.block_layer_bytes > self.pool.budget:
                raise TierFullError(f"one block-layer ({meta.block_layer_bytes} B) exceeds the budget "
                                    f"({self.pool.budget} B)")
            dest = self.destinations(meta)
        except (TransferError, TierError, BufferMismatchError) as exc:
            OUTCOMES.labels(role="receiver", outcome="refused").inc()
            self.refusals.append(exc)
            self._send(MsgType.TRANSFER_REFUSE, {"tid": tid, **error_meta(exc)})
            if isinstance(exc, ProtocolError):
                raise
            return
        inc = Incoming(tid, meta, dest, link)
        self.current = inc
        self.incoming.put(inc)
        self._send(MsgType.TRANSFER_ACCEPT, {"tid": tid, "budget": self.pool.budget,
                                             "grant": self.pool.announced_total})

    def _on_layer(self, hdr: FrameHeader, m: dict[str, object]) -> None:
        cur = self._cur(m)
        layer, b0 = m.get("layer"), m.get("b0")
        if cur is None or cur.state is not InState.RECEIVING:
            self.pool.on_received(hdr.payload_len)  # late frames of an aborted transfer: drain, release
            self.io.skip_payload(hdr, self._scratch)
            self.pool.release(hdr.payload_len)
            return
        meta = cur.meta
        if not isinstance(layer, int) or not isinstance(b0, int) or layer not in meta.layers or b0 < 0 \
                or b0 + hdr.n_chunks > meta.n_blocks or hdr.chunk_size != meta.block_layer_bytes \
                or hdr.payload_len != hdr.n_chunks * meta.block_layer_bytes:
            raise ProtocolError(f"LAYER frame (layer={layer}, b0={b0}, chunks={hdr.n_chunks}, "
                                f"chunk={hdr.chunk_size}) does not fit transfer {cur.tid}")
        self.pool.on_received(hdr.payload_len)
        cur.bytes_received += hdr.payload_len
        cur.bytes_held += hdr.payload_len
        views: list[memoryview] = []
        lost: list[int] = []
        if cur.link is not None:  # encoded chunks land in a scratch buffer, decoded once verified
            bad, lost = self._read_encoded(cur, cur.link, hdr, layer, b0)
        else:
            for i in range(b0, b0 + hdr.n_chunks):
                try:
                    views.append(cur.dest.view(i, layer))
                except TierFullError:
                    lost.append(i)
                    views.append(self._scratch[: meta.block_layer_bytes] if meta.block_layer_bytes <= 1 << 20
                                 else memoryview(bytearray(meta.block_layer_bytes)))
            bad = self.io.read_payload_into(hdr, views)
        RECV_BYTES.labels(transport=self.t.name).inc(hdr.payload_len)
        if lost:
            LOST_BLOCKS.inc(len(lost))
            cur.lost_blocks.update(lost)
        bad = [i for i in bad if b0 + i not in lost]
        if bad:
            what = "checksum" if cur.link is None else "checksum or did not decode"
            self._abort(cur, ChecksumError(f"transfer {cur.tid}: layer {layer} blocks "
                                           f"{[b0 + i for i in bad]} failed their {what}"))
            return
        cur._arrived(layer, hdr.n_chunks)
        if self.auto_release:
            cur.bytes_held -= hdr.payload_len
            self.release(hdr.payload_len)

    def _read_encoded(self, cur: Incoming, link: LinkCodec, hdr: FrameHeader, layer: int,
                      b0: int) -> tuple[list[int], list[int]]:
        """Receive a codec link's LAYER payload, then decode every chunk that passed its checksum into
        the destination. Returns (chunks that failed a check or did not decode, blocks lost)."""
        cb, n = hdr.chunk_size, hdr.n_chunks
        if self._enc.nbytes < n * cb:  # payload_len was capped by decode_header
            self._enc = memoryview(bytearray(n * cb))
        views = [self._enc[j * cb : (j + 1) * cb] for j in range(n)]
        bad = self.io.read_payload_into(hdr, views)
        lost: list[int] = []
        skip = set(bad)
        for j in range(n):
            if j in skip:
                continue
            try:
                link.decode_into(views[j], cur.dest.view(b0 + j, layer))
            except TierFullError:
                lost.append(b0 + j)
            except CodecError:
                bad.append(j)
        return bad, lost

    def _on_end(self, m: dict[str, object]) -> None:
        cur = self._cur(m)
        if cur is None or cur.state is not InState.RECEIVING:
            return  # already aborted and answered
        if cur.lost_blocks:
            self._abort(cur, TierFullError(f"transfer {cur.tid}: {len(cur.lost_blocks)} blocks dropped, "
                                           "no buffer (backpressure off)"))
            return
        if not cur.complete:
            self._abort(cur, ProtocolError(f"transfer {cur.tid} ended before every layer arrived"))
            return
        try:
            cur.dest.commit()
        except KVPortError as exc:
            self._abort(cur, TransferError(f"commit failed: {exc}"))
            return
        cur._finish(InState.COMMITTED)
        OUTCOMES.labels(role="receiver", outcome="committed").inc()
        self._send(MsgType.TRANSFER_COMMITTED, {"tid": cur.tid})

    def _abort(self, cur: Incoming, err: TransferError | TierError, tell_sender: bool = True) -> None:
        terr = err if isinstance(err, TransferError) else TransferError(str(err))
        if isinstance(err, TierFullError):
            terr.__cause__ = err
        if not cur._finish(InState.ABORTED, terr):
            return
        OUTCOMES.labels(role="receiver", outcome=type(err).__name__).inc()
        try:
            cur.dest.abort()
        finally:
            held, cur.bytes_held = cur.bytes_held, 0
            self.release(held)  # credits returned
            if tell_sender:
                self._send(MsgType.TRANSFER_ABORT, {"tid": cur.tid, **error_meta(err)})
