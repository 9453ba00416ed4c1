"""DeviceTier: fixed-size pages in one preallocated accelerator buffer (only when CUDA exists).

Same page discipline as :class:`~kvport.tiers.host.HostTier` (one value per page, length recorded),
but the pool is a ``torch.uint8`` CUDA tensor. Copies run on the tier's own CUDA stream and wait on
their own event, never on the whole device (a model computing on the default stream is not
stalled, nor waited for)::

    put:      source pinned?  yes -> DMA straight from it          (cudaMemcpyAsync, the limit)
                              no  -> memcpy into pinned staging, DMA from there, in pieces of
                                     staging/2: piece k+1 is copied in while piece k is on the wire
    get_into: the mirror image (DMA into pinned memory, then out to a pageable destination)

``put`` and ``get_into`` return once their copy completed (the source may be reused, the
destination read). ``put_many`` / ``get_many_into`` batch a call's values into one stream of copies
and one wait. ``kvport bench device`` measures both directions against pinned ``cudaMemcpy`` of the
same bytes in the same run.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvport.errors import BlockNotFoundError, BufferMismatchError, TierError, TierFullError
from kvport.tiers.base import Buffer, Tier, TierCaps, byte_view, writable_view

_STAGING = 32 << 20  # pinned staging for pageable sources and destinations (two halves, double-buffered)


class DeviceTier(Tier):
    def __init__(self, capacity_bytes: int, page_bytes: int, *, name: str = "device", device: str = "cuda",
                 staging_bytes: int = _STAGING) -> None:
        import torch

        if not torch.cuda.is_available():
            raise TierError("DeviceTier needs CUDA (torch.cuda.is_available() is False)")
        if page_bytes <= 0 or capacity_bytes < page_bytes:
            raise TierError(f"DeviceTier needs 0 < page_bytes <= capacity_bytes, got {page_bytes}, {capacity_bytes}")
        self._torch = torch
        self.name = name
        self.page_bytes = page_bytes
        self.num_pages = capacity_bytes // page_bytes
        self.caps = TierCaps(persistent=False, shared=False, zero_copy_read=False, max_value_bytes=page_bytes,
                             device=True)
        self.device = torch.device(device)
        self._pool = torch.empty(self.num_pages * page_bytes, dtype=torch.uint8, device=self.device)
        self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        half = max(1 << 20, staging_bytes // 2)
        self._stage = [torch.empty(half, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self._stage_np = [s.numpy() for s in self._stage]
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._slots: dict[bytes, tuple[int, int]] = {}
        self._lock = threading.Lock()  # pages and slots
        self._io = threading.Lock()  # the stream and the staging: one batch of copies at a time

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def used_bytes(self) -> int:
        return (self.num_pages - len(self._free)) * self.page_bytes

    def charge(self, nbytes: int) -> int:
        return self.page_bytes

    # ------------------------------------------------------------------ copies
    def _host(self, view: memoryview) -> Any:
        return self._torch.from_numpy(np.frombuffer(view, dtype=np.uint8))

    def _event(self) -> Any:
        ev = self._torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(self._stream)
        return ev

    def _up(self, jobs: Sequence[tuple[memoryview, int]]) -> None:
        """Host views -> pool offsets, on the tier's stream; returns when every copy completed."""
        torch = self._torch
        half = self._stage[0].numel()
        pending: list[Any] = [None, None]  # the event of the last DMA out of each staging half
        k = 0
        with self._io, torch.cuda.stream(self._stream):
            for src, off in jobs:
                host = None if src.readonly else self._host(src)  # bytes are never pinned memory
                if host is not None and host.is_pinned():
                    self._pool[off : off + src.nbytes].copy_(host, non_blocking=True)
                    continue
                for at in range(0, src.nbytes, half):
                    n = min(half, src.nbytes - at)
                    b = k & 1
                    k += 1
                    if pending[b] is not None:
                        pending[b].synchronize()  # that half's previous DMA has read it
                    np.copyto(self._stage_np[b][:n], np.frombuffer(src[at : at + n], dtype=np.uint8))
                    self._pool[off + at : off + at + n].copy_(self._stage[b][:n], non_blocking=True)
                    pending[b] = self._event()
            self._event().synchronize()

    def _down(self, jobs: Sequence[tuple[int, memoryview]]) -> None:
        """Pool offsets -> host views; returns when every byte is in its destination."""
        torch = self._torch
        half = self._stage[0].numel()
        with self._io, torch.cuda.stream(self._stream):
            staged: list[tuple[Any, int, memoryview, int]] = []  # (event, half, dst piece, n) to copy out
            k = 0

            def drain(keep: int) -> None:
                while len(staged) > keep:
                    ev, b, piece, n = staged.pop(0)
                    ev.synchronize()
                    np.copyto(np.frombuffer(piece, dtype=np.uint8), self._stage_np[b][:n])

            for off, dst in jobs:
                host = self._host(dst)
                if host.is_pinned():
                    host.copy_(self._pool[off : off + dst.nbytes], non_blocking=True)
                    continue
                for at in range(0, dst.nbytes, half):
                    n = min(half, dst.nbytes - at)
                    b = k & 1
                    k += 1
                    drain(1)  # the other half may still be on its way: the one about to be reused is out
                    self._stage[b][:n].copy_(self._pool[off + at : off + at + n], non_blocking=True)
                    staged.append((self._event(), b, dst[at : at + n], n))
            self._event().synchronize()
            drain(0)

    # ------------------------------------------------------------------ the tier
    def _take_pages(self, n: int) -> list[int]:
        with self._lock:
            if len(self._free) < n:
                raise TierFullError(f"{self.name}: {n} pages wanted, {len(self._free)} of {self.num_pages} free")
            return [self._free.pop() for _ in range(n)]

    def _publish(self, key: bytes, page: int, n: int) -> None:
        with self._lock:
            old = self._slots.get(key)
            self._slots[key] = (page, n)
            if old is not None:
                self._free.append(old[0])

    def put(self, key: bytes, data: Buffer, *, ttl_s: float | None = None) -> None:
        self.put_many([(key, data)], ttl_s=ttl_s)

    def put_many(self, items: Sequence[tuple[bytes, Buffer]], *, ttl_s: float | None = None) -> None:
        views = [byte_view(d) for _, d in items]
        for v in views:
            if v.nbytes > self.page_bytes:
                raise BufferMismatchError(f"{self.name}: value of {v.nbytes} bytes does not fit a "
                                          f"{self.page_bytes}-byte page")
        pages = self._take_pages(len(items))
        try:
            self._up([(v, p * self.page_bytes) for v, p in zip(views, pages, strict=True)])
        except BaseException:
            with self._lock:
                self._free.extend(pages)
            raise
        for (key, _), v, p in zip(items, views, pages, strict=True):  # visible only once on the device
            self._publish(key, p, v.nbytes)

    def get_into(self, key: bytes, dst: Buffer) -> int:
        got = self.get_many_into([(key, dst)])[0]
        if got is None:
            raise BlockNotFoundError(f"{self.name}: no block {key.hex()}")
        return got

    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]]) -> list[int | None]:
        jobs: list[tuple[int, memoryview]] = []
        out: list[int | None] = []
        with self._lock:  # held through the copies: no page is freed and refilled under them
            for key, dst in items:
                slot = self._slots.get(key)
                if slot is None:
                    out.append(None)
                    continue
                page, n = slot
                jobs.append((page * self.page_bytes, writable_view(dst, n)))
                out.append(n)
            self._down(jobs)
        return out

    def size_of(self, key: bytes) -> int | None:
        slot = self._slots.get(key)
        return None if slot is None else slot[1]

    def delete(self, key: bytes) -> bool:
        with self._lock:
            slot = self._slots.pop(key, None)
            if slot is None:
                return False
            self._free.append(slot[0])
            return True

    def keys(self) -> Iterator[bytes]:
        with self._lock:
            return iter(list(self._slots))
