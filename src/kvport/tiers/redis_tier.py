"""RedisTier: values in a Redis / Valkey (or Redis Cluster) server, chunked well under the 512 MiB bulk limit.

Keys (hex inside a hash tag, so every part of a value lands on one cluster slot, in order)::

    <prefix>{<key hex>}        header, 24 bytes: magic b"KVPR" | version u32 | length u64 | xxh3_64 u64 (LE)
    <prefix>{<key hex>}:<i>    payload chunk i = payload[i*chunk : (i+1)*chunk], i = 0 .. ceil(n/chunk)-1

The payload goes out as views of the caller's buffer (no concatenation copy, and no copy into a
packed command either: see :func:`zero_copy_packer`). A put writes every chunk of every value,
hashing each right after the socket copied it, then the headers (one ``MSET``); a delete removes
the header first. So a header, which is what ``contains`` and ``size_of`` read, is only ever
visible with its chunks behind it. A get pipelines the header and chunk 0 of every value (one
``MGET`` each; one round trip for values of one chunk), fetches further chunks in a second round
trip, checks length and (``verify=True``) checksum, and copies into the caller's buffer. Batched
gets go in pipelines of ~8 MiB, and the tiers' checksum thread (:mod:`kvport.tiers.checksums`)
verifies and copies a get's last group while the next one is on the wire. A missing or short
chunk (e.g. Redis evicted it under ``maxmemory``) is CorruptBlockError and the value is dropped.
TTLs (session lifetime) are set on every part with PX. Connection failures and timeouts are
TierUnavailableError; a Redis out-of-memory answer is
TierFullError.
"""

from __future__ import annotations

import contextlib
import functools
import struct
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import redis
import xxhash

from kvport.errors import BlockNotFoundError, CorruptBlockError, TierError, TierFullError, TierUnavailableError
from kvport.tiers import checksums
from kvport.tiers.base import Buffer, Tier, TierCaps, byte_view, writable_view

_HEADER = struct.Struct("<4sIQQ")
HEADER_BYTES = _HEADER.size  # 24
_MAGIC = b"KVPR"
DEFAULT_CHUNK = 64 << 20


def _map(name: str, exc: Exception) -> TierError:
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return TierUnavailableError(f"{name}: redis unavailable: {exc}")
    oom = getattr(redis.exceptions, "OutOfMemoryError", ())  # redis-py >= 5 names the OOM reply; older: "OOM ..."
    if isinstance(exc, oom) or (isinstance(exc, redis.ResponseError) and str(exc).startswith("OOM")):
        return TierFullError(f"{name}: redis is out of memory: {exc}")
    return TierError(f"{name}: redis error: {exc}")


