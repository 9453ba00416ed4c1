"""Write-behind: a tier's copies written by one background thread, after the put returned.

A tier with ``WriteMode.BEHIND`` gets every block put into a tier above it, like THROUGH, but the
put does not wait for it: the store queues the keys here and :class:`WriteBehind`'s thread copies
each block from the tier above into it. What that buys: a put costs the fast tier's write only
(a vLLM engine's save: the shared /dev/shm folder), while the slow one (the kvport server over TCP)
fills in behind.

* **Bounded, in bytes and in time**: the queue holds keys, not bytes (the writer reads each block
  back from the tier above), and at most ``max_pending_bytes`` of blocks. A put past that waits for
  the writer (backpressure: the copy below never falls further behind than that), but at most
  ``max_wait_s``: then the newest copies over the bound are dropped and counted, and the put goes on
  (a slow tier below costs its own copies, never a stalled engine step).
* **Best effort, like THROUGH**: a block that left the store before its turn is skipped; a write the
  tier refuses (full, unavailable) is dropped and counted (``kvport_store_behind_dropped_total``);
  the block stays where it is.
* **Ordered**: jobs run in the order they were queued; :meth:`after` queues a callable that runs once
  everything queued before it has been written (a lease on the tier below, taken when the blocks are
  there).
* :meth:`flush` waits until the queue is empty; :meth:`close` flushes (with a timeout), then stops.

:class:`StoreCopy` is the store's side, the copy function the queue's thread runs: each block still
held is read from a tier above under the store's lock (a local read), written below outside it (a
slow or hung tier below never stalls the store's other calls), and indexed there under the lock
again, unless it left meanwhile (then the copy below is deleted too).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvport import metrics
from kvport.errors import KVPortError, TierUnavailableError
from kvport.store.catalog import Catalog
from kvport.store.guard import Busy, StoreLock
from kvport.store.mover import Mover

log = logging.getLogger(__name__)

_DROPPED = metrics.counter("store_behind_dropped", "write-behind copies not made (tier full or down, block gone)",
                           ["tier"])
_PENDING = metrics.gauge("store_behind_pending_bytes", "bytes of blocks queued for write-behind", ["tier"])

DEFAULT_MAX_PENDING_BYTES = 512 << 20
DEFAULT_MAX_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class _Job:
    tier: str
    keys: tuple[bytes, ...]
    nbytes: int
    then: Callable[[], None] | None = None


class WriteBehind:
    """The queue and its thread. ``copy(tier, keys)`` does the work (the store's: read each block from
    the tier above, write it to ``tier``); it must not raise for one bad block."""

    def __init__(self, copy: Callable[[str, Sequence[bytes]], None],
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES, max_wait_s: float = DEFAULT_MAX_WAIT_S,
                 name: str = "kvport-write-behind") -> None:
        self._copy = copy
        self.max_pending_bytes = max_pending_bytes
        self.max_wait_s = max_wait_s
        self._jobs: collections.deque[_Job] = collections.deque()
        self._cond = threading.Condition()
        self._pending = 0
        self._busy = False
        self._closed = False
        self._name = name
        self._thread: threading.Thread | None = None

    @property
    def pending_bytes(self) -> int:
        return self._pending

    def submit(self, tier: str, keys: Sequence[bytes], nbytes: int, *, wait: bool = True) -> None:
        """Queue ``keys`` for ``tier``. ``wait``: first wait while the queue holds ``max_pending_bytes``
        already (a batch larger than that alone waits for an empty queue); never wait holding a lock
        the copy function takes (the store queues under its lock with ``wait=False``, then calls
        :meth:`wait_room` once it let go)."""
        if wait:
            self.wait_room(nbytes)
        with self._cond:
            if self._closed:
                return
            self._jobs.append(_Job(tier, tuple(keys), nbytes))
            self._pending += nbytes
            _PENDING.labels(tier).set(self._pending)
            self._start()
            self._cond.notify_all()

    def wait_room(self, nbytes: int = 0) -> None:
        """Wait until ``nbytes`` more fit under ``max_pending_bytes`` (or the queue is empty), at most
        ``max_wait_s``; past that, drop the newest queued copies until they fit (callbacks stay)."""
        with self._cond:
            if self._cond.wait_for(lambda: self._closed or self._pending == 0
                                   or self._pending + nbytes <= self.max_pending_bytes, self.max_wait_s):
                return
            kept: collections.deque[_Job] = collections.deque()
            while self._jobs and self._pending + nbytes > self.max_pending_bytes:
                job = self._jobs.pop()
                if job.then is not None:
                    kept.appendleft(job)
                    continue
                self._pending -= job.nbytes
                _DROPPED.labels(job.tier).inc(len(job.keys))
                _PENDING.labels(job.tier).set(self._pending)
                log.warning("kvport: write-behind to %s %.1f s behind; %d blocks not copied there", job.tier,
                            self.max_wait_s, len(job.keys))
            self._jobs.extend(kept)

    def after(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the writer thread once every job queued before it is done (at once, on this
        thread, when nothing is queued or being written)."""
        with self._cond:
            idle = not self._jobs and not self._busy
            if not idle:
                self._jobs.append(_Job("", (), 0, fn))
                self._start()
                self._cond.notify_all()
                return
        self._run_callback(fn)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued job is done; False if ``timeout_s`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        drained = self.flush(timeout_s)
        with self._cond:
            self._closed = True
            lost = sum(len(j.keys) for j in self._jobs)
            self._jobs.clear()
            self._pending = 0
            self._cond.notify_all()
        if not drained:
            log.warning("kvport: write-behind closed with %d blocks not copied below", lost)
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ thread
    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or bool(self._jobs))
                if self._closed:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                if job.then is not None:
                    self._run_callback(job.then)
                else:
                    self._copy_job(job)
            finally:
                with self._cond:
                    self._busy = False
                    self._pending -= job.nbytes
                    if job.tier:
                        _PENDING.labels(job.tier).set(self._pending)
                    self._cond.notify_all()

    def _copy_job(self, job: _Job) -> None:
        t0 = time.perf_counter()
        try:
            self._copy(job.tier, job.keys)
        except Exception as exc:  # the writer must survive anything one job does
            log.warning("kvport: write-behind of %d blocks to %s failed (%s: %s)", len(job.keys), job.tier,
                        type(exc).__name__, exc)
            _DROPPED.labels(job.tier).inc(len(job.keys))
        log.debug("kvport: write-behind of %d blocks to %s in %.3f s", len(job.keys), job.tier,
                  time.perf_counter() - t0)

    @staticmethod
    def _run_callback(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:
            log.warning("kvport: write-behind callback failed (%s: %s)", type(exc).__name__, exc)


class StoreCopy:
    """``copy(tier, keys)`` for a store's :class:`WriteBehind` (see the module docstring)."""

    def __init__(self, lock: StoreLock, catalog: Catalog, mover: Mover, busy: Busy) -> None:
        self._lock = lock
        self._cat = catalog
        self._mover = mover
        self._busy = busy
        self._scratch = bytearray(0)  # the thread's read buffer, grown to the largest block

    def __call__(self, tier: str, keys: Sequence[bytes]) -> None:
        cat = self._cat
        dropped = 0
        t = cat.tiers[tier]
        for key in keys:
            with self._lock:
                m = cat.records.get(key)
                if m is None or key in cat.idx[tier]:
                    dropped += m is None
                    continue
                src = next((n for n in cat.names if n != tier and key in cat.idx[n]), None)
                if src is None or not cat.health.healthy(t):
                    dropped += 1
                    continue
                if len(self._scratch) < m.size:
                    self._scratch = bytearray(m.size)
                view = memoryview(self._scratch)[: m.size]
                try:
                    n = cat.tiers[src].get_into(key, view)
                    charge = t.charge(n)
                    with self._busy({key}):
                        self._mover.make_room(tier, charge)
                except KVPortError as exc:
                    log.debug("kvport: write-behind of %s to %s dropped (%s)", key.hex(), tier, exc)
                    dropped += 1
                    continue
                meta, ttl = m.block_meta(), self._mover.native_ttl(t, m)
            try:  # outside the lock
                if t.caps.block_meta or t.caps.pool_records:
                    t.put_block(key, (view[:n],), meta, ttl_s=ttl)
                else:
                    t.put(key, view[:n], ttl_s=ttl)
            except TierUnavailableError as exc:
                cat.health.mark_broken(t, exc)
                log.debug("kvport: write-behind of %s to %s dropped (%s)", key.hex(), tier, exc)
                dropped += 1
                continue
            except KVPortError as exc:  # full, a value it refuses: this copy is not made
                log.debug("kvport: write-behind of %s to %s dropped (%s)", key.hex(), tier, exc)
                dropped += 1
                continue
            with self._lock:
                if key in cat.records and key not in cat.idx[tier]:
                    cat.written(tier, key, n, charge)
                elif key not in cat.records:  # deleted while it was being written: not kept below either
                    with contextlib.suppress(KVPortError):
                        t.delete(key)
        if dropped:
            _DROPPED.labels(tier).inc(dropped)
