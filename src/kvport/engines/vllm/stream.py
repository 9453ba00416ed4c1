"""The hand-off streamed layer by layer: a prefill engine's KV goes to the decode engine *during* the
prefill's forward, over kvport's transfer (:mod:`kvport.transfer`: the compatibility contract checked
before any byte, a checksum per block-layer, credits, an all-or-nothing commit). No vLLM import.

::

    prefill engine (kv_producer) worker                 decode engine (kv_consumer) worker
    start_load_kv   begin one transfer per streamed     Receiver (one per connection): TRANSFER_BEGIN
                    request of the step ------------->  -> spec checked, inbox slots reserved (or
                                                        refused: the inbox is full)
    save_kv_layer   layer l of the step's blocks,
                    straight from the paged KV (no        each block-layer lands in its inbox slot,
                    copy), sent by the transfer's thread  its checksum verified
                    while layers l+1.. compute ------->
    wait_for_save   TRANSFER_END, wait (bounded) for    every block-layer verified -> the blocks join
                    COMMITTED <------------------------  the stream's entry, keyed by the stream id
                    failed: the blocks go to the store
                    instead (the unstreamed hand-off)
                                                        the decode request (its kv_transfer_params name
                                                        the stream; no store lookup): AsyncLoads takes
                                                        the stream's slots for the request's own keys
                                                        and scatters them into the paged KV; after the
                                                        request's first step they are sealed and put in
                                                        the store (the next turn's prefill finds them)

A stream id is 128 random bits the producer's scheduler draws per request; the decode engine uses
only blocks of the stream its own request names, and only under the keys it computed from its own
prompt, so nothing else sent to the inbox can be linked into a request. Inbox slots are reserved
whole at TRANSFER_BEGIN (a full inbox refuses the transfer, and the rest of its stream: bounded
memory; the producer saves those blocks to the store in the step, and the decode request, told at
once, reads them there); a stream nobody takes within ``ttl_s`` goes to the store when its room is
needed.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvport import metrics
from kvport.deadline import Deadline
from kvport.errors import ConfigError, KVPortError, PeerError, TierFullError, TransferError
from kvport.keys import BlockKey
from kvport.protocol.rejects import Rejected
from kvport.protocol.transfer import TransferMeta
from kvport.protocol.transport import Transport
from kvport.spec import KVSpec
from kvport.transfer import shm, tcp
from kvport.transfer.receiver import Receiver
from kvport.transfer.sender import LayerStreamer, Outgoing, Sender

from .plan import StreamCopy
from .stream_addr import DEST_KEY, SHM_PREFIX, parse_dest

if TYPE_CHECKING:  # torch comes with the paged KV; the proxy imports this module without vLLM
    from .paged import PagedKV

log = logging.getLogger(__name__)

_STREAMS = metrics.counter("vllm_pd_streams", "hand-offs streamed layer by layer, by outcome (producer: "
                           "committed, failed; decode: taken, partial, lapsed, refused)", ["outcome"])
_STREAM_ID = re.compile(r"[0-9a-f]{32}")
IDLE_TIMEOUT_S = 3600.0
MAX_STREAMS = 4096  # streams an inbox tracks at once (most hold slots; failed ones only their reason)
RECEIVER_BUDGET_BYTES = 32 << 20  # bytes in flight per connection (credits); they land in the inbox at once
SHM_SLOT_BYTES, SHM_SLOTS = 4 << 20, 8  # a producer's ring to one inbox: 32 MiB
SHM_FRAME_BYTES = 32 << 20  # on shared memory a frame is one hand-off to the peer: a layer of a step per frame


def new_stream_id() -> str:
    return secrets.token_hex(16)


def is_stream_id(value: object) -> bool:
    return isinstance(value, str) and _STREAM_ID.fullmatch(value) is not None


# ---------------------------------------------------------------------- decode side
@dataclass(slots=True)
class _Stream:
    slots: dict[BlockKey, int] = field(default_factory=dict)  # committed blocks
    open: int = 0  # transfers of it still receiving
    error: str = ""  # why a transfer of it failed (the rest is recomputed)
    taken: bool = False  # a request took it while a transfer of it was open: that one's blocks go back
    t: float = field(default_factory=time.monotonic)


class Inbox:
    """Preallocated slots, one stored block each (envelope header + every layer's slab), where
    streamed blocks land; ``take`` hands a stream's blocks to the request that names it."""

    def __init__(self, spec: KVSpec, capacity_blocks: int, header: int, ttl_s: float = 30.0) -> None:
        if capacity_blocks <= 0:
            raise ConfigError(f"the inbox needs at least one block, got {capacity_blocks}")
        self.spec = spec
        self.header = header
        self.slab = spec.bytes_per_layer_block
        self.array = np.ones((capacity_blocks, header + spec.bytes_per_block), dtype=np.uint8)  # touched now
        self.ttl_s = ttl_s
        self._free = list(range(capacity_blocks - 1, -1, -1))  # pop() gives ascending slots
        self._streams: dict[str, _Stream] = {}
        self._cond = threading.Condition()
        # given a lapsed stream's (key, slot) pairs, keeps them (in the store) and releases the slots;
        # None: the slots are freed at once
        self.on_lapse: Callable[[list[tuple[BlockKey, int]]], None] | None = None

    @property
    def capacity(self) -> int:
        return int(self.array.shape[0])

    @property
    def free_blocks(self) -> int:
        with self._cond:
            return len(self._free)

    def slot_view(self, slot: int) -> memoryview:
        return memoryview(self.array[slot])

    @staticmethod
    def rows(slots: Sequence[int]) -> slice | np.ndarray:
        """The index of ``slots`` into the inbox, once per load: a slice when they are consecutive
        (then every layer's slabs are a view, no copy), else an index array."""
        if slots and all(b - a == 1 for a, b in itertools.pairwise(slots)):
            return slice(slots[0], slots[-1] + 1)
        return np.asarray(slots, dtype=np.int64)

    def layer(self, layer: int, rows: slice | np.ndarray) -> np.ndarray:
        """Layer ``layer``'s slabs of the slots ``rows`` (:meth:`rows`) names: (n, slab)."""
        at = self.header + layer * self.slab
        return self.array[rows, at : at + self.slab]

    # -- the receiver's side (its serve thread)
    def destination(self, meta: TransferMeta) -> InboxDestination:
        if not is_stream_id(meta.request_id):
            raise TransferError(f"a streamed hand-off names its stream (32 hex digits), got {meta.request_id[:40]!r}")
        with self._cond:
            crowded = len(self._free) < meta.n_blocks or len(self._streams) >= MAX_STREAMS // 2
            lapsed = self._lapse(time.monotonic()) if crowded else []
            err = self._streams[meta.request_id].error if meta.request_id in self._streams else ""
            if meta.request_id not in self._streams and len(self._streams) >= MAX_STREAMS:
                raise TierFullError(f"the inbox holds {len(self._streams)} streams nobody took yet")
            if len(self._free) < meta.n_blocks or err:
                _STREAMS.labels(outcome="refused").inc()
                why = err or (f"the inbox has {len(self._free)} free blocks of {self.capacity}, the transfer "
                              f"needs {meta.n_blocks}")
                # the stream is void (its decode request goes to the store at once, not after a wait)
                self._streams.setdefault(meta.request_id, _Stream()).error = why
                self._hand_lapsed(lapsed)
                raise TierFullError(why)
            slots = [self._free.pop() for _ in range(meta.n_blocks)]
            st = self._streams.setdefault(meta.request_id, _Stream())
            st.open += 1
        self._hand_lapsed(lapsed)
        return InboxDestination(self, meta, slots)

    def _hand_lapsed(self, lapsed: list[tuple[BlockKey, int]]) -> None:
        if not lapsed:
            return
        if self.on_lapse is None:
            self.release([slot for _, slot in lapsed])
        else:
            self.on_lapse(lapsed)

    def _commit(self, stream: str, keys: Sequence[bytes], slots: list[int]) -> None:
        with self._cond:
            st = self._streams.get(stream)
            if st is None or st.taken:  # lapsed or taken meanwhile: nobody will use these
                self._free.extend(slots)
                if st is not None:
                    st.open -= 1
                return
            st.open -= 1
            for key, slot in zip(keys, slots, strict=True):
                old = st.slots.pop(BlockKey(key), None)
                if old is not None:
                    self._free.append(old)
                st.slots[BlockKey(key)] = slot
            self._cond.notify_all()

    def _abort(self, stream: str, slots: list[int], why: str) -> None:
        with self._cond:
            self._free.extend(slots)
            st = self._streams.get(stream)
            if st is not None:
                st.open -= 1
                st.error = st.error or why
            self._cond.notify_all()

    def _lapse(self, now: float) -> list[tuple[BlockKey, int]]:
        """Streams nobody took within ``ttl_s`` (callers hold the lock): their (key, slot) pairs, for
        ``on_lapse`` to keep in the store before the slots are reused."""
        held: list[tuple[BlockKey, int]] = []
        for sid in [s for s, st in self._streams.items() if now - st.t > self.ttl_s and st.open == 0]:
            st = self._streams.pop(sid)
            held.extend(st.slots.items())
            if st.slots:
                _STREAMS.labels(outcome="lapsed").inc()
                log.warning("kvport: streamed hand-off %s… not taken in %.0f s; its %d blocks go to the store",
                            sid[:8], self.ttl_s, len(st.slots))
        return held

    # -- the decode request's side (the async loader)
    def take(self, stream: str, keys: Sequence[BlockKey], deadline: Deadline,
             unknown_wait_s: float = 1.0) -> tuple[list[int], str]:
        """Slots of the leading ``keys`` the stream holds, once no transfer of it is open, one of them
        failed, or the deadline passed (a stream never heard of is waited for ``unknown_wait_s`` at
        most: the prefill answered only after its transfer ended). The stream is the caller's from now
        on: :meth:`release` returns the slots. Returns (slots, why fewer than asked)."""
        t0 = time.monotonic()

        def settled() -> bool:
            st = self._streams.get(stream)
            if st is None or st.taken:
                return time.monotonic() - t0 >= unknown_wait_s
            # no transfer of it open: final (the prefill engine answered only after its last one ended)
            return bool(st.error) or st.open == 0

        with self._cond:
            while not settled() and not deadline.expired:
                wait = deadline.remaining()
                if stream not in self._streams:
                    wait = min(wait, max(0.0, unknown_wait_s - (time.monotonic() - t0)))
                self._cond.wait(max(0.001, min(wait, 0.5)))
            st = self._streams.pop(stream, None)
            if st is None or st.taken:
                if st is not None:
                    self._streams[stream] = st
                _STREAMS.labels(outcome="partial").inc()
                return [], "the stream never reached this decode engine (its transfer failed or went elsewhere)"
            taken: list[int] = []
            for k in keys:
                slot = st.slots.pop(k, None)
                if slot is None:
                    break
                taken.append(slot)
            self._free.extend(st.slots.values())  # blocks the request does not use (its vLLM cache had them)
            if st.open:  # still receiving: its slots come back when the transfer ends (lapsed: freed there)
                self._streams[stream] = _Stream(open=st.open, taken=True, t=st.t)
        why = ""
        if len(taken) < len(keys):
            why = st.error or ("past the load deadline" if deadline.expired else "blocks missing from the stream")
        _STREAMS.labels(outcome="taken" if not why else "partial").inc()
        return taken, why

    def release(self, slots: Sequence[int]) -> None:
        with self._cond:
            self._free.extend(slots)


class InboxDestination:
    """Where one transfer's blocks land: whole inbox slots reserved at TRANSFER_BEGIN."""

    def __init__(self, inbox: Inbox, meta: TransferMeta, slots: list[int]) -> None:
        self.inbox, self.meta, self.slots = inbox, meta, slots
        self._lo = meta.layers.start
        self._done = False

    def view(self, block: int, layer: int) -> memoryview:
        at = self.inbox.header + (layer - self._lo) * self.inbox.slab
        return self.inbox.slot_view(self.slots[block])[at : at + self.inbox.slab]

    def commit(self) -> None:
        if not self._done:
            self._done = True
            self.inbox._commit(self.meta.request_id, self.meta.block_keys, self.slots)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self.inbox._abort(self.meta.request_id, self.slots, "its transfer was aborted")


class InboxServer:
    """The decode worker's listener: every connection gets a :class:`Receiver` into the inbox.
    ``address``: ``HOST:PORT`` (TCP; loopback by default, any other address needs the shared secret,
    KVPORT_AUTH_TOKEN) or ``shm:NAME`` (shared memory, for producers on this host)."""

    def __init__(self, inbox: Inbox, address: str, secret: bytes | None = None) -> None:
        self.inbox = inbox
        if parse_dest(address) is None and not address.endswith(":0"):
            raise ConfigError(f"an inbox listens on HOST:PORT or shm:NAME, got {address!r}")
        self.listener: tcp.TcpListener | shm.ShmListener
        if address.startswith(SHM_PREFIX):
            self.listener = shm.ShmListener(address[len(SHM_PREFIX):])
            self.address = address
        else:
            host, _, port = address.rpartition(":")
            # a producer keeps its connection between hand-offs: idle for minutes is normal; a dead peer is an EOF
            self.listener = tcp.TcpListener(host.strip("[]"), int(port), secret=secret, timeout_s=IDLE_TIMEOUT_S)
            self.address = f"{self.listener.host}:{self.listener.port}"
        self._receivers: list[Receiver] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="kvport-pd-inbox", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                t: Transport
                if isinstance(self.listener, shm.ShmListener):
                    st = self.listener.accept(SHM_SLOT_BYTES, SHM_SLOTS, timeout_s=0.5)
                    st.settimeout(IDLE_TIMEOUT_S)
                    t = st
                else:
                    t = self.listener.accept(timeout_s=0.5)
            except (PeerError, OSError):  # nobody came (or the listener closed: the loop ends)
                continue
            except KVPortError as exc:  # a peer that failed the handshake: logged, the listener goes on
                log.warning("kvport: inbox connection refused (%s)", exc)
                continue
            if self._closed.is_set():
                t.close()
                return
            r = Receiver(t, self.inbox.spec, self.inbox.destination, RECEIVER_BUDGET_BYTES)
            r.start()
            self._receivers = [x for x in self._receivers if not x.closed.is_set()] + [r]

    def close(self) -> None:
        self._closed.set()
        self.listener.close()
        for r in self._receivers:
            r.close()
        self._thread.join(2)


# ---------------------------------------------------------------------- producer side
@dataclass(slots=True)
class _Open:
    sc: StreamCopy
    sender: Sender
    h: Outgoing
    streamer: LayerStreamer
    layers: int = 0  # layers handed to the streamer so far


class StreamOut:
    """The producer worker's transfers of one step (``begin`` / ``layer`` / ``finish``), over pooled
    connections per decode inbox. Every failure is returned by :meth:`finish` (or :meth:`begin`) as
    the copies to save the old way; nothing here raises into vLLM's forward."""

    def __init__(self, spec: KVSpec, paged: PagedKV, secret: bytes | None = None, tail_s: float = 5.0,
                 max_s: float = 120.0) -> None:
        """``tail_s``: how long ``finish`` waits, after the forward, for a transfer's last layers and its
        commit; ``max_s``: a transfer's whole life (a forward longer than that loses its stream)."""
        self.spec, self.paged, self.secret = spec, paged, secret
        self.tail_s, self.max_s = tail_s, max_s
        self._idle: dict[str, list[Sender]] = {}
        self._open: list[_Open] = []
        self._failed: list[StreamCopy] = []

    def _connect(self, dest: str) -> Sender:
        pool = self._idle.get(dest, [])
        while pool:
            s = pool.pop()
            if not isinstance(s.try_admit(), Rejected):  # an idle connection the peer closed is dropped
                return s
            s.close()
        # kept between hand-offs: the connection may idle; every wait on it has its own bound (tail_s, max_s)
        if dest.startswith(SHM_PREFIX):
            s_t = shm.connect(dest[len(SHM_PREFIX):], SHM_SLOT_BYTES, SHM_SLOTS, timeout_s=5.0)
            s_t.settimeout(IDLE_TIMEOUT_S)
            return Sender(s_t, credit_timeout_s=self.tail_s, max_frame_bytes=SHM_FRAME_BYTES,
                          batch_bytes=SHM_FRAME_BYTES)
        host, _, port = dest.rpartition(":")
        t = tcp.connect(host.strip("[]"), int(port), secret=self.secret, timeout_s=5.0)
        t.settimeout(IDLE_TIMEOUT_S)
        return Sender(t, credit_timeout_s=self.tail_s)

    def begin(self, copies: Sequence[StreamCopy]) -> None:
        for sc in copies:
            keys = tuple(bytes(k) for k in sc.copy.keys)
            meta = TransferMeta(self.spec, sc.stream, keys, token_start=sc.first_block * self.spec.block_size)
            sender = None
            try:
                sender = self._connect(sc.dest)
                # the decode engine's receiver answers at once; a step never waits long on one that does not
                h = sender.begin(meta, timeout_s=min(1.0, self.tail_s), deadline=Deadline.after(self.max_s))
            except (KVPortError, OSError, ValueError) as exc:
                log.warning("kvport: stream of request %s to %s not started (%s: %s); saved to the store instead",
                            sc.copy.req_id, sc.dest, type(exc).__name__, exc)
                if sender is not None:
                    sender.close()
                _STREAMS.labels(outcome="failed").inc()
                self._failed.append(sc)
                continue
            self._open.append(_Open(sc, sender, h, LayerStreamer(sender, h)))

    def layer(self, layer: int) -> None:
        """Layer ``layer`` of every open transfer's blocks: views of the paged KV, sent by each
        transfer's thread (the blocks stay the request's until ``finish``: nothing rewrites them)."""
        arr = self.paged.arrays[layer]
        for o in self._open:
            with contextlib.suppress(TransferError):  # finish() reports it
                o.streamer.push(layer, [arr[b].data for b in o.sc.copy.block_ids])
                o.layers += 1

    @property
    def active(self) -> bool:
        return bool(self._open)

    def finish(self) -> tuple[list[StreamCopy], list[StreamCopy]]:
        """End every open transfer, waiting for its commit (``tail_s`` at most each): the copies that
        committed, and those that did not (to be saved to the store)."""
        committed: list[StreamCopy] = []
        failed, self._failed = self._failed, []
        opened, self._open = self._open, []
        for o in opened:
            try:
                o.streamer.finish(timeout_s=self.tail_s)
            except (KVPortError, OSError) as exc:
                log.warning("kvport: stream of request %s to %s failed after %d of %d layers (%s: %s); saved to the "
                            "store instead", o.sc.copy.req_id, o.sc.dest, o.layers, self.spec.num_layers,
                            type(exc).__name__, exc)
                _STREAMS.labels(outcome="failed").inc()
                o.sender.abort(o.h, f"stream failed: {exc}")
                o.sender.close()
                failed.append(o.sc)
                continue
            _STREAMS.labels(outcome="committed").inc()
            committed.append(o.sc)
            pool = self._idle.setdefault(o.sc.dest, [])
            if len(pool) < 4:
                pool.append(o.sender)
            else:
                o.sender.close()
        return committed, failed

    def close(self) -> None:
        for o in self._open:
            o.sender.close()
        self._open = []
        for pool in self._idle.values():
            for s in pool:
                s.close()
        self._idle.clear()


__all__ = ["DEST_KEY", "Inbox", "InboxDestination", "InboxServer", "StreamCopy", "StreamOut", "is_stream_id",
           "new_stream_id", "parse_dest"]