class RedisTier(Tier):
    def __init__(self, url: str, *, name: str = "redis", prefix: str = "kvport:", capacity_bytes: int = 1 << 40,
                 chunk_bytes: int = DEFAULT_CHUNK, verify: bool = True, cluster: bool = False,
                 socket_timeout_s: float = 5.0, max_value_bytes: int = 4 << 30) -> None:
        if not 0 < chunk_bytes <= 256 << 20:
            raise TierError(f"chunk_bytes must be in (0, 256 MiB], got {chunk_bytes}")
        self.name = name
        self.prefix = prefix.encode()
        self.chunk_bytes = chunk_bytes
        self.verify = verify
        self.cluster = cluster
        self._capacity = capacity_bytes
        self.caps = TierCaps(persistent=True, shared=True, zero_copy_read=False, max_value_bytes=max_value_bytes,
                             native_ttl=True)
        kw: dict[str, Any] = {"socket_timeout": socket_timeout_s, "socket_connect_timeout": min(1.0, socket_timeout_s),
                              "command_packer": zero_copy_packer()}
        try:
            if cluster:
                from redis.cluster import RedisCluster

                self._r: Any = RedisCluster.from_url(url, **kw)
            else:
                self._r = redis.Redis.from_url(url, retry_on_timeout=False, **kw)
        except (redis.RedisError, ValueError) as exc:
            raise TierUnavailableError(f"{name}: cannot connect to {url}: {exc}") from exc

    # ------------------------------------------------------------------ layout
    def _k(self, key: bytes) -> bytes:
        return self.prefix + b"{" + key.hex().encode() + b"}"

    def _c(self, key: bytes, i: int) -> bytes:
        return self._k(key) + b":" + str(i).encode()

    def _chunks(self, n: int) -> int:
        return max(1, -(-n // self.chunk_bytes))

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        try:
            return int(self._r.info("memory")["used_memory"])
        except redis.RedisError as exc:
            raise _map(self.name, exc) from exc

    def _pipe(self) -> Any:
        return self._r.pipeline(transaction=False)

    # ------------------------------------------------------------------ put
    def _header_cmds(self, keys: Sequence[bytes], srcs: Sequence[memoryview], digests: Sequence[int],
                     px: int | None) -> list[tuple[Any, ...]]:
        heads = [(self._k(k), _HEADER.pack(_MAGIC, 1, v.nbytes, d))
                 for k, v, d in zip(keys, srcs, digests, strict=True)]
        if px is None and not self.cluster:  # one command for every header
            return [("MSET", *[x for h in heads for x in h])]
        return [("SET", h, body, "PX", px) if px is not None else ("SET", h, body) for h, body in heads]

    def put(self, key: bytes, data: Buffer, *, ttl_s: float | None = None) -> None:
        self.put_many([(key, data)], ttl_s=ttl_s)

    def put_many(self, items: Sequence[tuple[bytes, Buffer]], *, ttl_s: float | None = None) -> None:
        """Every chunk of every value, then the headers (one ``MSET``): a value becomes visible only
        with its header, after its chunks. Each chunk's SET goes straight to the socket (its bytes
        handed over as they are) and the chunk is hashed right after, while it is still in cache
        from that copy; replies are read at the end, like a pipeline's. (A redis-py pipeline packs
        everything before sending anything, so the hash had to read every value from RAM once more
        beside it: 0.6-0.7 of this speed here.)"""
        srcs = [byte_view(d) for _, d in items]
        keys = [k for k, _ in items]
        for v in srcs:
            if v.nbytes > self.caps.max_value_bytes:
                raise TierFullError(f"{self.name}: value of {v.nbytes} bytes exceeds max_value_bytes")
        if not items:
            return
        px = None if ttl_s is None else max(1, int(ttl_s * 1000))
        if self.cluster:
            return self._put_cluster(keys, srcs, px)
        pool = self._r.connection_pool
        conn: Any = None
        sent = 0
        try:
            conn = pool.get_connection()
            cb = self.chunk_bytes
            tail = b"\r\n" if px is None else b"\r\n$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(px)), px)
            digests: list[int] = []
            for key, src in zip(keys, srcs, strict=True):
                h = xxhash.xxh3_64()
                for i in range(self._chunks(src.nbytes)):
                    part = src[i * cb : (i + 1) * cb]
                    conn.send_packed_command(_resp_set(self._c(key, i), part, tail), check_health=sent == 0)
                    sent += 1
                    if self.verify:
                        h.update(part)  # right after the socket copied it: still in cache
                digests.append(h.intdigest() if self.verify else 0)
            for cmd in self._header_cmds(keys, srcs, digests, px):
                conn.send_packed_command(conn.pack_command(*cmd), check_health=False)
                sent += 1
            first: redis.RedisError | None = None
            for _ in range(sent):  # every reply, so the connection goes back to the pool in step
                try:
                    conn.read_response()
                except redis.ResponseError as exc:
                    first = first or exc
            if first is not None:
                raise _map(self.name, first) from first
        except (redis.RedisError, OSError) as exc:
            if conn is not None:
                conn.disconnect()  # half a command may be on the wire: never reuse this stream
            raise _map(self.name, exc if isinstance(exc, redis.RedisError) else redis.ConnectionError(str(exc))) \
                from exc
        finally:
            if conn is not None:
                pool.release(conn)

    def _put_cluster(self, keys: Sequence[bytes], srcs: Sequence[memoryview], px: int | None) -> None:
        """Cluster mode: a pipeline per ~8 MiB group (each routed by slot), chunks before headers."""
        cb = self.chunk_bytes
        for lo, hi in pipeline_groups([v.nbytes for v in srcs]):
            digests = checksums.xxh3_each(srcs[lo:hi]) if self.verify else [0] * (hi - lo)
            pipe = self._pipe()
            for key, src in zip(keys[lo:hi], srcs[lo:hi], strict=True):
                for i in range(self._chunks(src.nbytes)):
                    pipe.set(self._c(key, i), src[i * cb : (i + 1) * cb], px=px)
            for cmd in self._header_cmds(keys[lo:hi], srcs[lo:hi], digests, px):
                pipe.execute_command(*cmd)
            try:
                pipe.execute()
            except redis.RedisError as exc:
                raise _map(self.name, exc) from exc

    # ------------------------------------------------------------------ get
    def _head(self, keys: Sequence[bytes]) -> list[tuple[int, int] | None]:
        """(length, digest) per key from its header, or None when absent; (-1, 0) when malformed."""
        pipe = self._r.pipeline(transaction=False)
        for k in keys:
            pipe.get(self._k(k))
        try:
            heads = pipe.execute()
        except redis.RedisError as exc:
            raise _map(self.name, exc) from exc
        out: list[tuple[int, int] | None] = []
        for h in heads:
            if not h:
                out.append(None)
                continue
            if len(h) != HEADER_BYTES:
                out.append((-1, 0))
                continue
            magic, _, n, digest = _HEADER.unpack(h)
            out.append((n, digest) if magic == _MAGIC else (-1, 0))
        return out

    def get_into(self, key: bytes, dst: Buffer) -> int:
        res = self._get_many([(key, dst)], raise_missing=True)[0]
        assert res is not None
        return res

    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]]) -> list[int | None]:
        return self._get_many(items, raise_missing=False)

    def _get_many(self, items: Sequence[tuple[bytes, Buffer]], raise_missing: bool) -> list[int | None]:
        """Pipelined in groups of ~GET_GROUP_BYTES: while group k+1 is on the wire, the checksum
        thread verifies group k's one-chunk values and copies them into their destinations."""
        rest = self._r.pipeline(transaction=False)
        plans: list[tuple[bytes, memoryview, int, int | None] | None] = []  # digest None: verified already
        pending: list[Future[list[tuple[int, bytes]]]] = []
        try:
            for a, b in pipeline_groups([_nbytes(d) for _, d in items]):
                pipe = self._r.pipeline(transaction=False)
                for key, _ in items[a:b]:
                    if self.cluster:  # redis-py refuses MGET inside a cluster pipeline
                        pipe.get(self._k(key))
                        pipe.get(self._c(key, 0))
                    else:  # one command for header and first chunk (half the commands for small values)
                        pipe.mget(self._k(key), self._c(key, 0))
                try:
                    firsts = pipe.execute()
                except redis.RedisError as exc:
                    raise _map(self.name, exc) from exc
                singles: list[tuple[int, bytes, memoryview, bytes, int]] = []  # (plan, key, dst, bytes, digest)
                for j, (key, dst) in enumerate(items[a:b]):
                    head, chunk0 = (firsts[2 * j], firsts[2 * j + 1]) if self.cluster else firsts[j]
                    if head is None:
                        if raise_missing:
                            raise BlockNotFoundError(f"{self.name}: no block {key.hex()}")
                        plans.append(None)
                        continue
                    if len(head) != HEADER_BYTES or head[:4] != _MAGIC:
                        self._drop_bad(key, "bad header", raise_missing)
                        plans.append(None)
                        continue
                    _, _, n, digest = _HEADER.unpack(head)
                    out_mv = writable_view(dst, n)
                    want0 = min(n, self.chunk_bytes)
                    if chunk0 is None or len(chunk0) != want0:
                        self._drop_bad(key, "missing or short chunk 0", raise_missing)
                        plans.append(None)
                        continue
                    if n == want0:  # one chunk: verified and copied on the checksum thread
                        singles.append((len(plans), key, out_mv, chunk0, digest))
                        plans.append((key, out_mv, n, None))
                        continue
                    out_mv[:want0] = chunk0
                    for i in range(1, self._chunks(n)):
                        rest.get(self._c(key, i))
                    plans.append((key, out_mv, n, digest))
                if singles:
                    pending.append(checksums.aside(functools.partial(_verify_and_copy, singles, self.verify),
                                                   sum(len(c) for _, _, _, c, _ in singles)))
        except BaseException:
            _wait_all(pending)  # no thread writes into the caller's buffers once this returns
            raise
        bad = [x for fut in pending for x in fut.result()]
        for idx, key in bad:
            plans[idx] = None
            self._drop_bad(key, "checksum mismatch", raise_missing)
        try:
            chunks = rest.execute() if len(rest) else []
        except redis.RedisError as exc:
            raise _map(self.name, exc) from exc
        out: list[int | None] = []
        ci = 0
        cb = self.chunk_bytes
        for plan in plans:
            if plan is None:
                out.append(None)
                continue
            key, out_mv, n, digest = plan
            ok = True
            for i in range(1, self._chunks(n)):
                c = chunks[ci]
                ci += 1
                want = min(cb, n - i * cb)
                if c is None or len(c) != want:
                    ok = False
                    continue
                out_mv[i * cb : i * cb + want] = c
            if not ok:
                self._drop_bad(key, "missing or short chunk", raise_missing)
                out.append(None)
                continue
            if self.verify and digest is not None and xxhash.xxh3_64_intdigest(out_mv[:n]) != digest:
                self._drop_bad(key, "checksum mismatch", raise_missing)
                out.append(None)
                continue
            out.append(n)
        return out

    def _drop_bad(self, key: bytes, why: str, raise_it: bool) -> None:
        self.delete(key)
        if raise_it:
            raise CorruptBlockError(f"{self.name}: block {key.hex()}: {why}; dropped")

    # ------------------------------------------------------------------ metadata
    def size_of(self, key: bytes) -> int | None:
        h = self._head([key])[0]
        return None if h is None or h[0] < 0 else h[0]

    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Iterable[bytes]) -> list[bool]:
        ks = list(keys)
        if not ks:
            return []
        pipe = self._r.pipeline(transaction=False)
        for k in ks:
            pipe.exists(self._k(k))
        try:
            return [bool(x) for x in pipe.execute()]
        except redis.RedisError as exc:
            raise _map(self.name, exc) from exc

    def ttl_of(self, key: bytes) -> float | None:
        """Seconds left before Redis expires the value; None when it has no TTL or is absent."""
        try:
            ms = int(self._r.pttl(self._k(key)))
        except redis.RedisError as exc:
            raise _map(self.name, exc) from exc
        return None if ms < 0 else ms / 1000

    def delete(self, key: bytes) -> bool:
        h = self._head([key])[0]
        n = 0 if h is None or h[0] < 0 else h[0]
        try:
            gone = bool(self._r.delete(self._k(key)))  # the header first: the value is gone at once
            self._r.delete(*[self._c(key, i) for i in range(self._chunks(n))])
        except redis.RedisError as exc:
            raise _map(self.name, exc) from exc
        return gone

    def keys(self) -> Iterator[bytes]:
        plen = len(self.prefix) + 1
        try:
            found = list(self._r.scan_iter(match=self.prefix + b"{*}", count=1000))
        except redis.RedisError as exc:
            raise _map(self.name, exc) from exc
        return iter([bytes.fromhex(k[plen:-1].decode()) for k in found if k.endswith(b"}")])

    def close(self) -> None:
        with contextlib.suppress(redis.RedisError):
            self._r.close()


