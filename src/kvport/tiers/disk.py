"""DiskTier: slab files of checksummed blocks; the index is rebuilt from disk on start.

A ``put_many`` writes its whole batch (typically one request's blocks) as one slab, so reading the
request back cold is one sequential read of one file, as fast as raw file I/O; ``put`` writes a
slab of one. Slab ``<dir>/<pid>-<instance>-<seq>-<random>.kvs`` (the writer is in the name)::

    offset        size     field
    0             8        magic b"KVPSLAB1"
    8             4        entry count m (uint32 LE), m <= MAX_ENTRIES
    12            4        reserved (0)
    16            48 * m   entries: key 16 | payload offset u64 | length u64 | xxh3_64(key | payload) u64
                           | flags u64 (bit 0: deleted)
    16 + 48 m     ...      payloads, back to back in entry order

The checksum covers the key and the payload, so a damaged entry can never serve another key's
bytes. A slab is written to ``<dir>/tmp/`` and renamed into place (all or nothing; ``fsync=True``
fsyncs the file and the folder first). ENOSPC (or going over ``capacity_bytes``) is TierFullError
and the temporary file is removed. Deleting a block sets its deleted flag in place; a slab whose
blocks are all deleted is unlinked. (A flag lost in a crash only brings back a valid block.)
On start, temporary files of processes that are gone are deleted and every entry that is not deleted
and lies inside its file is indexed; reads verify length and checksum, and a mismatch marks the
entry deleted and raises CorruptBlockError (the next get is a clean miss).

Several processes may share one folder (engines on one host sharing a local disk cache): slabs are
immutable once renamed in, so :meth:`DiskTier.refresh` indexes the slabs others wrote since the last
scan and forgets blocks whose slab another process removed. It runs by itself on a miss, at most
once per ``refresh_s`` and only when the folder's mtime moved (one ``stat``). Each process charges
its capacity with the blocks it knows.

Hot paths (measured by ``kvport bench tiers`` against raw write / cold ``readinto`` of the same
bytes): a batch of at least 4 MiB is written in runs of up to 16 MiB (one ``pwritev`` each; one
syscall per value was 15-20% slower than one big write) while one checksum thread hashes it
beside the writer (two passes over the payload on two cores: as fast as the write alone here; a
single core would pay the hash on top, ~15-25%); smaller batches are hashed and written in 1 MiB
pieces while each piece is in cache. A batched
get reads runs of adjacent entries (up to 16 MiB) with one ``preadv`` each, straight into the
callers' buffers, in file order, so the kernel's sequential readahead works as for one big file.
(Measured: an explicit ``WILLNEED`` window ahead of the reads made cold reads slower here.)
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvport.errors import BlockNotFoundError, BufferMismatchError, CorruptBlockError, TierError, TierFullError
from kvport.tiers import checksums
from kvport.tiers.base import Buffer, Tier, TierCaps, byte_view, fs_room, writable_view

MAGIC = b"KVPSLAB1"
_HEAD = struct.Struct("<8sII")
_ENTRY = struct.Struct("<16sQQQQ")
HEAD_BYTES = _HEAD.size  # 16
ENTRY_BYTES = _ENTRY.size  # 48
MAX_ENTRIES = 1 << 16
_DELETED = 1
_SUFFIX = ".kvs"
WRITE_PIECE_BYTES = 1 << 20
PARALLEL_HASH_MIN_BYTES = checksums.ASIDE_MIN_BYTES  # batches this large: checksummed beside the write
_MAX_RUN_BYTES = 16 << 20
_MAX_IOV = 512


@dataclass(frozen=True, slots=True)
class _Loc:
    slab: str
    index: int  # entry number inside the slab
    offset: int  # payload offset in the file
    length: int
    digest: int


def _digest(key: bytes, payload: memoryview) -> int:
    h = xxhash.xxh3_64()
    h.update(key)
    h.update(payload)
    return int(h.intdigest())


class DiskTier(Tier):
    def __init__(self, dir: str | Path, capacity_bytes: int, *, fsync: bool = False, name: str = "disk",
                 max_value_bytes: int = 1 << 30, refresh_s: float | None = 1.0, shared: bool = False) -> None:
        """``refresh_s``: how often a miss may rescan the folder for other processes' slabs
        (None: never by itself; :meth:`refresh` still works). ``shared``: other processes write the
        folder while this one runs (engines sharing a local cache), so the store probes this tier
        for what it has not indexed itself (``caps.shared``)."""
        self.name = name
        self.dir = Path(dir)
        self.fsync = fsync
        self._capacity = capacity_bytes
        self.caps = TierCaps(persistent=True, shared=shared, zero_copy_read=False, max_value_bytes=max_value_bytes)
        self._tmp = self.dir / "tmp"
        self._index: dict[bytes, _Loc] = {}
        self._live: dict[str, int] = {}  # slab -> entries not deleted
        self._used = 0
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self.refresh_s = refresh_s
        self._scanned_ns = -1  # folder mtime at the last scan
        self._prefix = f"{os.getpid():x}-{os.urandom(3).hex()}-"  # names this instance's slabs
        self._next_refresh = 0.0
        try:
            self._tmp.mkdir(parents=True, exist_ok=True)
            self._rebuild()
        except OSError as exc:
            raise TierError(f"{name}: cannot open {self.dir}: {exc}") from exc

    # ------------------------------------------------------------------ layout
    def _path(self, slab: str) -> Path:
        return self.dir / (slab + _SUFFIX)

    def path_of(self, key: bytes) -> Path:
        """The slab file holding ``key`` (BlockNotFoundError when absent)."""
        return self.locate(key)[0]

    def locate(self, key: bytes) -> tuple[Path, int, int]:
        """(slab path, payload offset, length) of ``key``: for tools and fault-injection tests."""
        loc = self._index.get(key)
        if loc is None:
            raise BlockNotFoundError(f"{self.name}: no block {key.hex()}")
        return self._path(loc.slab), loc.offset, loc.length

    def _rebuild(self) -> None:
        for f in self._tmp.iterdir():
            if not _writer_alive(f.name):  # another live process may be writing it right now
                with contextlib.suppress(OSError):
                    f.unlink()
        with self._lock:
            self._scan(own=True)

    def _scan(self, own: bool = False) -> int:
        """Index slabs not seen yet, forget those gone; under the lock. Returns blocks added.
        ``own=False`` skips slabs named by this instance: :meth:`put_many` indexes those itself, and
        one renamed in but not yet indexed must not be taken for another process's."""
        self._scanned_ns = self.dir.stat().st_mtime_ns  # before listing: a slab renamed in later moves it again
        present = {f.name[: -len(_SUFFIX)]: f for f in self.dir.glob("*" + _SUFFIX)}
        gone = [slab for slab in self._live if slab not in present]
        if gone:
            dead = set(gone)
            for key in [k for k, loc in self._index.items() if loc.slab in dead]:
                self._used -= self._index.pop(key).length
            for slab in gone:
                self._live.pop(slab, None)
        added = 0
        for slab in sorted(present.keys() - self._live.keys()):
            if not own and slab.startswith(self._prefix):
                continue
            for loc in _read_table(present[slab]):
                if loc.key in self._index:
                    continue  # the same block in two slabs (a crash between write and retire)
                self._index[loc.key] = _Loc(slab, loc.index, loc.offset, loc.length, loc.digest)
                self._live[slab] = self._live.get(slab, 0) + 1
                self._used += loc.length
                added += 1
            if not self._live.get(slab):
                with contextlib.suppress(OSError):
                    present[slab].unlink()  # nothing live in it (all deleted, or not a slab at all)
        return added

    def refresh(self) -> int:
        """Pick up what other processes sharing the folder wrote or removed; returns blocks added."""
        try:
            with self._lock:
                if self.dir.stat().st_mtime_ns == self._scanned_ns:
                    return 0
                return self._scan()
        except OSError as exc:
            raise TierError(f"{self.name}: cannot rescan {self.dir}: {exc}") from exc

    def _refresh_on_miss(self) -> bool:
        """A throttled :meth:`refresh` after a miss; True if it indexed anything."""
        if self.refresh_s is None:
            return False
        now = time.monotonic()
        if now < self._next_refresh:
            return False
        self._next_refresh = now + self.refresh_s
        return self.refresh() > 0

    # ------------------------------------------------------------------ sizes
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def limit_capacity(self, nbytes: int) -> None:
        """Lower the capacity to ``nbytes`` (before a store accounts for it: a filesystem smaller
        than the capacity it was given)."""
        self._capacity = min(self._capacity, nbytes)

    def shortfall(self, nbytes: int, values: int) -> int:
        """Short of the filesystem's free space for ``values`` slabs of ``nbytes`` in all (each slab:
        its table and its tail rounded up to a filesystem block). The capacity is not counted here:
        the store's watermarks keep to it."""
        fs = fs_room(self.dir)
        need = nbytes + values * 2 * fs.block_bytes + nbytes // 1024  # tables: 48 bytes per entry
        return max(0, need - fs.free_bytes)

    # ------------------------------------------------------------------ writes
    def put(self, key: bytes, data: Buffer, *, ttl_s: float | None = None) -> None:
        self.put_many([(key, data)], ttl_s=ttl_s)

    def put_many(self, items: Sequence[tuple[bytes, Buffer]], *, ttl_s: float | None = None) -> None:
        """Write the batch as one slab: all of it or nothing."""
        if not items:
            return
        if len(items) > MAX_ENTRIES:
            half = len(items) // 2
            self.put_many(items[:half])
            self.put_many(items[half:])
            return
        last: dict[bytes, memoryview] = {}
        for k, d in items:  # a key twice in a batch: the later value wins
            last[k] = byte_view(d)
        keys = list(last)
        srcs = [last[k] for k in keys]
        for v in srcs:
            if v.nbytes > self.caps.max_value_bytes:
                raise BufferMismatchError(f"{self.name}: value of {v.nbytes} bytes exceeds max_value_bytes")
        total = sum(v.nbytes for v in srcs)
        with self._lock:
            freed = sum(self._index[k].length for k in keys if k in self._index)
            if self._used - freed + total > self._capacity:
                raise TierFullError(f"{self.name}: {total} more bytes would exceed capacity {self._capacity}")
        slab = f"{self._prefix}{next(self._seq):x}-{os.urandom(4).hex()}"
        tmp = self._tmp / (slab + _SUFFIX)
        table_end = HEAD_BYTES + ENTRY_BYTES * len(keys)
        locs: list[_Loc] = []
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                offs = list(itertools.accumulate((v.nbytes for v in srcs[:-1]), initial=table_end))
                if total >= PARALLEL_HASH_MIN_BYTES and checksums.PARALLEL:
                    digests = _write_hashing_aside(fd, keys, srcs, offs)
                else:
                    digests = [_hash_and_write(fd, k, v, o) for k, v, o in zip(keys, srcs, offs, strict=True)]
                locs = [_Loc(slab, i, o, v.nbytes, h)
                        for i, (v, o, h) in enumerate(zip(srcs, offs, digests, strict=True))]
                table = bytearray(_HEAD.pack(MAGIC, len(keys), 0))
                for k, loc in zip(keys, locs, strict=True):
                    table += _ENTRY.pack(k, loc.offset, loc.length, loc.digest, 0)
                _pwrite_all(fd, memoryview(table), 0)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self._path(slab))
            if self.fsync:
                _fsync_dir(self.dir)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFullError(f"{self.name}: disk full writing {len(keys)} blocks") from exc
            raise TierError(f"{self.name}: write of {len(keys)} blocks failed: {exc}") from exc
        with self._lock:
            for k, loc in zip(keys, locs, strict=True):
                old = self._index.get(k)
                self._index[k] = loc
                self._used += loc.length
                if old is not None:
                    self._retire(old)
            self._live[slab] = self._live.get(slab, 0) + len(keys)

    def _retire(self, loc: _Loc) -> None:
        """Mark one entry deleted in its slab; unlink the slab when none is left. Under the lock."""
        self._used -= loc.length
        left = self._live.get(loc.slab, 1) - 1
        path = self._path(loc.slab)
        try:
            if left <= 0:
                self._live.pop(loc.slab, None)
                path.unlink()
                return
            self._live[loc.slab] = left
            fd = os.open(path, os.O_WRONLY)
            try:
                flags_at = HEAD_BYTES + loc.index * ENTRY_BYTES + ENTRY_BYTES - 8
                os.pwrite(fd, _DELETED.to_bytes(8, "little"), flags_at)
            finally:
                os.close(fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise TierError(f"{self.name}: delete in {path.name} failed: {exc}") from exc

    def delete(self, key: bytes) -> bool:
        with self._lock:
            loc = self._index.pop(key, None)
            if loc is None:
                return False
            self._retire(loc)
            return True

    # ------------------------------------------------------------------ reads
    def get_into(self, key: bytes, dst: Buffer) -> int:
        loc = self._index.get(key)
        if loc is None and self._refresh_on_miss():
            loc = self._index.get(key)
        if loc is None:
            raise BlockNotFoundError(f"{self.name}: no block {key.hex()}")
        out = writable_view(dst, loc.length)
        got = self._read_slab(loc.slab, [(key, loc, out)], raise_corrupt=True)
        n = got[0]
        if n is None:
            raise BlockNotFoundError(f"{self.name}: block {key.hex()} vanished")
        return n

    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]]) -> list[int | None]:
        """Missing or corrupt blocks give None. Blocks of one slab are read in file order, runs of
        adjacent entries with one ``preadv`` each."""
        by_slab: dict[str, list[tuple[int, bytes, _Loc, memoryview]]] = {}
        out: list[int | None] = [None] * len(items)
        for i, (key, dst) in enumerate(items):
            loc = self._index.get(key)
            if loc is not None:
                by_slab.setdefault(loc.slab, []).append((i, key, loc, writable_view(dst, loc.length)))
        for slab, group in by_slab.items():
            got = self._read_slab(slab, [(k, loc, mv) for _, k, loc, mv in group], raise_corrupt=False)
            for (i, _, _, _), n in zip(group, got, strict=True):
                out[i] = n
        return out

    def _read_slab(self, slab: str, reqs: list[tuple[bytes, _Loc, memoryview]],
                   raise_corrupt: bool) -> list[int | None]:
        order = sorted(range(len(reqs)), key=lambda j: reqs[j][1].offset)
        res: list[int | None] = [None] * len(reqs)
        try:
            fd = os.open(self._path(slab), os.O_RDONLY)
        except FileNotFoundError:
            for key, _, _ in reqs:
                self._forget(key)
            return res
        except OSError as exc:
            raise TierError(f"{self.name}: open of slab {slab} failed: {exc}") from exc
        try:
            pos = 0
            while pos < len(order):
                run = [order[pos]]
                end = reqs[run[0]][1].offset + reqs[run[0]][1].length
                size = reqs[run[0]][1].length
                while (pos + len(run) < len(order) and len(run) < _MAX_IOV and size < _MAX_RUN_BYTES
                       and reqs[order[pos + len(run)]][1].offset == end):
                    nxt = reqs[order[pos + len(run)]][1]
                    run.append(order[pos + len(run)])
                    end += nxt.length
                    size += nxt.length
                start = reqs[run[0]][1].offset
                views = [reqs[j][2][: reqs[j][1].length] for j in run]
                got = os.preadv(fd, views, start) if size else 0
                for j in run:
                    key, loc, mv = reqs[j]
                    if got < loc.offset + loc.length - start or _digest(key, mv[: loc.length]) != loc.digest:
                        self._corrupt(key, raise_corrupt)
                        continue
                    res[j] = loc.length
                pos += len(run)
        except OSError as exc:
            raise TierError(f"{self.name}: read of slab {slab} failed: {exc}") from exc
        finally:
            os.close(fd)
        return res

    def _corrupt(self, key: bytes, raise_it: bool) -> None:
        self.delete(key)
        if raise_it:
            raise CorruptBlockError(f"{self.name}: block {key.hex()} failed its length/checksum check; dropped")

    def _forget(self, key: bytes) -> None:
        with self._lock:
            loc = self._index.pop(key, None)
            if loc is not None:
                self._used -= loc.length

    # ------------------------------------------------------------------ metadata
    def size_of(self, key: bytes) -> int | None:
        loc = self._index.get(key)
        if loc is None and self._refresh_on_miss():
            loc = self._index.get(key)
        return None if loc is None else loc.length

    def contains(self, key: bytes) -> bool:
        return key in self._index or (self._refresh_on_miss() and key in self._index)

    def keys(self) -> Iterator[bytes]:
        with self._lock:
            return iter(list(self._index))

    @property
    def slab_count(self) -> int:
        return len(self._live)


