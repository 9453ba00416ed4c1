"""The server's block catalog: what is stored where, for whom, and what may move. No I/O.

Every block is one :class:`Entry` under its *storage key* (tenant-salted). Entries sit in one LRU
order (oldest first); a hit moves a block to the back. A block is *movable* (may be demoted or
dropped) only while it has no pin and no live lease: readers hold leases, so a block is never
evicted under a reader.

Making room for a put (:meth:`Catalog.plan_put`) is a pure plan, applied by the caller after the
bytes moved::

    1. quota   the tenant's own oldest movable blocks are dropped until the new value fits its quota
    2. host    the oldest movable host blocks are demoted to disk (dropping the oldest movable disk
               blocks to make room there) or dropped when disk has no room; the value goes to host
    3. disk    when host cannot make room (pinned/leased, or the value is larger than host), the
               value goes straight to disk after dropping the oldest movable disk blocks
    4. else    Rejected(QUOTA | FULL, retry_after) -- nothing is buffered

Sizes are *charged* bytes (whole pages). Accounting invariants: ``host_used`` and ``disk_used`` are
the sums of entry sizes per place plus the room held for values in flight, and ``usage[t]`` the sum
over tenant ``t``'s entries; only :meth:`hold`, :meth:`unhold`, :meth:`add`, :meth:`move` and
:meth:`remove` change them.
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvport.errors import IllegalMoveError, LeaseError, UnknownBlockError
from kvport.server.limits import Rejected, RejectReason


class Place(enum.Enum):
    HOST = "host"
    DISK = "disk"


@dataclass(slots=True)
class Entry:
    tenant: str
    client_key: bytes
    size: int  # charged bytes (whole pages)
    place: Place
    length: int = 0  # the value's exact length
    checksums: bytes = b""  # the wire checksum of each page-sized chunk, as verified on PUT (may be empty)
    pins: int = 0
    leases: int = 0
    hits: int = 0

    @property
    def movable(self) -> bool:
        return self.pins == 0 and self.leases == 0


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: int
    tenant: str
    holder: int  # connection id: a closed connection releases its leases
    skeys: tuple[bytes, ...]
    expires_at: float


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a new value goes and what must happen first (in this order: drops, then demotes)."""

    place: Place
    drops: tuple[bytes, ...] = ()
    demotes: tuple[bytes, ...] = ()


@dataclass(slots=True)
class _Sim:
    host_used: int
    disk_used: int
    taken: set[bytes] = field(default_factory=set)
    drops: list[bytes] = field(default_factory=list)
    demotes: list[bytes] = field(default_factory=list)


