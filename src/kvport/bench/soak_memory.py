"""``kvport bench soak``'s memory phases: the server's RSS against ``--capacity`` plus a stated fixed
overhead, under a million read hits and under a lease flood (issue 25).

::

    kvport serve (the soak's flags, its own folder)   idle RSS sampled for 1 s: empty store
      read_hits    W blocks of 4 KiB put (3/4 of the host pool's pages), then N GETs of them in
                   turn on 4 connections, each pipelined (2 batches of 64 requests in flight)
      lease_flood  holder after holder, a connection each: PIN all W, then LEASE all W again and
                   again until refused; the connection's cap moves on to the next holder, the
                   tenant's cap or the server's budget for records ends the flood; then
                   FLOOD_TRIES more single-block leases and pins (granted while the budget has
                   room for one, refused after), and every record is held for ``hold_s``
    the server's RSS every 50 ms throughout; each phase's peak from its own start

The host pool is allocated and pre-faulted at start, so the idle RSS is the pool (empty pages, a
part of ``--capacity``) plus the process's baseline (interpreter, libraries, tables): the stated
fixed overhead is ``idle RSS - host pool``. The server counts that baseline inside
``--capacity`` too (:mod:`kvport.server.app`), so ``peak_rss_vs_capacity`` is the stricter figure.

Fields (``results.memory``): ``capacity_bytes``, ``idle_rss_bytes``, ``host_pool_bytes``,
``fixed_overhead_bytes``; per phase ``peak_rss_bytes``, ``rss_vs_capacity_plus_overhead`` (peak /
(capacity + overhead), target <= 1.0), ``peak_rss_vs_capacity``, ``growth_over_idle_bytes``;
``read_hits.hits`` (GETs answered with the value), ``misses``, ``hits_per_second``;
``lease_flood.leases_granted`` / ``leases_refused``, ``lease_blocks_granted``, ``pins_granted`` /
``pins_refused``, ``refused_by`` (which cap answered each refusal), ``held_budget_bytes``.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvport.bench.soak_server import SAMPLE_S, SoakServer
from kvport.client import ClientConfig, RemoteTier
from kvport.client.conn import ServerConn
from kvport.errors import LeaseError, ProtocolError, ServerError
from kvport.evidence.timing import ratio
from kvport.protocol.errors import remote_error
from kvport.protocol.frame import Flags, MsgType, encode_frame, frame_bytes
from kvport.protocol.server import GetRequest
from kvport.server.held import held_budget
from kvport.server.limits import ServerLimits

KiB = 1 << 10
VALUE_BYTES = 4 * KiB  # small values: the phase is about what each hit leaves behind, not bytes moved
BATCH = 64  # GETs per send; two batches in flight keep the server busy while the client reads
READERS = 4  # pipelined connections, a thread each (the server's one event loop is the limit)
FLOOD_TRIES = 100  # leases and pins asked for after the flood was refused: every one refused too
IDLE_S = 1.0
REFUSALS = ("connection_cap", "tenant_cap", "budget", "other")
MAX_KEYS = 4096  # ServerLimits.max_keys_per_request: a lease or pin of the whole working set is one request


def _phase(srv: SoakServer, capacity: int, idle: int, overhead: int) -> dict[str, Any]:
    peak = srv.window_peak
    return {"peak_rss_bytes": peak, "rss_vs_capacity_plus_overhead": ratio(peak, capacity + overhead),
            "peak_rss_vs_capacity": ratio(peak, capacity), "growth_over_idle_bytes": peak - idle}


def _put_working_set(port: int, blocks: int) -> list[bytes]:
    keys = [b"soak-mem" + i.to_bytes(8, "big") for i in range(blocks)]
    value = np.full(VALUE_BYTES, 0x5A, dtype=np.uint8)
    c = RemoteTier(ClientConfig(port=port, client="soak-mem-writer", pool_size=1))
    try:
        for k in keys:
            c.put(k, value)
        if not all(c.contains_many(keys)):
            raise ServerError("the memory phases' working set does not fit the host pool")
    finally:
        c.close()
    return keys


def pipelined_gets(port: int, keys: list[bytes], n: int) -> tuple[int, int]:
    """``n`` GETs of ``keys`` in turn on one connection, ``2 x BATCH`` in flight: (hits, misses).
    Requests are encoded once (a key's frame is resent as it is); answers come in request order."""
    conn = ServerConn(ClientConfig(port=port, client="soak-mem-reader"))
    frames = [frame_bytes(encode_frame(MsgType.GET, GetRequest(k).to_meta(), corr_id=i + 1))
              for i, k in enumerate(keys)]
    scratch = memoryview(bytearray(VALUE_BYTES + 4 * KiB))
    in_flight: deque[int] = deque()
    sent = hits = misses = 0
    try:
        while hits + misses < n:
            while sent < n and len(in_flight) < 2 * BATCH:
                batch = [(sent + j) % len(keys) for j in range(min(BATCH, n - sent))]
                conn.t.send([b"".join(frames[i] for i in batch)])
                in_flight.extend(batch)
                sent += len(batch)
            for _ in range(min(BATCH, len(in_flight))):
                hdr, meta = conn.io.read_head()
                i = in_flight.popleft()
                if hdr.flags & Flags.ERROR:
                    raise remote_error(meta, ServerError)
                if hdr.corr_id != i + 1:
                    raise ProtocolError(f"GET answer #{hdr.corr_id} where #{i + 1} was due")
                if hdr.payload_len:
                    conn.io.skip_payload(hdr, scratch)
                if meta.get("found") is True and hdr.payload_len == VALUE_BYTES:
                    hits += 1
                else:
                    misses += 1
    finally:
        conn.close()
    return hits, misses


def read_hits(srv: SoakServer, n: int) -> dict[str, Any]:
    blocks = min(MAX_KEYS, max(1, srv.host_pool_bytes // (1 << 20) * 3 // 4))  # 3/4 of the pool (1 MiB pages)
    keys = _put_working_set(srv.port, blocks)
    shares = [n // READERS + (r < n % READERS) for r in range(READERS)]
    srv.mark()
    t0 = time.monotonic()
    with ThreadPoolExecutor(READERS) as pool:
        answers = list(pool.map(lambda m: pipelined_gets(srv.port, keys, m), [m for m in shares if m]))
    elapsed = time.monotonic() - t0
    hits, misses = sum(a[0] for a in answers), sum(a[1] for a in answers)
    time.sleep(3 * SAMPLE_S)  # a sample after the last answer
    return {"working_set_blocks": blocks, "value_bytes": VALUE_BYTES, "gets": n, "hits": hits, "misses": misses,
            "elapsed_s": round(elapsed, 1), "hits_per_second": round(hits / elapsed) if elapsed else None}


@dataclass(slots=True)
class _Flood:
    """What one flood was granted and refused; each refusal named by the cap that answered it."""

    ttl_s: float
    holders: int = 0
    leases_granted: int = 0
    lease_blocks_granted: int = 0
    pins_granted: int = 0
    leases_refused: int = 0
    pins_refused: int = 0
    refused_by: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSALS, 0))

    def lease(self, c: RemoteTier, keys: list[bytes]) -> str | None:
        """One LEASE of ``keys``: None when granted, else the cap that refused it."""
        try:
            n = c.lease(keys, self.ttl_s)[1]
        except LeaseError as exc:
            self.leases_refused += 1
            return self._refused(exc)
        self.leases_granted += 1
        self.lease_blocks_granted += n
        return None

    def pin(self, c: RemoteTier, keys: list[bytes]) -> str | None:
        try:
            self.pins_granted += c.pin(keys, "soak flood", ttl_s=self.ttl_s)
        except LeaseError as exc:
            self.pins_refused += 1
            return self._refused(exc)
        return None

    def _refused(self, exc: LeaseError) -> str:
        msg = str(exc)  # kvport.server.held's three caps
        why = "connection_cap" if "per client connection" in msg else "tenant_cap" if "per tenant" in msg else \
            "budget" if "budget" in msg else "other"
        self.refused_by[why] += 1
        return why

    def report(self) -> dict[str, Any]:
        return {"holders": self.holders, "leases_granted": self.leases_granted,
                "lease_blocks_granted": self.lease_blocks_granted, "leases_refused": self.leases_refused,
                "pins_granted": self.pins_granted, "pins_refused": self.pins_refused, "refused_by": self.refused_by}


def _holder(port: int, name: str) -> RemoteTier:
    return RemoteTier(ClientConfig(port=port, client=name, pool_size=1, retries=0))  # one connection: one account


def lease_flood(srv: SoakServer, keys: list[bytes], hold_s: float) -> dict[str, Any]:
    srv.mark()
    flood = _Flood(ttl_s=hold_s + 60.0)  # every record outlives the hold
    ended: str | None = "connection_cap"
    while ended == "connection_cap":  # the next holder, a new connection
        c = _holder(srv.port, f"soak-flood-{flood.holders}")
        flood.holders += 1
        try:
            ended = flood.pin(c, keys)
            while ended is None:
                ended = flood.lease(c, keys)
        finally:
            c.close()  # its records stay charged to it until they lapse
    c = _holder(srv.port, "soak-flood-late")
    try:
        for _ in range(FLOOD_TRIES):
            flood.lease(c, keys[:1])
            flood.pin(c, keys[-1:])
    finally:
        c.close()
    time.sleep(hold_s)
    return {"ended_by": ended, **flood.report(), "hold_s": hold_s}


def run_memory(args: list[str], log: Path, capacity: int, hits: int, hold_s: float) -> dict[str, Any]:
    """Both phases on one fresh server started with ``args`` (``--capacity`` = ``capacity``)."""
    srv = SoakServer(args, log)
    srv.start()
    try:
        srv.mark()
        time.sleep(IDLE_S)
        idle = srv.window_peak
        overhead = max(0, idle - srv.host_pool_bytes)
        hit = read_hits(srv, hits)
        hit.update(_phase(srv, capacity, idle, overhead))
        keys = [b"soak-mem" + i.to_bytes(8, "big") for i in range(hit["working_set_blocks"])]
        flood = lease_flood(srv, keys, hold_s)
        flood.update(_phase(srv, capacity, idle, overhead))
    finally:
        exit_code = srv.stop()
    limits = ServerLimits()
    return {"capacity_bytes": capacity, "idle_rss_bytes": idle, "host_pool_bytes": srv.host_pool_bytes,
            "fixed_overhead_bytes": overhead,
            "held_budget_bytes": held_budget(capacity, 1, limits.max_held_per_tenant),
            "read_hits": hit, "lease_flood": flood, "server_exit_code": exit_code}
