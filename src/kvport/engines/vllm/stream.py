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
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvport import metrics
from kvport.deadline import Deadline
from kvport.errors import ConfigError, KVPortError, TierFullError, TransferError
from kvport.keys import BlockKey
from kvport.ledger import Ledger
from kvport.ledger.states import Owner
from kvport.lifetime import Lifetime
from kvport.protocol.transfer import TransferMeta
from kvport.spec import KVSpec
from kvport.transfer import links
from kvport.transfer.handoff import MAX_CONNECTIONS, TRANSFER_S, HandoffDialer, HandoffListener
from kvport.transfer.sender import LayerStreamer, Outgoing, Sender

from .params import is_stream_id
from .plan import StreamCopy

if TYPE_CHECKING:  # torch comes with the paged KV; the proxy imports this module without vLLM

    from .paged import PagedKV

log = logging.getLogger(__name__)

STREAM_OUTCOMES = metrics.counter(
    "vllm_pd_streams", "hand-offs streamed layer by layer, by outcome (producer: committed, failed, refused_dest "
    "-- a kvport_dest not among kvport_pd_destinations; decode: taken, partial, lapsed, refused, discarded -- "
    "its request did not need it)", ["outcome"])
MAX_STREAMS = 4096  # streams an inbox holds at once (accepted ones only)
MAX_REFUSED = 1024  # reasons kept for streams refused before anything landed (their decode requests ask)
MAX_SPENT = 65536  # ids taken, discarded or lapsed, remembered so that none is filled again (~6 MiB at most)
SPENT_MIN_S = 600.0  # ... for at least this long (or the inbox's ttl_s, when longer)
RECEIVER_BUDGET_BYTES = 32 << 20  # bytes in flight per connection (credits); they land in the inbox at once
SHM_SLOT_BYTES, SHM_SLOTS = 4 << 20, 8  # a producer's ring to one inbox: 32 MiB
SHM_FRAME_BYTES = 32 << 20  # on shared memory a frame is one hand-off to the peer: a layer of a step per frame


# ---------------------------------------------------------------------- decode side
@dataclass(slots=True)
class _Stream:
    slots: dict[BlockKey, int] = field(default_factory=dict)  # committed blocks, each verified whole
    pending: set[BlockKey] = field(default_factory=set)  # blocks of its transfers still receiving
    open: int = 0  # transfers of it still receiving
    error: str = ""  # why a transfer of it failed (the rest is recomputed)
    t: float = field(default_factory=time.monotonic)


