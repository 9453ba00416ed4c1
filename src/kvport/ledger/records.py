"""The ledger's records, as it hands them out: leases, pins, moves, a block's whole record, leak
reports, transfers; and what each record costs in memory (so that caps are charged before anything
is recorded) and the transfer id that names a hand-off in both ledgers."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from kvport.ledger.states import BlockState, Move, Owner
from kvport.lifetime import Lifetime

# what one record takes at most in this process (CPython 3.11, tracemalloc), worst case a block's own
# table grown for it: a lease 230-250 B and 41-170 B per block it holds; a pin 170-272 B
LEASE_BYTES = 256
LEASE_KEY_BYTES = 192
PIN_BYTES = 320


@dataclass(frozen=True, slots=True)
class Lease:
    """A reader's hold on ``keys`` until ``expires_at`` (or release)."""

    keys: tuple[bytes, ...]
    holder: Owner
    lease_id: int
    expires_at: float
    since: float = 0.0
    account: str = ""  # who is charged for it (the holder's name unless the caller named another)

    @property
    def key(self) -> bytes:
        return self.keys[0]


@dataclass(frozen=True, slots=True)
class Pin:
    """One holder's pin on a block: taken ``count`` times, last renewed at ``since``."""

    key: bytes
    holder: Owner
    count: int
    reason: str
    since: float
    expires_at: float | None  # None: until unpinned


@dataclass(frozen=True, slots=True)
class MoveRecord:
    seq: int
    at: float
    key: bytes
    move: Move
    state_from: BlockState | None
    state_to: BlockState
    owner_from: Owner | None
    owner_to: Owner | None
    tid: str | None = None  # the transfer id, when the move is part of one
    lifetime: Lifetime | None = None  # a hand-off to the pool names the block's lifetime class


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """Everything the ledger knows of one block (``kvport inspect --owners``)."""

    key: bytes
    state: BlockState
    owner: Owner
    since: float  # time of its last move
    origin: Owner | None  # who handed it here (a peer's engine, a pool client), if anyone
    tid: str | None
    lifetime: Lifetime | None
    pins: tuple[Pin, ...]
    leases: tuple[Lease, ...]


@dataclass(frozen=True, slots=True)
class LeakReport:
    """Blocks whose owner is gone, pins whose holder is gone or whose TTL passed, leases past their
    TTL that nobody reaped."""

    orphaned: tuple[tuple[bytes, Owner], ...]
    stale_pins: tuple[Pin, ...]
    expired_leases: tuple[Lease, ...]

    @property
    def clean(self) -> bool:
        return not (self.orphaned or self.stale_pins or self.expired_leases)


@dataclass(frozen=True, slots=True)
class Expired:
    leases: int
    pins: int


@dataclass(frozen=True, slots=True)
class TransferRecord:
    tid: str
    keys: tuple[bytes, ...]
    src: Owner
    dst: Owner
    remote: bool  # dst is a peer: the commit hands the blocks out of this ledger


def lease_bytes(blocks: int) -> int:
    """What a lease on ``blocks`` blocks takes at most (:meth:`Ledger.footprint` charges it)."""
    return LEASE_BYTES + LEASE_KEY_BYTES * blocks


def new_tid() -> str:
    """A transfer id unique across processes (it names the transfer in both ledgers)."""
    return secrets.token_hex(8)


__all__ = ["LEASE_BYTES", "LEASE_KEY_BYTES", "PIN_BYTES", "BlockRecord", "Expired", "LeakReport", "Lease", "MoveRecord",
           "Pin", "TransferRecord", "lease_bytes", "new_tid"]