GET_GROUP_BYTES = 8 << 20  # batched gets (and cluster puts) are pipelined in groups of about this many value bytes


def _resp_set(name: bytes, value: memoryview, tail: bytes) -> list[Buffer]:
    """``SET name value [PX ms]`` in RESP as three writes: the small head, the value as it is, and
    ``tail`` (CRLF, plus the packed PX option). redis-py's packer took ~12 us a command: at 128 SETs
    of 360 KiB, a tenth of the time of the whole put. (Writing several SETs at once, 1 or 4 MiB of
    values, measured no faster here.)"""
    n_args = 3 if tail == b"\r\n" else 5
    return [b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (n_args, len(name), name, value.nbytes), value, tail]


def zero_copy_packer() -> Any:
    """redis-py's pure-Python command packer: values over 6000 bytes (and memoryviews) go to the
    socket as they are. With hiredis installed redis-py packs with ``hiredis.pack_command``, which
    copies every value into a new bytes object first: that copy (into fresh memory, ~1.3 GB/s here)
    was the ceiling of SET at 0.6-0.9 GB/s; zero-copy packing ran the same SETs at 1.5-3.9 GB/s.
    Replies are still parsed by hiredis."""
    from redis import connection

    encoder: Any = connection.Encoder("utf-8", "strict", False)  # type: ignore[attr-defined,no-untyped-call]
    return connection.PythonRespSerializer(6000, encoder.encode)



