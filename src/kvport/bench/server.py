"""``kvport bench server``: the shared tier under 16 concurrent loopback clients, next to a raw socket.

One real ``kvport serve`` child process (host + disk tiers) and, in the same run:

- limit: :class:`kvport.evidence.rawserver.RawServer`, a plain Python socket server (a thread per
  connection, one reused buffer each: no framing, no checksums, no store) under the same load --
  16 clients in 4 processes, 40% PUT / 45% GET of 2-32 MiB, 15% pings, every socket tuned like
  kvport's -- for 2 s (1 s ``--quick``), measured between the steady windows: before the first and
  after each (the ratio uses their median: the shared machine's speed drifts). Why not one raw
  stream, as before: on this 2-CPU VM one loopback stream moves 3.4 GB/s when the scheduler puts its
  two ends on one CPU and 7.2 when it puts them on two, and picks per connection (measured here), so
  a one-stream limit landed in either mode and the server, whose 17 connections are spread by the
  same scheduler, measured 0.7-1.2 of it. The one-stream figure (system defaults) is reported beside
  it as ``limits.raw_single_stream_gbps``;
- phase A (steady, in ``windows`` windows, default 4 x 5 s): 16 clients (threads in 4 processes:
  one process of 16 threads loses much of its CPU to GIL convoys), each a :class:`RemoteTier`
  with one connection, a mix of PUT (2-32 MiB), GET of its own earlier values, and LOOKUP of its
  key chain; each client's working set is bounded so everything fits the host pool: before a PUT
  the client deletes its oldest values until its values, the new one included, hold at most 80% /
  16 of the pool's pages (a value never more: under a 32 MiB budget, small runs draw smaller
  values), so the server evicts nothing and a GET miss here is a *lost* value (it was: a client
  trimmed its set after the PUT, and 16 PUTs landing at once overflowed a small pool);
- phase B (overload): the same clients write twice the capacity; the server demotes and drops,
  and its RSS (sampled every 20 ms via psutil over the whole run) is compared with ``--capacity``.

The server runs with its default ``--io-threads`` (``--set io_threads=N`` to compare; 0 puts every
byte on the event loop thread).

For diagnosis beside the required fields: ``single_client_gbps`` (one client, sequential 32 MiB
PUT+GET, before the phases) and ``server_cpu_s_per_gb_steady`` (server CPU seconds per GB moved in
phase A, less sensitive to other load on the machine than wall-clock throughput) with its client
counterpart ``client_cpu_s_per_gb_steady`` (all client processes, integrity checks included).

Integrity: every value read is compared with what was written, byte range by byte range as
:meth:`RemoteTier.get_into` reports each range verified (``on_verified``), while it is still in
cache. Values are slices of one random pool starting on a 1 MiB boundary; each whole 1 MiB piece of
a value is compared by its xxh3-128 digest with the digest of the same pool piece, computed once
before the run (a different function from the wire's xxh3-64, over the bench's own buffer); every
other byte (partial pieces, any range not reported) by ``memcmp`` against the pool. A full
``memcmp`` of every value after the call read both buffers from RAM and cost the clients ~10% of
the machine's CPU. ``lost_or_corrupt`` = corrupt reads (both phases) + phase-A misses.
Throughput = (bytes put + bytes got) / wall time of phase A, both directions summed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import xxhash

from kvport.bench.harness import Report, SuiteOptions, conditions, finish
from kvport.client.conn import ClientConfig
from kvport.client.remote import RemoteTier
from kvport.errors import BlockNotFoundError, ConfigError, KVPortError
from kvport.evidence.limits import raw_socket_gbps
from kvport.evidence.rawserver import RawServer
from kvport.evidence.timing import gbps, ratio
from kvport.server.app import DEFAULT_IO_THREADS
from kvport.server.limits import Rejected

MiB = 1 << 20
CLIENTS = 16
_POOL_BYTES = 96 * MiB


@dataclass(slots=True)
class _Stats:
    put_lat: list[float] = field(default_factory=list)
    get_lat: list[float] = field(default_factory=list)
    lookup_lat: list[float] = field(default_factory=list)
    bytes_put: int = 0
    bytes_got: int = 0
    corrupt: int = 0
    lost: int = 0
    evicted: int = 0
    rejected: int = 0
    errors: list[str] = field(default_factory=list)


class _ServerProc:
    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvport.cli.serve_cmd", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            self.proc.wait(10)
            raise KVPortError(f"kvport serve did not start (rc={self.proc.returncode})")
        self.info: dict[str, Any] = json.loads(line)
        self.peak_rss = 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        p = psutil.Process(self.proc.pid)
        while not self._stop.is_set():
            with contextlib.suppress(psutil.Error):
                self.peak_rss = max(self.peak_rss, int(p.memory_info().rss))
            time.sleep(0.02)

    def stop(self) -> int:
        self._stop.set()
        self._sampler.join(2)
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(10)
        finally:
            if self.proc.stdout:
                self.proc.stdout.close()


class _Client:
    """One benchmark client: its keys, their (offset, size) in the shared random pool, its stats."""

    def __init__(self, idx: int, port: int, pool: _Pool, budget: int, page: int, seed: int) -> None:
        self.idx = idx
        self.tier = RemoteTier(ClientConfig(port=port, pool_size=1, backpressure_timeout_s=30.0))
        self.pool = pool.data
        self.out = bytearray(32 * MiB)
        self.check = _Checker(pool, np.frombuffer(self.out, dtype=np.uint8))
        self.budget, self.page = budget, page
        self.steady_max = steady_value_max(budget, page)
        self.held = 0  # pages (in bytes) of the values in ``live``
        self.rng = np.random.default_rng(seed)
        self.live: dict[bytes, tuple[int, int]] = {}
        self.order: list[bytes] = []
        self.seq = 0
        self.s = _Stats()

    def _new_value(self, largest: int) -> tuple[bytes, int, int]:
        size = int(self.rng.integers(2 * MiB, largest + 1))
        off = int(self.rng.integers(0, (len(self.pool) - size) // _PIECE + 1)) * _PIECE
        self.seq += 1
        return self.idx.to_bytes(4, "little") + self.seq.to_bytes(12, "little"), off, size

    def _pages(self, size: int) -> int:
        return -(-size // self.page) * self.page

    def put(self, keep: bool) -> None:
        """``keep``: the steady phase's working set -- room is made first (the oldest values deleted)
        so that this client's values, the new one included, never hold more pages than its budget:
        the clients together stay within the host pool, and a miss is a lost value, not an eviction
        the load caused."""
        key, off, size = self._new_value(self.steady_max if keep else 32 * MiB)
        while keep and self.order and self.held + self._pages(size) > self.budget:
            old = self.order.pop(0)
            self.tier.delete(old)
            self.held -= self._pages(self.live.pop(old)[1])
        t0 = time.perf_counter()
        res = self.tier.put_value(key, self.pool[off : off + size])
        self.s.put_lat.append(time.perf_counter() - t0)
        if isinstance(res, Rejected):
            self.s.rejected += 1
            return
        self.s.bytes_put += size
        self.live[key] = (off, size)
        self.order.append(key)
        self.held += self._pages(size)

    def get(self, key: bytes, must_exist: bool) -> None:
        off, size = self.live[key]
        self.check.start(off)
        t0 = time.perf_counter()
        try:
            n = self.tier.get_into(key, self.out, on_verified=self.check.range)
        except BlockNotFoundError:
            self.s.get_lat.append(time.perf_counter() - t0)
            if must_exist:
                self.s.lost += 1
            else:
                self.s.evicted += 1
            return
        self.s.get_lat.append(time.perf_counter() - t0)
        self.s.bytes_got += n
        if n != size or not self.check.finish(n):
            self.s.corrupt += 1

    def lookup(self) -> None:
        t0 = time.perf_counter()
        self.tier.lookup(self.order[-8:])
        self.s.lookup_lat.append(time.perf_counter() - t0)

    def steady(self, until: float) -> None:
        while time.perf_counter() < until:
            r = self.rng.random()
            if r < 0.4 or not self.live:
                self.put(keep=True)
            elif r < 0.85:
                self.get(self.order[int(self.rng.integers(0, len(self.order)))], must_exist=True)
            else:
                self.lookup()

    def overload(self, nbytes: int) -> None:
        written = 0
        while written < nbytes:
            before = self.s.bytes_put
            self.put(keep=False)
            written += max(self.s.bytes_put - before, 1)
        for key in list(self.live):
            self.get(key, must_exist=False)


_libc = ctypes.CDLL(None)  # CDLL calls release the GIL: 16 client threads compare in parallel
_libc.memcmp.restype = ctypes.c_int
_libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Byte-exact comparison: libc ``memcmp`` (one pass over both, no temporaries, ~13 GB/s here;
    ``np.array_equal`` makes a bool array and runs at ~4 GB/s, which the clients would pay per GET)."""
    if a.nbytes != b.nbytes or not (a.flags.c_contiguous and b.flags.c_contiguous):
        return bool(a.nbytes == b.nbytes and np.array_equal(a, b))
    return a.nbytes == 0 or int(_libc.memcmp(a.ctypes.data, b.ctypes.data, a.nbytes)) == 0


