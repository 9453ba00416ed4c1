"""RedisTier: values in a Redis / Valkey (or Redis Cluster) server, chunked well under the 512 MiB bulk limit.

Keys (hex inside a hash tag, so every part of a value lands on one cluster slot)::

    <prefix>{<key hex>}                   head: payload | own | trailer   (payload <= chunk_bytes)
                                                own | trailer             (larger: the payload is in chunk keys)
    <prefix>{<key hex>}:<version hex>:<i> chunk i = payload[i*chunk : (i+1)*chunk] of that version only

    trailer, 40 bytes LE: magic b"KVPR" | format u32 = 2 | own bytes << 8 | chunk u64 (0: payload
                          inline) | length u64 | xxh3_64 u64 | version u64 (random, new on every put)
    own (0 to 1024 bytes, ``records=True``): the value's hand-off to the pool, msgpack {by: the client
                          that put it, lt: lifetime, p: parent key hex, t: unix ms}: part of the value
                          itself, so it is written, expires and goes with the value, never apart
                          (:mod:`kvport.client.redis_pool` reads it; :meth:`RedisTier.own_of`)

Versions. A put never rewrites a key another put's head names: a value of one chunk is one key
(one ``SET``, read whole by one ``GET``), and a larger value's chunks are named by its version and
written before its head. So a get that read a head reads that version's bytes or finds them gone,
never a mix of two puts. A bad value (checksum mismatch, a missing or short chunk, a malformed
head) is deleted by ``_SETTLE`` in "drop" mode: only while the head still holds the version that
failed, so a newer value put meanwhile stays. A put probes each head (``GETRANGE``, in the same
stream: no extra round trip) and afterwards deletes the chunks of the version it replaced
("gc" mode: unless the head still holds it). Format 1 (a 24-byte head ``magic | 1 | length |
xxh3``, chunks ``<prefix>{<key hex>}:<i>``, written by older kvport) is read as before.

The payload goes out as views of the caller's buffer (no concatenation copy, and no copy into a
packed command either: see :func:`zero_copy_packer`); a put hashes each value right after the
socket copied it and sends the trailer after it. A head, which is what ``contains`` and
``size_of`` read, is only ever visible with its chunks behind it. A get pipelines one ``GET`` of
every head (one round trip for values of one chunk), fetches chunks in a second round trip, checks
length and (``verify=True``) checksum, and copies into the caller's buffer. Batched gets go in
pipelines of ~8 MiB, and the tiers' checksum thread (:mod:`kvport.tiers.checksums`) verifies and
copies a get's last group while the next one is on the wire. A missing or short chunk (e.g. Redis
evicted it under ``maxmemory``) is CorruptBlockError. TTLs (session lifetime) are set on every part
with PX. Connection failures and timeouts are TierUnavailableError; a Redis out-of-memory answer is
TierFullError.

Durability (``wait_replicas=N``). Replication is asynchronous: a put Redis acknowledged may be lost
when its primary dies before a replica copied it (the failover promotes a replica without it). With
``wait_replicas`` every put ends with ``WAIT N timeout`` on the connection that wrote it (in cluster
mode one per node the batch touched, in the same per-node pipeline as its writes), and returns only
when N replicas hold every write; fewer (or a slot that moved to another node meanwhile, whose
WAIT would not cover the write) and the put raises TierUnavailableError: not acknowledged, so the
caller keeps its own copy or recomputes. A value such a put left behind is whole and checksummed
(it may turn up later, never half). ``unacknowledged_puts`` counts them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import struct
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import redis
import xxhash

from kvport.errors import (
    BlockNotFoundError,
    ConfigError,
    CorruptBlockError,
    TierError,
    TierFullError,
    TierUnavailableError,
)
from kvport.lifetime import Lifetime
from kvport.tiers import checksums
from kvport.tiers.base import BlockMeta, Buffer, Tier, TierCaps, byte_view, writable_view

_TRAILER = struct.Struct("<4sIQQQQ")  # magic, format 2 | own << 8, chunk (0: inline), length, xxh3_64, version
MAX_OWN = 1024  # bytes of a value's own record
TRAILER_BYTES = _TRAILER.size  # 40
_HEADER_V1 = struct.Struct("<4sIQQ")  # format 1: magic, 1, length, xxh3_64 (read, never written)
_MAGIC = b"KVPR"
_MAX_CHUNKS = 1 << 20  # a head naming more chunks than this is malformed
DEFAULT_CHUNK = 64 << 20

# KEYS[1]: a head; KEYS[2..]: the chunks of the version whose head value is ARGV[2] bytes long and
# ends with ARGV[1]. "drop": if the head still holds that version, delete it and its chunks.
# "gc": if it does not, delete the chunks (no head can name them again). Returns 1 if it deleted.
_SETTLE = """
local held = redis.call('STRLEN', KEYS[1]) == tonumber(ARGV[2])
    and redis.call('GETRANGE', KEYS[1], -#ARGV[1], -1) == ARGV[1]
if held ~= (ARGV[3] == 'drop') then return 0 end
for i = (held and 1 or 2), #KEYS do redis.call('DEL', KEYS[i]) end
return 1
"""

# a cluster between topologies (a primary lost, its replica not promoted yet; a slot moving): unavailable for now
_CLUSTER_TRANSIENT: tuple[type[Exception], ...] = tuple(
    c for c in (getattr(redis.exceptions, n, None) for n in ("ClusterDownError", "TryAgainError", "MasterDownError",
                                                              "ClusterError", "RedisClusterException"))
    if isinstance(c, type))


# every error redis-py raises: its cluster client's own (RedisClusterException) is not a RedisError
_REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, *(
    c for c in (getattr(redis.exceptions, "RedisClusterException", None),) if isinstance(c, type)))
_REDIS_OR_VALUE: tuple[type[Exception], ...] = (*_REDIS_ERRORS, ValueError)
_REDIS_OR_OS: tuple[type[Exception], ...] = (*_REDIS_ERRORS, OSError)


def _map(name: str, exc: Exception) -> TierError:
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return TierUnavailableError(f"{name}: redis unavailable: {exc}")
    if isinstance(exc, _CLUSTER_TRANSIENT) or (isinstance(exc, redis.ResponseError) and str(exc).startswith(
            ("CLUSTERDOWN", "TRYAGAIN", "MASTERDOWN"))) or "cluster is down" in str(exc):
        return TierUnavailableError(f"{name}: redis cluster unavailable: {exc}")
    oom = getattr(redis.exceptions, "OutOfMemoryError", ())  # redis-py >= 5 names the OOM reply; older: "OOM ..."
    if isinstance(exc, oom) or (isinstance(exc, redis.ResponseError) and str(exc).startswith("OOM")):
        return TierFullError(f"{name}: redis is out of memory: {exc}")
    return TierError(f"{name}: redis error: {exc}")


@dataclass(frozen=True, slots=True)
class _Version:
    """One put's value as its head names it; ``n < 0`` when the head is malformed."""

    tail: bytes  # the head's last bytes, which name the version: the trailer (format 1: the whole head)
    strlen: int  # the head value's length
    n: int
    digest: int
    chunk: int  # payload bytes per chunk key; 0: the payload is inline in the head
    tag: bytes  # chunk i is <head>:<tag><i>: b"<version hex>:" (format 2), b"" (format 1)
    own: int = 0  # bytes of the own record just before the trailer

    @property
    def n_chunks(self) -> int:
        return 0 if self.n < 0 or self.chunk == 0 else max(1, -(-self.n // self.chunk))

    def chunk_keys(self, head: bytes) -> list[bytes]:
        return [b"%s:%s%d" % (head, self.tag, i) for i in range(self.n_chunks)]


def _parse(tail: bytes, strlen: int | None, v1_chunk: int) -> _Version:
    """The version a head names, from its last (up to 40) bytes and its length (None: derive it)."""
    if len(tail) == _HEADER_V1.size and strlen in (None, _HEADER_V1.size):
        magic, fmt, n, digest = _HEADER_V1.unpack(tail)
        if magic == _MAGIC and fmt == 1 and -(-n // v1_chunk) <= _MAX_CHUNKS:
            return _Version(tail, _HEADER_V1.size, n, digest, v1_chunk, b"")
    elif len(tail) == TRAILER_BYTES:
        magic, fmt, chunk, n, digest, ver = _TRAILER.unpack(tail)
        own = fmt >> 8
        size = TRAILER_BYTES + own + (n if chunk == 0 else 0)
        if (magic == _MAGIC and fmt & 0xFF == 2 and own <= MAX_OWN and strlen in (None, size)
                and (chunk == 0 or (chunk < n and -(-n // chunk) <= _MAX_CHUNKS))):
            return _Version(tail, size, n, digest, chunk, b"%016x:" % ver, own)
    return _Version(tail, len(tail) if strlen is None else strlen, -1, 0, 0, b"")


def _may_name_chunks(tail: bytes) -> bool:
    """Cheap test before :func:`_parse` on a put's probe: not a one-key value, nor absent."""
    return len(tail) == _HEADER_V1.size or (len(tail) == TRAILER_BYTES and tail[8:16] != bytes(8))


class RedisTier(Tier):
    def __init__(self, url: str, *, name: str = "redis", prefix: str = "kvport:", capacity_bytes: int = 1 << 40,
                 chunk_bytes: int = DEFAULT_CHUNK, verify: bool = True, cluster: bool = False,
                 socket_timeout_s: float = 5.0, max_value_bytes: int = 4 << 30, wait_replicas: int = 0,
                 wait_timeout_s: float = 1.0, records: bool = True, client: str | None = None) -> None:
        if not 0 < chunk_bytes <= 256 << 20:
            raise TierError(f"chunk_bytes must be in (0, 256 MiB], got {chunk_bytes}")
        if not 0 <= wait_replicas <= 16 or not 0 < wait_timeout_s < socket_timeout_s:
            raise TierError(f"wait_replicas must be in [0, 16] and wait_timeout_s in (0, socket_timeout_s), got "
                            f"{wait_replicas}, {wait_timeout_s}")
        self.wait_replicas = wait_replicas
        self._wait_ms = max(1, int(wait_timeout_s * 1000))
        self.unacknowledged_puts = 0
        self.name = name
        self.prefix = prefix.encode()
        self.chunk_bytes = chunk_bytes
        self.verify = verify
        self.cluster = cluster
        self._capacity = capacity_bytes
        self.caps = TierCaps(persistent=True, shared=True, zero_copy_read=False, max_value_bytes=max_value_bytes,
                             native_ttl=True, pool_records=records)
        kw: dict[str, Any] = {"socket_timeout": socket_timeout_s, "socket_connect_timeout": min(1.0, socket_timeout_s),
                              "command_packer": zero_copy_packer()}
        try:
            if cluster:
                from redis.cluster import RedisCluster

                self._r: Any = RedisCluster.from_url(url, connection_class=zero_copy_connection(), **kw)
            else:
                self._r = redis.Redis.from_url(url, retry_on_timeout=False, **kw)
        except _REDIS_OR_VALUE as exc:
            raise TierUnavailableError(f"{name}: cannot connect to {url}: {exc}") from exc
        self._settle_script: Any = self._r.register_script(_SETTLE)  # no I/O: loaded on first use
        # each value's own record (who handed it to the pool: kvport.client.redis_pool reads them, and
        # keeps the pool's leases and pins beside them)
        self.keeps_records = records
        self.client = check_client(client or default_client())

    @classmethod
    def from_url(cls, url: str, *, name: str = "redis", **kw: Any) -> RedisTier:
        """A tier from one URL, kvport's own options in its query (every other part is redis-py's)::

            redis://HOST:PORT/0                              one Redis / Valkey server
            redis://HOST:PORT/0?cluster=true                 a Redis Cluster (any node: the rest is mapped)
            ...?cluster=true&wait_replicas=1&wait_timeout_ms=500
                                                             every put waits for a replica (WAIT)
            ...?client=prefill-0                             the name this client's pool records carry
                                                             (default host:pid); records=false: none

        The one spelling ``KVPORT_REDIS_URL``, the vLLM connector's ``kvport_redis`` and the demo use."""
        base, opts = split_url(url)
        return cls(base, name=name, **{**opts, **kw})

    # ------------------------------------------------------------------ layout
    def _k(self, key: bytes) -> bytes:
        return self.prefix + b"{" + key.hex().encode() + b"}"

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        try:
            return int(self._r.info("memory")["used_memory"])
        except _REDIS_ERRORS as exc:
            raise _map(self.name, exc) from exc

    def _pipe(self) -> Any:
        return self._r.pipeline(transaction=False)

    def _settle(self, key: bytes, ver: _Version, mode: str) -> bool:
        """``_SETTLE`` for one version of ``key`` (one slot: every key under its hash tag)."""
        head = self._k(key)
        try:
            return bool(self._settle_script(keys=[head, *ver.chunk_keys(head)], args=[ver.tail, ver.strlen, mode]))
        except _REDIS_ERRORS as exc:
            raise _map(self.name, exc) from exc

    def _owns(self, metas: Sequence[BlockMeta | None], px: int | None) -> list[bytes]:
        """Each value's own record (module docstring); empty ones without ``records``."""
        if not self.keeps_records:
            return [b""] * len(metas)
        now = int(time.time() * 1000)
        out = []
        for m in metas:
            lt = m.lifetime.value if m is not None and m.lifetime is not None else \
                (Lifetime.PREFIX.value if px is None else Lifetime.SESSION.value)
            parent = m.parent.hex() if m is not None and m.parent is not None else ""
            out.append(msgpack.packb({"by": self.client, "lt": lt, "p": parent, "t": now}))
        return out

    def _trailer(self, n: int, digest: int, version: bytes, own: int = 0) -> bytes:
        chunk = 0 if n <= self.chunk_bytes else self.chunk_bytes
        return _TRAILER.pack(_MAGIC, 2 | own << 8, chunk, n, digest, int.from_bytes(version, "little"))

    def own_of(self, keys: Sequence[bytes]) -> list[dict[str, Any] | None]:
        """The own record of each key's value (None: absent, or a value put without one)."""
        pipe = self._r.pipeline(transaction=False)
        for k in keys:
            pipe.getrange(self._k(k), -(TRAILER_BYTES + MAX_OWN), -1)
        try:
            tails = pipe.execute()
        except _REDIS_ERRORS as exc:
            raise _map(self.name, exc) from exc
        return [parse_own(t) for t in tails]

    # ------------------------------------------------------------------ put
    def put(self, key: bytes, data: Buffer, *, ttl_s: float | None = None) -> None:
        self.put_many([(key, data)], ttl_s=ttl_s)

    def put_block(self, key: bytes, parts: Sequence[Buffer], meta: BlockMeta, *, ttl_s: float | None = None) -> None:
        data = parts[0] if len(parts) == 1 else b"".join(byte_view(p) for p in parts)
        self.put_many_meta([(key, data)], [meta], ttl_s=ttl_s)

    def put_many(self, items: Sequence[tuple[bytes, Buffer]], *, ttl_s: float | None = None) -> None:
        self.put_many_meta(items, [None] * len(items), ttl_s=ttl_s)

    def put_many_meta(self, items: Sequence[tuple[bytes, Buffer]], metas: Sequence[BlockMeta | None], *,
                      ttl_s: float | None = None) -> None:
        """Per value: probe its head, write its chunks (if over one chunk), then its head; replies
        are read at the end, like a pipeline's; then the chunks of replaced versions are deleted.
        Each SET goes straight to the socket (its bytes handed over as they are) and the value is
        hashed right after, while it is still in cache from that copy; its trailer goes last. (A
        redis-py pipeline packs everything before sending anything, so the hash had to read every
        value from RAM once more beside it: 0.6-0.7 of this speed here.) With the pool's records
        (``records=True``), each value's own record (who handed it to the pool, its lifetime and
        parent from ``metas``) goes in its head, before the trailer: one value, one write."""
        srcs = [byte_view(d) for _, d in items]
        keys = [k for k, _ in items]
        for v in srcs:
            if v.nbytes > self.caps.max_value_bytes:
                raise TierFullError(f"{self.name}: value of {v.nbytes} bytes exceeds max_value_bytes")
        if not items:
            return
        px = None if ttl_s is None else max(1, int(ttl_s * 1000))
        versions = os.urandom(8 * len(items))  # not random.*: forked writers would share its state
        own = self._owns(metas, px)
        if self.cluster:
            return self._put_cluster(keys, srcs, px, versions, own)
        pool = self._r.connection_pool
        conn: Any = None
        replies: list[Any] = []
        trailers: list[bytes] = []
        counts: list[int] = []  # replies per value: probe, chunk SETs, head SET
        try:
            conn = pool.get_connection()
            cb = self.chunk_bytes
            tail = b"\r\n" if px is None else b"\r\n$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(px)), px)
            n_args = 3 if px is None else 5
            pending = b""  # small RESP pieces that go out with the next write: two writes a value
            for j, (key, src) in enumerate(zip(keys, srcs, strict=True)):
                head, n, version, mine = self._k(key), src.nbytes, versions[8 * j : 8 * j + 8], own[j]
                pending += _RESP_PROBE % (len(head), head)
                if n <= cb:  # one key: payload | own | trailer
                    conn.send_packed_command([pending + _resp_set_head(n_args, head, n + len(mine) + TRAILER_BYTES),
                                              src], check_health=j == 0)
                    digest = xxhash.xxh3_64_intdigest(src) if self.verify else 0  # still in cache
                    trailers.append(self._trailer(n, digest, version, len(mine)))
                    pending = mine + trailers[-1] + tail
                    counts.append(2)
                    continue
                h = xxhash.xxh3_64()
                tag = b"%016x:" % int.from_bytes(version, "little")
                for i in range(-(-n // cb)):
                    part = src[i * cb : (i + 1) * cb]
                    conn.send_packed_command([pending + _resp_set_head(n_args, b"%s:%s%d" % (head, tag, i),
                                                                       part.nbytes), part], check_health=j == i == 0)
                    pending = tail
                    if self.verify:
                        h.update(part)
                trailers.append(self._trailer(n, h.intdigest() if self.verify else 0, version, len(mine)))
                pending += _resp_set_head(n_args, head, len(mine) + TRAILER_BYTES) + mine + trailers[-1] + tail
                counts.append(2 + -(-n // cb))
            if self.wait_replicas:  # on the connection that wrote: WAIT covers exactly these writes
                pending += b"*3\r\n$4\r\nWAIT\r\n$%d\r\n%d\r\n$%d\r\n%d\r\n" % (
                    len(str(self.wait_replicas)), self.wait_replicas, len(str(self._wait_ms)), self._wait_ms)
            conn.send_packed_command([pending], check_health=False)
            for _ in range(sum(counts) + (1 if self.wait_replicas else 0)):  # every reply: the pool stays in step
                try:
                    replies.append(conn.read_response())
                except redis.ResponseError as exc:
                    replies.append(exc)
        except _REDIS_OR_OS as exc:
            if conn is not None:
                conn.disconnect()  # half a command may be on the wire: never reuse this stream
            raise _map(self.name, exc if isinstance(exc, _REDIS_ERRORS) else redis.ConnectionError(str(exc))) \
                from exc
        finally:
            if conn is not None:
                pool.release(conn)
        self._after_put(keys, trailers, counts, replies)
        if self.wait_replicas:
            self._check_acks([replies[-1]], moved=False)

    def _check_acks(self, acks: Sequence[Any], moved: bool) -> None:
        """Raise when a WAIT saw fewer replicas than asked (or failed), or a slot moved under the put."""
        short = [a for a in acks if not isinstance(a, int) or a < self.wait_replicas]
        if short or moved:
            self.unacknowledged_puts += 1
            why = "a slot moved to another node during the put" if moved else \
                f"WAIT answered {short[0]!r} of {self.wait_replicas} replicas within {self._wait_ms} ms"
            raise TierUnavailableError(f"{self.name}: put not acknowledged by its replicas: {why}")

    def _put_cluster(self, keys: Sequence[bytes], srcs: Sequence[memoryview], px: int | None,
                     versions: bytes, own: Sequence[bytes]) -> None:
        """Cluster mode: a pipeline per ~8 MiB group (each routed by slot: one connection per node),
        in the same order. A one-chunk value and its trailer go out as one argument of two buffers
        (:class:`Joined`)."""
        cb = self.chunk_bytes
        for lo, hi in pipeline_groups([v.nbytes for v in srcs]):
            digests = checksums.xxh3_each(srcs[lo:hi]) if self.verify else [0] * (hi - lo)
            trailers = [own[j] + self._trailer(srcs[j].nbytes, digests[j - lo], versions[8 * j : 8 * j + 8],
                                               len(own[j])) for j in range(lo, hi)]  # own | trailer
            pipe = self._pipe()
            counts: list[int] = []
            for key, src, trailer in zip(keys[lo:hi], srcs[lo:hi], trailers, strict=True):
                head = self._k(key)
                pipe.getrange(head, -TRAILER_BYTES, -1)
                if src.nbytes <= cb:
                    pipe.set(head, Joined(src, trailer), px=px)  # sent as the two buffers: no copy
                    counts.append(2)
                    continue
                chunk_keys = _parse(trailer[-TRAILER_BYTES:], None, cb).chunk_keys(head)
                for i, ck in enumerate(chunk_keys):
                    pipe.set(ck, src[i * cb : (i + 1) * cb], px=px)
                pipe.set(head, trailer, px=px)
                counts.append(2 + len(chunk_keys))
            before = self._nodes_of(keys[lo:hi]) if self.wait_replicas else []
            for node in {n.name: n for n in before}.values():  # after its writes, on that node's connection
                pipe.execute_command("WAIT", self.wait_replicas, self._wait_ms, target_nodes=node)
            try:
                replies = pipe.execute(raise_on_error=False)
            except _REDIS_ERRORS as exc:
                raise _map(self.name, exc) from exc
            self._after_put(keys[lo:hi], trailers, counts, replies)
            if before:  # a write redirected (MOVED/ASK) to another node is not covered by the WAITs sent
                after = self._nodes_of(keys[lo:hi])
                self._check_acks(replies[sum(counts):], moved=[n.name for n in after] != [n.name for n in before])

    def _nodes_of(self, keys: Sequence[bytes]) -> list[Any]:
        """The primary serving each key's slot, as the client's slot map has it now."""
        try:
            return [self._r.get_node_from_key(self._k(k)) for k in keys]
        except _REDIS_ERRORS as exc:
            raise _map(self.name, exc) from exc

    def _after_put(self, keys: Sequence[bytes], trailers: Sequence[bytes], counts: Sequence[int],
                   replies: Sequence[Any]) -> None:
        """Delete the chunks of the versions these puts replaced, and every part of a put that
        failed; then raise the first failure. Each value's replies (``counts``): probe, chunk SETs,
        head SET."""
        first: Exception | None = None
        at = 0
        for key, trailer, took in zip(keys, trailers, counts, strict=True):
            probe, writes = replies[at], replies[at + 1 : at + took]
            at += took
            failed = next((r for r in writes if isinstance(r, Exception)), None)
            first = first or failed
            with contextlib.suppress(TierError):  # best effort: what stays behind is garbage, not wrong data
                old = _parse(probe, None, self.chunk_bytes) if isinstance(probe, bytes) and _may_name_chunks(probe) \
                    else None
                if old is not None and old.n_chunks:
                    self._settle(key, old, "gc")
                if failed is not None and took > 2:
                    ours = _parse(trailer[-TRAILER_BYTES:], None, self.chunk_bytes)
                    if not self._settle(key, ours, "drop"):
                        self._settle(key, ours, "gc")
        if first is not None:
            raise _map(self.name, first) from first

    # ------------------------------------------------------------------ get
    def _versions(self, keys: Sequence[bytes]) -> list[_Version | None]:
        """The version each key's head names, or None when absent (heads read as far as their trailers)."""
        pipe = self._r.pipeline(transaction=False)
        for k in keys:
            pipe.strlen(self._k(k))
            pipe.getrange(self._k(k), -TRAILER_BYTES, -1)
        try:
            got = pipe.execute()
        except _REDIS_ERRORS as exc:
            raise _map(self.name, exc) from exc
        return [_parse(t, int(s), self.chunk_bytes) if s else None for s, t in zip(got[::2], got[1::2], strict=True)]

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
        plans: list[tuple[bytes, memoryview, _Version, bool] | None] = []  # (key, dst, version, checked aside)
        pending: list[Future[list[tuple[int, bytes]]]] = []
        try:
            for a, b in pipeline_groups([_nbytes(d) for _, d in items]):
                pipe = self._r.pipeline(transaction=False)
                for key, _ in items[a:b]:
                    pipe.get(self._k(key))
                try:
                    heads = pipe.execute()
                except _REDIS_ERRORS as exc:
                    raise _map(self.name, exc) from exc
                singles: list[tuple[int, bytes, memoryview, memoryview, int]] = []  # (plan, key, dst, bytes, digest)
                for (key, dst), head in zip(items[a:b], heads, strict=True):
                    if head is None:
                        if raise_missing:
                            raise BlockNotFoundError(f"{self.name}: no block {key.hex()}")
                        plans.append(None)
                        continue
                    ver = _parse(head[-TRAILER_BYTES:], len(head), self.chunk_bytes)
                    if ver.n < 0:
                        self._drop_bad(key, ver, "bad header", raise_missing)
                        plans.append(None)
                        continue
                    out_mv = writable_view(dst, ver.n)
                    if ver.chunk == 0:  # one key: verified and copied on the checksum thread
                        singles.append((len(plans), key, out_mv, memoryview(head)[: ver.n], ver.digest))
                        plans.append((key, out_mv, ver, True))
                        continue
                    for ck in ver.chunk_keys(self._k(key)):
                        rest.get(ck)
                    plans.append((key, out_mv, ver, False))
                if singles:
                    pending.append(checksums.aside(functools.partial(_verify_and_copy, singles, self.verify),
                                                   sum(len(c) for _, _, _, c, _ in singles)))
        except BaseException:
            _wait_all(pending)  # no thread writes into the caller's buffers once this returns
            raise
        bad = [x for fut in pending for x in fut.result()]
        for idx, key in bad:
            plan = plans[idx]
            assert plan is not None
            plans[idx] = None
            self._drop_bad(key, plan[2], "checksum mismatch", raise_missing)
        try:
            chunks = rest.execute() if len(rest) else []
        except _REDIS_ERRORS as exc:
            raise _map(self.name, exc) from exc
        out: list[int | None] = []
        ci = 0
        for plan in plans:
            if plan is None:
                out.append(None)
                continue
            key, out_mv, ver, aside = plan
            if aside:
                out.append(ver.n)
                continue
            ok = True
            for lo in range(0, max(1, ver.n), ver.chunk):
                c = chunks[ci]
                ci += 1
                want = min(ver.chunk, ver.n - lo)
                if c is None or len(c) != want:
                    ok = False
                    continue
                out_mv[lo : lo + want] = c
            if not ok:
                self._drop_bad(key, ver, "missing or short chunk", raise_missing)
                out.append(None)
                continue
            if self.verify and xxhash.xxh3_64_intdigest(out_mv[: ver.n]) != ver.digest:
                self._drop_bad(key, ver, "checksum mismatch", raise_missing)
                out.append(None)
                continue
            out.append(ver.n)
        return out

    def _drop_bad(self, key: bytes, ver: _Version, why: str, raise_it: bool) -> None:
        """Delete the version of ``key`` that failed, unless a newer one replaced it meanwhile."""
        dropped = self._settle(key, ver, "drop")
        if raise_it:
            fate = "dropped" if dropped else "not dropped: the key no longer holds the version read"
            raise CorruptBlockError(f"{self.name}: block {key.hex()}: {why}; {fate}")

    # ------------------------------------------------------------------ metadata
    def size_of(self, key: bytes) -> int | None:
        ver = self._versions([key])[0]
        return None if ver is None or ver.n < 0 else ver.n

    def sizes_of(self, keys: Iterable[bytes]) -> list[int | None]:
        ks = list(keys)
        return [None if v is None or v.n < 0 else v.n for v in self._versions(ks)] if ks else []

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
        except _REDIS_ERRORS as exc:
            raise _map(self.name, exc) from exc

    def ttl_of(self, key: bytes) -> float | None:
        """Seconds left before Redis expires the value; None when it has no TTL or is absent."""
        try:
            ms = int(self._r.pttl(self._k(key)))
        except _REDIS_ERRORS as exc:
            raise _map(self.name, exc) from exc
        return None if ms < 0 else ms / 1000

    def delete(self, key: bytes) -> bool:
        """The version the head names, head and chunks at once; read again if a put replaced it
        in between (a few times: then the head alone, and that version's chunks stay behind)."""
        for _ in range(4):
            ver = self._versions([key])[0]
            if ver is None:
                return False
            if self._settle(key, ver, "drop"):
                return True
        try:
            return bool(self._r.delete(self._k(key)))
        except _REDIS_ERRORS as exc:
            raise _map(self.name, exc) from exc

    def keys(self) -> Iterator[bytes]:
        plen = len(self.prefix) + 1
        try:
            found = list(self._r.scan_iter(match=self.prefix + b"{*}", count=1000))
        except _REDIS_ERRORS as exc:
            raise _map(self.name, exc) from exc
        return iter([bytes.fromhex(k[plen:-1].decode()) for k in found if k.endswith(b"}")])

    def close(self) -> None:
        with contextlib.suppress(redis.RedisError):
            self._r.close()


_URL_OPTIONS = ("cluster", "wait_replicas", "wait_timeout_ms", "records", "client")
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


MAX_CLIENT = 128


def parse_own(tail: bytes | None) -> dict[str, Any] | None:
    """The own record in a head's last bytes (up to TRAILER_BYTES + MAX_OWN of them), or None:
    absent, a value without one, anything malformed (data from the network: capped, typed)."""
    if not tail or len(tail) < TRAILER_BYTES:
        return None
    ver = _parse(tail[-TRAILER_BYTES:], None, DEFAULT_CHUNK)
    if ver.n < 0 or not ver.own or len(tail) < TRAILER_BYTES + ver.own:
        return None
    raw = tail[-TRAILER_BYTES - ver.own : -TRAILER_BYTES]
    try:
        o = msgpack.unpackb(raw, raw=False, max_str_len=256, max_map_len=8, max_array_len=0, max_bin_len=0)
    except (ValueError, msgpack.UnpackException, TypeError):
        return None
    if not isinstance(o, dict) or not all(isinstance(o.get(f), str) for f in ("by", "lt", "p")) \
            or not isinstance(o.get("t"), int):
        return None
    return o


def default_client() -> str:
    """The name a client's records carry unless it names itself: host and process."""
    return f"{socket.gethostname()}:{os.getpid()}"[:MAX_CLIENT]


def check_client(name: str, what: str = "client name") -> str:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_CLIENT or any(c in name for c in "{}\r\n"):
        raise TierError(f"{what} must be 1-{MAX_CLIENT} characters without braces or line breaks, got {name!r}")
    return name


def split_url(url: str) -> tuple[str, dict[str, Any]]:
    """``url`` without kvport's query options, and those options as RedisTier's keyword arguments;
    ConfigError for a malformed one (a typo must not silently mean "one server, no WAIT")."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(f"a Redis URL is redis://, rediss:// or unix://, got {url!r}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in query if k in _URL_OPTIONS}
    rest = [(k, v) for k, v in query if k not in _URL_OPTIONS]
    opts: dict[str, Any] = {}
    for flag in ("cluster", "records"):
        if flag in ours:
            if ours[flag].lower() not in _BOOLS:
                raise ConfigError(f"{flag}= must be true or false in {url!r}")
            opts[flag] = _BOOLS[ours[flag].lower()]
    if "client" in ours:
        name = ours["client"]
        if not 0 < len(name) <= 128 or any(c in name for c in "{}\r\n"):
            raise ConfigError(f"client= must name this client in 1-128 characters without braces in {url!r}")
        opts["client"] = name
    try:
        if "wait_replicas" in ours:
            opts["wait_replicas"] = int(ours["wait_replicas"])
        if "wait_timeout_ms" in ours:
            opts["wait_timeout_s"] = int(ours["wait_timeout_ms"]) / 1000
    except ValueError:
        raise ConfigError(f"wait_replicas= and wait_timeout_ms= must be integers in {url!r}") from None
    return urlunsplit(parts._replace(query=urlencode(rest))), opts


GET_GROUP_BYTES = 8 << 20  # batched gets (and cluster puts) are pipelined in groups of about this many value bytes
_RESP_PROBE = b"*4\r\n$8\r\nGETRANGE\r\n$%d\r\n%s\r\n$3\r\n-40\r\n$2\r\n-1\r\n"  # a head's trailer (TRAILER_BYTES)


def _resp_set_head(n_args: int, name: bytes, nbytes: int) -> bytes:
    """``SET name <nbytes-long value> [PX ms]`` in RESP up to the value; the value and then the
    tail (CRLF, plus the packed PX option) follow as their own writes. redis-py's packer took ~12 us
    a command: at 128 SETs of 360 KiB, a tenth of the time of the whole put. (Writing several SETs
    at once, 1 or 4 MiB of values, measured no faster here.)"""
    return b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (n_args, len(name), name, nbytes)


class Joined:
    """One command argument sent as several buffers back to back (a value and its trailer), never
    concatenated into a new one: :func:`zero_copy_packer` writes them after one length prefix."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, *parts: memoryview | bytes) -> None:
        self.parts = parts
        self.nbytes = sum(memoryview(p).nbytes for p in parts)


def zero_copy_packer() -> Any:
    """redis-py's pure-Python command packer: values over 6000 bytes (and memoryviews) go to the
    socket as they are. With hiredis installed redis-py packs with ``hiredis.pack_command``, which
    copies every value into a new bytes object first: that copy (into fresh memory, ~1.3 GB/s here)
    was the ceiling of SET at 0.6-0.9 GB/s; zero-copy packing ran the same SETs at 1.5-3.9 GB/s.
    A :class:`Joined` argument goes out as its parts. Replies are still parsed by hiredis."""
    from redis import connection

    encoder: Any = connection.Encoder("utf-8", "strict", False)  # type: ignore[attr-defined,no-untyped-call]

    class Packer(connection.PythonRespSerializer):  # type: ignore[misc]
        def pack(self, *args: Any) -> list[Any]:
            if not any(isinstance(a, Joined) for a in args):
                out: list[Any] = super().pack(*args)  # type: ignore[no-untyped-call]
                return out
            head = tuple(args[0].encode().split()) if isinstance(args[0], str) else (args[0],)
            buff = b"*%d\r\n" % (len(head) + len(args) - 1)
            output: list[Any] = []
            for arg in (*head, *args[1:]):
                if isinstance(arg, Joined):
                    output.append(b"%s$%d\r\n" % (buff, arg.nbytes))
                    output.extend(arg.parts)
                    buff = b"\r\n"
                    continue
                enc = self.encode(arg)
                if isinstance(enc, memoryview) or len(enc) > 6000:
                    output.append(b"%s$%d\r\n" % (buff, len(enc)))
                    output.append(enc)
                    buff = b"\r\n"
                else:
                    buff = b"%s$%d\r\n%s\r\n" % (buff, len(enc), enc)
            output.append(buff)
            return output

    return Packer(6000, encoder.encode)


@functools.cache
def zero_copy_connection() -> type:
    """A redis-py Connection class packing with :func:`zero_copy_packer`: how a RedisCluster's node
    connections get it (the cluster client does not pass ``command_packer`` on to its nodes)."""

    class ZeroCopyConnection(redis.connection.Connection):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**{**kw, "command_packer": zero_copy_packer()})  # type: ignore[no-untyped-call]

    return ZeroCopyConnection



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


def _verify_and_copy(singles: list[tuple[int, bytes, memoryview, memoryview, int]],
                     verify: bool) -> list[tuple[int, bytes]]:
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
