"""DeviceTier: fixed-size pages in one preallocated accelerator buffer (only when CUDA exists).

Same page discipline as :class:`~kvport.tiers.host.HostTier` (one value per page, length recorded),
but the pool is a ``torch.uint8`` CUDA tensor: ``put`` copies host bytes up, ``get_into`` copies
them down into the caller's host buffer (synchronised before returning).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np

from kvport.errors import BlockNotFoundError, BufferMismatchError, TierError, TierFullError
from kvport.tiers.base import Buffer, Tier, TierCaps, byte_view, writable_view


class DeviceTier(Tier):
    def __init__(self, capacity_bytes: int, page_bytes: int, *, name: str = "device", device: str = "cuda") -> None:
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
        self._pool = torch.zeros(self.num_pages * page_bytes, dtype=torch.uint8, device=device)
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._slots: dict[bytes, tuple[int, int]] = {}
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def used_bytes(self) -> int:
        return (self.num_pages - len(self._free)) * self.page_bytes

    def charge(self, nbytes: int) -> int:
        return self.page_bytes

    def put(self, key: bytes, data: Buffer, *, ttl_s: float | None = None) -> None:
        src = byte_view(data)
        n = src.nbytes
        if n > self.page_bytes:
            raise BufferMismatchError(f"{self.name}: value of {n} bytes does not fit a {self.page_bytes}-byte page")
        with self._lock:
            if not self._free:
                raise TierFullError(f"{self.name}: all {self.num_pages} pages in use")
            page = self._free.pop()
        off = page * self.page_bytes
        host = self._torch.from_numpy(np.frombuffer(src, dtype=np.uint8))
        self._pool[off : off + n].copy_(host)
        self._torch.cuda.synchronize()
        with self._lock:
            old = self._slots.get(key)
            self._slots[key] = (page, n)
            if old is not None:
                self._free.append(old[0])

    def get_into(self, key: bytes, dst: Buffer) -> int:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                raise BlockNotFoundError(f"{self.name}: no block {key.hex()}")
            page, n = slot
            out = writable_view(dst, n)
            off = page * self.page_bytes
            host = self._torch.from_numpy(np.frombuffer(out, dtype=np.uint8, count=n))
            host.copy_(self._pool[off : off + n])
            self._torch.cuda.synchronize()
        return n

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
