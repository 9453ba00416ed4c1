"""The shared-tier protocol (client <-> ``kvport serve``): typed requests and answers.

Every request is one frame; its answer is one frame of the same ``msg_type`` with
``Flags.RESPONSE`` and the request's ``corr_id``: the answer class below, a :class:`Rejected`
(``{"rejected", "retry_after", "detail"}``), or ``Flags.ERROR`` with :func:`~kvport.protocol.errors.
error_meta`. Keys on the wire are the client's 16-byte block keys; the server salts them per tenant
and never returns storage keys. Leases and pins belong to the holder ``tenant/client`` named at the
handshake, not to a connection: a client's pool may use any of its connections, and a client that
dies loses its leases and pins when they expire (never later).

==============================================  =================================  ==================================
request (payload)                               answer (payload)                   notes
==============================================  =================================  ==================================
PutRequest {key, parent, lifetime, ttl_s, pin}  PutAnswer {status} | Rejected      value in chunks of page_bytes;
  (value)                                                                          visible only after every checksum;
                                                                                   a PUT hands the block to the pool
GetRequest {key, lease_s}                       GetAnswer {found, length, lease}   the read itself holds a lease;
                                                  (value) | Rejected(busy)         lease_s > 0 keeps one after it
LookupRequest {keys, lease_s}                   LookupAnswer {hits, lease}         longest present prefix of keys
ContainsRequest {keys}                          ContainsAnswer {present, lengths}
PinRequest {keys, reason, ttl_s}                CountAnswer {count}                pins expire at ttl_s
UnpinRequest {keys}                             CountAnswer {count}
LeaseRequest {keys, ttl_s}                      LeaseAnswer {lease, held}
ReleaseRequest {lease}                          Done {}
DeleteRequest {keys}                            CountAnswer {count}                pinned / leased blocks stay
StatsRequest {brief, list_keys}                 StatsAnswer                        a tenant sees its own rows only
OwnersRequest {keys, prefix}                    OwnersAnswer {blocks}              ``kvport inspect --owners``
LeaksRequest {}                                 LeaksAnswer                        ``kvport inspect --leaks``
PingRequest {}                                  Done {}
==============================================  =================================  ==================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

from kvport.errors import ProtocolError
from kvport.lifetime import Lifetime
from kvport.protocol.frame import MsgType
from kvport.protocol.rejects import Rejected
from kvport.protocol.schema import Key, Len, Message, Name, Range, decode

MAX_KEYS = 1 << 16  # keys in one request's list (the server's own cap may be lower)
MAX_ROWS = 1 << 16  # rows of one report
MAX_TTL_S = 7 * 24 * 3600.0
Reason = Annotated[str, Len(256)]
Ttl = Annotated[float, Range(0.0, MAX_TTL_S)]
Keys = Annotated[tuple[Key, ...], Len(MAX_KEYS)]


# ---------------------------------------------------------------------- requests
@dataclass(frozen=True, slots=True)
class PinSpec:
    reason: Reason = ""
    ttl_s: Ttl = 0.0  # 0: the server's default pin TTL


@dataclass(frozen=True, slots=True)
class PutRequest(Message):
    TYPE: ClassVar[MsgType] = MsgType.PUT
    key: Key
    parent: Key | None = None  # the previous block of the same prefix (the server keeps no orphans)
    lifetime: Lifetime = Lifetime.PREFIX
    ttl_s: Ttl = 0.0  # SESSION: idle time before the pool drops it (0: the server's default)
    pin: PinSpec | None = None  # pin it once stored (a retried PUT never pins twice)


@dataclass(frozen=True, slots=True)
class GetRequest(Message):
    TYPE: ClassVar[MsgType] = MsgType.GET
    key: Key
    lease_s: Ttl = 0.0  # > 0: keep a lease on the block after the read


@dataclass(frozen=True, slots=True)
class LookupRequest(Message):
    TYPE: ClassVar[MsgType] = MsgType.LOOKUP
    keys: Keys
    lease_s: Ttl = 0.0


@dataclass(frozen=True, slots=True)
class ContainsRequest(Message):
    TYPE: ClassVar[MsgType] = MsgType.CONTAINS
    keys: Keys


@dataclass(frozen=True, slots=True)
class PinRequest(Message):
    TYPE: ClassVar[MsgType] = MsgType.PIN
    keys: Keys
    reason: Reason = ""
    ttl_s: Ttl = 0.0


@dataclass(frozen=True, slots=True)
class UnpinRequest(Message):
    TYPE: ClassVar[MsgType] = MsgType.UNPIN
    keys: Keys


@dataclass(frozen=True, slots=True)
class LeaseRequest(Message):
    TYPE: ClassVar[MsgType] = MsgType.LEASE
    keys: Keys
    ttl_s: Ttl = 0.0


@dataclass(frozen=True, slots=True)
class ReleaseRequest(Message):
    TYPE: ClassVar[MsgType] = MsgType.RELEASE
    lease: Annotated[int, Range(1, 2**63 - 1)]


@dataclass(frozen=True, slots=True)
class DeleteRequest(Message):
    TYPE: ClassVar[MsgType] = MsgType.DELETE
    keys: Keys


@dataclass(frozen=True, slots=True)
class StatsRequest(Message):
    TYPE: ClassVar[MsgType] = MsgType.STATS
    brief: bool = False
    list_keys: bool = False


@dataclass(frozen=True, slots=True)
class OwnersRequest(Message):
    TYPE: ClassVar[MsgType] = MsgType.OWNERS
    keys: Keys = ()
    prefix: Annotated[str, Len(32)] = ""  # hex prefix of client keys (instead of keys)


@dataclass(frozen=True, slots=True)
class LeaksRequest(Message):
    TYPE: ClassVar[MsgType] = MsgType.LEAKS


@dataclass(frozen=True, slots=True)
class PingRequest(Message):
    TYPE: ClassVar[MsgType] = MsgType.PING


Request = (PutRequest | GetRequest | LookupRequest | ContainsRequest | PinRequest | UnpinRequest | LeaseRequest
           | ReleaseRequest | DeleteRequest | StatsRequest | OwnersRequest | LeaksRequest | PingRequest)
REQUESTS: dict[MsgType, type[Message]] = {c.TYPE: c for c in (
    PutRequest, GetRequest, LookupRequest, ContainsRequest, PinRequest, UnpinRequest, LeaseRequest, ReleaseRequest,
    DeleteRequest, StatsRequest, OwnersRequest, LeaksRequest, PingRequest)}


def decode_request(msg_type: MsgType, meta: dict[str, Any]) -> Request:
    cls = REQUESTS.get(msg_type)
    if cls is None:
        raise ProtocolError(f"{msg_type.name} is not a request this server answers")
    out: Request = decode(cls, meta)  # type: ignore[assignment]
    return out


# ---------------------------------------------------------------------- answers
@dataclass(frozen=True, slots=True)
class Done(Message):
    TYPE: ClassVar[MsgType] = MsgType.PING  # any request's empty answer


@dataclass(frozen=True, slots=True)
class PutAnswer(Message):
    TYPE: ClassVar[MsgType] = MsgType.PUT
    status: Annotated[str, Len(16)]  # "stored" | "exists"

    @property
    def existed(self) -> bool:
        return self.status == "exists"


@dataclass(frozen=True, slots=True)
class GetAnswer(Message):
    TYPE: ClassVar[MsgType] = MsgType.GET
    found: bool
    length: Annotated[int, Range(0, 2**40)] = 0
    lease: Annotated[int, Range(1, 2**63 - 1)] | None = None


@dataclass(frozen=True, slots=True)
class LookupAnswer(Message):
    TYPE: ClassVar[MsgType] = MsgType.LOOKUP
    hits: Annotated[int, Range(0, MAX_KEYS)]
    lease: Annotated[int, Range(1, 2**63 - 1)] | None = None


@dataclass(frozen=True, slots=True)
class ContainsAnswer(Message):
    TYPE: ClassVar[MsgType] = MsgType.CONTAINS
    present: Annotated[tuple[bool, ...], Len(MAX_KEYS)]
    lengths: Annotated[tuple[Annotated[int, Range(0, 2**40)] | None, ...], Len(MAX_KEYS)]


@dataclass(frozen=True, slots=True)
class CountAnswer(Message):
    TYPE: ClassVar[MsgType] = MsgType.PIN  # PIN, UNPIN, DELETE
    count: Annotated[int, Range(0, MAX_KEYS)]


@dataclass(frozen=True, slots=True)
class LeaseAnswer(Message):
    TYPE: ClassVar[MsgType] = MsgType.LEASE
    lease: Annotated[int, Range(1, 2**63 - 1)] | None
    held: Annotated[int, Range(0, MAX_KEYS)]


@dataclass(frozen=True, slots=True)
class PinRow:
    holder: Name
    reason: Reason
    since_s: float  # seconds since the pin was taken (or last renewed)
    expires_in_s: float | None  # negative: past its TTL and not yet reaped
    count: Annotated[int, Range(1, 2**31)] = 1
    key: Annotated[str, Len(32)] = ""  # hex client key (leak reports)


@dataclass(frozen=True, slots=True)
class LeaseRow:
    lease: Annotated[int, Range(1, 2**63 - 1)]
    holder: Name
    blocks: Annotated[int, Range(0, MAX_KEYS)]
    expires_in_s: float


@dataclass(frozen=True, slots=True)
class BlockOwners:
    """Who holds one block, where, for how long (``kvport inspect --owners``)."""

    key: Annotated[str, Len(32)]  # hex client key
    tenant: Name
    owner: Name  # "pool:pool" once stored; the ledger's owner of the block
    state: Annotated[str, Len(32)]
    since_s: float  # seconds since its last ownership move
    handed_off_by: Annotated[str, Len(128)]  # the client whose PUT handed it to the pool
    lifetime: Lifetime
    expires_in_s: float | None  # SESSION: until the pool drops it, unless used again
    tiers: Annotated[tuple[Name, ...], Len(8)]
    length: Annotated[int, Range(0, 2**40)]
    parent: Annotated[str, Len(32)]  # hex client key of the parent block ("" at a root)
    children: Annotated[int, Range(0, 2**31)]
    pins: Annotated[tuple[PinRow, ...], Len(MAX_ROWS)]
    leases: Annotated[tuple[LeaseRow, ...], Len(MAX_ROWS)]


@dataclass(frozen=True, slots=True)
class OwnersAnswer(Message):
    TYPE: ClassVar[MsgType] = MsgType.OWNERS
    blocks: Annotated[tuple[BlockOwners, ...], Len(MAX_ROWS)]
    truncated: bool = False


@dataclass(frozen=True, slots=True)
class LeaksAnswer(Message):
    """Leaks as the server's ledger and store see them now (a tenant sees its own)."""

    TYPE: ClassVar[MsgType] = MsgType.LEAKS
    expired_pins: Annotated[tuple[PinRow, ...], Len(MAX_ROWS)]  # past their TTL, not yet reaped
    expired_leases: Annotated[tuple[LeaseRow, ...], Len(MAX_ROWS)]
    without_owner: Annotated[tuple[Annotated[str, Len(32)], ...], Len(MAX_ROWS)]  # stored, no ledger record
    unstored_records: Annotated[tuple[Annotated[str, Len(32)], ...], Len(MAX_ROWS)]  # ledger record, no bytes
    orphan_children: Annotated[tuple[Annotated[str, Len(32)], ...], Len(MAX_ROWS)]  # parent gone, child kept

    @property
    def clean(self) -> bool:
        return not (self.expired_pins or self.expired_leases or self.without_owner or self.unstored_records
                    or self.orphan_children)


