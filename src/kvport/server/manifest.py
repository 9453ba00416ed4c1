"""The disk manifest: which tenant owns each disk block, so a restart rebuilds quotas and the catalog.

An append-only file of records, each::

    u32 body_len | u32 xxh32(body) | body = msgpack [op, storage_key(16), tenant, client_key(16), size]

``op`` is ADD (the block is whole on the disk tier) or REMOVE. An ADD is appended only *after* the
disk tier's ``put`` returned (the tier's put is all-or-nothing), so a crash leaves at worst a disk
block without a record, which :func:`reconcile` deletes. Reading stops at the first truncated or
corrupt record (a torn tail). At start the manifest is reconciled with the disk tier's keys and
rewritten compactly (write to a temp file, fsync, rename).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import msgpack
import xxhash

from kvport.errors import TierError

MANIFEST_FILE = "server.manifest"
_REC = struct.Struct("<II")
_ADD, _REMOVE = 1, 2
_MAX_BODY = 1 << 12


@dataclass(frozen=True, slots=True)
class DiskRecord:
    skey: bytes
    tenant: str
    client_key: bytes
    size: int


def _encode(op: int, skey: bytes, tenant: str, client_key: bytes, size: int) -> bytes:
    body: bytes = msgpack.packb([op, skey, tenant, client_key, size], use_bin_type=True)
    return _REC.pack(len(body), xxhash.xxh32_intdigest(body)) + body


def read_records(path: Path) -> dict[bytes, DiskRecord]:
    """The live ADD records of a manifest (missing file: none)."""
    live: dict[bytes, DiskRecord] = {}
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return live
    except OSError as exc:
        raise TierError(f"cannot read manifest {path}: {exc}") from exc
    off = 0
    while off + _REC.size <= len(data):
        n, check = _REC.unpack_from(data, off)
        body = data[off + _REC.size : off + _REC.size + n]
        if n > _MAX_BODY or len(body) != n or xxhash.xxh32_intdigest(body) != check:
            break  # torn or corrupt tail
        try:
            op, skey, tenant, ckey, size = msgpack.unpackb(body, raw=False)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            break
        off += _REC.size + n
        if op == _ADD:
            live[bytes(skey)] = DiskRecord(bytes(skey), str(tenant), bytes(ckey), int(size))
        elif op == _REMOVE:
            live.pop(bytes(skey), None)
    return live


class Manifest:
    """Appends records; :meth:`sync` makes them durable (graceful shutdown, after spills)."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / MANIFEST_FILE
        self._f: BinaryIO | None = None

    def rewrite(self, records: Iterable[DiskRecord]) -> None:
        tmp = self.path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                for r in records:
                    f.write(_encode(_ADD, r.skey, r.tenant, r.client_key, r.size))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            self._f = open(self.path, "ab")  # noqa: SIM115 - held open for appends until close()
        except OSError as exc:
            raise TierError(f"cannot write manifest {self.path}: {exc}") from exc

    def add(self, r: DiskRecord) -> None:
        self._append(_encode(_ADD, r.skey, r.tenant, r.client_key, r.size))

    def remove(self, skey: bytes) -> None:
        self._append(_encode(_REMOVE, skey, "", b"", 0))

    def _append(self, rec: bytes) -> None:
        if self._f is None:
            raise TierError("manifest is not open")
        try:
            self._f.write(rec)
            self._f.flush()
        except OSError as exc:
            raise TierError(f"cannot append to manifest {self.path}: {exc}") from exc

    def sync(self) -> None:
        if self._f is not None:
            try:
                self._f.flush()
                os.fsync(self._f.fileno())
            except OSError as exc:
                raise TierError(f"cannot sync manifest {self.path}: {exc}") from exc

    def close(self) -> None:
        if self._f is not None:
            self.sync()
            self._f.close()
            self._f = None