class Inbox:
    """Preallocated slots, one stored block each (envelope header + every layer's slab), where
    streamed blocks land; ``take`` hands a stream's blocks to the request that names it.

    A stream id's life, and what each state accepts::

        unknown --TRANSFER_BEGIN accepted--> open (transfers landing, committed blocks held)
        open    --take / discard / lapse----> spent      (its slots go to the request, back, or to the store)
        open    --a block written twice-----> open, void (error set: take returns only what came before)
        unknown --TRANSFER_BEGIN refused----> refused    (the reason kept, bounded, for the decode request)
        spent   --TRANSFER_BEGIN------------> refused    (single-use: an id is never filled again)

    A transfer lands in whole blocks only: every layer of each block (``[0, num_layers)``) in one
    transfer, so a block in a stream is complete by construction once its transfer committed (the
    receiver's bitmap: every block-layer exactly once, each verified). A block key is written once
    per stream: a transfer naming a key the stream holds or is receiving voids the stream.

    With a ledger (``ledger`` / ``owner``: the decode engine's, given to its :class:`InboxServer` too)
    a committed transfer is ``owner`` acquiring its blocks from the producer, recorded by the receiver
    with the producer's transfer id; the record stays while any slot holds the block (or a transfer
    of it is still landing) and goes with the last one: handed to the pool first when the keeper put
    it in the store (:meth:`release` ``kept=True``), else forgotten. The ledger never outgrows the inbox."""

    def __init__(self, spec: KVSpec, capacity_blocks: int, header: int, ttl_s: float = 30.0,
                 ledger: Ledger | None = None, owner: Owner | None = None) -> None:
        if capacity_blocks <= 0:
            raise ConfigError(f"the inbox needs at least one block, got {capacity_blocks}")
        self.spec = spec
        self.header = header
        self.slab = spec.bytes_per_layer_block
        self.array = np.ones((capacity_blocks, header + spec.bytes_per_block), dtype=np.uint8)  # touched now
        self.ttl_s = ttl_s
        self._free = list(range(capacity_blocks - 1, -1, -1))  # pop() gives ascending slots
        self._streams: dict[str, _Stream] = {}
        self._spent: OrderedDict[str, float] = OrderedDict()  # ids taken, discarded or lapsed: never again
        self._refused: OrderedDict[str, str] = OrderedDict()  # ids refused before any transfer landed: why
        self._cond = threading.Condition()
        self.ledger, self.owner = ledger, owner
        self._slot_key: dict[int, BlockKey] = {}  # committed slots -> their block
        self._holders: dict[BlockKey, int] = {}  # committed slots holding each block
        self._landing: dict[BlockKey, int] = {}  # transfers still receiving each block
        self._kept: set[BlockKey] = set()  # blocks a slot of which the keeper put in the store
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

    @property
    def streams(self) -> int:
        """Streams open now (the ones that hold slots or may still receive)."""
        with self._cond:
            return len(self._streams)

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
        sid = meta.request_id
        if not is_stream_id(sid):
            raise TransferError(f"a streamed hand-off names its stream (32 hex digits), got {sid[:40]!r}")
        if meta.layers != range(self.spec.num_layers):
            raise TransferError(f"a streamed hand-off carries whole blocks (layers [0, {self.spec.num_layers})), "
                                f"this one layers [{meta.layers.start}, {meta.layers.stop})")
        keys = [BlockKey(k) for k in meta.block_keys]
        if not keys or len(set(keys)) != len(keys):
            raise TransferError(f"a streamed hand-off names distinct blocks, got {len(keys)} keys, "
                                f"{len(set(keys))} distinct")
        lapsed: list[tuple[BlockKey, int]] = []
        try:
            with self._cond:
                now = time.monotonic()
                self._forget_spent(now)
                if len(self._free) < len(keys) or len(self._streams) >= MAX_STREAMS // 2:
                    lapsed = self._lapse(now)
                slots = self._reserve(sid, keys)
        finally:  # outside the lock: the keeper puts lapsed blocks in the store, then frees their slots
            self._hand_lapsed(lapsed)
        return InboxDestination(self, meta, keys, slots)

    def _reserve(self, sid: str, keys: list[BlockKey]) -> list[int]:
        """Whole slots for one transfer of stream ``sid`` (callers hold the lock), or the typed refusal."""
        if sid in self._spent:
            raise self._refuse(sid, "the stream was taken or released already: a stream id is single-use")
        st = self._streams.get(sid)
        if st is not None and st.error:
            raise self._refuse(sid, st.error)
        if st is not None and any(k in st.slots or k in st.pending for k in keys):
            st.error = "a block of the stream arrived twice (a stream's blocks are written once)"
            self._cond.notify_all()
            raise self._refuse(sid, st.error)
        if st is None and len(self._streams) >= MAX_STREAMS:
            raise self._refuse(sid, f"the inbox holds {len(self._streams)} streams nobody took yet")
        if len(self._free) < len(keys):
            why = f"the inbox has {len(self._free)} free blocks of {self.capacity}, the transfer needs {len(keys)}"
            if st is not None:  # the rest of the stream is void: its decode request goes to the store at once
                st.error = why
                self._cond.notify_all()
            raise self._refuse(sid, why)
        if st is None:
            st = self._streams[sid] = _Stream()
            self._refused.pop(sid, None)
        slots = [self._free.pop() for _ in keys]
        for k in keys:
            self._landing[k] = self._landing.get(k, 0) + 1
        st.pending.update(keys)
        st.open += 1
        return slots

    def _refuse(self, sid: str, why: str) -> TierFullError:
        STREAM_OUTCOMES.labels(outcome="refused").inc()
        if sid not in self._streams and sid not in self._spent:  # told at once to its decode request (bounded)
            self._refused[sid] = why
            self._refused.move_to_end(sid)
            while len(self._refused) > MAX_REFUSED:
                self._refused.popitem(last=False)
        self._cond.notify_all()
        return TierFullError(why)

    def _spend(self, sid: str) -> None:
        """``sid`` will never be filled again (callers hold the lock)."""
        self._spent[sid] = time.monotonic()
        self._spent.move_to_end(sid)
        while len(self._spent) > MAX_SPENT:
            self._spent.popitem(last=False)

    def _forget_spent(self, now: float) -> None:
        """Ids spent longer ago than a stream may live (a producer's transfer ends within ``ttl_s``
        of its prefill at the latest) are dropped: the table stays bounded by time and count."""
        horizon = max(self.ttl_s, SPENT_MIN_S)
        while self._spent:
            t = next(iter(self._spent.values()))
            if now - t <= horizon:
                break
            self._spent.popitem(last=False)

    def _hand_lapsed(self, lapsed: list[tuple[BlockKey, int]]) -> None:
        if not lapsed:
            return
        if self.on_lapse is None:
            self.release([slot for _, slot in lapsed])
        else:
            self.on_lapse(lapsed)

    def _commit(self, sid: str, keys: Sequence[BlockKey], slots: list[int]) -> None:
        """Every block-layer of the transfer arrived once and verified: its whole blocks join the stream."""
        with self._cond:
            self._landed(keys)
            st = self._streams.get(sid)
            if st is None:  # taken, discarded or lapsed meanwhile: nobody will use these
                self._free.extend(slots)
                self._settle(keys)
                return
            st.open -= 1
            st.pending.difference_update(keys)
            if st.error:  # void: its blocks are not linked (the request reads the store or recomputes)
                self._free.extend(slots)
                self._settle(keys)
            else:
                st.slots.update(zip(keys, slots, strict=True))
                for k, slot in zip(keys, slots, strict=True):
                    self._slot_key[slot] = k
                    self._holders[k] = self._holders.get(k, 0) + 1
            self._cond.notify_all()

    def _abort(self, sid: str, keys: Sequence[BlockKey], slots: list[int], why: str) -> None:
        with self._cond:
            self._landed(keys)
            self._free.extend(slots)
            self._settle(keys)
            st = self._streams.get(sid)
            if st is not None:
                st.open -= 1
                st.pending.difference_update(keys)
                st.error = st.error or why
            self._cond.notify_all()

    def _landed(self, keys: Sequence[BlockKey]) -> None:
        for k in keys:
            n = self._landing.get(k, 0) - 1
            if n > 0:
                self._landing[k] = n
            else:
                self._landing.pop(k, None)

    def _free_slots(self, slots: Iterable[int], kept: bool = False) -> None:
        """Committed slots back to the free list (callers hold the lock); their blocks' records settle."""
        keys: list[BlockKey] = []
        for slot in slots:
            self._free.append(slot)
            k = self._slot_key.pop(slot, None)
            if k is None:
                continue
            n = self._holders.get(k, 0) - 1
            if n > 0:
                self._holders[k] = n
            else:
                self._holders.pop(k, None)
            if kept:
                self._kept.add(k)
            keys.append(k)
        self._settle(keys)

    def _settle(self, keys: Iterable[BlockKey]) -> None:
        """Blocks no slot holds and no transfer is landing leave the ledger: handed to the pool when
        the keeper put one in the store, else forgotten (callers hold the lock)."""
        for k in keys:
            if k in self._holders or k in self._landing:
                continue
            kept = k in self._kept
            self._kept.discard(k)
            led, me = self.ledger, self.owner
            if led is None or me is None or not led.knows(k) or led.owner_of(k) != me:
                continue
            with contextlib.suppress(KVPortError):
                if kept:
                    led.hand_off(bytes(k), me, Owner.pool(), lifetime=Lifetime.PREFIX)
                led.forget(bytes(k))

    def _lapse(self, now: float) -> list[tuple[BlockKey, int]]:
        """Streams nobody took within ``ttl_s`` (callers hold the lock): their (key, slot) pairs, for
        ``on_lapse`` to keep in the store before the slots are reused."""
        held: list[tuple[BlockKey, int]] = []
        for sid in [s for s, st in self._streams.items() if now - st.t > self.ttl_s and st.open == 0]:
            st = self._streams.pop(sid)
            self._spend(sid)
            held.extend(st.slots.items())
            if st.slots:
                STREAM_OUTCOMES.labels(outcome="lapsed").inc()
                log.warning("kvport: streamed hand-off %s… not taken in %.0f s; its %d blocks go to the store",
                            sid[:8], self.ttl_s, len(st.slots))
        return held

    # -- the decode request's side (the async loader, the scheduler's plan)
    def take(self, stream: str, keys: Sequence[BlockKey], deadline: Deadline,
             unknown_wait_s: float = 1.0) -> tuple[list[int], str]:
        """Slots of the leading ``keys`` the stream holds, once no transfer of it is open, one of them
        failed, or the deadline passed (a stream never heard of is waited for ``unknown_wait_s`` at
        most: the prefill answered only after its transfer ended). The stream is spent: its slots
        are the caller's from now on (:meth:`release` returns them), the rest are freed, and nothing
        lands under its id again. Returns (slots, why fewer than asked)."""
        t0 = time.monotonic()

        def settled() -> bool:
            st = self._streams.get(stream)
            if st is None:
                return stream in self._spent or stream in self._refused or \
                    time.monotonic() - t0 >= unknown_wait_s
            # no transfer of it open: final (the prefill engine answered only after its last one ended)
            return bool(st.error) or st.open == 0

        with self._cond:
            while not settled() and not deadline.expired:
                wait = deadline.remaining()
                if stream not in self._streams:
                    wait = min(wait, max(0.0, unknown_wait_s - (time.monotonic() - t0)))
                self._cond.wait(max(0.001, min(wait, 0.5)))
            st = self._streams.pop(stream, None)
            if st is None:
                STREAM_OUTCOMES.labels(outcome="partial").inc()
                if stream in self._spent:
                    return [], "the stream was taken already (a stream id is single-use)"
                refused = self._refused.pop(stream, None)
                if refused is not None:
                    return [], f"the inbox refused the stream ({refused})"
                return [], "the stream never reached this decode engine (its transfer failed or went elsewhere)"
            self._spend(stream)
            taken: list[int] = []
            for k in keys:
                slot = st.slots.pop(k, None)
                if slot is None:
                    break
                taken.append(slot)
            self._free_slots(st.slots.values())  # blocks the request does not use (its vLLM cache had them)
            # transfers of it still open: their commits find the stream gone and free their slots
        why = ""
        if len(taken) < len(keys):
            why = st.error or ("past the load deadline" if deadline.expired else "blocks missing from the stream")
        STREAM_OUTCOMES.labels(outcome="taken" if not why else "partial").inc()
        return taken, why

    def discard(self, stream: str) -> int:
        """The decode request that names ``stream`` will not take it (its engine's own cache held the
        prompt, or its hand-off was refused): its slots are freed at once and the id is spent.
        Returns how many blocks it held."""
        with self._cond:
            st = self._streams.pop(stream, None)
            self._refused.pop(stream, None)
            self._spend(stream)
            if st is None:
                return 0
            self._free_slots(st.slots.values())
            self._cond.notify_all()
        STREAM_OUTCOMES.labels(outcome="discarded").inc()
        return len(st.slots)

    def release(self, slots: Sequence[int], kept: bool = False) -> None:
        """Slots back to the inbox; ``kept``: their blocks were put in the store (handed to the pool)."""
        with self._cond:
            self._free_slots(slots, kept)


