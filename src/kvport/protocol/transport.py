"""The transport interface: a reliable, ordered byte stream, blocking (the sync shell's side).

A transport moves bytes only; framing, checksums and credits live above it. ``send`` gathers from
several buffers (zero-copy iovecs where the transport allows), ``recv_into`` scatters into several
caller buffers and returns only when every one is full. Every OS error and every timeout surfaces
as :class:`~kvport.errors.PeerError` (the peer is gone, reset the connection, or stopped reading).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

Buffer = bytes | bytearray | memoryview


@runtime_checkable
class Transport(Protocol):
    name: str

    def send(self, parts: Sequence[Buffer]) -> None:
        """Send every byte of ``parts`` in order, or raise PeerError."""

    def recv_into(self, parts: Sequence[memoryview]) -> None:
        """Fill every buffer of ``parts`` completely, in order, or raise PeerError."""

    def readable(self, timeout: float) -> bool:
        """True when at least one byte (or EOF) can be read without blocking, within ``timeout``."""

    def close(self) -> None: ...


@runtime_checkable
class DescribedPayloads(Protocol):
    """A transport that can carry a frame's whole payload as descriptors of memory the peer has
    mapped (shared memory): :class:`~kvport.protocol.sync.FrameIO` offers it every payload.

    ``describe`` says whether it can (a plan, or None: send as plain stream bytes);
    ``send_described`` writes the frame head and the described payload with its checksums;
    ``recv_described_into`` copies and verifies a described payload into the caller's views and
    returns the failed chunk indexes, or None when the next bytes are not one such payload (nothing
    consumed; read them with ``recv_into``). The stream bytes are the same either way."""

    def describe(self, chunks: Sequence[Buffer], chunk_size: int) -> Any | None: ...

    def send_described(self, head: Buffer, plan: Any, digests: bytes) -> None: ...

    def recv_described_into(self, views: Sequence[memoryview], trailers: memoryview, chunk_size: int,
                            payload_len: int) -> list[int] | None: ...


def nbytes(parts: Sequence[Buffer]) -> int:
    return sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)


def as_byte_views(parts: Sequence[Buffer]) -> list[memoryview]:
    """Flat unsigned-byte views of ``parts``, empty ones dropped (hot path: called per batch of chunks,
    so a part that already is such a view is taken as it is)."""
    out: list[memoryview] = []
    for p in parts:
        mv = p if type(p) is memoryview else memoryview(p)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        if mv.nbytes:
            out.append(mv)
    return out


def advance(views: list[memoryview], i: int, n: int) -> int:
    """After a scatter/gather call moved ``n`` bytes starting at ``views[i]``: drop the views it
    finished, slice the partial one in place, and return the index of the first unfinished view."""
    while n:
        m = views[i].nbytes
        if n >= m:
            n -= m
            i += 1
        else:
            views[i] = views[i][n:]
            n = 0
    return i
