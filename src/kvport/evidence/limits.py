"""Physical limits, measured in the same run as the suite that compares against them.

Each function measures the raw machine path for the same bytes a suite moves: numpy memcpy into a
reused buffer, a raw Python socket between two processes, raw file write + cold read, raw redis-py
SET/GET. Each returns decimal GB/s (median of trials) and never guesses: on failure it returns None.
The many-client socket server limit is :class:`kvport.evidence.rawserver.RawServer`.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import time
from pathlib import Path

import numpy as np

from kvport.evidence.pagecache import drop_file_cache
from kvport.evidence.timing import gbps, time_it
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
