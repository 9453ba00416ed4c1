"""Receiver: checks compatibility and the sender's owner before any payload, receives straight into
destination buffers, links blocks only after every (block, layer) was verified exactly once, and
grants credits from its free buffer space.

One serve loop per connection (:meth:`Receiver.serve`, or a thread via :meth:`start`) handles::

    TRANSFER_BEGIN  decode -> sender owner a known peer? -> check_compatible -> REFUSE {error}
                    | destination(meta) -> ACCEPT {budget, grant, owner}
    LAYER           a (block, layer) already arrived? -> abort (ProtocolError, payload drained)
                    views = destination.view(b, l) -> recv_into(views) -> verify -> set bits
    TRANSFER_END    every (block, layer) bit set -> ledger.acquire -> destination.commit()
                    -> COMMITTED {owner}, else abort
    TRANSFER_ABORT  destination.abort(), bytes released (credits returned)

Completeness is a bitmap per transfer, not a count: ``arrived[layer, block]`` is set when a LAYER
frame naming that block-layer is accepted (a second frame for it is a duplicate: the transfer
aborts, whatever its bytes), ``verified[layer, block]`` once its chunk passed its checksum (and, on
a codec link, decoded). A transfer commits only when every bit of ``verified`` is set::

    verified  (layers x blocks, numpy bool)      layer_ready(l) = verified[l].all()
              b0 b1 b2 b3 ...                    complete       = count == layers * blocks
      l0   [   1  1  1  1  ]
      l1   [   1  1  0  0  ]  <- a LAYER frame sets its rectangle verified[l0 : l0 + nl, b0 : b0 + nb]
                                   in one slice (one layer of many blocks, or whole blocks)

Incoming state: RECEIVING -> COMMITTED | ABORTED (:meth:`Incoming._finish` is the one place that
moves it; a second move raises). Any failure -- checksum, duplicate, protocol, lost blocks, a second
owner, EOF or reset from the sender -- aborts the destination (no partial block linked), releases
the transfer's bytes, then wakes ``wait``/``wait_for_layer`` waiters with the typed error (a waiter
woken by an abort finds the pages and credits already back) and tells the sender when the connection
still works.

With a ledger (``Receiver(ledger=, owner=, peers=)``) a commit is a recorded hand-off: the sender's
owner must be a known peer (else REFUSE with UnknownPeerError), blocks this ledger already owns are
refused (IllegalMoveError), and at TRANSFER_END the ledger records ACQUIRE(owner, from=sender owner,
the sender's ``ledger_tid``) before the destination links anything; a commit that then fails forgets
the acquired keys. A load is complete, verified and owned, or nothing.
"""

from __future__ import annotations

import contextlib
import enum
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvport.errors import (
    BufferMismatchError,
    ChecksumError,
    CodecError,
    ConfigError,
    DeadlineExceeded,
    IllegalMoveError,
    KVPortError,
    OwnershipError,
    PeerError,
    ProtocolError,
    TierError,
    TierFullError,
    TransferError,
    UnknownPeerError,
)
from kvport.ledger.states import Owner
from kvport.metrics import counter
from kvport.protocol.errors import error_meta
from kvport.protocol.frame import DEFAULT_LIMITS, FrameHeader, Limits, MsgType
from kvport.protocol.schema import Message
from kvport.protocol.sync import FrameIO
from kvport.protocol.transfer import (
    Credit,
    HandoffRecords,
    HandoffRecordsAnswer,
    HandoffRow,
    LayerHead,
    TransferAbort,
    TransferAccept,
    TransferBegin,
    TransferCommitted,
    TransferEnd,
    TransferRefuse,
    tid_of,
)
from kvport.protocol.transport import Transport
from kvport.spec import KVSpec
from kvport.transfer.credits import Backpressure, CreditPool
from kvport.transfer.destination import Destination, DestinationFactory
from kvport.transfer.meta import TransferMeta, check_compatible
from kvport.transfer.sender import OUTCOMES

if TYPE_CHECKING:
    from kvport.ledger import Ledger
    from kvport.transfer.linkcodec import LinkCodec

RECV_BYTES = counter("transfer_received_bytes_total", "KV payload bytes received", ["transport"])
LOST_BLOCKS = counter("transfer_lost_blocks_total", "Blocks dropped for want of a buffer (backpressure off)")


