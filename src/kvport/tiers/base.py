"""The tier interface: opaque values of recorded length under 16-byte block keys.

A tier stores bytes, nothing else: it knows no owners, lifetimes or policies (the ledger and the
store decide those). A value is a block in the canonical LKHTD layout or codec-encoded bytes of any
length up to ``caps.max_value_bytes``; every tier records each value's exact length.

Contract shared by every implementation:

* ``put`` either stores the whole value or nothing (no partial value is ever visible); putting an
  existing key replaces its value.
* ``get_into(key, dst)`` writes the value to ``dst[:n]`` and returns ``n``. ``dst`` must be a writable,
  contiguous buffer of at least ``n`` bytes, else :class:`BufferMismatchError` (checked before any
  byte is written). A missing key is :class:`BlockNotFoundError`; stored bytes that fail their
  length or checksum check are :class:`CorruptBlockError` (the tier drops them, so the next get is a
  clean miss); a backing service that is down is :class:`TierUnavailableError`. Never wrong data.
* Foreign errors (OSError, redis-py, torch) never escape: they are mapped to the tree in
  :mod:`kvport.errors` with ``raise ... from exc``.
* Batched forms have correct default implementations (a loop); tiers override them where the backend
  can batch (Redis pipelines).
* A block may travel with its :class:`BlockMeta` (parent, lifetime class, TTL, account, opaque
  attributes): ``put_block`` takes it, and a tier that declares ``caps.block_meta`` keeps it (the
  paged tier's journal) or forwards it (the kvport server's client) and gives it back in
  ``records()``; every other tier ignores it. A tier never acts on it: placement is the store's.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
from typing_extensions import Buffer as _BufferProtocol

from kvport.errors import BlockNotFoundError, BufferMismatchError, CorruptBlockError, TierError
from kvport.lifetime import Lifetime

__all__ = ["BlockMeta", "Buffer", "Tier", "TierCaps", "byte_view", "writable_view"]

# Anything exposing the buffer protocol; numpy arrays listed explicitly because numpy's stubs only
# declare ``__buffer__`` for Python >= 3.12.
Buffer: TypeAlias = _BufferProtocol | np.ndarray[Any, Any]


def _memoryview(data: Buffer) -> memoryview:
    if isinstance(data, np.ndarray):
        return data.data
    return memoryview(data)


@dataclass(frozen=True, slots=True)
class TierCaps:
    """What a tier can do, declared (callers never probe with ``hasattr``).

    persistent:      values survive a restart of this process (disk, Redis).
    shared:          other processes / machines see the same values (Redis, remote server).
    zero_copy_read:  ``view(key)`` returns a read-only view into the tier's own memory (host pool).
    zero_copy_write: ``reserve/commit/abort`` write straight into the tier's memory (host pool).
    max_value_bytes: the largest value one ``put`` accepts.
    native_ttl:      the backend expires values itself (Redis); otherwise the store expires them.
    device:          the values live in accelerator memory.
    block_meta:      ``put_block`` keeps or forwards the BlockMeta and ``records()`` gives it back.
    pool_records:    ``put_block`` and ``put_many_meta`` keep the pool's record of each value beside it
                     (Redis: who handed it over, its lifetime and parent).
    """

    persistent: bool
    shared: bool
    zero_copy_read: bool
    max_value_bytes: int
    zero_copy_write: bool = False
    native_ttl: bool = False
    device: bool = False
    block_meta: bool = False
    pool_records: bool = False


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What the store knows of a block beside its bytes; opaque to every tier but the ones that
    persist (``caps.block_meta``) or forward it. ``attrs`` are the caller's own bytes (the server
    keeps the client key and the verified chunk checksums there)."""

    parent: bytes | None = None
    lifetime: Lifetime | None = None
    ttl_s: float | None = None
    account: str | None = None
    attrs: bytes = b""


