"""Ledger: the only place that changes a block's owner, and the book of who reads and pins what.

Invariants (every public method keeps them, under one lock):

* a registered block has exactly one owner and one :class:`BlockState`; moves go through
  :func:`~kvport.ledger.states.transition` and are appended to :attr:`Ledger.history`, with the
  transfer id and the peer when ownership crosses processes;
* ownership only moves to an owner this ledger knows: the pool, a local owner (one that registered a
  block here, or :meth:`Ledger.add_owner`) or a peer (:meth:`Ledger.add_peer`, an owner in another
  process). A hand-off to anyone else is an :class:`UnknownPeerError` and changes nothing;
* a transfer owns its blocks between ``begin_transfer`` and ``commit_transfer`` / ``abort_transfer``:
  all blocks of a transfer move together, and a failed precondition moves none of them. When the
  destination is a peer, the commit is a hand-off across processes: this side records HANDED_OFF
  (the blocks leave this ledger) and the peer's ledger records :meth:`acquire` with the same id;
* readers hold **leases** (on one or more blocks, expire at ``since + ttl_s``) and **pins** (per
  holder: a count, a reason, since when, and an expiry); a block with a live pin or lease is not
  evictable and cannot be forgotten. Both lapse at their TTL: :meth:`expire` reaps them, and a
  holder that died loses them then, never later. Releasing a lapsed lease is a
  :class:`LeaseExpiredError` that changes nothing;
* every lease-block pair and pin is charged to an **account** (the holder's name unless the caller
  names another: the server charges the connection that asked) and to :meth:`Ledger.footprint`,
  the bytes its records take at most (``LEASE_BYTES`` + ``LEASE_KEY_BYTES`` per block, ``PIN_BYTES``;
  measured upper bounds, checked by a test), so that caps can be charged before anything is recorded;
* the clock is injected (``clock()`` returns seconds, monotonic), so tests control expiry.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field

from kvport.errors import IllegalMoveError, LeaseError, LeaseExpiredError, UnknownBlockError, UnknownPeerError
from kvport.ledger.records import (
    LEASE_KEY_BYTES,
    PIN_BYTES,
    BlockRecord,
    Expired,
    LeakReport,
    Lease,
    MoveRecord,
    Pin,
    TransferRecord,
    lease_bytes,
    new_tid,
)
from kvport.ledger.states import TERMINAL, BlockState, Move, Owner, OwnerKind, transition
from kvport.lifetime import Lifetime
from kvport.metrics import counter, gauge

_MOVES = counter("ledger_moves_total", "Ownership moves recorded by the ledger", ["move"])
_MOVE_COUNTS = {m: _MOVES.labels(m.value) for m in Move}  # one child per move, looked up once (every put moves)
_LEASES = counter("ledger_leases_total", "Leases granted")
_PINS = counter("ledger_pins_total", "Pins taken")
_EXPIRED = counter("ledger_expired_total", "Leases and pins reaped at their TTL", ["kind"])
_LEAKS = gauge("ledger_leaks", "Leaks found by the last leak report", ["kind"])

HISTORY_LIMIT = 100_000


@dataclass(slots=True)
class _PinState:
    count: int
    reason: str
    since: float
    expires_at: float | None
    account: str  # charged for it (whoever took it first)


@dataclass(slots=True)
class _Block:
    state: BlockState
    owner: Owner
    since: float
    origin: Owner | None = None
    tid: str | None = None
    lifetime: Lifetime | None = None
    pins: dict[Owner, _PinState] = field(default_factory=dict)
    leases: dict[int, Lease] = field(default_factory=dict)


class Ledger:
    def __init__(self, clock: Callable[[], float] = time.monotonic, history_limit: int = HISTORY_LIMIT,
                 owners: Iterable[Owner] = (), peers: Iterable[Owner] = ()) -> None:
        self.clock = clock
        self._blocks: dict[bytes, _Block] = {}
        self._transfers: dict[str, TransferRecord] = {}
        self._leases: dict[int, Lease] = {}
        self._owners: set[Owner] = {Owner.pool(), *owners}
        self._peers: set[Owner] = set(peers)
        self._history: deque[MoveRecord] = deque(maxlen=history_limit)
        self._seq = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self._held: dict[str, int] = {}  # lease-block pairs + pins per account (caps are charged from it)
        self._footprint = 0  # bytes the lease and pin records take at most
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ who is known
    def add_owner(self, owner: Owner) -> None:
        """A local owner (an engine in this process) that may receive blocks."""
        with self._lock:
            self._owners.add(owner)

    def add_peer(self, owner: Owner) -> None:
        """An owner in another process (the other end of a transfer) that may receive blocks."""
        if owner.kind is OwnerKind.TRANSFER:
            raise IllegalMoveError("a transfer is not a peer")
        with self._lock:
            self._peers.add(owner)

    def drop_peer(self, owner: Owner) -> None:
        with self._lock:
            self._peers.discard(owner)

    def _check_dst(self, dst: Owner) -> bool:
        """True when ``dst`` is a peer (remote); UnknownPeerError when it is not known at all."""
        if dst.kind is OwnerKind.TRANSFER:
            raise IllegalMoveError("a block moves to an engine or the pool; transfers use begin_transfer")
        if dst in self._peers and dst not in self._owners:
            return True
        if dst.kind is OwnerKind.POOL or dst in self._owners:
            return False
        raise UnknownPeerError(f"{dst} is neither a local owner nor a known peer of this ledger")

    # ------------------------------------------------------------------ internals
    def _get(self, key: bytes) -> _Block:
        b = self._blocks.get(key)
        if b is None:
            raise UnknownBlockError(f"ledger has no block {key.hex()}")
        return b

    def _record(self, key: bytes, move: Move, before: BlockState | None, after: BlockState,
                owner_from: Owner | None, owner_to: Owner | None, tid: str | None = None,
                lifetime: Lifetime | None = None) -> None:
        self._history.append(MoveRecord(next(self._seq), self.clock(), key, move, before, after, owner_from,
                                        owner_to, tid, lifetime))
        _MOVE_COUNTS[move].inc()

    def _create(self, key: bytes, owner: Owner, move: Move = Move.REGISTER, origin: Owner | None = None,
                tid: str | None = None, lifetime: Lifetime | None = None) -> _Block:
        b = _Block(BlockState.ALLOCATED, owner, self.clock(), origin, tid, lifetime)
        self._blocks[key] = b
        self._owners.add(owner)
        if move is Move.ACQUIRE:
            b.state = BlockState.COMMITTED
            self._record(key, move, None, b.state, origin, owner, tid, lifetime)
        else:
            self._record(key, move, None, b.state, None, owner, tid, lifetime)
        return b

    def _move(self, key: bytes, b: _Block, move: Move, new_owner: Owner | None, tid: str | None = None) -> None:
        """The one place a block's state/owner changes (plus its recorded history entry)."""
        before, old_owner = b.state, b.owner
        after = transition(before, move)
        if after in TERMINAL:
            del self._blocks[key]
            for lease in list(b.leases.values()):  # a lease on a block that left holds nothing
                self._drop_lease_key(lease, key)
            for p in b.pins.values():
                self._charge(p.account, -1, -PIN_BYTES)
        else:
            b.state = after
            b.since = self.clock()
            if new_owner is not None:
                b.owner = new_owner
            if tid is not None:
                b.tid = tid
        self._record(key, move, before, after, old_owner, new_owner if new_owner is not None else old_owner,
                     tid, b.lifetime)

    def _blocked(self, b: _Block, now: float) -> str | None:
        if any(p.expires_at is None or p.expires_at > now for p in b.pins.values()):
            return "pinned"
        if any(lease.expires_at > now for lease in b.leases.values()):
            return "leased"
        return None

    # ------------------------------------------------------------------ ownership
    def register(self, key: bytes, owner: Owner, *, committed: bool = True, lifetime: Lifetime | None = None,
                 origin: Owner | None = None) -> None:
        """Record a new block owned by ``owner`` (COMMITTED, or ALLOCATED while being written).
        A block owned by the pool is SHARED; ``origin`` names who handed it to the pool (a client)
        and ``lifetime`` its class. Registering a known block is an IllegalMoveError (one owner)."""
        if owner.kind in (OwnerKind.TRANSFER, OwnerKind.CLIENT):
            raise IllegalMoveError("a block is registered by an engine or the pool; transfers use begin_transfer")
        with self._lock:
            if key in self._blocks:
                raise IllegalMoveError(f"block {key.hex()} already has owner {self._blocks[key].owner}")
            b = self._create(key, owner, origin=origin, lifetime=lifetime)
            if committed:
                self._move(key, b, Move.COMMIT, None)
                if owner.kind is OwnerKind.POOL:
                    self._move(key, b, Move.SHARE, None)

    def acquire(self, keys: Iterable[bytes], owner: Owner, src: Owner, tid: str) -> None:
        """A peer's transfer ``tid`` committed here: ``owner`` now holds ``keys`` (recorded ACQUIRE
        from ``src``). All or nothing: a key already owned here is a second owner (IllegalMoveError),
        ``src`` must be a known peer (UnknownPeerError); nothing changes then."""
        ks = tuple(keys)
        with self._lock:
            if src not in self._peers:
                raise UnknownPeerError(f"{src} is not a known peer of this ledger")
            if owner.kind in (OwnerKind.TRANSFER, OwnerKind.CLIENT):
                raise IllegalMoveError(f"{owner} cannot own blocks")
            if len(set(ks)) != len(ks):
                raise IllegalMoveError("a transfer names a block twice")
            for k in ks:
                if k in self._blocks:
                    raise IllegalMoveError(f"block {k.hex()} already has owner {self._blocks[k].owner}")
            for k in ks:
                self._create(k, owner, Move.ACQUIRE, origin=src, tid=tid)

    def commit(self, key: bytes, owner: Owner) -> None:
        """ALLOCATED -> COMMITTED (or SHARED for the pool) by its owner."""
        with self._lock:
            b = self._get(key)
            if b.owner != owner:
                raise IllegalMoveError(f"{owner} commits block {key.hex()} owned by {b.owner}")
            self._move(key, b, Move.COMMIT, None)
            if owner.kind is OwnerKind.POOL:
                self._move(key, b, Move.SHARE, None)

    def hand_off(self, key: bytes, src: Owner, dst: Owner, *, lifetime: Lifetime | None = None) -> None:
        """Explicit, recorded change of owner ``src`` -> ``dst`` (local, or the pool: SHARED)."""
        with self._lock:
            if self._check_dst(dst):
                raise IllegalMoveError(f"{dst} is a peer in another process: hand blocks to it with a transfer")
            b = self._get(key)
            if b.owner != src:
                raise IllegalMoveError(f"{src} hands off block {key.hex()} owned by {b.owner}")
            if lifetime is not None:
                b.lifetime = lifetime
            self._move(key, b, Move.SHARE if dst.kind is OwnerKind.POOL else Move.HAND_OFF, dst)

    def begin_transfer(self, keys: Iterable[bytes], src: Owner, dst: Owner, tid: str | None = None) -> str:
        """Move every block from ``src`` to a new transfer owner; returns its transfer id (``tid``, or a
        new one unique across processes). All or nothing: one block not COMMITTED by ``src``, or a
        ``dst`` this ledger does not know, moves none."""
        ks = tuple(keys)
        with self._lock:
            remote = self._check_dst(dst)
            tid = new_tid() if tid is None else tid
            if tid in self._transfers:
                raise IllegalMoveError(f"transfer {tid!r} is already open")
            for k in ks:
                b = self._get(k)
                if b.owner != src or b.state is not BlockState.COMMITTED:
                    raise IllegalMoveError(f"block {k.hex()} is {b.state.value} owned by {b.owner}, not {src}")
            towner = Owner.transfer(tid)
            for k in ks:
                self._move(k, self._blocks[k], Move.BEGIN_TRANSFER, towner, tid)
            self._transfers[tid] = TransferRecord(tid, ks, src, dst, remote)
            return tid

    def commit_transfer(self, tid: str) -> TransferRecord:
        """The receiver linked every block: they are ``dst``'s (here), or left for ``dst`` (a peer)."""
        with self._lock:
            t = self._pop_transfer(tid)
            if t.remote:
                move = Move.HANDED_OFF
            else:
                move = Move.COMMIT_TRANSFER_TO_POOL if t.dst.kind is OwnerKind.POOL else Move.COMMIT_TRANSFER
            for k in t.keys:
                self._move(k, self._blocks[k], move, t.dst, tid)
            return t

    def abort_transfer(self, tid: str) -> TransferRecord:
        with self._lock:
            t = self._pop_transfer(tid)
            for k in t.keys:
                self._move(k, self._blocks[k], Move.ABORT_TRANSFER, t.src, tid)
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
    def lease(self, key: bytes, holder: Owner, ttl_s: float, account: str | None = None) -> Lease:
        return self.lease_many((key,), holder, ttl_s, account)

    def lease_many(self, keys: Iterable[bytes], holder: Owner, ttl_s: float, account: str | None = None) -> Lease:
        """One lease on every block of ``keys`` (all known and readable, else nothing is leased),
        charged to ``account`` (default: the holder's name)."""
        ks = tuple(keys)
        if not (ttl_s > 0 and math.isfinite(ttl_s)):
            raise LeaseError(f"lease ttl must be positive, got {ttl_s}")
        with self._lock:
            for k in ks:
                b = self._get(k)
                if b.state in (BlockState.ALLOCATED, BlockState.IN_TRANSFER):
                    raise LeaseError(f"block {k.hex()} is {b.state.value}: not readable")
            now = self.clock()
            lease = Lease(ks, holder, next(self._lease_ids), now + ttl_s, now,
                          str(holder) if account is None else account)
            for k in ks:
                self._blocks[k].leases[lease.lease_id] = lease
            self._leases[lease.lease_id] = lease
            self._charge(lease.account, len(ks), lease_bytes(len(ks)))
            _LEASES.inc()
            return lease

    def release(self, lease: Lease) -> None:
        self.release_id(lease.lease_id, lease.holder)

    def release_id(self, lease_id: int, holder: Owner) -> Lease:
        """End a lease. Not held by ``holder`` (double release, someone else's): LeaseError; past its
        TTL: LeaseExpiredError (it had already lapsed; nothing changes, the reaper removes it)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.holder != holder:
                raise LeaseError(f"lease {lease_id} is not held by {holder}")
            if lease.expires_at <= self.clock():
                raise LeaseExpiredError(f"lease {lease_id} lapsed at its TTL")
            self._drop_lease(lease)
            return lease

    def _charge(self, account: str, n: int, nbytes: int) -> None:
        left = self._held.get(account, 0) + n
        if left > 0:
            self._held[account] = left
        else:
            self._held.pop(account, None)
        self._footprint += nbytes

    def held_by(self, account: str | Owner) -> int:
        """Lease-block pairs and pins charged to ``account`` now (a holder: its name, the default
        account); what a per-account cap is charged against."""
        return self._held.get(str(account), 0)

    def footprint(self) -> int:
        """Bytes the lease and pin records take at most (the per-record constants above)."""
        return self._footprint

    def _drop_lease(self, lease: Lease) -> None:
        if self._leases.pop(lease.lease_id, None) is not None:
            self._charge(lease.account, -len(lease.keys), -lease_bytes(len(lease.keys)))
        for k in lease.keys:
            b = self._blocks.get(k)
            if b is not None:
                b.leases.pop(lease.lease_id, None)

    def _drop_lease_key(self, lease: Lease, key: bytes) -> None:
        """A leased block left this ledger: the lease no longer holds it (dropped when it holds none)."""
        rest = tuple(k for k in lease.keys if k != key)
        if not rest:
            self._charge(lease.account, -len(lease.keys), -lease_bytes(len(lease.keys)))
            self._leases.pop(lease.lease_id, None)
            return
        self._charge(lease.account, len(rest) - len(lease.keys), (len(rest) - len(lease.keys)) * LEASE_KEY_BYTES)
        smaller = Lease(rest, lease.holder, lease.lease_id, lease.expires_at, lease.since, lease.account)
        self._leases[lease.lease_id] = smaller
        for k in rest:
            b = self._blocks.get(k)
            if b is not None:
                b.leases[lease.lease_id] = smaller

    def pin(self, key: bytes, holder: Owner, reason: str = "", ttl_s: float | None = None,
            account: str | None = None) -> Pin:
        """Pin ``key`` for ``holder`` (counted; a pin by the same holder renews reason, since and expiry).
        A new pin is charged to ``account`` (default: the holder's name); a renewed one stays where it was."""
        if ttl_s is not None and not (ttl_s > 0 and math.isfinite(ttl_s)):
            raise LeaseError(f"pin ttl must be positive, got {ttl_s}")
        with self._lock:
            b = self._get(key)
            now = self.clock()
            p = b.pins.get(holder)
            expires = None if ttl_s is None else now + ttl_s
            if p is None or (p.expires_at is not None and p.expires_at <= now):
                if p is None:
                    charged = str(holder) if account is None else account
                    self._charge(charged, 1, PIN_BYTES)
                else:
                    charged = p.account
                p = _PinState(1, reason, now, expires, charged)
                b.pins[holder] = p
            else:
                p.count += 1
                p.reason = reason or p.reason
                p.since = now
                p.expires_at = expires if expires is None or p.expires_at is None else max(expires, p.expires_at)
            _PINS.inc()
            return Pin(key, holder, p.count, p.reason, p.since, p.expires_at)

    def unpin(self, key: bytes, holder: Owner) -> None:
        with self._lock:
            b = self._get(key)
            p = b.pins.get(holder)
            if p is None or p.count <= 0:
                raise LeaseError(f"{holder} holds no pin on block {key.hex()}")
            if p.count == 1:
                del b.pins[holder]
                self._charge(p.account, -1, -PIN_BYTES)
            else:
                p.count -= 1

    def expire(self, now: float | None = None) -> Expired:
        """Reap every lease and pin past its TTL; returns how many of each."""
        t = self.clock() if now is None else now
        with self._lock:
            dead = [lease for lease in self._leases.values() if lease.expires_at <= t]
            for lease in dead:
                self._drop_lease(lease)
            pins = 0
            for b in self._blocks.values():
                gone = [h for h, p in b.pins.items() if p.expires_at is not None and p.expires_at <= t]
                for h in gone:
                    self._charge(b.pins.pop(h).account, -1, -PIN_BYTES)
                pins += len(gone)
        if dead:
            _EXPIRED.labels("lease").inc(len(dead))
        if pins:
            _EXPIRED.labels("pin").inc(pins)
        return Expired(len(dead), pins)

    # ------------------------------------------------------------------ queries
    def is_evictable(self, key: bytes, now: float | None = None) -> bool:
        """COMMITTED or SHARED, no live pin and no unexpired lease. Unknown blocks: UnknownBlockError."""
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

    def blocks(self) -> list[bytes]:
        """Every block this ledger has a record of (a snapshot)."""
        with self._lock:
            return list(self._blocks)

    def pins_of(self, key: bytes) -> dict[Owner, int]:
        with self._lock:
            return {h: p.count for h, p in self._get(key).pins.items()}

    def record(self, key: bytes) -> BlockRecord:
        with self._lock:
            b = self._get(key)
            pins = tuple(Pin(key, h, p.count, p.reason, p.since, p.expires_at) for h, p in b.pins.items())
            return BlockRecord(key, b.state, b.owner, b.since, b.origin, b.tid, b.lifetime, pins,
                               tuple(b.leases.values()))

    def leases(self) -> list[Lease]:
        with self._lock:
            return list(self._leases.values())

    def lease_of(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def pins(self) -> Iterator[Pin]:
        with self._lock:
            out = [Pin(k, h, p.count, p.reason, p.since, p.expires_at)
                   for k, b in self._blocks.items() for h, p in b.pins.items()]
        return iter(out)

    def transfer(self, tid: str) -> TransferRecord | None:
        return self._transfers.get(tid)

    @property
    def peers(self) -> frozenset[Owner]:
        return frozenset(self._peers)

    @property
    def history(self) -> tuple[MoveRecord, ...]:
        with self._lock:
            return tuple(self._history)

    def recent(self, n: int) -> list[MoveRecord]:
        """The newest ``n`` moves, oldest first (a copy of the tail only)."""
        with self._lock:
            h = self._history
            return [h[i] for i in range(max(0, len(h) - n), len(h))]

    def __len__(self) -> int:
        return len(self._blocks)

    def leak_report(self, now: float | None = None, live_owners: Collection[Owner] | None = None,
                    grace_s: float = 0.0) -> LeakReport:
        """Leaks as of ``now``: blocks whose owner is not live (the pool is always live; a transfer is
        live while its source or destination is; ``live_owners=None``: every owner is live), pins
        held by owners not live or past their TTL by more than ``grace_s``, leases past their TTL by
        more than ``grace_s`` and never reaped. Also sets the ``ledger_leaks`` gauge."""
        t = self.clock() if now is None else now
        live = None if live_owners is None else set(live_owners)

        def alive(o: Owner) -> bool:
            if live is None or o.kind is OwnerKind.POOL or o in live:
                return True
            if o.kind is OwnerKind.TRANSFER:
                tr = self._transfers.get(o.id)
                return tr is not None and (alive(tr.src) or alive(tr.dst))
            return False

        orphaned: list[tuple[bytes, Owner]] = []
        stale: list[Pin] = []
        with self._lock:
            for k, b in self._blocks.items():
                if not alive(b.owner):
                    orphaned.append((k, b.owner))
                stale.extend(Pin(k, h, p.count, p.reason, p.since, p.expires_at) for h, p in b.pins.items()
                             if not alive(h) or (p.expires_at is not None and p.expires_at + grace_s <= t))
            expired = [lease for lease in self._leases.values() if lease.expires_at + grace_s <= t]
        _LEAKS.labels("orphaned").set(len(orphaned))
        _LEAKS.labels("stale_pins").set(len(stale))
        _LEAKS.labels("expired_leases").set(len(expired))
        return LeakReport(tuple(orphaned), tuple(stale), tuple(expired))