def _transfer_error(err: KVPortError) -> KVPortError:
    """What a failed transfer reports, here and to the sender: a tier's error (no buffer, a buffer
    that does not fit) is the transfer's failure, caused by it; transfer and ownership errors are
    reported as they are."""
    if isinstance(err, TierError):
        out = TransferError(f"{type(err).__name__}: {err}")
        out.__cause__ = err
        return out
    return err


class InState(enum.Enum):
    RECEIVING = "receiving"
    COMMITTED = "committed"
    ABORTED = "aborted"


class Incoming:
    """One transfer as the receiver sees it; decode engines wait on its layers.

    ``peer``: the sender's ledger owner and ``ledger_tid`` its transfer id (None / "" without
    ledgers). ``error``: why it aborted -- a TransferError, or an OwnershipError when the ledgers
    disagree (unknown peer, a second owner)."""

    def __init__(self, tid: int, meta: TransferMeta, dest: Destination, link: LinkCodec | None = None,
                 peer: Owner | None = None, ledger_tid: str = "") -> None:
        self.tid, self.meta, self.dest = tid, meta, dest
        self.peer, self.ledger_tid = peer, ledger_tid
        self.state = InState.RECEIVING
        self.error: KVPortError | None = None
        self.bytes_received = 0
        self.bytes_held = 0  # received, not yet released to the credit pool
        self.lost_blocks: set[int] = set()
        shape = (len(meta.layers), meta.n_blocks)
        self._arrived = np.zeros(shape, dtype=np.bool_)  # a LAYER frame named it (duplicates abort)
        self._verified = np.zeros(shape, dtype=np.bool_)  # its chunk passed its checksum (and decoded)
        self._n_verified = 0
        self._cond = threading.Condition()
        self._settled = False  # finished and cleaned up: what waiters wait for
        self.t_begin = time.monotonic()
        self.t_done: float | None = None
        self.link = link  # the link's codec (None: raw block-layers)

    def _finish(self, to: InState, error: KVPortError | None = None, settle: bool = True) -> bool:
        """The move; ``settle=False`` claims it without waking waiters (an abort cleans up first,
        then :meth:`_settle`)."""
        with self._cond:
            if self.state is not InState.RECEIVING:
                if to is InState.ABORTED and self.state is InState.ABORTED:
                    return False
                raise IllegalMoveError(f"incoming {self.tid}: {self.state.value} -> {to.value}")
            self.state, self.error, self.t_done = to, error, time.monotonic()
            if settle:
                self._settle()
            return True

    def _settle(self) -> None:
        with self._cond:
            self._settled = True
            self._cond.notify_all()

    def _claim(self, layer: int, n_layers: int, b0: int, n_blocks: int) -> bool:
        """Mark the block-layers of one LAYER frame as arriving; False when one of them already did."""
        li = layer - self.meta.layer_lo
        region = self._arrived[li : li + n_layers, b0 : b0 + n_blocks]
        if region.any():
            return False
        region[:] = True
        return True

    def _verified_run(self, layer: int, b0: int, ok: np.ndarray) -> None:
        """Chunks of one LAYER frame passed their checks: ``ok[l, i]`` for block-layer
        (``b0 + i``, ``layer + l``)."""
        li = layer - self.meta.layer_lo
        with self._cond:
            region = self._verified[li : li + ok.shape[0], b0 : b0 + ok.shape[1]]
            region |= ok  # never set twice: _claim refused every (block, layer) a second time
            self._n_verified += int(np.count_nonzero(ok))
            self._cond.notify_all()

    @property
    def verified(self) -> np.ndarray:
        """A copy of the bitmap: ``[layer - layer_lo, block]`` True once that chunk was verified."""
        with self._cond:
            return self._verified.copy()

    def layer_ready(self, layer: int) -> bool:
        li = layer - self.meta.layer_lo
        return 0 <= li < self._verified.shape[0] and bool(self._verified[li].all())

    @property
    def settled(self) -> bool:
        """Committed, or aborted with its pages and credits back: :meth:`wait` answers at once."""
        return self._settled

    @property
    def complete(self) -> bool:
        return self._n_verified == self._verified.size

    def wait_for_layer(self, layer: int, timeout: float | None = None) -> None:
        """Return once every block's ``layer`` arrived and passed its checksum; raise the transfer's
        error if it aborts first, PeerError on timeout."""
        if layer not in self.meta.layers:
            raise TransferError(f"layer {layer} is not part of transfer {self.tid} ({self.meta.layers})")
        with self._cond:
            ok = self._cond.wait_for(lambda: self._settled or (self.layer_ready(layer)
                                                               and self.state is not InState.ABORTED), timeout)
            if self._settled and self.state is InState.ABORTED and self.error is not None:
                raise self.error
            if not ok or not self.layer_ready(layer):
                raise PeerError(f"layer {layer} of transfer {self.tid} did not arrive within {timeout} s")

    def wait(self, timeout: float | None = None) -> Incoming:
        """Until committed (returns self) or aborted (raises the error)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._settled, timeout):
                raise PeerError(f"transfer {self.tid} not finished within {timeout} s")
            if self.error is not None:
                raise self.error
        return self


class Receiver:
    def __init__(self, transport: Transport, spec: KVSpec, destinations: DestinationFactory, budget_bytes: int,
                 bp: Backpressure | None = None, limits: Limits = DEFAULT_LIMITS, codecs: Iterable[str] = ("raw",),
                 auto_release: bool = True, ledger: Ledger | None = None, owner: Owner | None = None,
                 peers: Iterable[Owner] = (), admit_peer: Callable[[Owner], bool] | None = None,
                 reshard: bool = False) -> None:
        """``auto_release``: bytes are released as soon as they landed and verified (the destination is
        the caller's own memory; credits then bound bytes in flight); otherwise the consumer calls
        :meth:`release` once it has freed committed KV (credits then bound the buffer it holds).

        ``ledger`` / ``owner``: record each commit as ``owner`` acquiring the blocks from the sender's
        owner, which must be one of ``peers`` (added to the ledger), already a peer of it, or one
        ``admit_peer`` admits (it adds it: a sender on an authenticated link, :mod:`kvport.transfer.handoff`).

        ``reshard``: accept senders of another TP width whose heads are some of this rank's (their
        destination assembles the heads: :mod:`kvport.transfer.reshard`); else such a spec is refused."""
        if ledger is not None and owner is None:
            raise ConfigError("a Receiver with a ledger needs its owner")
        peers = tuple(peers)
        if peers and ledger is None:
            raise ConfigError("peers are known to a ledger: pass ledger= with them")
        self.t = transport
        self.io = FrameIO(transport, limits)
        self._recv_bytes = RECV_BYTES.labels(transport=transport.name)
        self.spec = spec
        self.destinations = destinations
        self.bp = bp or Backpressure()
        self.pool = CreditPool(budget_bytes, self.bp)
        self.codecs = tuple(codecs)
        self.auto_release = auto_release
        self.ledger, self.owner = ledger, owner
        self.admit_peer = admit_peer
        self.reshard = reshard
        for p in peers:
            ledger.add_peer(p)  # type: ignore[union-attr]  # checked above
        self.incoming: queue.Queue[Incoming] = queue.Queue()
        self.current: Incoming | None = None
        self.error: TransferError | None = None
        self.refusals: list[KVPortError] = []  # every refused TRANSFER_BEGIN, newest last
        self._scratch = memoryview(bytearray(1 << 20))
        self._enc = memoryview(bytearray(0))  # encoded chunks of one LAYER frame (codec links), reused
        self._wlock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.closed = threading.Event()

    @property
    def _owner_name(self) -> str:
        return "" if self.owner is None else str(self.owner)

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

    def release(self, nbytes: int, inc: Incoming | None = None) -> None:
        """The consumer freed ``nbytes`` of received KV (of transfer ``inc``, when given: an abort
        then returns only what the consumer still held): grant them back to the sender."""
        if inc is not None:
            with inc._cond:
                nbytes = min(nbytes, inc.bytes_held)
                inc.bytes_held -= nbytes
        self._grant(self.pool.release(nbytes))

    def _grant(self, grant: int | None) -> None:
        """Tell the sender of credits the pool gave back (a socket write)."""
        if grant is not None and self.bp.enabled:
            self._send(Credit(grant))

    def abandon(self, inc: Incoming, reason: str = "the consumer gave up (deadline)") -> None:
        """The consumer gives up on ``inc`` (its load's deadline passed): the transfer is void --
        nothing of it is linked, the destination is aborted, the credits it held come back and the
        sender is told (its ledger gives the blocks back to their owner). A transfer that already
        committed or aborted is left as it is (an abort under way on the receiving thread is waited
        for: its cleanup is local, bounded here at 5 s)."""
        if inc.state is InState.RECEIVING:
            self._abort(inc, DeadlineExceeded(reason))
        with inc._cond:
            inc._cond.wait_for(lambda: inc._settled, 5.0)

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
                self._send_raw(MsgType.ERROR, error_meta(exc))
        finally:
            self.closed.set()
            self.t.close()

    def _send(self, msg: Message) -> None:
        self._send_raw(msg.TYPE, msg.to_meta())

    def _send_raw(self, mtype: MsgType, meta: dict[str, Any]) -> None:
        try:
            with self._wlock:
                self.io.send(mtype, meta)
        except TransferError:
            pass  # the sender is gone; the serve loop sees EOF and aborts

    def _dispatch(self, hdr: FrameHeader, m: dict[str, Any]) -> None:
        """Decode the peer's message (ProtocolError on a bad field) and hand it to its handler."""
        mt = hdr.msg_type
        if mt is MsgType.LAYER:
            self._on_layer(hdr, LayerHead.from_meta(m))
            return
        if hdr.payload_len:
            raise ProtocolError(f"{mt.name} frames carry no payload")
        if mt is MsgType.TRANSFER_BEGIN:
            try:
                begin = TransferBegin.from_meta(m)
            except ProtocolError as exc:  # refused (the sender may match it by tid), then the connection ends
                tid = tid_of(m)
                if tid is not None:
                    self._refuse(tid, exc)
                raise
            self._on_begin(begin)
        elif mt is MsgType.TRANSFER_END:
            self._on_end(TransferEnd.from_meta(m))
        elif mt is MsgType.TRANSFER_ABORT:
            abort = TransferAbort.from_meta(m)
            cur = self._cur(abort.tid)
            if cur is not None:
                self._abort(cur, abort.error, tell_sender=False)
        elif mt is MsgType.HANDOFF_RECORDS:
            self._send(self._records(HandoffRecords.from_meta(m).limit))
        elif mt is not MsgType.PING:
            raise ProtocolError(f"unexpected {mt.name} on a transfer connection")

    def _records(self, limit: int) -> HandoffRecordsAnswer:
        """The newest ``limit`` moves of this receiver's ledger (none without one), oldest first."""
        if self.ledger is None:
            return HandoffRecordsAnswer("", 0, ())
        now = self.ledger.clock()
        rows = tuple(HandoffRow(r.key.hex(), r.move.value, "" if r.owner_from is None else str(r.owner_from),
                                "" if r.owner_to is None else str(r.owner_to), r.tid or "", max(0.0, now - r.at))
                     for r in self.ledger.recent(limit))
        return HandoffRecordsAnswer(self._owner_name, len(self.ledger), rows)

    def _cur(self, tid: int) -> Incoming | None:
        cur = self.current
        if cur is None or tid != cur.tid:
            return None
        return cur

    def _refuse(self, tid: int, exc: KVPortError) -> None:
        OUTCOMES.labels(role="receiver", outcome="refused").inc()
        self.refusals.append(exc)
        self._send(TransferRefuse(tid, _transfer_error(exc)))

    def _sender_owner(self, begin: TransferBegin) -> Owner | None:
        """The sender's owner, a known peer of our ledger (None without a ledger)."""
        if self.ledger is None:
            return None
        try:
            peer = Owner.parse(begin.owner)
        except IllegalMoveError as exc:
            raise UnknownPeerError(f"sender owner {begin.owner[:80]!r} is not a known peer of this receiver") from exc
        if peer not in self.ledger.peers and (self.admit_peer is None or not self.admit_peer(peer)):
            raise UnknownPeerError(f"{peer} is not a known peer of this receiver's ledger")
        if not begin.ledger_tid:
            raise ProtocolError(f"TRANSFER_BEGIN {begin.tid} from {peer} names no ledger_tid")
        # once per transfer: a block someone else owns here is refused; one this receiver's owner
        # already holds (a prefix two requests share: the key names the bytes) stays as it is
        owned = [k for k in begin.transfer.block_keys if self.ledger.knows(k) and not self._held(k)]
        if owned:
            raise IllegalMoveError(f"{len(owned)} of the blocks already have an owner here "
                                   f"(first {owned[0].hex()}): a transfer does not make a second owner")
        return peer

    def _held(self, key: bytes) -> bool:
        """``key`` is already this receiver's owner's (a ledger record of it, by this owner)."""
        assert self.ledger is not None
        try:
            return self.ledger.owner_of(key) == self.owner
        except OwnershipError:
            return False

    def _on_begin(self, begin: TransferBegin) -> None:
        tid, meta = begin.tid, begin.transfer
        if self.current is not None and self.current.state is InState.RECEIVING:
            raise ProtocolError(f"TRANSFER_BEGIN {tid} while {self.current.tid} is open")
        try:
            peer = self._sender_owner(begin)
            check_compatible(self.spec, meta, self.codecs, self.reshard)
            link = None
            if meta.codec_id != "raw":  # the codecs (torch, numba) load only when a link uses one
                from kvport.transfer.linkcodec import LinkCodec

                link = LinkCodec.for_peer(meta.codec_id, meta.codec_params, meta.spec, meta.block_layer_bytes)
            if meta.block_layer_bytes > self.pool.budget:
                raise TierFullError(f"one block-layer ({meta.block_layer_bytes} B) exceeds the budget "
                                    f"({self.pool.budget} B)")
            dest = self.destinations(meta)
        except (TransferError, TierError, BufferMismatchError, OwnershipError) as exc:
            self._refuse(tid, exc)
            if isinstance(exc, ProtocolError):
                raise
            return
        inc = Incoming(tid, meta, dest, link, peer, begin.ledger_tid)
        self.current = inc
        self.incoming.put(inc)
        self._send(TransferAccept(tid, self.pool.budget, self.pool.announced_total, self._owner_name))

    def _drain(self, hdr: FrameHeader) -> None:
        """A payload nobody will keep (late frames of an aborted transfer, a duplicate): read through
        the scratch buffer, its bytes granted back."""
        self.pool.on_received(hdr.payload_len)
        self.io.skip_payload(hdr, self._scratch)
        self.release(hdr.payload_len)

    def _on_layer(self, hdr: FrameHeader, head: LayerHead) -> None:
        cur = self._cur(head.tid)
        if cur is None or cur.state is not InState.RECEIVING:
            self._drain(hdr)
            return
        meta = cur.meta
        layer, b0, nl, n = head.layer, head.b0, head.n_layers, hdr.n_chunks
        nb = n // nl  # chunk j is block-layer (b0 + j // nl, layer + j % nl)
        if n % nl or layer < meta.layer_lo or layer + nl > meta.layers.stop or b0 + nb > meta.n_blocks \
                or hdr.chunk_size != meta.block_layer_bytes or hdr.payload_len != n * meta.block_layer_bytes:
            raise ProtocolError(f"LAYER frame (layer={layer}, n_layers={nl}, b0={b0}, chunks={n}, "
                                f"chunk={hdr.chunk_size}) does not fit transfer {cur.tid}")
        if not cur._claim(layer, nl, b0, nb):  # nothing of it lands: verified bytes are never overwritten
            self._abort(cur, ProtocolError(f"transfer {cur.tid}: a LAYER frame repeats block-layers (layers "
                                           f"[{layer}, {layer + nl}), blocks [{b0}, {b0 + nb})): every "
                                           "block-layer must arrive exactly once"))
            self._drain(hdr)
            return
        self.pool.on_received(hdr.payload_len)
        cur.bytes_received += hdr.payload_len
        with cur._cond:  # the consumer releases (and may abandon) from its own thread
            cur.bytes_held += hdr.payload_len
        lost: list[int] = []
        if cur.link is not None:  # encoded chunks land in a scratch buffer, decoded once verified
            bad, lost = self._read_encoded(cur, cur.link, hdr, layer, nl, b0)
        else:
            views: list[memoryview] = []
            for j in range(n):
                try:
                    views.append(cur.dest.view(b0 + j // nl, layer + j % nl))
                except TierFullError:
                    lost.append(j)
                    views.append(self._scratch[: meta.block_layer_bytes] if meta.block_layer_bytes <= 1 << 20
                                 else memoryview(bytearray(meta.block_layer_bytes)))
            bad = self.io.read_payload_into(hdr, views)
        self._recv_bytes.inc(hdr.payload_len)
        ok = np.ones(n, dtype=np.bool_)
        if lost:
            LOST_BLOCKS.inc(len({j // nl for j in lost}))
            cur.lost_blocks.update(b0 + j // nl for j in lost)
            ok[lost] = False
        bad = [j for j in bad if ok[j]]
        if bad:
            what = "checksum" if cur.link is None else "checksum or did not decode"
            where = (f"layer {layer} blocks {[b0 + j for j in bad]}" if nl == 1 else
                     f"block-layers {[(b0 + j // nl, layer + j % nl) for j in bad]}")
            self._abort(cur, ChecksumError(f"transfer {cur.tid}: {where} failed their {what}"))
            return
        cur._verified_run(layer, b0, ok.reshape(nb, nl).T)
        if self.auto_release:
            self.release(hdr.payload_len, cur)

    def _read_encoded(self, cur: Incoming, link: LinkCodec, hdr: FrameHeader, layer: int, nl: int,
                      b0: int) -> tuple[list[int], list[int]]:
        """Receive a codec link's LAYER payload, then decode every chunk that passed its checksum into
        the destination. Returns (chunks that failed a check or did not decode, chunks whose block
        had no buffer), as indexes into the frame."""
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
                link.decode_into(views[j], cur.dest.view(b0 + j // nl, layer + j % nl))
            except TierFullError:
                lost.append(j)
            except CodecError:
                bad.append(j)  # its bit stays unset: the transfer aborts
        return bad, lost

    def _on_end(self, end: TransferEnd) -> None:
        cur = self._cur(end.tid)
        if cur is None or cur.state is not InState.RECEIVING:
            return  # already aborted and answered
        if cur.lost_blocks:
            self._abort(cur, TierFullError(f"transfer {cur.tid}: {len(cur.lost_blocks)} blocks dropped, "
                                           "no buffer (backpressure off)"))
            return
        if not cur.complete:
            missing = int(cur._verified.size - cur._n_verified)
            self._abort(cur, ProtocolError(f"transfer {cur.tid} ended with {missing} block-layers never verified"))
            return
        keys: tuple[bytes, ...] = ()  # acquired now: those this owner does not hold already
        if self.ledger is not None and self.owner is not None and cur.peer is not None:
            keys = tuple(k for k in cur.meta.block_keys if not (self.ledger.knows(k) and self._held(k)))
            try:  # all or nothing: a key another owner took meanwhile is a second owner, nothing changes
                if keys:
                    self.ledger.acquire(keys, self.owner, cur.peer, cur.ledger_tid)
            except OwnershipError as exc:
                self._abort(cur, exc)
                return
        try:
            cur.dest.commit()
        except KVPortError as exc:
            if self.ledger is not None and cur.peer is not None:
                for k in keys:  # the acquired records go: nothing was linked
                    with contextlib.suppress(OwnershipError):
                        self.ledger.forget(k)
            self._abort(cur, TransferError(f"commit failed: {exc}"))
            return
        self._send(TransferCommitted(cur.tid, self._owner_name))  # before a waiter may close the connection
        cur._finish(InState.COMMITTED)
        OUTCOMES.labels(role="receiver", outcome="committed").inc()

    def _abort(self, cur: Incoming, err: KVPortError, tell_sender: bool = True) -> None:
        terr = _transfer_error(err)
        if not cur._finish(InState.ABORTED, terr, settle=False):
            return
        grant = None
        try:
            OUTCOMES.labels(role="receiver", outcome=type(err).__name__).inc()
            cur.dest.abort()
        finally:
            try:
                with cur._cond:
                    held, cur.bytes_held = cur.bytes_held, 0
                grant = self.pool.release(held)  # credits back in the pool
            finally:
                cur._settle()  # only now are waiters woken (whatever failed above): pages and credits are back
            self._grant(grant)  # then the peer is told, which may wait on the socket
            if tell_sender:
                self._send(TransferAbort(cur.tid, terr))
