"""HostTier: one preallocated RAM pool of fixed-size pages; no allocation per put or get.

::

    pool (uint8, allocated once; pinned when CUDA exists)
    +-----------+-----------+-----------+-----+-------------+
    | page 0    | page 1    | page 2    | ... | page N-1    |     N = capacity_bytes // page_bytes
    +-----------+-----------+-----------+-----+-------------+
      value = pool[page * page_bytes : page * page_bytes + nbytes],  nbytes <= page_bytes

A value occupies exactly one page (``caps.max_value_bytes == page_bytes``); its length is recorded.
A page is in exactly one of three sets at any time::

    free  --reserve-->  reserved  --commit-->  committed  --delete/replace-->  free
                          |  abort                 ^
                          +-------> free           +-- put (= reserve + copy + commit)

Only committed pages are visible to ``get_into / view / contains / keys``. ``used_bytes`` counts
reserved and committed pages as whole pages. A view from ``view(key)`` or ``reserve`` stays valid
until the key is deleted or replaced: callers hold a ledger lease or pin across its use.

Resident memory: ``prefault=True`` (the default) faults the whole pool in at start, so no put ever
waits for the kernel (fresh pages fault at ~1 GB/s) and the memory is the tier's from the first
second. ``prefault=False`` (``kvport serve``'s default) maps the pool without touching it: a page
faults in when a put first writes it, in that put's copy (outside the tier's lock, on whichever
thread copies). An idle pool costs next to nothing; a filling one pays each page's fault once
(pages are handed out lowest first and freed pages are reused first, so the resident part only grows
when the tier holds more than it ever did). ``resident_bytes`` is that high-water mark.

Hot path (measured by ``kvport bench tiers`` against numpy memcpy of the same bytes): one
``memoryview`` slice assignment per value, under a lock that only guards the page tables.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvport.errors import BlockNotFoundError, BufferMismatchError, TierError, TierFullError
from kvport.tiers.base import BlockMeta, Buffer, Tier, TierCaps, byte_view, writable_view


@dataclass(frozen=True, slots=True)
class _Slot:
    page: int
    nbytes: int


def _addr(mv: memoryview) -> int:
    addr: int = np.frombuffer(mv, dtype=np.uint8).ctypes.data
    return addr


def _copy_runs(dsts: list[memoryview], srcs: list[memoryview]) -> None:
    """dst[i][:] = src[i][:] for all i, merging neighbours that are adjacent on both sides."""
    i = 0
    n = len(dsts)
    while i < n:
        if not dsts[i].nbytes:
            i += 1
            continue
        d0, s0 = _addr(dsts[i]), _addr(srcs[i])
        length = dsts[i].nbytes
        j = i + 1
        while (j < n and dsts[j].nbytes and _addr(dsts[j]) == d0 + length and _addr(srcs[j]) == s0 + length):
            length += dsts[j].nbytes
            j += 1
        if j == i + 1:
            dsts[i][:] = srcs[i]
        else:
            ctypes.memmove(d0, s0, length)
        i = j


_HUGE_PAGE = 2 << 20


def _alloc_pool(nbytes: int, pin: bool | None, prefault: bool = True) -> tuple[object, memoryview, bool]:
    """The pool array (kept alive by the tier), a flat writable byte view of it, and whether it is
    faulted in (a pinned pool always is).

    ``pin=None`` pins when CUDA is usable *and torch is already imported* (an engine on a GPU has
    imported it); a host-only process does not pay seconds of ``import torch`` for a RAM pool."""
    torch_mod = sys.modules.get("torch")
    want_pin = pin if pin is not None else bool(torch_mod is not None and torch_mod.cuda.is_available())
    if want_pin:
        import torch

        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        t.fill_(0)
        arr = t.numpy()
        return t, arr.data.cast("B"), True
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= _HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        # 2 MiB pages where the kernel allows them (THP "madvise" or "always"): one TLB entry
        # covers 512x the bytes, which the copies into and out of the pool (memcpy, and the
        # kernel's socket copies in the server) feel on every access
        with contextlib.suppress(OSError):
            m.madvise(mmap.MADV_HUGEPAGE)
    arr = np.frombuffer(m, dtype=np.uint8)
    if prefault:
        arr.fill(0)  # pre-fault every page now, not on the first put (fresh pages fault at ~1 GB/s)
    return m, arr.data.cast("B"), prefault


class HostTier(Tier):
    def __init__(self, capacity_bytes: int, page_bytes: int, *, name: str = "host", pin: bool | None = None,
                 prefault: bool = True) -> None:
        if page_bytes <= 0 or capacity_bytes < page_bytes:
            raise TierError(f"HostTier needs 0 < page_bytes <= capacity_bytes, got {page_bytes}, {capacity_bytes}")
        self.name = name
        self.page_bytes = page_bytes
        self.num_pages = capacity_bytes // page_bytes
        self.caps = TierCaps(persistent=False, shared=False, zero_copy_read=True, max_value_bytes=page_bytes,
                             zero_copy_write=True)
        self._owner, self._mv, faulted = _alloc_pool(self.num_pages * page_bytes, pin, prefault)
        self._resident_pages = self.num_pages if faulted else 0  # pages [0, n) have been handed out (or faulted)
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._committed: dict[bytes, _Slot] = {}
        self._reserved: dict[bytes, _Slot] = {}
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ sizes
    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def used_bytes(self) -> int:
        return (self.num_pages - len(self._free)) * self.page_bytes

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def resident_bytes(self) -> int:
        """Bytes of the pool ever handed out, so resident (the whole pool when it was pre-faulted)."""
        return self._resident_pages * self.page_bytes

    def _grow_to(self, page: int) -> None:
        """Record that ``page`` is handed out (the high-water mark of :attr:`resident_bytes`); under the lock."""
        self._resident_pages = max(self._resident_pages, page + 1)

    # ------------------------------------------------------------------ two-phase zero-copy write
    def reserve(self, key: bytes, nbytes: int) -> memoryview:
        """A writable view of ``nbytes`` into a free page; invisible until :meth:`commit`.

        Raises TierFullError when no page is free, BufferMismatchError when ``nbytes`` exceeds a
        page, TierError when ``key`` is already reserved."""
        if not 0 <= nbytes <= self.page_bytes:
            raise BufferMismatchError(
                f"{self.name}: value of {nbytes} bytes does not fit a {self.page_bytes}-byte page")
        with self._lock:
            self._check_open()
            if key in self._reserved:
                raise TierError(f"{self.name}: block {key.hex()} is already reserved")
            if not self._free:
                raise TierFullError(f"{self.name}: all {self.num_pages} pages in use")
            slot = _Slot(self._free.pop(), nbytes)
            self._grow_to(slot.page)
            self._reserved[key] = slot
        off = slot.page * self.page_bytes
        return self._mv[off : off + nbytes]

    def reserve_views(self, key: bytes, nbytes: int) -> list[memoryview]:
        return [self.reserve(key, nbytes)]

    def commit(self, key: bytes, meta: BlockMeta | None = None) -> None:
        """Make a reserved page visible under ``key`` (replacing any committed value)."""
        with self._lock:
            slot = self._reserved.pop(key, None)
            if slot is None:
                raise TierError(f"{self.name}: commit of {key.hex()} that is not reserved")
            old = self._committed.get(key)
            self._committed[key] = slot
            if old is not None:
                self._free.append(old.page)

    def abort(self, key: bytes) -> None:
        """Return a reserved page to the free list; its bytes are never visible."""
        with self._lock:
            slot = self._reserved.pop(key, None)
            if slot is None:
                raise TierError(f"{self.name}: abort of {key.hex()} that is not reserved")
            self._free.append(slot.page)

    def view(self, key: bytes) -> memoryview:
        """A read-only zero-copy view of a committed value (valid until delete/replace)."""
        with self._lock:
            slot = self._committed.get(key)
        if slot is None:
            raise BlockNotFoundError(f"{self.name}: no block {key.hex()}")
        off = slot.page * self.page_bytes
        return self._mv[off : off + slot.nbytes].toreadonly()

    # ------------------------------------------------------------------ Tier
    def put(self, key: bytes, data: Buffer, *, ttl_s: float | None = None) -> None:
        src = byte_view(data)
        dst = self.reserve(key, src.nbytes)
        try:
            dst[:] = src
        except BaseException:
            self.abort(key)
            raise
        self.commit(key)

    def put_many(self, items: Sequence[tuple[bytes, Buffer]], *, ttl_s: float | None = None) -> None:
        """All-or-nothing batch put. Pages are handed out in ascending order, so a request's blocks
        that sit back to back in the caller's memory land in adjacent pages and each such run is
        one large copy (large copies run at full memcpy speed; 2 MiB copies do not)."""
        srcs = [byte_view(d) for _, d in items]
        keys = [k for k, _ in items]
        if len(set(keys)) != len(keys):
            for k, v in zip(keys, srcs, strict=True):
                self.put(k, v)
            return
        big = next((v.nbytes for v in srcs if v.nbytes > self.page_bytes), None)
        if big is not None:
            raise BufferMismatchError(f"{self.name}: value of {big} bytes does not fit a {self.page_bytes}-byte page")
        with self._lock:
            self._check_open()
            if any(k in self._reserved for k in keys):
                raise TierError(f"{self.name}: a block of the batch is already reserved")
            if len(self._free) < len(keys):
                raise TierFullError(f"{self.name}: {len(keys)} pages wanted, {len(self._free)} free")
            pages = sorted(self._free[len(self._free) - len(keys) :])  # ascending: neighbours stay neighbours
            del self._free[len(self._free) - len(keys) :]
            if pages:
                self._grow_to(pages[-1])
            for k, v, page in zip(keys, srcs, pages, strict=True):
                self._reserved[k] = _Slot(page, v.nbytes)
        pb = self.page_bytes
        dsts = [self._mv[pg * pb : pg * pb + v.nbytes] for pg, v in zip(pages, srcs, strict=True)]
        try:
            _copy_runs(dsts, srcs)
        except BaseException:
            for k in keys:
                self.abort(k)
            raise
        for k in keys:
            self.commit(k)

    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]]) -> list[int | None]:
        """Batch get; a missing key gives None. Adjacent pages read into adjacent destination
        memory are copied as one run."""
        with self._lock:
            srcs: list[memoryview] = []
            dsts: list[memoryview] = []
            out: list[int | None] = []
            for key, dst in items:
                slot = self._committed.get(key)
                if slot is None:
                    out.append(None)
                    continue
                o = writable_view(dst, slot.nbytes)
                off = slot.page * self.page_bytes
                srcs.append(self._mv[off : off + slot.nbytes])
                dsts.append(o[: slot.nbytes])
                out.append(slot.nbytes)
            _copy_runs(dsts, srcs)  # under the lock: no page is reused mid-copy
        return out

    def get_into(self, key: bytes, dst: Buffer) -> int:
        with self._lock:
            slot = self._committed.get(key)
            if slot is None:
                raise BlockNotFoundError(f"{self.name}: no block {key.hex()}")
            out = writable_view(dst, slot.nbytes)
            off = slot.page * self.page_bytes
            out[: slot.nbytes] = self._mv[off : off + slot.nbytes]  # under the lock: no concurrent reuse
        return slot.nbytes

    def size_of(self, key: bytes) -> int | None:
        slot = self._committed.get(key)
        return None if slot is None else slot.nbytes

    def contains(self, key: bytes) -> bool:
        return key in self._committed

    def charge(self, nbytes: int) -> int:
        return self.page_bytes

    def delete(self, key: bytes) -> bool:
        with self._lock:
            slot = self._committed.pop(key, None)
            if slot is None:
                return False
            self._free.append(slot.page)
            return True

    def keys(self) -> Iterator[bytes]:
        with self._lock:
            snapshot = list(self._committed)
        return iter(snapshot)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._committed.clear()
            self._reserved.clear()
            self._free = []

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"{self.name}: tier is closed")