@dataclass(frozen=True, slots=True)
class _SlabEntry:
    slab: str
    key: bytes
    index: int
    offset: int
    length: int
    digest: int


def _writer_alive(name: str) -> bool | None:
    """Whether the process that named a slab or temporary file (``<pid hex>-...``) still runs; None
    when the name carries no pid."""
    head = name.split("-", 1)[0]
    try:
        pid = int(head, 16)
    except ValueError:
        return None
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def _read_table(path: Path) -> list[_SlabEntry]:
    """Live entries of a slab that lie inside the file; [] for a file that is not a slab."""
    slab = path.name[: -len(_SUFFIX)]
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES)
            if len(head) != HEAD_BYTES:
                return []
            magic, m, _ = _HEAD.unpack(head)
            if magic != MAGIC or m > MAX_ENTRIES or HEAD_BYTES + m * ENTRY_BYTES > size:
                return []
            table = f.read(m * ENTRY_BYTES)
    except OSError:
        return []
    out: list[_SlabEntry] = []
    for i in range(m):
        key, off, n, digest, flags = _ENTRY.unpack_from(table, i * ENTRY_BYTES)
        if flags & _DELETED or off < HEAD_BYTES + m * ENTRY_BYTES or off + n > size:
            continue
        out.append(_SlabEntry(slab, key, i, off, n, digest))
    return out


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n


