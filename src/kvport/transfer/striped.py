"""Striping one byte stream over several transports (e.g. TCP connections) for one transfer.

Stream byte ``o`` travels on transport ``(o // stripe_bytes) % n``; both ends count offsets the
same way, so message boundaries never matter::

    offset:  [0, S)   [S, 2S)   [2S, 3S)  ...   [nS, (n+1)S)
    conn:      0        1         2       ...        0

``send``/``recv_into`` cut the caller's buffers at stripe boundaries (memoryview slices, no copy)
and drive every transport in parallel from a small pool of threads (the syscalls release the GIL).
Connections are set up by :func:`kvport.transfer.tcp.connect` / ``TcpListener.accept`` with
``streams=n``: each announces its stripe index and a session token first.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvport.errors import ConfigError
from kvport.protocol.transport import Buffer, Transport, as_byte_views


def split_stream(views: Sequence[memoryview], start: int, stripe: int, n: int) -> list[list[memoryview]]:
    """Per-transport view lists for the stream bytes ``[start, start + total)``."""
    out: list[list[memoryview]] = [[] for _ in range(n)]
    off = start
    for v in views:
        pos = 0
        while pos < v.nbytes:
            k = min(v.nbytes - pos, stripe - off % stripe)
            out[(off // stripe) % n].append(v[pos : pos + k])
            pos += k
            off += k
    return out


class StripedTransport:
    def __init__(self, transports: Sequence[Transport], stripe_bytes: int = 1 << 20) -> None:
        if not transports or stripe_bytes <= 0:
            raise ConfigError("striping needs at least one transport and a positive stripe size")
        self.ts = list(transports)
        self.stripe = stripe_bytes
        self.name = f"{self.ts[0].name}x{len(self.ts)}"
        self._tx_off = 0
        self._rx_off = 0
        self._tx_pool = ThreadPoolExecutor(len(self.ts), thread_name_prefix="kvport-stripe-tx")
        self._rx_pool = ThreadPoolExecutor(len(self.ts), thread_name_prefix="kvport-stripe-rx")

    def _run(self, pool: ThreadPoolExecutor, per: list[list[memoryview]], recv: bool) -> None:
        jobs = [(t, p) for t, p in zip(self.ts, per, strict=True) if p]
        if len(jobs) == 1:
            t, p = jobs[0]
            (t.recv_into if recv else t.send)(p)
            return
        futs = [pool.submit(t.recv_into if recv else t.send, p) for t, p in jobs]
        for f in futs:
            f.result()  # re-raises the first PeerError

    def send(self, parts: Sequence[Buffer]) -> None:
        views = as_byte_views(parts)
        per = split_stream(views, self._tx_off, self.stripe, len(self.ts))
        self._tx_off += sum(v.nbytes for v in views)
        self._run(self._tx_pool, per, recv=False)

    def recv_into(self, parts: Sequence[memoryview]) -> None:
        views = as_byte_views(parts)
        per = split_stream(views, self._rx_off, self.stripe, len(self.ts))
        self._rx_off += sum(v.nbytes for v in views)
        self._run(self._rx_pool, per, recv=True)

    def readable(self, timeout: float) -> bool:
        return self.ts[(self._rx_off // self.stripe) % len(self.ts)].readable(timeout)

    def close(self) -> None:
        for t in self.ts:
            t.close()
        self._tx_pool.shutdown(wait=False)
        self._rx_pool.shutdown(wait=False)
