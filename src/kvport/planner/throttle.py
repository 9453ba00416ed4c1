"""A KV peer in another process that serves byte ranges over loopback TCP at a set rate.

Calibration and ``kvport bench planner`` use it as "the remote worker that holds the cached KV":
the KV bytes are uploaded once (unthrottled), then each ``get_into`` asks for a range and the peer
sends it through kvport's TCP transport wrapped in a token bucket
(:class:`kvport.transfer.RateLimited`), in chunks of about 5 ms of the rate so the link is smooth.

Request header (little endian, 25 bytes)::

    op u8 (1 PUT, 2 GET, 3 PING, 4 BYE) | offset u64 | length u64 | rate f64 (bytes/s, 0 = unlimited)

PUT is followed by ``length`` bytes; GET is answered by ``length`` bytes; PING by one byte. The peer
holds one preallocated buffer of ``capacity`` bytes and closes the connection on any range outside it
(no allocation ever follows a length read from the socket). It listens on 127.0.0.1, or (``link=``)
across an emulated link (:mod:`kvport.evidence.netlink`): this process listens in the link's first
namespace, the peer process runs in the second, and the connection is authenticated with a secret
made for it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import struct
import time

import numpy as np

from kvport.errors import PeerError, PlanInputError
from kvport.evidence.netlink import ShapedLink, in_netns
from kvport.transfer.ratelimit import RateLimited, TokenBucket
from kvport.transfer.tcp import TcpListener, TcpTransport, connect

_HDR = struct.Struct("<BQQd")
OP_PUT, OP_GET, OP_PING, OP_BYE = 1, 2, 3, 4
_MIN_CHUNK, _MAX_CHUNK = 64 << 10, 4 << 20


def chunk_for(rate: float) -> int:
    """Bytes per token-bucket take: ~5 ms of the rate, within [64 KiB, 4 MiB]."""
    return int(min(_MAX_CHUNK, max(_MIN_CHUNK, rate * 0.005)))


def _serve(port: int, capacity: int, host: str = "127.0.0.1", secret: bytes | None = None) -> None:  # the peer
    buf = np.zeros(capacity, dtype=np.uint8)
    mv = memoryview(buf.data).cast("B")
    t = connect(host, port, secret=secret, timeout_s=None)
    hdr = bytearray(_HDR.size)
    try:
        while True:
            t.recv_into([memoryview(hdr)])
            op, off, n, rate = _HDR.unpack(hdr)
            if op == OP_BYE:
                return
            if op == OP_PING:
                t.send([b"p"])
                continue
            if op not in (OP_PUT, OP_GET) or off + n > capacity or not rate >= 0:
                return  # protocol error: drop the connection
            if op == OP_PUT:
                t.recv_into([mv[off : off + n]])
                t.send([b"k"])
                continue
            if rate == 0:
                t.send([mv[off : off + n]])
                continue
            chunk = chunk_for(rate)
            lim = RateLimited(t, TokenBucket(rate, chunk))
            for pos in range(off, off + n, chunk):
                lim.send([mv[pos : min(off + n, pos + chunk)]])
    except PeerError:
        return
    finally:
        t.close()


class LoopbackPeer:
    """Owner of the peer process and the one connection to it. Not thread-safe: one request at a time."""

    def __init__(self, capacity: int, *, start_timeout_s: float = 60.0, link: ShapedLink | None = None) -> None:
        if capacity <= 0:
            raise PlanInputError(f"peer capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.link = link
        host, secret = ("127.0.0.1", None) if link is None else (link.addr[0], os.urandom(16))
        with contextlib.nullcontext() if link is None else in_netns(link.ns[0]):  # the socket stays there
            self._listener = TcpListener(host, 0, secret=secret, timeout_s=None)
        ctx = mp.get_context("spawn")
        self._proc = ctx.Process(target=_serve, args=(self._listener.port, capacity, host, secret), daemon=True)
        with contextlib.nullcontext() if link is None else in_netns(link.ns[1]):  # the peer process is host B
            self._proc.start()
        try:
            self._t: TcpTransport = self._accept(start_timeout_s)
        except BaseException:
            self._stop()
            raise
        self._hdr = bytearray(_HDR.size)
        self._ack = bytearray(1)

    def _accept(self, timeout_s: float) -> TcpTransport:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self._listener.accept(timeout_s=0.25)
            except PeerError:
                if not self._proc.is_alive() or time.monotonic() > deadline:
                    raise PeerError(f"KV peer process did not connect (exit code {self._proc.exitcode})") from None

    def _request(self, op: int, off: int, n: int, rate: float) -> None:
        if off < 0 or n < 0 or off + n > self.capacity:
            raise PlanInputError(f"range [{off}, {off + n}) outside the peer's {self.capacity} bytes")
        if not rate >= 0:
            raise PlanInputError(f"rate must be >= 0, got {rate}")
        _HDR.pack_into(self._hdr, 0, op, off, n, float(rate))
        self._t.send([self._hdr])

    def put(self, offset: int, data: memoryview | bytes | bytearray) -> None:
        view = memoryview(data).cast("B")
        self._request(OP_PUT, offset, view.nbytes, 0.0)
        self._t.send([view])
        self._t.recv_into([memoryview(self._ack)])

    def get_into(self, offset: int, out: memoryview, rate: float = 0.0) -> float:
        """Fill ``out`` with the peer's bytes at ``offset`` sent at ``rate`` bytes/s; returns seconds."""
        view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        t0 = time.perf_counter()
        self._request(OP_GET, offset, view.nbytes, rate)
        self._t.recv_into([view])
        return time.perf_counter() - t0

    def ping(self) -> float:
        t0 = time.perf_counter()
        self._request(OP_PING, 0, 0, 0.0)
        self._t.recv_into([memoryview(self._ack)])
        return time.perf_counter() - t0

    def _stop(self) -> None:
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._listener.close()

    def close(self) -> None:
        with contextlib.suppress(PeerError, PlanInputError):
            self._request(OP_BYE, 0, 0, 0.0)
        self._t.close()
        self._stop()

    def __enter__(self) -> LoopbackPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
