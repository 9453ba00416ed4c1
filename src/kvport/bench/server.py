"""``kvport bench server``: the shared tier under 16 concurrent loopback clients, next to a raw socket.

One real ``kvport serve`` child process (host + disk tiers) and, in the same run:

- limit: :func:`kvport.bench.limits.raw_socket_gbps` (one Python TCP stream, recv_into a reused
  buffer, second process) for the largest value size, measured before and after the server run
  (the ratio uses their mean: the shared machine's load drifts);
- phase A (steady): 16 clients (threads in 4 processes: one process of 16 threads loses much of
  its CPU to GIL convoys), each a :class:`RemoteTier` with one connection, a mix of
  PUT (2-32 MiB), GET of its own earlier values, and LOOKUP of its key chain; each client's working
  set is bounded so everything fits the host pool: a GET miss here is a *lost* value;
- phase B (overload): the same clients write twice the capacity; the server demotes and drops,
  and its RSS (sampled every 20 ms via psutil over the whole run) is compared with ``--capacity``.

For diagnosis beside the required fields: ``single_client_gbps`` (one client, sequential 32 MiB
PUT+GET, before the phases) and ``server_cpu_s_per_gb_steady`` (server CPU seconds per GB moved in
phase A, less sensitive to other load on the machine than wall-clock throughput) with its client
counterpart ``client_cpu_s_per_gb_steady`` (all client processes, integrity checks included).

Integrity: every value read is compared with what was written (values are slices of one random
pool at known offsets). ``lost_or_corrupt`` = corrupt reads (both phases) + phase-A misses.
Throughput = (bytes put + bytes got) / wall time of phase A, both directions summed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from kvport.bench.harness import Report, SuiteOptions, conditions, finish, gbps, ratio
from kvport.bench.limits import raw_socket_gbps
from kvport.errors import BlockNotFoundError, KVPortError
from kvport.server.client import RemoteTier
from kvport.server.limits import Rejected
from kvport.server.pool import ClientConfig

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

    def __init__(self, idx: int, port: int, pool: np.ndarray, budget: int, seed: int) -> None:
        self.idx = idx
        self.tier = RemoteTier(ClientConfig(port=port, pool_size=1, backpressure_timeout_s=30.0))
        self.pool = pool
        self.budget = budget
        self.rng = np.random.default_rng(seed)
        self.live: dict[bytes, tuple[int, int]] = {}
        self.order: list[bytes] = []
        self.seq = 0
        self.out = bytearray(32 * MiB)
        self.s = _Stats()

    def _new_value(self) -> tuple[bytes, int, int]:
        size = int(self.rng.integers(2 * MiB, 32 * MiB + 1))
        off = int(self.rng.integers(0, len(self.pool) - size))
        self.seq += 1
        return self.idx.to_bytes(4, "little") + self.seq.to_bytes(12, "little"), off, size

    def put(self, keep: bool) -> None:
        key, off, size = self._new_value()
        t0 = time.perf_counter()
        res = self.tier.put_value(key, self.pool[off : off + size])
        self.s.put_lat.append(time.perf_counter() - t0)
        if isinstance(res, Rejected):
            self.s.rejected += 1
            return
        self.s.bytes_put += size
        self.live[key] = (off, size)
        self.order.append(key)
        while keep and sum(sz for _, sz in self.live.values()) > self.budget:
            old = self.order.pop(0)
            self.tier.delete(old)
            del self.live[old]

    def get(self, key: bytes, must_exist: bool) -> None:
        off, size = self.live[key]
        t0 = time.perf_counter()
        try:
            n = self.tier.get_into(key, self.out)
        except BlockNotFoundError:
            self.s.get_lat.append(time.perf_counter() - t0)
            if must_exist:
                self.s.lost += 1
            else:
                self.s.evicted += 1
            return
        self.s.get_lat.append(time.perf_counter() - t0)
        self.s.bytes_got += n
        if n != size or not _equal(np.frombuffer(self.out, dtype=np.uint8, count=n), self.pool[off : off + size]):
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


def _client_thread(c: _Client, phase: str, arg: float) -> None:
    try:
        if phase == "steady":
            c.steady(arg)
        else:
            c.overload(int(arg))
    except (KVPortError, OSError) as exc:
        c.s.errors.append(f"{type(exc).__name__}: {exc}")


def _worker(idxs: list[int], port: int, pool: np.ndarray, budget: int, overload_bytes: int, steady_s: float,
            ready: Any, go: Any, t_go: Any, phase_b: Any, out: Any) -> None:
    """One client process: ``len(idxs)`` client threads through both phases; stats go to ``out``."""
    clients = [_Client(i, port, pool, budget, seed=i + 1) for i in idxs]
    ready.wait()
    go.wait()
    results: dict[str, Any] = {}
    for phase, arg in (("steady", t_go.value + steady_s), ("overload", float(overload_bytes))):
        if phase == "overload":
            phase_b.wait()
            for c in clients:
                c.s = _Stats()
        cpu0 = _cpu_s(os.getpid())
        threads = [threading.Thread(target=_client_thread, args=(c, phase, arg)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results[phase] = [c.s for c in clients]
        results[phase + "_cpu_s"] = _cpu_s(os.getpid()) - cpu0
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


def _run_phases(port: int, server_pid: int, budget: int, overload_bytes: int, steady_s: float, procs: int
                ) -> _Phases:
    """16 clients in ``procs`` forked processes (threads inside each; fewer GIL convoys than one
    process). Forked, so the random value pool is shared copy-on-write and nothing is re-imported."""
    pool = np.random.default_rng(0).integers(0, 256, _POOL_BYTES, dtype=np.uint8)
    ctx = mp.get_context("fork")
    ready, go, phase_b = ctx.Barrier(procs + 1), ctx.Event(), ctx.Barrier(procs + 1)
    t_go = ctx.Value("d", 0.0)
    out = ctx.Queue()
    groups = [list(range(CLIENTS))[i::procs] for i in range(procs)]
    workers = [ctx.Process(target=_worker, args=(g, port, pool, budget, overload_bytes, steady_s, ready, go, t_go,
                                                 phase_b, out), daemon=True) for g in groups]
    for w in workers:
        w.start()
    ready.wait(timeout=300)
    cpu0 = _cpu_s(server_pid)
    t_go.value = time.perf_counter()
    go.set()
    phase_b.wait(timeout=600)
    t_b = time.perf_counter()
    cpu_a = _cpu_s(server_pid) - cpu0
    wall_a = t_b - t_go.value
    got = [out.get(timeout=600) for _ in workers]
    wall_b = time.perf_counter() - t_b
    for w in workers:
        w.join(30)
    return _Phases([s for r in got for s in r["steady"]], [s for r in got for s in r["overload"]], wall_a, wall_b,
                   cpu_a, sum(float(r["steady_cpu_s"]) for r in got))


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
    capacity = int(opts.extra.get("capacity_bytes", (640 if opts.quick else 3072) * MiB))
    steady_s = float(opts.extra.get("steady_s", 4.0 if opts.quick else 20.0))
    inflight = int(opts.extra.get("inflight_bytes", (64 if opts.quick else 128) * MiB))
    overload = float(opts.extra.get("overload_factor", 2.0))  # write load, in multiples of the capacity
    cond = conditions()  # machine facts and load at the start
    raw_trials = 3 if opts.quick else 5
    raw_before = raw_socket_gbps(32 * MiB, trials=raw_trials)
    procs = int(opts.extra.get("client_processes", 4))
    with tempfile.TemporaryDirectory(prefix="kvport-bench-server-") as tmp:
        srv = _ServerProc(["--listen", "127.0.0.1:0", "--capacity", str(capacity), "--disk", str(Path(tmp) / "disk"),
                           "--disk-capacity", str(capacity // 2), "--max-value", "32MiB",
                           "--inflight", str(inflight), "--no-spill"])
        try:
            host_cap = int(srv.info["host_capacity"])
            budget = int(host_cap * 0.8) // CLIENTS
            per_client = int(overload * capacity) // CLIENTS
            single = _single_client(int(srv.info["port"]), 4 if opts.quick else 16)
            ph = _run_phases(int(srv.info["port"]), srv.proc.pid, budget, per_client, steady_s, procs)
            a, b, wall_a, wall_b = ph.steady, ph.overload, ph.wall_steady_s, ph.wall_overload_s
            moved_a = sum(s.bytes_put + s.bytes_got for s in a)
            a_corrupt, a_lost = sum(s.corrupt for s in a), sum(s.lost for s in a)
        finally:
            rc = srv.stop()
    # the machine is shared and its load drifts: the limit is measured before and after the server
    # run, and the ratio uses their mean (both are reported)
    raw_after = raw_socket_gbps(32 * MiB, trials=raw_trials)
    raws = [x for x in (raw_before, raw_after) if x is not None]
    raw = sum(raws) / len(raws) if raws else None
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
                      inflight_bytes=inflight, overload_factor=overload, value_sizes="2-32 MiB uniform",
                      mix="40% put, 45% get, 15% lookup",
                      steady_s=steady_s, link="tcp 127.0.0.1", client_processes=procs,
                      threads_per_process=CLIENTS // procs)
    limits = {"raw_socket_gbps": round(raw, 4) if raw else None,
              "raw_socket_gbps_before": round(raw_before, 4) if raw_before else None,
              "raw_socket_gbps_after": round(raw_after, 4) if raw_after else None}
    return finish(Report("server", cond, limits, results))