@dataclass(frozen=True, slots=True)
class TenantUsage:
    name: Name
    bytes: Annotated[int, Range(0, 2**62)]
    blocks: Annotated[int, Range(0, 2**40)]
    quota: Annotated[int, Range(0, 2**62)] | None
    connections: Annotated[int, Range(0, 2**31)]


@dataclass(frozen=True, slots=True)
class TierUsage:
    name: Name
    used: Annotated[int, Range(0, 2**62)]
    capacity: Annotated[int, Range(0, 2**62)]
    blocks: Annotated[int, Range(0, 2**40)]


@dataclass(frozen=True, slots=True)
class ServerUsage:
    tiers: Annotated[tuple[TierUsage, ...], Len(8)]
    page_bytes: Annotated[int, Range(1, 2**40)]
    connections: Annotated[int, Range(0, 2**31)]
    staging_bytes: Annotated[int, Range(0, 2**62)]
    draining: bool
    uptime_s: float


@dataclass(frozen=True, slots=True)
class PrefixRow:
    tenant: Name
    key: Annotated[str, Len(32)]
    hits: Annotated[int, Range(0, 2**62)]
    bytes: Annotated[int, Range(0, 2**40)]
    tier: Name


@dataclass(frozen=True, slots=True)
class StatsAnswer(Message):
    """``brief``: capacity/quota/used only (cheap: a store's watermark checks); else the report."""

    TYPE: ClassVar[MsgType] = MsgType.STATS
    capacity: Annotated[int, Range(0, 2**62)]
    quota: Annotated[int, Range(0, 2**62)] | None
    used: Annotated[int, Range(0, 2**62)]
    server: ServerUsage | None = None
    tenants: Annotated[tuple[TenantUsage, ...], Len(MAX_ROWS)] = ()
    top_prefixes: Annotated[tuple[PrefixRow, ...], Len(MAX_ROWS)] = ()
    pins: Annotated[tuple[PinRow, ...], Len(MAX_ROWS)] = ()
    leases: Annotated[tuple[LeaseRow, ...], Len(MAX_ROWS)] = ()
    keys: Annotated[tuple[Key, ...], Len(MAX_ROWS)] = field(default=())


Answer = (Done | PutAnswer | GetAnswer | LookupAnswer | ContainsAnswer | CountAnswer | LeaseAnswer | OwnersAnswer
          | LeaksAnswer | StatsAnswer)


def decode_answer(cls: type[Message], meta: dict[str, Any]) -> Any:
    """The typed answer, or the :class:`Rejected` the server sent instead."""
    rej = Rejected.from_meta(meta)
    if rej is not None:
        return rej
    return decode(cls, meta)
