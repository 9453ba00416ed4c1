"""The loopback limit of a many-client server: a raw socket server and its clients, no kvport.

Measured in the same run as ``kvport bench server``, which compares the kvport server with it. The
server answers a fixed 9-byte head (op u8: 1 put, 2 get, 3 ping | size u64, little-endian) with one
byte (put, ping) or ``size`` bytes from the connection's reused buffer (get).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import socket
import threading
import time
from typing import Any

from kvport.evidence.timing import gbps
from kvport.protocol.net import tune

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
