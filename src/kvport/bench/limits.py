"""Physical limits, measured in the same run as the suite that compares against them.

Each function measures the raw machine path for the same bytes a suite moves: numpy memcpy into a
reused buffer, a raw Python socket between two processes, raw file write + cold read. Each returns
decimal GB/s (median of trials) and never guesses: on failure it returns None.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import random
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvport.bench.harness import gbps, time_it
from kvport.protocol.net import tune


def memcpy_gbps(nbytes: int, trials: int = 5) -> float:
    """np.copyto between two preallocated, pre-faulted buffers (one thread)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    t = time_it(lambda: np.copyto(dst, src), trials=trials)
    return gbps(nbytes, t.median_s)


_SOCK_CHUNK = 4 << 20


def _socket_sink(port: int, nbytes: int, rounds: int, tuned: bool = False) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    if tuned:
        tune(s)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_CHUNK)
    buf = bytearray(_SOCK_CHUNK)
    mv = memoryview(buf)
    for _ in range(rounds):
        left = nbytes
        while left:
            n = s.recv_into(mv[: min(left, _SOCK_CHUNK)])
            if not n:
                return
            left -= n
        s.sendall(b"k")
    s.close()


def raw_socket_gbps(nbytes: int, trials: int = 3, tuned: bool = False) -> float | None:
    """Plain Python TCP loopback: sendall of 4 MiB memoryview slices, recv_into a reused buffer,
    in a second process; one ack byte per round. The ceiling the TCP transport is compared with.
    ``tuned``: both sockets get kvport's own socket settings (:func:`kvport.protocol.net.tune`: on
    loopback a congestion control that does not pace), so a suite whose sockets are tuned compares
    with a limit tuned the same way; otherwise the system's defaults."""
    payload = np.ones(nbytes, dtype=np.uint8)
    mv = payload.data.cast("B")
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    port = ls.getsockname()[1]
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_socket_sink, args=(port, nbytes, trials + 1, tuned), daemon=True)
    proc.start()
    try:
        ls.settimeout(60)
        conn, _ = ls.accept()
        if tuned:
            tune(conn)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_CHUNK)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times: list[float] = []
        for r in range(trials + 1):
            t0 = time.perf_counter()
            for off in range(0, nbytes, _SOCK_CHUNK):
                conn.sendall(mv[off : off + _SOCK_CHUNK])
            if conn.recv(1) != b"k":
                return None
            if r:
                times.append(time.perf_counter() - t0)
        conn.close()
        times.sort()
        return gbps(nbytes, times[len(times) // 2])
    except OSError:
        return None
    finally:
        ls.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def drop_file_cache(path: str | Path) -> None:
    """Ask the kernel to drop a file's pages (posix_fadvise DONTNEED) so the next read is cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_disk_gbps(folder: str | Path, nbytes: int, trials: int = 3, fsync: bool = False) -> dict[str, float]:
    """Raw file write (write of a reused buffer, optional fsync) and cold read (readinto after
    fadvise DONTNEED) of ``nbytes`` in ``folder``. Returns {"write_gbps", "read_gbps"}."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "kvport-raw-disk.bin"
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    w: list[float] = []
    r: list[float] = []
    try:
        for _ in range(trials):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            t0 = time.perf_counter()
            with open(path, "wb", buffering=0) as f:
                f.write(src.data)
                if fsync:
                    os.fsync(f.fileno())
            w.append(time.perf_counter() - t0)
            drop_file_cache(path)
            t0 = time.perf_counter()
            with open(path, "rb", buffering=0) as f:
                f.readinto(dst.data)
            r.append(time.perf_counter() - t0)
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    w.sort()
    r.sort()
    return {"write_gbps": gbps(nbytes, w[len(w) // 2]), "read_gbps": gbps(nbytes, r[len(r) // 2])}


def raw_redis_gbps(url: str, values: list[memoryview], trials: int = 3,
                   group_bytes: int = 8 << 20) -> dict[str, float | None]:
    """Raw redis-py (hiredis parser) SET and GET of ``values`` (each well under 512 MiB), against the
    server at ``url``: every combination of two command packers (redis-py's default, which with
    hiredis copies each value into the packed command, and the zero-copy pure-Python packer, which
    hands large values to the socket as they are) and two batchings (one pipeline for everything,
    and pipelines of about ``group_bytes`` of values one after another: a huge GET pipeline buffers
    the whole reply before handing any of it back). Returns the fastest per direction
    ({"set_gbps", "get_gbps"}: the ceiling the Redis tier is compared with) and each way
    ({"set_one_pipeline_gbps", "set_grouped_gbps", "set_copying_packer_gbps", ...}); None for a
    direction that failed. GETs carry no value, so the packer does not change them: they are timed
    with one client only (the best of two timings of the same commands would be a lucky draw, not
    a faster way)."""
    import redis

    from kvport.tiers.redis_tier import pipeline_groups, zero_copy_packer

    nbytes = sum(v.nbytes for v in values)
    names = [f"kvport-raw:{i}".encode() for i in range(len(values))]
    groups = pipeline_groups([v.nbytes for v in values], group_bytes)
    out: dict[str, float | None] = {"set_gbps": None, "get_gbps": None}
    ways = [(packer, how) for packer in ("copying", "zero_copy") for how in ("one", "grouped")]
    times: dict[str, list[float]] = {f"{d}_{p}_{h}": [] for d in ("set", "get") for p, h in ways
                                     if d == "set" or p == "zero_copy"}
    try:
        clients = {"copying": redis.Redis.from_url(url, socket_timeout=60),
                   "zero_copy": redis.Redis.from_url(url, socket_timeout=60, command_packer=zero_copy_packer())}
        for _ in range(trials + 1):
            for packer, how in ways:
                r = clients[packer]
                parts = [(0, len(values))] if how == "one" else groups
                r.delete(*names)
                t0 = time.perf_counter()
                for lo, hi in parts:
                    p = r.pipeline(transaction=False)
                    for k, v in zip(names[lo:hi], values[lo:hi], strict=True):
                        p.set(k, v)
                    p.execute()
                times[f"set_{packer}_{how}"].append(time.perf_counter() - t0)
                if packer != "zero_copy":
                    continue
                t0 = time.perf_counter()
                got_bytes = 0
                for lo, hi in parts:
                    p = r.pipeline(transaction=False)
                    for k in names[lo:hi]:
                        p.get(k)
                    got = p.execute()
                    got_bytes += sum(len(g) for g in got)
                    del got
                times[f"get_{packer}_{how}"].append(time.perf_counter() - t0)
                if got_bytes != nbytes:
                    return out
        clients["copying"].delete(*names)
        for c in clients.values():
            c.close()
    except redis.RedisError:
        return out
    med = {k: sorted(v[1:])[len(v[1:]) // 2] for k, v in times.items()}
    for d in ("set", "get"):
        packers = ("copying", "zero_copy") if d == "set" else ("zero_copy",)
        best = {h: min(med[f"{d}_{p}_{h}"] for p in packers) for h in ("one", "grouped")}
        out[f"{d}_one_pipeline_gbps"] = gbps(nbytes, best["one"])
        out[f"{d}_grouped_gbps"] = gbps(nbytes, best["grouped"])
        out[f"{d}_gbps"] = gbps(nbytes, min(best.values()))
    out["set_copying_packer_gbps"] = gbps(nbytes, min(med[f"set_copying_{h}"] for h in ("one", "grouped")))
    return out


# ---------------------------------------------------------------------- a raw socket server, many clients
_RAW_HEAD = 9  # op u8 (1 put, 2 get, 3 ping) | size u64


def _raw_serve_conn(c: socket.socket) -> None:
    buf = memoryview(bytearray(32 << 20))
    head = bytearray(_RAW_HEAD)
    try:
        while True:
            if c.recv_into(head, _RAW_HEAD, socket.MSG_WAITALL) < _RAW_HEAD:
                return
            op, size = head[0], int.from_bytes(head[1:], "little")
            if op == 1:  # put: the value into the connection's reused buffer, then a one-byte answer
                got = 0
                while got < size:
                    n = c.recv_into(buf[got:size])
                    if n == 0:
                        return
                    got += n
                c.sendall(b"k")
            elif op == 2:  # get: the value from that buffer
                c.sendall(buf[:size])
            else:
                c.sendall(b"k")
    except OSError:
        return


def _raw_server(port_q: Any) -> None:
    ls = socket.create_server(("127.0.0.1", 0), backlog=256)
    port_q.put(ls.getsockname()[1])
    while True:
        c, _ = ls.accept()
        tune(c)
        threading.Thread(target=_raw_serve_conn, args=(c,), daemon=True).start()


def _raw_client_proc(port: int, threads: int, seed: int, lo: int, hi: int, ready: Any, start: Any, deadline: Any,
                     out: Any) -> None:
    moved = [0] * threads

    def run(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        s = socket.create_connection(("127.0.0.1", port))
        tune(s)
        src = memoryview(bytearray(b"\x01" * hi))
        dst = memoryview(bytearray(hi))
        ready.release()  # connected, buffers faulted in: the clock starts only once every client is here
        start.wait()
        end = deadline.value
        while time.perf_counter() < end:
            x, size = rng.random(), rng.randint(lo, hi)
            if x < 0.40:
                s.sendall(b"\x01" + size.to_bytes(8, "little"))
                s.sendall(src[:size])
                s.recv(1)
            elif x < 0.85:
                s.sendall(b"\x02" + size.to_bytes(8, "little"))
                got = 0
                while got < size:
                    got += s.recv_into(dst[got:size])
            else:
                s.sendall(b"\x03" + bytes(8))
                s.recv(1)
                size = 0
            if time.perf_counter() <= end:
                moved[i] += size
        s.close()

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out.put(sum(moved))


class RawServer:
    """The loopback limit of a many-client server: a plain Python socket server (a thread per
    connection receiving into / sending from one reused buffer; no framing, no checksums, no store)
    and ``clients`` clients in ``procs`` processes doing the same mix as ``kvport bench server`` (40%
    PUT, 45% GET of ``lo..hi`` bytes, 15% one-byte pings), every socket tuned like kvport's. What a
    kvport server with the same concurrency on the same machine is compared with."""

    def __init__(self, clients: int = 16, procs: int = 4, lo: int = 2 << 20, hi: int = 32 << 20) -> None:
        self.clients, self.procs, self.lo, self.hi = clients, procs, lo, hi
        self._ctx = mp.get_context("spawn")
        q = self._ctx.Queue()
        self._srv = self._ctx.Process(target=_raw_server, args=(q,), daemon=True)
        self._srv.start()
        self.port = int(q.get(timeout=60))
        self._round = 0

    def gbps(self, seconds: float) -> float | None:
        """Bytes moved by the clients in ``seconds`` (after all connected), in GB/s; None on failure."""
        ctx = mp.get_context("fork")  # fast: the clients need nothing but sockets
        start, deadline, out = ctx.Event(), ctx.Value("d", 0.0), ctx.Queue()
        ready = ctx.Semaphore(0)
        per = [len(range(i, self.clients, self.procs)) for i in range(self.procs)]
        self._round += 1
        ps = [ctx.Process(target=_raw_client_proc, args=(self.port, n, self._round * 100 + i, self.lo, self.hi, ready,
                                                         start, deadline, out), daemon=True) for i, n in enumerate(per)]
        try:
            for p in ps:
                p.start()
            # on a busy 2-core machine forking and faulting in the buffers can take longer than a short
            # window: a fixed sleep once let the clock run out before any client had moved a byte (0 GB/s)
            if not all(ready.acquire(timeout=60) for _ in range(self.clients)):
                return None
            deadline.value = time.perf_counter() + seconds
            start.set()
            total = sum(int(out.get(timeout=seconds + 120)) for _ in ps)
        except (OSError, queue.Empty):
            return None
        finally:
            for p in ps:
                p.join(10)
                if p.is_alive():
                    p.kill()
        return gbps(total, seconds) if total > 0 else None  # nothing moved is a failed measurement, not a limit of 0

    def close(self) -> None:
        self._srv.kill()
        self._srv.join(5)
