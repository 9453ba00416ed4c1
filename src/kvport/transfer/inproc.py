"""In-process transport pair for tests: a bounded byte pipe per direction (threads, no sockets).

``capacity`` bounds the bytes buffered per direction, so a reader that stops reading makes the
writer block and then time out, like a full socket buffer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kvport.errors import PeerError
from kvport.protocol.transport import Buffer, as_byte_views


class _Pipe:
    def __init__(self, capacity: int) -> None:
        self.buf = bytearray()
        self.capacity = capacity
        self.closed = False
        self.cond = threading.Condition()

    def write(self, views: list[memoryview], timeout: float | None, name: str) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            for v in views:
                off = 0
                while off < v.nbytes:
                    while len(self.buf) >= self.capacity and not self.closed:
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            raise PeerError(f"{name}: send timed out (peer stopped reading)")
                        self.cond.wait(left)
                    if self.closed:
                        raise PeerError(f"{name}: connection closed")
                    n = min(v.nbytes - off, self.capacity - len(self.buf))
                    self.buf += v[off : off + n]
                    off += n
                    self.cond.notify_all()

    def read_into(self, views: list[memoryview], timeout: float | None, name: str) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            for v in views:
                off = 0
                while off < v.nbytes:
                    while not self.buf:
                        if self.closed:
                            raise PeerError(f"{name}: connection closed by peer mid-frame")
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            raise PeerError(f"{name}: receive timed out")
                        self.cond.wait(left)
                    n = min(v.nbytes - off, len(self.buf))
                    v[off : off + n] = self.buf[:n]
                    del self.buf[:n]
                    off += n
                    self.cond.notify_all()


class InprocTransport:
    def __init__(self, rx: _Pipe, tx: _Pipe, timeout_s: float | None, name: str) -> None:
        self._rx, self._tx = rx, tx
        self.timeout_s = timeout_s
        self.name = name

    def send(self, parts: Sequence[Buffer]) -> None:
        self._tx.write(as_byte_views(parts), self.timeout_s, self.name)

    def recv_into(self, parts: Sequence[memoryview]) -> None:
        self._rx.read_into(as_byte_views(parts), self.timeout_s, self.name)

    def readable(self, timeout: float) -> bool:
        with self._rx.cond:
            if not self._rx.buf and not self._rx.closed:
                self._rx.cond.wait(max(0.0, timeout))
            return bool(self._rx.buf) or self._rx.closed

    def close(self) -> None:
        for p in (self._rx, self._tx):
            with p.cond:
                p.closed = True
                p.cond.notify_all()


def pair(capacity: int = 8 << 20, timeout_s: float | None = 30.0) -> tuple[InprocTransport, InprocTransport]:
    a, b = _Pipe(capacity), _Pipe(capacity)
    return InprocTransport(a, b, timeout_s, "inproc-a"), InprocTransport(b, a, timeout_s, "inproc-b")
