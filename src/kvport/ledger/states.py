"""Owners, block states and the one transition function.

Every block has exactly one owner at a time. Its state moves only through :func:`transition`::

    register(owner, committed=False)     register(owner) | acquire(from peer, tid)
              |                               |
          ALLOCATED ---commit---------> COMMITTED(owner) ---share---> SHARED(pool)
              |                          |    ^    |  hand_off (owner -> owner, recorded)
              |                 begin_transfer  |  |
              |                          v    |abort / commit (dst engine here)
              |                     IN_TRANSFER(src -> dst, tid) ---commit (dst pool)---> SHARED(pool)
              |                          |
              |                          +---commit (dst a peer in another process)---> HANDED_OFF
              +------ forget ------> FREED <---- forget ---- COMMITTED / SHARED

``FREED`` and ``HANDED_OFF`` are terminal: the record leaves this ledger (its history keeps the
move, with the transfer id and the peer). A block IN_TRANSFER cannot be forgotten or handed off;
pins and live leases block ``forget`` (checked by the ledger, which knows them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvport.errors import IllegalMoveError


class OwnerKind(enum.Enum):
    ENGINE = "engine"  # an engine instance (prefill / decode worker), here or in a peer process
    TRANSFER = "transfer"  # a transfer in flight: the block is neither the sender's nor the receiver's
    POOL = "pool"  # the shared pool (the tiered store); readers take leases
    CLIENT = "client"  # a client of the pool (tenant/instance): holds leases and pins, never blocks


@dataclass(frozen=True, slots=True)
class Owner:
    kind: OwnerKind
    id: str

    @classmethod
    def engine(cls, id: str) -> Owner:
        return cls(OwnerKind.ENGINE, id)

    @classmethod
    def pool(cls, id: str = "pool") -> Owner:
        return cls(OwnerKind.POOL, id)

    @classmethod
    def transfer(cls, id: str) -> Owner:
        return cls(OwnerKind.TRANSFER, id)

    @classmethod
    def client(cls, id: str) -> Owner:
        return cls(OwnerKind.CLIENT, id)

    @classmethod
    def parse(cls, text: str) -> Owner:
        """The inverse of ``str(owner)`` (``kind:id``), for owners named on the wire."""
        kind, sep, id = text.partition(":")
        known = {k.value: k for k in OwnerKind}
        if kind not in known or not sep or not id:
            raise IllegalMoveError(f"not an owner name: {text[:80]!r} (expected kind:id)")
        return cls(known[kind], id)

    def __str__(self) -> str:
        return f"{self.kind.value}:{self.id}"


class BlockState(enum.Enum):
    ALLOCATED = "allocated"
    COMMITTED = "committed"
    IN_TRANSFER = "in_transfer"
    SHARED = "shared"
    FREED = "freed"
    HANDED_OFF = "handed_off"


class Move(enum.Enum):
    REGISTER = "register"  # (new) -> ALLOCATED or COMMITTED
    ACQUIRE = "acquire"  # (new) -> COMMITTED: a peer's transfer committed here
    COMMIT = "commit"
    HAND_OFF = "hand_off"
    SHARE = "share"
    BEGIN_TRANSFER = "begin_transfer"
    COMMIT_TRANSFER = "commit_transfer"
    COMMIT_TRANSFER_TO_POOL = "commit_transfer_to_pool"
    HANDED_OFF = "handed_off"  # a transfer to a peer in another process committed: the block left
    ABORT_TRANSFER = "abort_transfer"
    FORGET = "forget"


_S = BlockState
_TABLE: dict[tuple[BlockState, Move], BlockState] = {
    (_S.ALLOCATED, Move.COMMIT): _S.COMMITTED,
    (_S.ALLOCATED, Move.FORGET): _S.FREED,
    (_S.COMMITTED, Move.HAND_OFF): _S.COMMITTED,
    (_S.COMMITTED, Move.SHARE): _S.SHARED,
    (_S.COMMITTED, Move.BEGIN_TRANSFER): _S.IN_TRANSFER,
    (_S.COMMITTED, Move.FORGET): _S.FREED,
    (_S.SHARED, Move.FORGET): _S.FREED,
    (_S.IN_TRANSFER, Move.COMMIT_TRANSFER): _S.COMMITTED,
    (_S.IN_TRANSFER, Move.COMMIT_TRANSFER_TO_POOL): _S.SHARED,
    (_S.IN_TRANSFER, Move.HANDED_OFF): _S.HANDED_OFF,
    (_S.IN_TRANSFER, Move.ABORT_TRANSFER): _S.COMMITTED,
}
TERMINAL = frozenset({BlockState.FREED, BlockState.HANDED_OFF})


def transition(state: BlockState, move: Move) -> BlockState:
    """The state after ``move``; IllegalMoveError for every pair not in the table above."""
    nxt = _TABLE.get((state, move))
    if nxt is None:
        raise IllegalMoveError(f"cannot {move.value} a block in state {state.value}")
    return nxt