_PIECE = MiB  # the pool's digest grid: values start on it


@dataclass(frozen=True, slots=True)
class _Pool:
    data: np.ndarray
    digests: list[int]  # xxh3-128 of each whole _PIECE of ``data``

    @staticmethod
    def make(nbytes: int) -> _Pool:
        data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        return _Pool(data, [xxhash.xxh3_128_intdigest(data[i : i + _PIECE].data) for i in range(0, nbytes - _PIECE + 1,
                                                                                            _PIECE)])


class _Checker:
    """Checks one GET's value range by range, in the order ``get_into`` reports them verified."""

    def __init__(self, pool: _Pool, out: np.ndarray) -> None:
        self.pool, self.out = pool, out
        self.off = self.done = 0
        self.ok = True

    def start(self, off: int) -> None:
        self.off, self.done, self.ok = off, 0, True

    def range(self, lo: int, n: int) -> None:
        if lo == 0:  # a retry after a reconnect reports the value again from the start
            self.done, self.ok = 0, True
        if lo != self.done:  # a gap or a range out of order: checked after the call instead
            return
        self.ok = self.ok and self._same(lo, lo + n)
        self.done = lo + n

    def finish(self, n: int) -> bool:
        """Whole value checked: the reported ranges, and any bytes not reported (``memcmp``)."""
        if self.done > n:
            return False
        return self.ok and _equal(self.out[self.done : n], self.pool.data[self.off + self.done : self.off + n])

    def _same(self, lo: int, hi: int) -> bool:
        p, off, digests = lo, self.off, self.pool.digests
        while p < hi:
            a = off + p
            if a % _PIECE == 0 and p + _PIECE <= hi:
                if xxhash.xxh3_128_intdigest(self.out[p : p + _PIECE].data) != digests[a // _PIECE]:
                    return False
                p += _PIECE
                continue
            q = min(hi, p + _PIECE - a % _PIECE)
            if not _equal(self.out[p:q], self.pool.data[a : a + q - p]):
                return False
            p = q
        return True


def _client_thread(c: _Client, phase: str, arg: float) -> None:
    try:
        if phase == "steady":
            c.steady(arg)
        else:
            c.overload(int(arg))
    except (KVPortError, OSError) as exc:
        c.s.errors.append(f"{type(exc).__name__}: {exc}")


def steady_value_max(budget: int, page: int) -> int:
    """The largest value of the steady phase: 32 MiB, or the pages of a client's budget when fewer."""
    return min(32 * MiB, budget // page * page)


def _worker(idxs: list[int], port: int, pool: _Pool, budget: int, page: int, overload_bytes: int, windows: int,
            sync: Any, deadline: Any, out: Any) -> None:
    """One client process: ``len(idxs)`` client threads through the steady windows and the overload
    phase, each started and ended on the ``sync`` barrier; stats go to ``out``."""
    clients = [_Client(i, port, pool, budget, page, seed=i + 1) for i in idxs]
    results: dict[str, Any] = {"steady_cpu_s": 0.0}
    sync.wait()  # connected
    phases = [("steady", -1.0)] * windows + [("overload", float(overload_bytes))]
    for k, (phase, arg) in enumerate(phases):
        sync.wait()  # start
        if phase == "overload":
            results["steady"] = [c.s for c in clients]
            for c in clients:
                c.s = _Stats()
        cpu0 = _cpu_s(os.getpid())
        threads = [threading.Thread(target=_client_thread, args=(c, phase, deadline.value if arg < 0 else arg))
                   for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if phase == "steady":
            results["steady_cpu_s"] += _cpu_s(os.getpid()) - cpu0
        if k < len(phases) - 1:
            sync.wait()  # end of a steady window
    results["overload"] = [c.s for c in clients]
    for c in clients:
        c.tier.close()
    out.put(results)


def _cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


@dataclass(frozen=True, slots=True)
class _Phases:
    steady: list[_Stats]
    overload: list[_Stats]
    wall_steady_s: float
    wall_overload_s: float
    server_cpu_steady_s: float
    client_cpu_steady_s: float  # every client process, integrity checks included
    raw_socket_gbps: list[float | None]  # before the first steady window and after each


def _run_phases(port: int, server_pid: int, budget: int, page: int, overload_bytes: int, steady_s: float, procs: int,
                windows: int, raw: Callable[[], float | None]) -> _Phases:
    """16 clients in ``procs`` forked processes (threads inside each; fewer GIL convoys than one
    process). Forked, so the random value pool is shared copy-on-write and nothing is re-imported.

    The steady phase runs in ``windows`` windows of ``steady_s / windows``; ``raw()`` (the limit)
    is measured before the first and after every window while the clients wait, so the limit and
    the server see the same stretch of a machine whose speed drifts."""
    pool = _Pool.make(_POOL_BYTES)
    ctx = mp.get_context("fork")
    sync = ctx.Barrier(procs + 1)
    deadline = ctx.Value("d", 0.0)
    out = ctx.Queue()
    groups = [list(range(CLIENTS))[i::procs] for i in range(procs)]
    workers = [ctx.Process(target=_worker, daemon=True,
                           args=(g, port, pool, budget, page, overload_bytes, windows, sync, deadline, out))
               for g in groups]
    for w in workers:
        w.start()
    sync.wait(timeout=300)  # every client connected
    raws: list[float | None] = [raw()]
    wall_a = cpu_a = 0.0
    for _ in range(windows):
        cpu0 = _cpu_s(server_pid)
        t0 = time.perf_counter()
        deadline.value = t0 + steady_s / windows
        sync.wait(timeout=300)  # start
        sync.wait(timeout=600)  # every client finished its last operation of the window
        wall_a += time.perf_counter() - t0
        cpu_a += _cpu_s(server_pid) - cpu0
        raws.append(raw())
    t_b = time.perf_counter()
    sync.wait(timeout=300)  # overload starts
    got = [out.get(timeout=600) for _ in workers]
    wall_b = time.perf_counter() - t_b
    for w in workers:
        w.join(30)
    return _Phases([s for r in got for s in r["steady"]], [s for r in got for s in r["overload"]], wall_a, wall_b,
                   cpu_a, sum(float(r["steady_cpu_s"]) for r in got), raws)


def _single_client(port: int, rounds: int) -> float:
    """One client, sequential PUT + GET of 32 MiB values: the per-stream path without concurrency."""
    tier = RemoteTier(ClientConfig(port=port, pool_size=1))
    value = np.random.default_rng(1).integers(0, 256, 32 * MiB, dtype=np.uint8)
    out = bytearray(32 * MiB)
    keys = [b"single-%09d" % i for i in range(rounds)]
    tier.put(keys[0], value)  # warm-up: faults the destination pages once
    tier.get_into(keys[0], out)
    tier.delete(keys[0])
    t0 = time.perf_counter()
    for k in keys:
        tier.put(k, value)
        tier.get_into(k, out)
    dt = time.perf_counter() - t0
    tier.delete_many(keys)
    tier.close()
    return gbps(2 * rounds * value.nbytes, dt)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return round(float(np.percentile(np.asarray(xs), q)) * 1e3, 3)


def run(opts: SuiteOptions) -> Report:
    capacity = opts.number("capacity_bytes", (640 if opts.quick else 3072) * MiB, lo=MiB, integer=True)
    steady_s = opts.number("steady_s", 4.0 if opts.quick else 20.0)
    inflight = opts.number("inflight_bytes", (64 if opts.quick else 128) * MiB, lo=MiB, integer=True)
    overload = opts.number("overload_factor", 2.0)  # write load, in multiples of the capacity
    cond = conditions()  # machine facts and load at the start
    raw_seconds = 1.0 if opts.quick else 2.0
    windows = opts.number("windows", 2 if opts.quick else 4, lo=1, integer=True)
    procs = opts.number("client_processes", 4, lo=1, integer=True)
    io_threads = opts.number("io_threads", DEFAULT_IO_THREADS, integer=True)
    with tempfile.TemporaryDirectory(prefix="kvport-bench-server-") as tmp:
        srv = _ServerProc(["--listen", "127.0.0.1:0", "--capacity", str(capacity), "--disk", str(Path(tmp) / "disk"),
                           "--disk-capacity", str(capacity // 2), "--max-value", "32MiB",
                           "--inflight", str(inflight), "--no-spill", "--io-threads", str(io_threads),
                           # steady state: the pool resident from the start. Phase A evicts nothing (every
                           # client's pages, its put under way included, within 80% of the pool / 16); in the
                           # overload LRU drops the oldest values, where the default (fslru) drops the newest
                           # unread ones first. The bench measures the server, not the eviction policy (bench
                           # trace).
                           "--prefault", "--eviction", "lru"])
        try:
            host_cap = int(srv.info["host_capacity"])
            page = int(srv.info["page_bytes"])
            budget = int(host_cap * 0.8) // CLIENTS
            if steady_value_max(budget, page) < 2 * MiB:
                raise ConfigError(f"--set capacity_bytes={capacity}: a host pool of {host_cap} bytes leaves each of "
                                  f"{CLIENTS} clients under the 2 MiB of the smallest value")
            per_client = int(overload * capacity) // CLIENTS
            single = _single_client(int(srv.info["port"]), 4 if opts.quick else 16)
            raw_server = RawServer(CLIENTS, procs)
            try:
                ph = _run_phases(int(srv.info["port"]), srv.proc.pid, budget, page, per_client, steady_s, procs,
                                 windows, lambda: raw_server.gbps(raw_seconds))
            finally:
                raw_server.close()
            a, b, wall_a, wall_b = ph.steady, ph.overload, ph.wall_steady_s, ph.wall_overload_s
            moved_a = sum(s.bytes_put + s.bytes_got for s in a)
            a_corrupt, a_lost = sum(s.corrupt for s in a), sum(s.lost for s in a)
        finally:
            rc = srv.stop()
    # the machine is shared and its speed drifts: the limit is measured between the steady windows
    # (before the first, after each), and the ratio uses their median (each, and the mean, reported)
    raws = [x for x in ph.raw_socket_gbps if x is not None]
    raw = statistics.median(raws) if raws else None
    put_lat = [x for s in a for x in s.put_lat]
    get_lat = [x for s in a for x in s.get_lat]
    lookup_lat = [x for s in a for x in s.lookup_lat]
    all_lat = put_lat + get_lat + lookup_lat
    tput = gbps(moved_a, wall_a) if wall_a > 0 else None
    results: dict[str, Any] = {
        "throughput_gbps": round(tput, 4) if tput else None,
        "throughput_vs_raw_socket": ratio(tput, raw),
        "single_client_gbps": round(single, 4),
        "single_client_vs_raw_socket": ratio(single, raw),
        "server_cpu_s_per_gb_steady": round(ph.server_cpu_steady_s / (moved_a / 1e9), 4) if moved_a else None,
        "client_cpu_s_per_gb_steady": round(ph.client_cpu_steady_s / (moved_a / 1e9), 4) if moved_a else None,
        "p50_ms": _pct(all_lat, 50), "p99_ms": _pct(all_lat, 99),
        "put_p50_ms": _pct(put_lat, 50), "put_p99_ms": _pct(put_lat, 99),
        "get_p50_ms": _pct(get_lat, 50), "get_p99_ms": _pct(get_lat, 99),
        "lookup_p50_ms": _pct(lookup_lat, 50), "lookup_p99_ms": _pct(lookup_lat, 99),
        "ops_steady": len(all_lat),
        "lost_or_corrupt": a_corrupt + a_lost + sum(s.corrupt for s in b),
        "server_peak_rss_bytes": srv.peak_rss,
        "peak_memory_vs_capacity": ratio(srv.peak_rss, capacity),
        "overload_bytes_written": sum(s.bytes_put for s in b),
        "overload_write_vs_capacity": ratio(sum(s.bytes_put for s in b), capacity),
        "overload_gbps": round(gbps(sum(s.bytes_put + s.bytes_got for s in b), wall_b), 4),
        "overload_evicted_values": sum(s.evicted for s in b),
        "overload_values_checked": sum(len(s.get_lat) for s in b),
        "rejected_puts": sum(s.rejected for s in a) + sum(s.rejected for s in b),
        "client_errors": [e for s in a + b for e in s.errors][:10],
        "server_exit_code": rc,
        "steady_wall_s": round(wall_a, 3),
    }
    cond.update(clients=CLIENTS, capacity_bytes=capacity, host_capacity_bytes=srv.info["host_capacity"],
                      disk_capacity_bytes=srv.info["disk_capacity"], page_bytes=srv.info["page_bytes"],
                      inflight_bytes=inflight, overload_factor=overload,
                      value_sizes=f"2-{steady_value_max(budget, page) / MiB:g} MiB uniform (steady: each client's "
                      "values within 80% of the host pool / 16, room made before each put), 2-32 MiB (overload)",
                      mix="40% put, 45% get, 15% lookup",
                      steady_s=steady_s, link="tcp 127.0.0.1", client_processes=procs, server_io_threads=io_threads,
                      threads_per_process=CLIENTS // procs)
    one_stream = raw_socket_gbps(32 * MiB, trials=5)
    limits = {"raw_socket_gbps": round(raw, 4) if raw else None,
              "raw_socket_kind": f"raw socket server, {CLIENTS} clients in {procs} processes, same mix and sizes, "
                                 "sockets tuned like kvport's (protocol.net.tune)",
              "raw_single_stream_gbps": round(one_stream, 4) if one_stream else None,
              "raw_socket_gbps_mean": round(sum(raws) / len(raws), 4) if raws else None,
              "raw_socket_gbps_each": [round(x, 4) if x else None for x in ph.raw_socket_gbps],
              "raw_socket_gbps_min": round(min(raws), 4) if raws else None,
              "raw_socket_gbps_max": round(max(raws), 4) if raws else None}
    return finish(Report("server", cond, limits, results))