class InboxDestination:
    """Where one transfer's blocks land: whole inbox slots reserved at TRANSFER_BEGIN (every layer of
    every block: ``Inbox.destination`` accepts nothing else)."""

    def __init__(self, inbox: Inbox, meta: TransferMeta, keys: list[BlockKey], slots: list[int]) -> None:
        self.inbox, self.meta, self.keys, self.slots = inbox, meta, keys, slots
        self._done = False

    def view(self, block: int, layer: int) -> memoryview:
        at = self.inbox.header + layer * self.inbox.slab
        return self.inbox.slot_view(self.slots[block])[at : at + self.inbox.slab]

    def commit(self) -> None:
        if not self._done:
            self._done = True
            self.inbox._commit(self.meta.request_id, self.keys, self.slots)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self.inbox._abort(self.meta.request_id, self.keys, self.slots, "its transfer was aborted")


class InboxServer(HandoffListener):
    """The decode worker's listener: the one hand-off's receiving side
    (:class:`~kvport.transfer.handoff.HandoffListener`: ``HOST:PORT``, ``shm:NAME`` or ``nixl:HOST:PORT``, every
    connection authenticated with the deployment's secret, the handshake bound to this inbox's
    address, at most ``max_connections`` at once, a transfer still receiving ``transfer_s`` after its
    TRANSFER_BEGIN abandoned) serving a :class:`Receiver` into the inbox per connection. With the
    inbox's ledger every commit is recorded as the decode engine acquiring the blocks from the
    producer (named by its ledger owner, admitted over the authenticated link)."""

    def __init__(self, inbox: Inbox, address: str, secret: bytes | None, names: Sequence[str] = (),
                 max_connections: int = MAX_CONNECTIONS, transfer_s: float = TRANSFER_S) -> None:
        self.inbox = inbox
        super().__init__(address, secret, inbox.spec, inbox.destination, names=names,
                         budget_bytes=RECEIVER_BUDGET_BYTES, ledger=inbox.ledger, owner=inbox.owner,
                         max_connections=max_connections, transfer_s=transfer_s,
                         ring=links.ShmRing(SHM_SLOT_BYTES, SHM_SLOTS))