def byte_view(data: Buffer) -> memoryview:
    """A flat, read-only ``uint8`` view of any C-contiguous buffer (no copy)."""
    try:
        mv = _memoryview(data)
    except (TypeError, ValueError) as exc:
        raise BufferMismatchError(f"value of type {type(data).__name__} does not expose a buffer") from exc
    if not mv.c_contiguous:
        raise BufferMismatchError("value buffer must be C-contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv.toreadonly()


@dataclass(frozen=True, slots=True)
class FsRoom:
    """What ``os.statvfs`` says of a folder's filesystem: bytes free to this process, block size."""

    free_bytes: int
    total_bytes: int
    block_bytes: int


def fs_room(path: str | Path) -> FsRoom:
    try:
        st = os.statvfs(path)
    except OSError as exc:
        raise TierError(f"cannot stat the filesystem of {path}: {exc}") from exc
    return FsRoom(st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize, st.f_frsize or 4096)


def writable_view(dst: Buffer, need: int) -> memoryview:
    """A flat writable ``uint8`` view of ``dst`` of at least ``need`` bytes, else BufferMismatchError."""
    try:
        mv = _memoryview(dst)
    except (TypeError, ValueError) as exc:
        raise BufferMismatchError(f"destination of type {type(dst).__name__} does not expose a buffer") from exc
    if mv.readonly:
        raise BufferMismatchError("destination buffer is read-only")
    if not mv.c_contiguous:
        raise BufferMismatchError("destination buffer must be C-contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if mv.nbytes < need:
        raise BufferMismatchError(f"destination holds {mv.nbytes} bytes, value needs {need}")
    return mv


class Tier(abc.ABC):
    """Bytes in, bytes out, under 16-byte keys. See the module docstring for the shared contract."""

    name: str
    caps: TierCaps

    # ------------------------------------------------------------------ sizes
    @property
    @abc.abstractmethod
    def capacity_bytes(self) -> int:
        """Bytes this tier may hold in all (the store's watermarks are fractions of it)."""

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Bytes held now, as the tier accounts them (host: whole pages; others: value lengths)."""

    # ------------------------------------------------------------------ single values
    @abc.abstractmethod
    def put(self, key: bytes, data: Buffer, *, ttl_s: float | None = None) -> None:
        """Store ``data`` under ``key`` (replacing any old value), all or nothing.

        Raises TierFullError (no room), BufferMismatchError (value too large / not a buffer),
        TierUnavailableError (backend down)."""

    @abc.abstractmethod
    def get_into(self, key: bytes, dst: Buffer) -> int:
        """Copy the value into ``dst[:n]`` and return ``n`` (see the module docstring for errors)."""

    @abc.abstractmethod
    def size_of(self, key: bytes) -> int | None:
        """The stored value's length, or None when absent."""

    @abc.abstractmethod
    def delete(self, key: bytes) -> bool:
        """Drop the value; True if it was there."""

    @abc.abstractmethod
    def keys(self) -> Iterator[bytes]:
        """Every key held (a snapshot; order unspecified)."""

    def contains(self, key: bytes) -> bool:
        return self.size_of(key) is not None

    def view(self, key: bytes) -> memoryview:
        """A read-only zero-copy view of the value; only tiers with ``caps.zero_copy_read``."""
        raise TierError(f"{self.name}: no zero-copy read (caps.zero_copy_read is False)")

    def charge(self, nbytes: int) -> int:
        """Bytes of capacity a value of ``nbytes`` takes here (the host pool charges whole pages)."""
        return nbytes

    def shortfall(self, nbytes: int, values: int) -> int:
        """Bytes missing, now, for ``values`` more values of ``nbytes`` charged bytes in all (0: they
        fit). The default reads the tier's own accounting; a tier on a filesystem answers for the
        filesystem instead (its free space may be less than the capacity says, or taken by others)."""
        return max(0, self.used_bytes + nbytes - self.capacity_bytes)

    # ------------------------------------------------------------------ blocks with metadata, parts
    def put_block(self, key: bytes, parts: Sequence[Buffer], meta: BlockMeta, *, ttl_s: float | None = None) -> None:
        """Store the value made of ``parts`` (in order) with its metadata; all or nothing. The default
        ignores ``meta`` (``caps.block_meta`` is False) and joins the parts when there are several."""
        if len(parts) == 1:
            self.put(key, parts[0], ttl_s=ttl_s)
            return
        self.put(key, b"".join(byte_view(p) for p in parts), ttl_s=ttl_s)

    def records(self) -> Iterator[tuple[bytes, int, BlockMeta | None]]:
        """(key, length, metadata) of every value held; the metadata is None where not kept."""
        for k in list(self.keys()):
            n = self.size_of(k)
            if n is not None:
                yield k, n, None

    # ------------------------------------------------------------------ zero-copy (caps.zero_copy_*)
    def reserve_views(self, key: bytes, nbytes: int) -> list[memoryview]:
        """Writable views that receive the value, in order; invisible until :meth:`commit`, gone on
        :meth:`abort`. Only tiers with ``caps.zero_copy_write``."""
        raise TierError(f"{self.name}: no zero-copy write (caps.zero_copy_write is False)")

    def commit(self, key: bytes, meta: BlockMeta | None = None) -> None:
        """Make a reserved value visible (with its metadata, where the tier keeps it)."""
        raise TierError(f"{self.name}: no zero-copy write (caps.zero_copy_write is False)")

    def abort(self, key: bytes) -> None:
        raise TierError(f"{self.name}: no zero-copy write (caps.zero_copy_write is False)")

    def read_views(self, key: bytes) -> list[memoryview]:
        """Read-only zero-copy views of the value, in order (valid until it is deleted or replaced:
        the caller holds a lease or pin). Only tiers with ``caps.zero_copy_read``."""
        return [self.view(key)]

    def get(self, key: bytes) -> bytes:
        """Convenience copy for tests and small values (hot paths use ``get_into``)."""
        n = self.size_of(key)
        if n is None:
            raise BlockNotFoundError(f"{self.name}: no block {key.hex()}")
        buf = bytearray(n)
        got = self.get_into(key, buf)
        return bytes(buf[:got])

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op for tiers without resources
        """Release resources (sockets, files, pools). Idempotent."""

    # ------------------------------------------------------------------ batched defaults
    def put_many(self, items: Sequence[tuple[bytes, Buffer]], *, ttl_s: float | None = None) -> None:
        """Put every item; stops at the first error (items before it stay stored)."""
        for key, data in items:
            self.put(key, data, ttl_s=ttl_s)

    def put_many_meta(self, items: Sequence[tuple[bytes, Buffer]], metas: Sequence[BlockMeta | None], *,
                      ttl_s: float | None = None) -> None:
        """:meth:`put_many` with each value's BlockMeta, for a tier that keeps the pool's records
        (``caps.pool_records``); the others ignore it."""
        self.put_many(items, ttl_s=ttl_s)

    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]]) -> list[int | None]:
        """Get each key into its buffer; None for a key that is missing or failed its check.

        Unavailability (TierUnavailableError) and buffer mismatches raise: they are the caller's or
        the service's fault, not a miss."""
        out: list[int | None] = []
        for key, dst in items:
            try:
                out.append(self.get_into(key, dst))
            except (BlockNotFoundError, CorruptBlockError):
                out.append(None)
        return out

    def contains_many(self, keys: Iterable[bytes]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def sizes_of(self, keys: Iterable[bytes]) -> list[int | None]:
        """:meth:`size_of` of each key (a remote tier answers them all in one round trip)."""
        return [self.size_of(k) for k in keys]

    def delete_many(self, keys: Iterable[bytes]) -> int:
        return sum(1 for k in keys if self.delete(k))

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, used={self.used_bytes}, capacity={self.capacity_bytes})"

