"""An append-only journal of which values a folder holds, each record checksummed on its own.

::

    record = magic u32 "KVJ1" | body_len u32 | xxh32(body) u32 | body
    body   = msgpack ["add", key(16), length, meta map] | ["del", key(16)]

Writers append a record *after* the bytes it names are in place (an ADD) and *before* they are
removed (a DEL), so a crash leaves at worst bytes no record accounts for, never a record of bytes
that are gone -- except a delete on a filesystem too full for the DEL record, whose bytes go first
to make room for it (a reader checks that a record's bytes are there: such a record is dropped).
Reading never stops at damage: a record whose magic, length or checksum is wrong is
skipped and the reader looks for the next magic (one flipped byte loses one record, not the rest).
At open the live records are rewritten compactly (temp file, fsync, rename). A folder is used by
one process at a time: :class:`Journal` holds an exclusive ``flock`` on ``<dir>/LOCK`` while open,
so a second server on the same folder is refused at start instead of losing values later.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import msgpack
import xxhash

from kvport.errors import TierError, TierFullError
from kvport.lifetime import Lifetime
from kvport.tiers.base import BlockMeta, fs_room

log = logging.getLogger(__name__)
MAGIC = b"KVJ1"
_HEAD = struct.Struct("<4sII")
MAX_BODY = 1 << 16
JOURNAL_FILE = "blocks.journal"
LOCK_FILE = "LOCK"
RECORD_ROOM = 512  # room counted per record to come (an ADD with its meta is ~100-300 bytes)


@dataclass(frozen=True, slots=True)
class Entry:
    key: bytes
    length: int
    meta: BlockMeta


@dataclass(frozen=True, slots=True)
class Replay:
    live: dict[bytes, Entry]
    records: int  # good records read
    skipped_bytes: int  # bytes of damaged records stepped over


def _meta_map(m: BlockMeta) -> dict[str, object]:
    return {"parent": m.parent, "lifetime": None if m.lifetime is None else m.lifetime.value, "ttl_s": m.ttl_s,
            "account": m.account, "attrs": m.attrs}


def _meta_of(d: object) -> BlockMeta:
    if not isinstance(d, dict):
        raise ValueError("meta is not a map")
    parent, lt, ttl, account, attrs = (d.get("parent"), d.get("lifetime"), d.get("ttl_s"), d.get("account"),
                                       d.get("attrs", b""))
    if parent is not None and (not isinstance(parent, bytes) or len(parent) != 16):
        raise ValueError("bad parent")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float)):
        raise ValueError("bad ttl")
    if (account is not None and not isinstance(account, str)) or not isinstance(attrs, bytes):
        raise ValueError("bad account or attrs")
    return BlockMeta(parent, None if lt is None else Lifetime(lt), None if ttl is None else float(ttl), account, attrs)


def encode_add(key: bytes, length: int, meta: BlockMeta) -> bytes:
    return _frame(["add", key, length, _meta_map(meta)])


def encode_del(key: bytes) -> bytes:
    return _frame(["del", key])


def _frame(body_obj: list[object]) -> bytes:
    body: bytes = msgpack.packb(body_obj, use_bin_type=True)
    if len(body) > MAX_BODY:
        raise TierError(f"journal record of {len(body)} bytes exceeds {MAX_BODY}")
    return _HEAD.pack(MAGIC, len(body), xxhash.xxh32_intdigest(body)) + body


def replay(data: bytes) -> Replay:
    """The live ADD records of a journal's bytes, skipping damaged records."""
    live: dict[bytes, Entry] = {}
    off, good, skipped = 0, 0, 0
    n = len(data)
    while off + _HEAD.size <= n:
        magic, blen, check = _HEAD.unpack_from(data, off)
        body = data[off + _HEAD.size : off + _HEAD.size + blen] if blen <= MAX_BODY else b""
        rec = None
        if magic == MAGIC and blen <= MAX_BODY and len(body) == blen and xxhash.xxh32_intdigest(body) == check:
            try:
                rec = msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=blen, max_str_len=blen,
                                      max_array_len=16, max_map_len=16)
            except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
                rec = None
        if rec is not None and _apply(live, rec):
            good += 1
            off += _HEAD.size + blen
            continue
        nxt = data.find(MAGIC, off + 1)  # damaged: resynchronise on the next record's magic
        nxt = n if nxt < 0 else nxt
        skipped += nxt - off
        off = nxt
    skipped += max(0, n - off) if off < n else 0
    return Replay(live, good, skipped)