def pipeline_groups(sizes: Sequence[int], group_bytes: int | None = None) -> list[tuple[int, int]]:
    """[a, b) index ranges of consecutive values whose ``sizes`` add up to ~group_bytes: how batches
    are cut into pipelines (also used by the raw-Redis limit of ``kvport bench tiers``)."""
    limit = GET_GROUP_BYTES if group_bytes is None else group_bytes
    out: list[tuple[int, int]] = []
    a = acc = 0
    for i, n in enumerate(sizes):
        acc += n
        if acc >= limit:
            out.append((a, i + 1))
            a, acc = i + 1, 0
    if a < len(sizes):
        out.append((a, len(sizes)))
    return out


def _nbytes(buf: Buffer) -> int:
    return int(getattr(buf, "nbytes", 0) or len(buf))  # type: ignore[arg-type]


def _verify_and_copy(singles: list[tuple[int, bytes, memoryview, bytes, int]], verify: bool) -> list[tuple[int, bytes]]:
    """Hash each received value (read from RAM once), then copy it from cache into its destination;
    returns (plan index, key) of those that failed their checksum (their destination holds garbage
    and the caller reports a miss). numpy copies without the GIL."""
    bad: list[tuple[int, bytes]] = []
    for idx, key, dst, c, digest in singles:
        if verify and xxhash.xxh3_64_intdigest(c) != digest:
            bad.append((idx, key))
            continue
        np.copyto(np.frombuffer(dst, dtype=np.uint8, count=len(c)), np.frombuffer(c, dtype=np.uint8))
    return bad


def _wait_all(futs: list[Future[list[tuple[int, bytes]]]]) -> None:
    for f in futs:
        f.exception()  # waits, never raises
