"""Ledger: the only place that changes a block's owner, and the book of who reads what.

Invariants (every public method keeps them, under one lock):

* a registered block has exactly one owner and one :class:`BlockState`; moves go through
  :func:`~kvport.ledger.states.transition` and are appended to :attr:`Ledger.history`;
* readers hold **leases** (expire at ``now + ttl_s``) or **pins** (counted per holder, no expiry);
  a block with a pin or an unexpired lease is not evictable and cannot be forgotten;
* a transfer owns its blocks between ``begin_transfer`` and ``commit_transfer`` / ``abort_transfer``:
  all blocks of a transfer move together, and a failed precondition moves none of them;
* the clock is injected (``clock()`` returns seconds, monotonic), so tests control expiry.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from kvport.errors import IllegalMoveError, LeaseError, UnknownBlockError
from kvport.ledger.states import BlockState, Move, Owner, OwnerKind, transition
from kvport.metrics import counter, gauge

_MOVES = counter("ledger_moves_total", "Ownership moves recorded by the ledger", ["move"])
_LEASES = counter("ledger_leases_total", "Leases granted")
_PINS = counter("ledger_pins_total", "Pins taken")
_LEAKS = gauge("ledger_leaks", "Leaks found by the last leak report", ["kind"])

HISTORY_LIMIT = 100_000


@dataclass(frozen=True, slots=True)
class Lease:
    key: bytes
    holder: Owner
    lease_id: int
    expires_at: float


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


@dataclass(frozen=True, slots=True)
class LeakReport:
    """Blocks whose owner is gone, pins whose holder is gone, leases past expiry and never released."""

    orphaned: tuple[tuple[bytes, Owner], ...]
    stale_pins: tuple[tuple[bytes, Owner], ...]
    expired_leases: tuple[Lease, ...]

    @property
    def clean(self) -> bool:
        return not (self.orphaned or self.stale_pins or self.expired_leases)


@dataclass(frozen=True, slots=True)
class TransferRecord:
    tid: str
    keys: tuple[bytes, ...]
    src: Owner
    dst: Owner


@dataclass(slots=True)
class _Block:
    state: BlockState
    owner: Owner
    pins: dict[Owner, int] = field(default_factory=dict)
    leases: dict[int, Lease] = field(default_factory=dict)


class Ledger:
    def __init__(self, clock: Callable[[], float] = time.monotonic, history_limit: int = HISTORY_LIMIT) -> None:
        self.clock = clock
        self._blocks: dict[bytes, _Block] = {}
        self._transfers: dict[str, TransferRecord] = {}
        self._history: deque[MoveRecord] = deque(maxlen=history_limit)
        self._seq = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self._tids = itertools.count(1)
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ internals
    def _get(self, key: bytes) -> _Block:
        b = self._blocks.get(key)
        if b is None:
            raise UnknownBlockError(f"ledger has no block {key.hex()}")
        return b

    def _record(self, key: bytes, move: Move, before: BlockState | None, after: BlockState,
                owner_from: Owner | None, owner_to: Owner | None) -> None:
        self._history.append(MoveRecord(next(self._seq), self.clock(), key, move, before, after, owner_from, owner_to))
        _MOVES.labels(move.value).inc()

    def _create(self, key: bytes, owner: Owner) -> _Block:
        b = _Block(BlockState.ALLOCATED, owner)
        self._blocks[key] = b
        self._record(key, Move.REGISTER, None, b.state, None, owner)
        return b

    def _move(self, key: bytes, b: _Block, move: Move, new_owner: Owner | None) -> None:
        """The one place a block's state/owner changes (plus its recorded history entry)."""
        before, old_owner = b.state, b.owner
        after = transition(before, move)
        if after is BlockState.FREED:
            del self._blocks[key]
        else:
            b.state = after
            if new_owner is not None:
                b.owner = new_owner
        self._record(key, move, before, after, old_owner, new_owner if new_owner is not None else old_owner)

    @staticmethod
    def _blocked(b: _Block, now: float) -> str | None:
        if b.pins:
            return "pinned"
        if any(lease.expires_at > now for lease in b.leases.values()):
            return "leased"
        return None

    # ------------------------------------------------------------------ ownership
    def register(self, key: bytes, owner: Owner, *, committed: bool = True) -> None:
        """Record a new block owned by ``owner`` (COMMITTED, or ALLOCATED while being written).
        A block owned by the pool is SHARED. Registering a known block is an IllegalMoveError."""
        if owner.kind is OwnerKind.TRANSFER:
            raise IllegalMoveError("a block is registered by an engine or the pool; transfers use begin_transfer")
        with self._lock:
            if key in self._blocks:
                raise IllegalMoveError(f"block {key.hex()} already has owner {self._blocks[key].owner}")
            b = self._create(key, owner)
            if committed:
                self._move(key, b, Move.COMMIT, None)
                if owner.kind is OwnerKind.POOL:
                    self._move(key, b, Move.SHARE, None)

    def commit(self, key: bytes, owner: Owner) -> None:
        """ALLOCATED -> COMMITTED (or SHARED for the pool) by its owner."""
        with self._lock:
            b = self._get(key)
            if b.owner != owner:
                raise IllegalMoveError(f"{owner} commits block {key.hex()} owned by {b.owner}")
            self._move(key, b, Move.COMMIT, None)
            if owner.kind is OwnerKind.POOL:
                self._move(key, b, Move.SHARE, None)

    def hand_off(self, key: bytes, src: Owner, dst: Owner) -> None:
        """Explicit, recorded change of owner ``src`` -> ``dst``; to the pool it becomes SHARED."""
        if dst.kind is OwnerKind.TRANSFER:
            raise IllegalMoveError("hand-off to a transfer: use begin_transfer")
        with self._lock:
            b = self._get(key)
            if b.owner != src:
                raise IllegalMoveError(f"{src} hands off block {key.hex()} owned by {b.owner}")
            self._move(key, b, Move.SHARE if dst.kind is OwnerKind.POOL else Move.HAND_OFF, dst)

    def begin_transfer(self, keys: Iterable[bytes], src: Owner, dst: Owner) -> str:
        """Move every block from ``src`` to a new transfer owner; returns its transfer id.
        All-or-nothing: one block not COMMITTED by ``src`` moves none."""
        ks = tuple(keys)
        if dst.kind is OwnerKind.TRANSFER:
            raise IllegalMoveError("a transfer's destination is an engine or the pool")
        with self._lock:
            for k in ks:
                b = self._get(k)
                if b.owner != src or b.state is not BlockState.COMMITTED:
                    raise IllegalMoveError(f"block {k.hex()} is {b.state.value} owned by {b.owner}, not {src}")
            tid = f"t{next(self._tids)}"
            towner = Owner.transfer(tid)
            for k in ks:
                self._move(k, self._blocks[k], Move.BEGIN_TRANSFER, towner)
            self._transfers[tid] = TransferRecord(tid, ks, src, dst)
            return tid

    def commit_transfer(self, tid: str) -> TransferRecord:
        with self._lock:
            t = self._pop_transfer(tid)
            move = Move.COMMIT_TRANSFER_TO_POOL if t.dst.kind is OwnerKind.POOL else Move.COMMIT_TRANSFER
            for k in t.keys:
                self._move(k, self._blocks[k], move, t.dst)
            return t

    def abort_transfer(self, tid: str) -> TransferRecord:
        with self._lock:
            t = self._pop_transfer(tid)
            for k in t.keys:
                self._move(k, self._blocks[k], Move.ABORT_TRANSFER, t.src)
            return t

    def _pop_transfer(self, tid: str) -> TransferRecord:
        t = self._transfers.pop(tid, None)
        if t is None:
            raise IllegalMoveError(f"no open transfer {tid!r}")
        return t

    def forget(self, key: bytes) -> None:
        """Drop the block's record (it was freed/evicted). Pinned, leased or in-transfer: IllegalMoveError."""
        with self._lock:
            b = self._get(key)
            why = self._blocked(b, self.clock())
            if why:
                raise IllegalMoveError(f"cannot forget block {key.hex()}: {why}")
            self._move(key, b, Move.FORGET, None)

    # ------------------------------------------------------------------ readers
    def lease(self, key: bytes, holder: Owner, ttl_s: float) -> Lease:
        if not ttl_s > 0:
            raise LeaseError(f"lease ttl must be positive, got {ttl_s}")
        with self._lock:
            b = self._get(key)
            if b.state in (BlockState.ALLOCATED, BlockState.IN_TRANSFER):
                raise LeaseError(f"block {key.hex()} is {b.state.value}: not readable")
            lease = Lease(key, holder, next(self._lease_ids), self.clock() + ttl_s)
            b.leases[lease.lease_id] = lease
            _LEASES.inc()
            return lease

    def release(self, lease: Lease) -> None:
        """End a lease (also after expiry). A lease not held (double release, wrong key) is a LeaseError."""
        with self._lock:
            b = self._blocks.get(lease.key)
            held = None if b is None else b.leases.get(lease.lease_id)
            if b is None or held is None or held.holder != lease.holder:
                raise LeaseError(f"lease {lease.lease_id} on {lease.key.hex()} is not held by {lease.holder}")
            del b.leases[lease.lease_id]

    def pin(self, key: bytes, holder: Owner) -> None:
        with self._lock:
            b = self._get(key)
            b.pins[holder] = b.pins.get(holder, 0) + 1
            _PINS.inc()

    def unpin(self, key: bytes, holder: Owner) -> None:
        with self._lock:
            b = self._get(key)
            n = b.pins.get(holder, 0)
            if n <= 0:
                raise LeaseError(f"{holder} holds no pin on block {key.hex()}")
            if n == 1:
                del b.pins[holder]
            else:
                b.pins[holder] = n - 1

    # ------------------------------------------------------------------ queries
    def is_evictable(self, key: bytes, now: float | None = None) -> bool:
        """COMMITTED or SHARED, no pin and no unexpired lease. Unknown blocks: UnknownBlockError."""
        with self._lock:
            b = self._get(key)
            if b.state not in (BlockState.COMMITTED, BlockState.SHARED):
                return False
            return self._blocked(b, self.clock() if now is None else now) is None

    def owner_of(self, key: bytes) -> Owner:
        with self._lock:
            return self._get(key).owner

    def state_of(self, key: bytes) -> BlockState:
        with self._lock:
            return self._get(key).state

    def knows(self, key: bytes) -> bool:
        return key in self._blocks

    def pins_of(self, key: bytes) -> dict[Owner, int]:
        with self._lock:
            return dict(self._get(key).pins)

    def transfer(self, tid: str) -> TransferRecord | None:
        return self._transfers.get(tid)

    @property
    def history(self) -> tuple[MoveRecord, ...]:
        with self._lock:
            return tuple(self._history)

    def __len__(self) -> int:
        return len(self._blocks)

    def leak_report(self, now: float | None = None, live_owners: Collection[Owner] = ()) -> LeakReport:
        """Leaks as of ``now``: blocks whose owner is not live (the pool is always live; a transfer is
        live while its source or destination is), pins held by owners not live, expired leases
        never released. Also sets the ``ledger_leaks`` gauge."""
        t = self.clock() if now is None else now
        live = set(live_owners)

        def alive(o: Owner) -> bool:
            if o.kind is OwnerKind.POOL or o in live:
                return True
            if o.kind is OwnerKind.TRANSFER:
                tr = self._transfers.get(o.id)
                return tr is not None and (alive(tr.src) or alive(tr.dst))
            return False

        orphaned: list[tuple[bytes, Owner]] = []
        stale: list[tuple[bytes, Owner]] = []
        expired: list[Lease] = []
        with self._lock:
            for k, b in self._blocks.items():
                if not alive(b.owner):
                    orphaned.append((k, b.owner))
                stale.extend((k, h) for h in b.pins if not alive(h))
                expired.extend(lease for lease in b.leases.values() if lease.expires_at <= t)
        _LEAKS.labels("orphaned").set(len(orphaned))
        _LEAKS.labels("stale_pins").set(len(stale))
        _LEAKS.labels("expired_leases").set(len(expired))
        return LeakReport(tuple(orphaned), tuple(stale), tuple(expired))
