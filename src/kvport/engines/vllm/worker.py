"""Worker-side data path of the connector: store blocks <-> vLLM's paged KV. No vLLM import.

Load, per engine step (``prefix_ttft`` reports its read and copy times and GB/s)::

    begin_load(loads)     one batched ``get_many_into`` per request into preallocated staging slots
                          (reads and checksums, no allocation), then each block's envelope
                          checked (identity, key, one KV part per layer, each part's xxh3); a
                          block that is missing, corrupt, the wrong size, unreadable or refused by
                          its envelope ends that request's load there (a refused one is deleted
                          from the store): its block ids from that point on are reported as load
                          errors, and nothing of them is copied into the paged KV
    load_layer(i)         one ``index_copy_`` of layer i for every loaded block of the step
    finish_load()         copies any layer the engine did not ask for, drops the batch

The background loader (:class:`AsyncLoads`) uses the mover's other half: ``deadline_for(n)`` (the
time n blocks may take at this worker's read speed), ``load_now(keys, ids, deadline)`` (read and
copy every layer at once, in staging-sized waves) and ``copy_in(ids, layer_of)`` (blocks that are
already in memory, e.g. in the inbox, copied into the paged KV).

A step loading more blocks than the staging holds is copied eagerly in staging-sized waves at
``begin_load`` (every layer at once), so correctness never depends on the staging size.

Save: ``save(saves)`` copies each block's slab of every layer into a preallocated save slot, seals
its envelope there (each layer's part hashed right after its copy, while in cache) and puts each
run of blocks with one ``put_many`` under its parent (the store writes it as one batch per tier,
evicts to make room, and keeps the chain; best effort: a store that cannot take it loses the save,
never the request).

Every byte goes through the store port (:func:`kvport.client.port.open_store`): the connector
holds a :class:`~kvport.store.TieredStore`, never a tier.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvport import metrics
from kvport.codec.envelope import block_format
from kvport.deadline import Deadline, DeadlinePolicy
from kvport.errors import DeadlineExceeded, KVPortError, TierError
from kvport.keys import BlockKey
from kvport.spec import KVSpec
from kvport.store import TieredStore

from .paged import PagedKV, StagingSlots
from .plan import BlockCopy
from .store import read_checked
from .stream import Inbox

log = logging.getLogger(__name__)

_BLOCKS = metrics.counter("vllm_connector_blocks", "KV blocks moved by the vLLM connector", ["op"])
SECONDS = metrics.counter("vllm_connector_seconds", "seconds the vLLM connector spent moving KV, by op "
                          "(save: paged KV -> store; load: store -> paged KV, reads, checks and copies; load_async: "
                          "a hand-off's load, its inbox wait included; stream: a producer's steps on streamed "
                          "hand-offs; keep_streamed: a decode engine putting them in the store, after the "
                          "request's first step; lookup: the scheduler asking what kvport holds for a request; "
                          "schedule: the scheduler planning a step's loads and saves)",
                          ["op"])


_NOT_QUEUED = object()
# a streamed hand-off taken in the request's first step waits no longer than this for its stream (it
# committed before the prefill engine answered: it is there, unless something failed; the whole batch
# waits meanwhile, so what is not there by then is read from the store or recomputed)
SYNC_TAKE_WAIT_S = 0.05


@dataclass(slots=True)
class WorkerStats:
    blocks_loaded: int = 0
    blocks_failed: int = 0
    blocks_refused: int = 0  # read, but refused by their envelope (deleted; recomputed by vLLM)
    blocks_saved: int = 0
    saves_dropped: int = 0
    load_read_s: float = 0.0  # tier reads into staging (includes the tier's checksum)
    load_copy_s: float = 0.0  # staging -> paged KV scatters
    save_s: float = 0.0  # paged KV -> block buffer -> tier puts


class BlockMover:
    """Moves whole blocks between the store and the paged KV; one instance per worker."""

    def __init__(self, spec: KVSpec, store: TieredStore, paged: PagedKV, staging_blocks: int,
                 deadlines: DeadlinePolicy | None = None, save_blocks: int | None = None) -> None:
        """``deadlines``: a step's loads may take ``factor`` x the time expected from this worker's
        observed read speed (the policy's maximum before the first read), within bounds; blocks not
        read by then are load errors and vLLM recomputes them."""
        self.spec = spec
        self.store = store
        self.deadlines = deadlines or DeadlinePolicy()
        self._read_bps: float | None = None  # observed read speed (EWMA): what a load is expected to take
        self.paged = paged
        self.format = block_format(spec)  # every stored block: envelope + the block's slabs
        h = self.format.header_len
        self.staging = StagingSlots(spec, staging_blocks, header=h, pinned=paged.device.type == "cuda")
        # save buffer: one stored value per block of a batched put; touched now, like the staging
        nsave = staging_blocks if save_blocks is None else save_blocks
        self._save_buf = np.ones((nsave, self.format.value_bytes), dtype=np.uint8)
        self._save_views: tuple[memoryview, ...] = tuple(self._save_buf[j].data for j in range(nsave))
        self._save_slabs = self._save_buf[:, h:].reshape(nsave, spec.num_layers, spec.bytes_per_layer_block)
        self._ids: np.ndarray | None = None  # block ids of the staged batch, slot order
        self._count = 0
        self._layers_done: list[bool] = [True] * spec.num_layers
        self._failed: set[int] = set()
        self._ahead: dict[int, object] = {}  # layer -> its copy queued ahead (CUDA: an event; else None, done)
        self._queued: list[object] = []  # this step's queued copies (CUDA events), synced before the staging is reused
        self.stats = WorkerStats()

    # ------------------------------------------------------------------ load
    def _read(self, keys: Sequence[BlockKey], slot0: int, deadline: Deadline | None = None) -> int:
        """Read consecutive blocks into slots slot0.. (one batched tier call: a DiskTier reads adjacent
        entries of a slab with one ``preadv``); returns how many leading blocks arrived intact (none
        past ``deadline``) and passed their envelope check."""
        views = [self.staging.slot_view(slot0 + j) for j in range(len(keys))]
        try:
            r = read_checked(self.store, self.format, keys, views, deadline=deadline, engine="vLLM")
        except TierError as exc:
            log.warning("kvport: load of %d blocks failed (%s); vLLM recomputes them", len(keys), exc)
            return 0
        except DeadlineExceeded as exc:
            log.warning("kvport: load of %d blocks past its deadline (%s); vLLM recomputes them", len(keys), exc)
            return 0
        if r.whole and r.seconds > 0:
            bps = r.good * self.format.value_bytes / r.seconds
            self._read_bps = bps if self._read_bps is None else 0.7 * self._read_bps + 0.3 * bps
        if r.refused:
            self.stats.blocks_refused += 1
            _BLOCKS.labels(op="refused").inc()
        return r.good

    def deadline_for(self, nblocks: int) -> Deadline:
        """The deadline of a load of ``nblocks``: the policy's factor x what this worker's observed read
        speed says they take (the policy's maximum before the first read)."""
        bps = self._read_bps
        return self.deadlines.for_expected(None if bps is None else nblocks * self.format.value_bytes / bps)

    def begin_load(self, loads: Sequence[BlockCopy]) -> None:
        self.finish_load()
        t0, copy0 = time.perf_counter(), self.stats.load_copy_s
        try:
            self._begin_load(loads)
        finally:  # eager waves copy inside begin_load: that time is counted as copy, not read
            dt = time.perf_counter() - t0
            self.stats.load_read_s += dt - (self.stats.load_copy_s - copy0)
            SECONDS.labels(op="load").inc(dt)

    def _begin_load(self, loads: Sequence[BlockCopy]) -> None:
        total = sum(len(c.keys) for c in loads)
        if total == 0:
            return
        cap = self.staging.capacity
        ids: list[int] = []
        eager = total > cap
        deadline = self.deadline_for(total)  # one for the step's loads: nothing waits past it
        for c in loads:
            pos = 0
            while pos < len(c.keys):
                if len(ids) == cap:  # only in eager mode: flush the full staging
                    self._scatter_all(ids)
                    ids = []
                take = min(len(c.keys) - pos, cap - len(ids))
                got = self._read(c.keys[pos : pos + take], len(ids), deadline)
                ids.extend(c.block_ids[pos : pos + got])
                pos += got
                if got < take:
                    self._failed.update(c.block_ids[pos:])
                    self.stats.blocks_failed += len(c.block_ids) - pos
                    _BLOCKS.labels(op="load_failed").inc(len(c.block_ids) - pos)
                    break
        if eager:
            self._scatter_all(ids)
            return
        self.stats.blocks_loaded += len(ids)
        _BLOCKS.labels(op="loaded").inc(len(ids))
        if ids:
            self._ids = np.asarray(ids, dtype=np.int64)
            self._count = len(ids)
            self._layers_done = [False] * self.spec.num_layers

    def _scatter_all(self, ids: list[int]) -> None:
        n = len(ids)
        self.copy_in(ids, lambda layer: self.staging.layer(layer, n))

    def copy_in(self, block_ids: Sequence[int], layer_of: Callable[[int], np.ndarray], op: str = "loaded") -> None:
        """Every layer of blocks already in memory into the paged KV: ``layer_of(i)`` is layer i's slabs
        of them, (len(block_ids), slab), in the order of ``block_ids``; counted as loaded (metric ``op``)."""
        if not block_ids:
            return
        t0 = time.perf_counter()
        idx = np.asarray(block_ids, dtype=np.int64)
        for layer in range(self.spec.num_layers):
            self.paged.scatter_layer(layer, idx, layer_of(layer))
        self.stats.load_copy_s += time.perf_counter() - t0
        self.stats.blocks_loaded += len(block_ids)
        _BLOCKS.labels(op=op).inc(len(block_ids))

    def load_now(self, keys: Sequence[BlockKey], block_ids: Sequence[int], deadline: Deadline) -> list[int]:
        """Blocks read from the store and copied into the paged KV at once (every layer), in waves of the
        staging's size; the block ids not loaded, from the first block that failed on (load errors,
        counted; vLLM recomputes them)."""
        cap = self.staging.capacity
        pos = 0
        while pos < len(keys):
            take = min(cap, len(keys) - pos)
            got = self._read(keys[pos : pos + take], 0, deadline)
            self._scatter_all(list(block_ids[pos : pos + got]))
            pos += got
            if got < take:
                rest = list(block_ids[pos:])
                self.stats.blocks_failed += len(rest)
                _BLOCKS.labels(op="load_failed").inc(len(rest))
                return rest
        return []

    def load_layer(self, layer: int) -> None:
        """Layer ``layer`` of the step's loaded blocks into the paged KV before its attention runs. On
        CUDA the next layer's copy is queued at once on the side stream, so it runs while this layer
        computes (``PagedKV.scatter_layer_ahead``); the forward waits only for the layer it reads."""
        if self._ids is None or self._layers_done[layer]:
            return
        t0 = time.perf_counter()
        ahead = self._ahead.pop(layer, _NOT_QUEUED)
        if ahead is _NOT_QUEUED:
            ahead = self._queue(layer)
        self.paged.wait_copy(ahead)
        self._layers_done[layer] = True
        nxt = layer + 1
        if self.paged.device.type == "cuda" and nxt < self.spec.num_layers and not self._layers_done[nxt] \
                and nxt not in self._ahead:
            self._ahead[nxt] = self._queue(nxt)
        dt = time.perf_counter() - t0
        self.stats.load_copy_s += dt
        SECONDS.labels(op="load").inc(dt)

    def _queue(self, layer: int) -> object:
        assert self._ids is not None
        ev = self.paged.scatter_layer_ahead(layer, self._ids, self.staging.layer(layer, self._count))
        if ev is not None:
            self._queued.append(ev)
        return ev

    def finish_load(self) -> None:
        if self._ids is not None:
            for layer, done in enumerate(self._layers_done):
                if not done:
                    self.load_layer(layer)
        for ev in self._queued:  # the staging is rewritten by the next step's reads: its copies must be out
            self.paged.sync_copy(ev)
        self._queued.clear()
        self._ahead.clear()
        self._ids = None
        self._count = 0

    def fail(self, block_ids: Iterable[int]) -> None:
        """Blocks of this step's loads that did not arrive: reported as load errors (vLLM recomputes)."""
        self._failed.update(block_ids)

    def take_failed(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    # ------------------------------------------------------------------ save
    def save(self, saves: Sequence[BlockCopy]) -> None:
        t0 = time.perf_counter()
        try:
            self._save(saves)
        finally:
            dt = time.perf_counter() - t0
            self.stats.save_s += dt
            SECONDS.labels(op="save").inc(dt)

    def _save(self, saves: Sequence[BlockCopy]) -> None:
        cap = self._save_buf.shape[0]
        for c in saves:
            parent = c.parent
            for start in range(0, len(c.keys), cap):
                chunk = list(zip(c.keys[start : start + cap], c.block_ids[start : start + cap], strict=True))
                self._save_chunk(chunk, parent)
                parent = chunk[-1][0]

    def _save_chunk(self, chunk: list[tuple[BlockKey, int]], parent: BlockKey | None) -> None:
        if self.paged.zero_copy:  # block by block: each sealed right after its copy, its slabs in cache
            for j, (key, block_id) in enumerate(chunk):
                self.paged.gather_block(block_id, self._save_slabs[j])
                self.format.seal(self._save_views[j], key)
        else:  # strided or device layouts: one gather per layer for the whole chunk
            n = len(chunk)
            ids = np.fromiter((block_id for _, block_id in chunk), dtype=np.int64, count=n)
            for layer in range(self.spec.num_layers):
                self.paged.gather_layer(layer, ids, self._save_slabs[:n, layer])
            for j, (key, _) in enumerate(chunk):
                self.format.seal(self._save_views[j], key)
        items = [(key, self._save_views[j]) for j, (key, _) in enumerate(chunk)]
        try:  # one batch: a DiskTier writes it as one slab, read back later with one preadv
            self.store.put_many(items, parent=parent)
        except TierError as exc:
            log.warning("kvport: save of %d blocks dropped (%s)", len(chunk), exc)
            self.stats.saves_dropped += len(chunk)
            _BLOCKS.labels(op="save_dropped").inc(len(chunk))
            return
        self.stats.blocks_saved += len(chunk)
        _BLOCKS.labels(op="saved").inc(len(chunk))


class AsyncLoads:
    """Loads of handed-off requests (``load_kv_async``) in one background thread, straight into the
    paged KV: vLLM keeps running other requests' steps meanwhile, and schedules a request once
    :meth:`take` has reported it (``get_finished``). Its own staging, allocated and touched at
    start-up like the synchronous one; the same checks (checksums, envelopes, deadline): blocks not
    loaded are reported with the request, and vLLM recomputes them.

    Only the request's own, newly allocated blocks are written, which nothing else reads or writes
    until vLLM schedules the request, so the copies need no lock against the model's forward.

    A hand-off streamed into ``inbox`` (:mod:`.stream`; ``BlockCopy.stream``) is taken from there:
    blocks that arrived whole and verified are copied from their inbox slots, the rest is read from the
    store, what neither has is recomputed. The streamed blocks stay in their slots until the request's
    first step has run (:meth:`keep`, from ``wait_for_save``): then a keeper thread seals them and puts
    them in the store (the next turn's prefill, on any engine, finds them) and frees the slots, so
    that the store's writes never compete with the request's first token for the cores."""

    def __init__(self, spec: KVSpec, store: TieredStore, paged: PagedKV, staging_blocks: int,
                 deadlines: DeadlinePolicy | None = None, inbox: Inbox | None = None) -> None:
        self.mover = BlockMover(spec, store, paged, staging_blocks, deadlines, save_blocks=1)
        self.inbox = inbox
        self._taken: dict[str, tuple[BlockKey | None, list[tuple[BlockKey, int]]]] = {}  # req -> its streamed slots
        self._keeps: queue.Queue[tuple[str, BlockKey | None, list[tuple[BlockKey, int]]] | None] = queue.Queue()
        self._keeper: threading.Thread | None = None
        if inbox is not None:
            inbox.on_lapse = lambda held: self._keeps.put(("lapsed", None, held))
            self._keeper = threading.Thread(target=self._keep_run, name="kvport-keep-streamed", daemon=True)
            self._keeper.start()
        self._queue: queue.Queue[BlockCopy | None] = queue.Queue()
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._failed: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="kvport-async-loads", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> WorkerStats:
        return self.mover.stats

    def submit(self, loads: Sequence[BlockCopy]) -> None:
        for c in loads:
            self._queue.put(c)

    def take(self) -> tuple[set[str], set[int]]:
        """Requests whose load ended since the last call, and the block ids of theirs not loaded."""
        with self._lock:
            done, failed = self._done, self._failed
            self._done, self._failed = set(), set()
        return done, failed

    def _run(self) -> None:
        while True:
            c = self._queue.get()
            if c is None:
                return
            failed: list[int] = []
            try:
                failed = self._load(c)
            except Exception as exc:  # a load must end (reported), never kill the loader
                log.warning("kvport: async load of %s failed (%s: %s); vLLM recomputes it", c.req_id,
                            type(exc).__name__, exc)
                failed = list(c.block_ids)
            with self._lock:
                self._failed.update(failed)
                self._done.add(c.req_id)

    def _from_inbox(self, c: BlockCopy, inbox: Inbox, stream: str, deadline: Deadline,
                    unknown_wait_s: float = 1.0) -> int:
        """The leading blocks of ``c`` the stream holds, copied into the paged KV; how many."""
        slots, why = inbox.take(stream, c.keys, deadline, unknown_wait_s=unknown_wait_s)
        if why:
            log.warning("kvport: request %s: %d of %d blocks streamed (%s); the rest from the store or recomputed",
                        c.req_id, len(slots), len(c.keys), why)
        if not slots:
            return 0
        rows = inbox.rows(slots)
        try:
            self.mover.copy_in(c.block_ids[: len(slots)], lambda layer: inbox.layer(layer, rows), op="streamed")
        except BaseException:
            inbox.release(slots)
            raise
        with self._lock:  # kept in the store once the request's first step ran (keep)
            self._taken[c.req_id] = (c.parent, list(zip(c.keys, slots, strict=False)))
        return len(slots)

    def keep(self, req_ids: Iterable[str]) -> None:
        """These requests' first step ran (or they ended): their streamed blocks go to the store now."""
        for rid in req_ids:
            with self._lock:
                taken = self._taken.pop(rid, None)
            if taken is not None:
                self._keeps.put((rid, *taken))

    def _keep_run(self) -> None:
        inbox, fmt = self.inbox, self.mover.format
        while (item := self._keeps.get()) is not None and inbox is not None:
            rid, parent, held = item
            t0 = time.perf_counter()
            kept = False
            try:
                for key, slot in held:
                    fmt.seal(inbox.slot_view(slot), key)
                self.mover.store.put_many([(key, inbox.slot_view(slot)) for key, slot in held], parent=parent)
                kept = True
                _BLOCKS.labels(op="kept").inc(len(held))
            except KVPortError as exc:
                log.warning("kvport: streamed blocks of %s not kept in the store (%s)", rid, exc)
            finally:  # kept: the engine's ledger records them handed to the pool
                inbox.release([slot for _, slot in held], kept=kept)
                SECONDS.labels(op="keep_streamed").inc(time.perf_counter() - t0)

    def load_now(self, copies: Sequence[BlockCopy]) -> list[int]:
        """Streamed hand-offs taken at once, in the caller's step (kvport_pd_take "sync"): from the
        inbox without waiting for a stream still arriving (:data:`SYNC_TAKE_WAIT_S` at most), the rest
        from the store; the block ids not loaded (vLLM recomputes them)."""
        failed: list[int] = []
        for c in copies:
            try:
                failed += self._load(c, wait_s=SYNC_TAKE_WAIT_S, op="load")
            except Exception as exc:  # a load must end (reported), never fail the engine's step
                log.warning("kvport: taking the hand-off of %s failed (%s: %s); vLLM recomputes it", c.req_id,
                            type(exc).__name__, exc)
                failed += list(c.block_ids)
        return failed

    def _load(self, c: BlockCopy, wait_s: float | None = None, op: str = "load_async") -> list[int]:
        """``wait_s``: the longest the inbox is waited for (the stream not there yet, or still open)."""
        m = self.mover
        t0, copy0 = time.perf_counter(), m.stats.load_copy_s
        deadline = m.deadline_for(len(c.keys))
        pos = 0
        try:
            if c.stream is not None and self.inbox is not None:
                take = deadline if wait_s is None else Deadline(min(deadline.at, time.monotonic() + wait_s))
                pos = self._from_inbox(c, self.inbox, c.stream, take, unknown_wait_s=1.0 if wait_s is None else wait_s)
                deadline = m.deadline_for(len(c.keys) - pos)  # the store's reads get their own time
            return m.load_now(c.keys[pos:], c.block_ids[pos:], deadline)
        finally:
            dt = time.perf_counter() - t0
            m.stats.load_read_s += dt - (m.stats.load_copy_s - copy0)
            SECONDS.labels(op=op).inc(dt)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)
        self.keep(list(self._taken))
        self._keeps.put(None)
        if self._keeper is not None:
            self._keeper.join(10)