def _apply(live: dict[bytes, Entry], rec: object) -> bool:
    if not isinstance(rec, list) or not rec:
        return False
    try:
        if rec[0] == "add" and len(rec) == 4 and isinstance(rec[1], bytes) and len(rec[1]) == 16 \
                and isinstance(rec[2], int) and rec[2] >= 0:
            live[rec[1]] = Entry(rec[1], rec[2], _meta_of(rec[3]))
            return True
        if rec[0] == "del" and len(rec) == 2 and isinstance(rec[1], bytes) and len(rec[1]) == 16:
            live.pop(rec[1], None)
            return True
    except ValueError:
        return False
    return False


class Journal:
    """The journal of one folder, open for appends; the folder is locked to this process meanwhile."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path = folder / JOURNAL_FILE
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise TierError(f"cannot open {folder}: {exc}") from exc
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock_fd)
            raise TierError(f"{folder} is in use by another process (its LOCK is held); one server per folder") \
                from exc
        self._f: BinaryIO | None = None

    def read(self) -> Replay:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return Replay({}, 0, 0)
        except OSError as exc:
            raise TierError(f"cannot read journal {self.path}: {exc}") from exc
        out = replay(data)
        if out.skipped_bytes:
            log.warning("journal %s: skipped %d damaged bytes, kept %d good records", self.path, out.skipped_bytes,
                        out.records)
        return out

    def rewrite(self, entries: Iterable[Entry]) -> None:
        """Replace the journal by ADD records of ``entries`` (temp file, fsync, rename), then append."""
        tmp = self.path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                for e in entries:
                    f.write(encode_add(e.key, e.length, e.meta))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            if self._f is not None:
                self._f.close()
            self._f = open(self.path, "ab")  # noqa: SIM115 - held open for appends until close()
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise _mapped(exc, f"cannot write journal {self.path}") from exc

    def open_append(self) -> None:
        """Append to the journal as it is (when it cannot be rewritten: a full disk)."""
        if self._f is None:
            try:
                self._f = open(self.path, "ab")  # noqa: SIM115 - held open for appends until close()
            except OSError as exc:
                raise _mapped(exc, f"cannot open journal {self.path}") from exc

    def shortfall(self, records: int) -> int:
        """Bytes the journal's filesystem lacks for ``records`` more records (0: they fit)."""
        fs = fs_room(self.folder)
        return max(0, records * RECORD_ROOM + fs.block_bytes - fs.free_bytes)

    def add(self, key: bytes, length: int, meta: BlockMeta) -> None:
        self._append(encode_add(key, length, meta))

    def remove(self, key: bytes) -> None:
        self._append(encode_del(key))

    def _append(self, rec: bytes) -> None:
        if self._f is None:
            raise TierError("journal is not open")
        try:
            self._f.write(rec)
            self._f.flush()
        except OSError as exc:
            # a torn record at the tail is skipped by the next replay; keep appending after it
            raise _mapped(exc, f"cannot append to journal {self.path}") from exc

    def sync(self) -> None:
        if self._f is not None:
            try:
                self._f.flush()
                os.fsync(self._f.fileno())
            except OSError as exc:
                raise _mapped(exc, f"cannot sync journal {self.path}") from exc

    def close(self) -> None:
        if self._f is not None:
            with contextlib.suppress(TierError):
                self.sync()
            with contextlib.suppress(OSError):
                self._f.close()
            self._f = None
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                os.close(self._lock_fd)
            self._lock_fd = -1


def _mapped(exc: OSError, what: str) -> TierError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return TierFullError(f"{what}: {exc}")
    return TierError(f"{what}: {exc}")