def _digests(keys: Sequence[bytes], srcs: Sequence[memoryview]) -> list[int]:
    out = []
    for k, v in zip(keys, srcs, strict=True):
        h = xxhash.xxh3_64()  # xxhash releases the GIL: this runs beside the writer's pwrite calls
        h.update(k)
        h.update(v)
        out.append(int(h.intdigest()))
    return out


def _write_hashing_aside(fd: int, keys: Sequence[bytes], srcs: Sequence[memoryview],
                         offs: Sequence[int]) -> list[int]:
    """Write every value whole while the hasher thread checksums the batch beside it: the two passes
    over the payload run on two cores instead of one after the other. The hasher is waited for
    before this returns, also on error (it reads the caller's buffers)."""
    fut = checksums.submit(lambda: _digests(keys, srcs))
    try:
        i = 0
        while i < len(srcs):  # the values lie back to back: runs of up to 16 MiB, one pwritev each
            j, run = i + 1, srcs[i].nbytes
            while j < len(srcs) and j - i < _MAX_IOV and run + srcs[j].nbytes <= _MAX_RUN_BYTES:
                run += srcs[j].nbytes
                j += 1
            _pwritev_all(fd, list(srcs[i:j]), offs[i])
            i = j
    except BaseException:
        fut.exception()  # wait; the write error is what the caller sees
        raise
    return fut.result()


def _pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
    """Write ``views`` back to back at ``offset`` (a short write continues where it stopped)."""
    views = [v for v in views if v.nbytes]  # an empty value takes no room
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views = views[1:]
        if n:
            views[0] = views[0][n:]


def _hash_and_write(fd: int, key: bytes, src: memoryview, offset: int) -> int:
    """Write ``src`` at ``offset`` piece by piece, hashing each piece just before it is written
    while it is still in cache: the payload is read from RAM once, as a raw write reads it."""
    h = xxhash.xxh3_64()
    h.update(key)
    for off in range(0, src.nbytes, WRITE_PIECE_BYTES):
        piece = src[off : off + WRITE_PIECE_BYTES]
        h.update(piece)
        _pwrite_all(fd, piece, offset + off)
    return int(h.intdigest())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