# ---------------------------------------------------------------------- producer side
@dataclass(slots=True)
class _Open:
    sc: StreamCopy
    sender: Sender
    h: Outgoing
    streamer: LayerStreamer
    ledger: Ledger | None = None  # the ledger recording it (the engine's, or its own: see StreamOut)
    layers: int = 0  # layers handed to the streamer so far


class StreamOut:
    """The producer worker's transfers of one step (``begin`` / ``layer`` / ``finish``): the one
    hand-off's sending side (:class:`~kvport.transfer.handoff.HandoffDialer`: pooled connections per
    decode inbox, dialled only to ``destinations``, the inboxes its own deployment configured
    (``kvport_pd_destinations``), never an address a request names by itself, every connection
    authenticated with the deployment's secret, signed for the inbox it dialled). With ``ledger`` /
    ``owner`` (the producer engine's) each transfer's blocks are registered as the engine's, go to the
    transfer at the inbox's ACCEPT and are HANDED_OFF to the decode engine at its commit, with the
    transfer id both ledgers record; a transfer that fails gives them back, and they are forgotten
    (saved to the store the old way). A block is in one transfer of a ledger at a time, and two
    requests of one step that share a prefix stream it twice (every prompt block goes to the decode
    engine under its request's stream): a transfer with a block another open transfer holds is
    recorded in a ledger of its own (same owner, the same moves; ``transfer_ledgers`` counts them),
    so it streams too. Every failure is returned by :meth:`finish` (or :meth:`begin`)
    as the copies to save; nothing here raises into vLLM's forward."""

    def __init__(self, spec: KVSpec, paged: PagedKV, secret: bytes | None, destinations: Iterable[str],
                 tail_s: float = 5.0, max_s: float = 120.0, ledger: Ledger | None = None,
                 owner: Owner | None = None) -> None:
        """``tail_s``: how long ``finish`` waits, after the forward, for a transfer's last layers and its
        commit; ``max_s``: a transfer's whole life (a forward longer than that loses its stream)."""
        self.spec, self.paged, self.secret = spec, paged, secret
        self.tail_s, self.max_s = tail_s, max_s
        self.ledger, self.owner = ledger, owner
        self.dialer = HandoffDialer(secret, destinations, ledger=ledger, owner=owner, credit_timeout_s=tail_s,
                                    shm_frame_bytes=SHM_FRAME_BYTES, ring=links.ShmRing(SHM_SLOT_BYTES, SHM_SLOTS))
        self.destinations = self.dialer.destinations
        self._open: list[_Open] = []
        self._failed: list[StreamCopy] = []
        self.transfer_ledgers = 0  # transfers recorded in a ledger of their own (a block another one held)

    def _ledger_for(self, keys: Sequence[bytes]) -> Ledger | None:
        """The ledger to record a transfer of ``keys`` in, its blocks registered there as this engine's:
        the engine's, or one of the transfer's own when another open transfer holds one of them."""
        if self.ledger is None or self.owner is None:
            return None
        led = self.ledger
        if any(led.knows(k) for k in keys):  # in another open transfer (settled ones left the ledger)
            led = Ledger(owners=[self.owner], peers=self.ledger.peers)
            self.transfer_ledgers += 1
        for k in keys:
            led.register(k, self.owner, lifetime=Lifetime.REQUEST)
        return led

    def _forget(self, led: Ledger | None, keys: Sequence[bytes]) -> None:
        """A transfer that did not commit: its blocks (given back to this engine) leave the ledger."""
        if led is None or self.owner is None:
            return
        for k in keys:
            if led.knows(k) and led.owner_of(k) == self.owner:
                with contextlib.suppress(KVPortError):
                    led.forget(k)

    def begin(self, copies: Sequence[StreamCopy]) -> None:
        for sc in copies:
            keys = tuple(bytes(k) for k in sc.copy.keys)
            meta = TransferMeta(self.spec, sc.stream, keys, token_start=sc.first_block * self.spec.block_size)
            sender = None
            led = None
            try:
                sender = self.dialer.sender(sc.dest)
                led = self._ledger_for(keys)
                # the decode engine's receiver answers at once; a step never waits long on one that does not
                h = sender.begin(meta, timeout_s=min(1.0, self.tail_s), deadline=Deadline.after(self.max_s),
                                 ledger=led)
            except (KVPortError, OSError, ValueError) as exc:
                log.warning("kvport: stream of request %s to %s not started (%s: %s); saved to the store instead",
                            sc.copy.req_id, sc.dest, type(exc).__name__, exc)
                if sender is not None:
                    sender.close()
                self._forget(led, keys)
                STREAM_OUTCOMES.labels(outcome="failed").inc()
                self._failed.append(sc)
                continue
            self._open.append(_Open(sc, sender, h, LayerStreamer(sender, h), led))

    def layer(self, layer: int) -> None:
        """Layer ``layer`` of every open transfer's blocks: views of the paged KV, sent by each
        transfer's thread (the blocks stay the request's until ``finish``: nothing rewrites them)."""
        for o in self._open:
            with contextlib.suppress(TransferError):  # finish() reports it
                o.streamer.push(layer, self.paged.slab_views(layer, o.sc.copy.block_ids))
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
                STREAM_OUTCOMES.labels(outcome="failed").inc()
                o.sender.abort(o.h, f"stream failed: {exc}")  # best effort: the link may be gone (EOF aborts)
                o.sender.close()
                self._forget(o.ledger, o.h.meta.block_keys)
                failed.append(o.sc)
                continue
            STREAM_OUTCOMES.labels(outcome="committed").inc()
            committed.append(o.sc)
            self.dialer.keep(o.sc.dest, o.sender)
        return committed, failed

    def close(self) -> None:
        for o in self._open:
            o.sender.close()
            self._forget(o.ledger, o.h.meta.block_keys)
        self._open = []
        self.dialer.close()


__all__ = [
    "STREAM_OUTCOMES",
    "Inbox",
    "InboxDestination",
    "InboxServer",
    "StreamCopy",
    "StreamOut",
]
