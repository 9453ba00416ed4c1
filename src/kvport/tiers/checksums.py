"""Checksums beside the copy: one hashing thread per process for the tiers' large batches.

xxhash releases the GIL while it hashes, so a batch's checksums can be computed on a second core
while the calling thread writes the same bytes (a disk slab) or copies them (Redis values into the
caller's buffers): the two passes over the payload then take the time of one. Small batches are
hashed inline (a thread handoff costs more than it saves).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import xxhash

ASIDE_MIN_BYTES = 4 << 20  # batches this large are hashed on the checksum thread
PARALLEL = (os.cpu_count() or 1) >= 2

T = TypeVar("T")

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _hasher() -> ThreadPoolExecutor:
    """The process's checksum thread, started on first use (a forked child starts its own)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="kvport-tier-xxh3")
            os.register_at_fork(after_in_child=_forget)
        return _pool


def _forget() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


def aside(fn: Callable[[], T], nbytes: int) -> Future[T]:
    """``fn()`` on the checksum thread when ``nbytes`` is large enough and a second core exists,
    else inline (an already completed future). The caller must wait for it before it lets go of
    the buffers ``fn`` reads."""
    if PARALLEL and nbytes >= ASIDE_MIN_BYTES:
        return submit(fn)
    fut: Future[T] = Future()
    try:
        fut.set_result(fn())
    except BaseException as exc:  # delivered by result(), as from the thread
        fut.set_exception(exc)
    return fut


def submit(fn: Callable[[], T]) -> Future[T]:
    """``fn()`` on the checksum thread, whatever its size (the caller decided it is worth it)."""
    return _hasher().submit(fn)


def xxh3_each(bufs: Sequence[bytes | memoryview]) -> list[int]:
    return [xxhash.xxh3_64_intdigest(b) for b in bufs]