class Catalog:
    def __init__(self, host_capacity: int, disk_capacity: int, retry_after_s: float = 0.05) -> None:
        self.host_capacity = host_capacity
        self.disk_capacity = disk_capacity
        self.retry_after_s = retry_after_s
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        self._leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count(1)
        self.host_used = 0
        self.disk_used = 0
        self.usage: dict[str, int] = {}
        self.blocks: dict[str, int] = {}

    # ------------------------------------------------------------ reads
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, skey: object) -> bool:
        return skey in self._entries

    def get(self, skey: bytes) -> Entry | None:
        return self._entries.get(skey)

    def items(self) -> Iterator[tuple[bytes, Entry]]:
        return iter(list(self._entries.items()))

    def hit(self, skey: bytes) -> None:
        e = self._entries[skey]
        e.hits += 1
        self._entries.move_to_end(skey)

    def leases(self) -> list[Lease]:
        return list(self._leases.values())

    # ------------------------------------------------------------ the only place accounting changes
    def hold(self, place: Place, size: int) -> None:
        """Reserve room for a value in flight (counted in ``*_used``; not an entry, not visible)."""
        self._need_room(place, size)
        self._used(place, size)

    def unhold(self, place: Place, size: int) -> None:
        self._used(place, -size)

    def add(self, skey: bytes, entry: Entry, *, held: bool = False) -> None:
        """Make a block visible; ``held``: its room was reserved by :meth:`hold` and is converted."""
        if skey in self._entries:
            raise IllegalMoveError("block already committed")
        if held:
            self._used(entry.place, -entry.size)
        else:
            self._need_room(entry.place, entry.size)
        self._entries[skey] = entry
        self._count(entry, +1)

    def move(self, skey: bytes, place: Place) -> None:
        e = self._require(skey)
        if e.place is place or not e.movable:
            raise IllegalMoveError(f"cannot move a {e.place.value} block (pins={e.pins}, leases={e.leases}) "
                                   f"to {place.value}")
        self._need_room(place, e.size)
        self._count(e, -1)
        e.place = place
        self._count(e, +1)

    def remove(self, skey: bytes) -> Entry:
        e = self._require(skey)
        if not e.movable:
            raise IllegalMoveError(f"cannot drop a block with pins={e.pins}, leases={e.leases}")
        del self._entries[skey]
        self._count(e, -1)
        return e

    def _require(self, skey: bytes) -> Entry:
        e = self._entries.get(skey)
        if e is None:
            raise UnknownBlockError("no such block")
        return e

    def _need_room(self, place: Place, size: int) -> None:
        if place is Place.HOST:
            used, cap = self.host_used, self.host_capacity
        else:
            used, cap = self.disk_used, self.disk_capacity
        if used + size > cap:
            raise IllegalMoveError(f"{place.value} would exceed its capacity ({used} + {size} > {cap})")

    def _used(self, place: Place, delta: int) -> None:
        if place is Place.HOST:
            self.host_used += delta
        else:
            self.disk_used += delta
        if self.host_used < 0 or self.disk_used < 0:
            raise IllegalMoveError("catalog accounting went negative")

    def _count(self, e: Entry, sign: int) -> None:
        self._used(e.place, sign * e.size)
        self.usage[e.tenant] = self.usage.get(e.tenant, 0) + sign * e.size
        self.blocks[e.tenant] = self.blocks.get(e.tenant, 0) + sign

    # ------------------------------------------------------------ pins and leases
    def pin(self, skey: bytes) -> None:
        self._require(skey).pins += 1

    def unpin(self, skey: bytes) -> None:
        e = self._require(skey)
        if e.pins == 0:
            raise IllegalMoveError("unpin of a block that is not pinned")
        e.pins -= 1

    def lease(self, tenant: str, holder: int, skeys: list[bytes], ttl_s: float, now: float) -> Lease:
        present = tuple(k for k in skeys if k in self._entries)
        lease = Lease(next(self._lease_ids), tenant, holder, present, now + ttl_s)
        for k in present:
            self._entries[k].leases += 1
        self._leases[lease.lease_id] = lease
        return lease

    def release(self, lease_id: int, tenant: str) -> None:
        lease = self._leases.get(lease_id)
        if lease is None or lease.tenant != tenant:
            raise LeaseError(f"lease {lease_id} is not held")
        self._drop_lease(lease)

    def release_holder(self, holder: int) -> int:
        mine = [ls for ls in self._leases.values() if ls.holder == holder]
        for ls in mine:
            self._drop_lease(ls)
        return len(mine)

    def expire(self, now: float) -> int:
        dead = [ls for ls in self._leases.values() if ls.expires_at <= now]
        for ls in dead:
            self._drop_lease(ls)
        return len(dead)

    def _drop_lease(self, lease: Lease) -> None:
        del self._leases[lease.lease_id]
        for k in lease.skeys:
            e = self._entries.get(k)
            if e is not None:
                e.leases -= 1

    # ------------------------------------------------------------ making room
    def plan_put(self, tenant: str, size: int, quota: int | None) -> Placement | Rejected:
        if size > max(self.host_capacity, self.disk_capacity) or (quota is not None and size > quota):
            return Rejected(RejectReason.TOO_LARGE, None, f"{size} bytes can never fit")
        sim = _Sim(self.host_used, self.disk_used)
        if quota is not None:
            need = self.usage.get(tenant, 0) + size - quota
            for skey, e in self._entries.items():
                if need <= 0:
                    break
                if e.tenant == tenant and e.movable:
                    self._sim_drop(sim, skey, e)
                    need -= e.size
            if need > 0:
                return Rejected(RejectReason.QUOTA, self.retry_after_s, "quota full of pinned or leased blocks")
        if size <= self.host_capacity and self._sim_host_room(sim, size):
            return Placement(Place.HOST, tuple(sim.drops), tuple(sim.demotes))
        if size <= self.disk_capacity and self._sim_disk_room(sim, size):
            return Placement(Place.DISK, tuple(sim.drops), tuple(sim.demotes))
        return Rejected(RejectReason.FULL, self.retry_after_s, "server full of pinned or leased blocks")

    def _sim_drop(self, sim: _Sim, skey: bytes, e: Entry) -> None:
        sim.taken.add(skey)
        sim.drops.append(skey)
        if e.place is Place.HOST:
            sim.host_used -= e.size
        else:
            sim.disk_used -= e.size

    def _sim_host_room(self, sim: _Sim, size: int) -> bool:
        victims: list[tuple[bytes, Entry]] = []
        need = sim.host_used + size - self.host_capacity
        for skey, e in self._entries.items():
            if need <= 0:
                break
            if e.place is Place.HOST and e.movable and skey not in sim.taken:
                victims.append((skey, e))
                need -= e.size
        if need > 0:
            return False
        for skey, e in victims:
            sim.taken.add(skey)
            sim.host_used -= e.size
            if self._sim_disk_room(sim, e.size):
                sim.demotes.append(skey)
                sim.disk_used += e.size
            else:
                sim.drops.append(skey)
        return True

    def _sim_disk_room(self, sim: _Sim, size: int) -> bool:
        if size > self.disk_capacity:
            return False
        need = sim.disk_used + size - self.disk_capacity
        if need <= 0:
            return True
        victims: list[tuple[bytes, Entry]] = []
        for skey, e in self._entries.items():
            if need <= 0:
                break
            if e.place is Place.DISK and e.movable and skey not in sim.taken:
                victims.append((skey, e))
                need -= e.size
        if need > 0:
            return False
        for skey, e in victims:
            self._sim_drop(sim, skey, e)
        return True
