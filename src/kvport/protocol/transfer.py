"""The KV-transfer protocol (sender <-> receiver): typed messages, one per frame type.

::

    sender                                               receiver
    TransferBegin {tid, transfer: TransferMeta,  ---->
                   owner, ledger_tid}
                                                 <----  TransferAccept {tid, budget, grant, owner}
                                                        | TransferRefuse {tid, error...}
                                                 (the sender checks the receiver's owner; its ledger:
                                                  IN_TRANSFER(owner -> receiver owner, ledger_tid))
    LayerHead {tid, layer, b0, n_layers} + one
      chunk per block-layer, block-major         ---->
                                                 <----  Credit {grant}                (any time)
    TransferEnd {tid}                            ---->  every (block, layer) verified exactly once?
                                                        ledger.acquire(keys, owner, from=sender, ledger_tid)
                                                        destination.commit()
                                                 <----  TransferCommitted {tid, owner} | TransferAbort {tid, error...}
    (sender's ledger: HANDED_OFF(to=receiver owner, ledger_tid))
    TransferAbort {tid, error...}                ---->  (either way: void, nothing linked)

``owner`` names each side's ledger owner and ``ledger_tid`` the sender's ledger transfer id, so that a
commit is recorded as a hand-off on both sides (sender: HANDED_OFF to the receiver's owner; receiver:
ACQUIRED from the sender's owner, both with ``ledger_tid``).

TRANSFER_BEGIN's ``transfer`` map (:class:`TransferMeta`, msgpack, str keys)::

    spec          KVSpec.as_dict() of the sender's KV (all COMPAT_FIELDS)
    fingerprint   bin16, KVSpec.fingerprint (checked against the spec map it arrived with)
    request_id    str (<= 256 chars)
    token_range   [start, end)  tokens covered; end - start == n_blocks * block_size
    block_keys    [bin16, ...]  one chained key per block, in token order
    layer_range   [lo, hi)      layers this transfer carries (all by default)
    codec         {"id": str, "params": map}
    chunk_bytes   int           payload bytes of one block-layer (== spec.bytes_per_layer_block for raw)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Self

from kvport.errors import KVPortError, ProtocolError, SpecError, TransferError
from kvport.keys import KEY_BYTES
from kvport.protocol.errors import error_meta, remote_error
from kvport.protocol.frame import MsgType
from kvport.protocol.schema import Len, Message, Name, Range, decode
from kvport.spec import KVSpec

MAX_BLOCKS = 1 << 20
MAX_REQUEST_ID = 256
Tid = Annotated[int, Range(0, 2**63 - 1)]
LedgerTid = Annotated[str, Len(64)]


@dataclass(frozen=True, slots=True)
class TransferMeta:
    spec: KVSpec
    request_id: str
    block_keys: tuple[bytes, ...]
    token_start: int = 0
    layer_lo: int = 0
    layer_hi: int | None = None  # None: all layers
    codec_id: str = "raw"
    codec_params: dict[str, Any] = field(default_factory=dict)
    chunk_bytes: int | None = None  # None: spec.bytes_per_layer_block (raw)

    @property
    def n_blocks(self) -> int:
        return len(self.block_keys)

    @property
    def layers(self) -> range:
        return range(self.layer_lo, self.spec.num_layers if self.layer_hi is None else self.layer_hi)

    @property
    def block_layer_bytes(self) -> int:
        return self.spec.bytes_per_layer_block if self.chunk_bytes is None else self.chunk_bytes

    @property
    def total_bytes(self) -> int:
        return self.n_blocks * len(self.layers) * self.block_layer_bytes

    @property
    def token_range(self) -> tuple[int, int]:
        return self.token_start, self.token_start + self.n_blocks * self.spec.block_size

    def to_wire(self) -> dict[str, Any]:
        return {
            "spec": self.spec.as_dict(),
            "fingerprint": self.spec.fingerprint,
            "request_id": self.request_id,
            "token_range": list(self.token_range),
            "block_keys": list(self.block_keys),
            "layer_range": [self.layers.start, self.layers.stop],
            "codec": {"id": self.codec_id, "params": self.codec_params},
            "chunk_bytes": self.block_layer_bytes,
        }

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> TransferMeta:
        """Validate every field's type and range (peer input) and build the value."""
        try:
            spec_map = m["spec"]
            if not isinstance(spec_map, dict):
                raise ProtocolError("spec must be a map")
            spec = KVSpec.from_dict(spec_map)
            if m.get("fingerprint") != spec.fingerprint:
                raise ProtocolError("spec fingerprint does not match the spec map")
            rid = m["request_id"]
            keys = m["block_keys"]
            tr, lr, codec, cb = m["token_range"], m["layer_range"], m["codec"], m["chunk_bytes"]
        except KeyError as exc:
            raise ProtocolError(f"transfer metadata lacks {exc.args[0]!r}") from exc
        except SpecError as exc:
            raise ProtocolError(f"transfer metadata has an invalid spec: {exc}") from exc
        if not isinstance(rid, str) or len(rid) > MAX_REQUEST_ID:
            raise ProtocolError("request_id must be a str of at most 256 chars")
        if not isinstance(keys, list) or len(keys) > MAX_BLOCKS or \
                not all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys):
            raise ProtocolError(f"block_keys must be a list of at most {MAX_BLOCKS} 16-byte keys")
        if not (_int_pair(tr) and _int_pair(lr)):
            raise ProtocolError("token_range and layer_range must be [start, end) int pairs")
        if tr[1] - tr[0] != len(keys) * spec.block_size or tr[0] < 0:
            raise ProtocolError(f"token_range {tr} does not cover {len(keys)} blocks of {spec.block_size}")
        if not 0 <= lr[0] < lr[1] <= spec.num_layers:
            raise ProtocolError(f"layer_range {lr} outside [0, {spec.num_layers})")
        if not isinstance(codec, dict) or not isinstance(codec.get("id"), str) or \
                not isinstance(codec.get("params", {}), dict):
            raise ProtocolError("codec must be {'id': str, 'params': map}")
        if not isinstance(cb, int) or not 0 < cb <= (1 << 30):
            raise ProtocolError(f"chunk_bytes must be a positive int, got {cb!r}")
        return cls(spec, rid, tuple(keys), tr[0], lr[0], lr[1], codec["id"], dict(codec.get("params", {})), cb)


def _int_pair(v: object) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v) \
        and v[0] <= v[1]


@dataclass(frozen=True, slots=True)
class TransferBegin(Message):
    TYPE: ClassVar[MsgType] = MsgType.TRANSFER_BEGIN
    tid: int
    transfer: TransferMeta
    owner: str = ""  # the sender's ledger owner, ``str(Owner)`` ("" without one)
    ledger_tid: str = ""  # the sender's ledger transfer id (kvport.ledger.new_tid())

    def to_meta(self) -> dict[str, Any]:
        return {"tid": self.tid, "transfer": self.transfer.to_wire(), "owner": self.owner,
                "ledger_tid": self.ledger_tid}

    @classmethod
    def from_meta(cls, m: dict[str, Any]) -> TransferBegin:
        head = decode(_BeginHead, m, "TransferBegin")
        t = m.get("transfer")
        if not isinstance(t, dict):
            raise ProtocolError("TransferBegin.transfer must be a map")
        return cls(head.tid, TransferMeta.from_wire(t), head.owner, head.ledger_tid)


@dataclass(frozen=True, slots=True)
class _BeginHead:
    tid: Tid
    owner: Annotated[str, Len(128)] = ""
    ledger_tid: LedgerTid = ""


@dataclass(frozen=True, slots=True)
class _TidHead:
    tid: Tid


def tid_of(meta: dict[str, Any]) -> int | None:
    """The transfer id of a peer's message, or None when it has no valid one (to answer a malformed
    TRANSFER_BEGIN with a refusal the sender can match)."""
    try:
        return decode(_TidHead, meta).tid
    except ProtocolError:
        return None


@dataclass(frozen=True, slots=True)
class TransferAccept(Message):
    TYPE: ClassVar[MsgType] = MsgType.TRANSFER_ACCEPT
    tid: Tid
    budget: Annotated[int, Range(1, 2**62)]
    grant: Annotated[int, Range(0, 2**62)]
    owner: Annotated[str, Len(128)] = ""  # the receiver's ledger owner ("" without a ledger)


@dataclass(frozen=True, slots=True)
class Credit(Message):
    TYPE: ClassVar[MsgType] = MsgType.CREDIT
    grant: Annotated[int, Range(0, 2**62)]  # cumulative bytes granted on this connection


@dataclass(frozen=True, slots=True)
class LayerHead(Message):
    """A LAYER frame's metadata. Its payload is one chunk per block-layer of blocks ``b0 ..
    b0 + n - 1`` and layers ``layer .. layer + n_layers - 1``, block-major::

        (b0, layer) (b0, layer+1) ... (b0, layer+n_layers-1) (b0+1, layer) ...   n = n_chunks / n_layers

    ``n_layers = 1``: one layer of consecutive blocks (layer-wise streaming); all of a transfer's
    layers: whole blocks in the order of their bytes in a block-contiguous (LKHTD) KV."""

    TYPE: ClassVar[MsgType] = MsgType.LAYER
    tid: Tid
    layer: Annotated[int, Range(0, 1 << 16)]
    b0: Annotated[int, Range(0, MAX_BLOCKS)]
    n_layers: Annotated[int, Range(1, 1 << 16)] = 1


@dataclass(frozen=True, slots=True)
class TransferEnd(Message):
    TYPE: ClassVar[MsgType] = MsgType.TRANSFER_END
    tid: Tid


@dataclass(frozen=True, slots=True)
class _Failure(Message):
    """A transfer that will not commit, and why: ``{tid, error, message[, field, expected, got]}``
    (:func:`kvport.protocol.errors.error_meta`). The error comes back as the kvport exception it
    names (:func:`~kvport.protocol.errors.remote_error`; a name kvport does not know: TransferError)."""

    tid: int
    error: KVPortError

    def to_meta(self) -> dict[str, Any]:
        return {"tid": self.tid, **error_meta(self.error)}

    @classmethod
    def from_meta(cls, m: dict[str, Any]) -> Self:
        return cls(decode(_TidHead, m, cls.__name__).tid, remote_error(m, TransferError))


@dataclass(frozen=True, slots=True)
class TransferRefuse(_Failure):
    """Receiver -> sender: TRANSFER_BEGIN refused (incompatible spec, unknown peer, no buffer ...)."""

    TYPE: ClassVar[MsgType] = MsgType.TRANSFER_REFUSE


@dataclass(frozen=True, slots=True)
class TransferAbort(_Failure):
    """Either way: the transfer is void, nothing is linked."""

    TYPE: ClassVar[MsgType] = MsgType.TRANSFER_ABORT


@dataclass(frozen=True, slots=True)
class TransferCommitted(Message):
    TYPE: ClassVar[MsgType] = MsgType.TRANSFER_COMMITTED
    tid: Tid
    owner: Annotated[str, Len(128)] = ""  # the receiver's ledger owner that acquired the blocks


MAX_RECORDS = 512  # ownership moves one HANDOFF_RECORDS answer carries at most (< 256 KiB of metadata)


@dataclass(frozen=True, slots=True)
class HandoffRecords(Message):
    """Asker -> receiver, on an authenticated hand-off link: the newest ``limit`` ownership moves of the
    receiver's ledger (``kvport inspect --handoff``)."""

    TYPE: ClassVar[MsgType] = MsgType.HANDOFF_RECORDS
    limit: Annotated[int, Range(1, MAX_RECORDS)]


@dataclass(frozen=True, slots=True)
class HandoffRow:
    """One ownership move: a block (hex key) went ``owner_from`` -> ``owner_to`` by ``move``."""

    key: Annotated[str, Len(32)]
    move: Annotated[str, Len(32)]
    owner_from: Annotated[str, Len(128)]
    owner_to: Annotated[str, Len(128)]
    tid: Annotated[str, Len(64)]  # the hand-off's transfer id, both ledgers record it ("" outside one)
    age_s: float  # seconds ago


@dataclass(frozen=True, slots=True)
class HandoffRecordsAnswer(Message):
    TYPE: ClassVar[MsgType] = MsgType.HANDOFF_RECORDS_ANSWER
    owner: Annotated[str, Len(128)]  # the receiver's ledger owner ("" without a ledger)
    held: Annotated[int, Range(0, 2**40)]  # blocks its ledger holds now
    records: Annotated[tuple[HandoffRow, ...], Len(MAX_RECORDS)]  # oldest first


__all__ = [
    "MAX_BLOCKS",
    "MAX_RECORDS",
    "Credit",
    "HandoffRecords",
    "HandoffRecordsAnswer",
    "HandoffRow",
    "LayerHead",
    "Name",
    "TransferAbort",
    "TransferAccept",
    "TransferBegin",
    "TransferCommitted",
    "TransferEnd",
    "TransferMeta",
    "TransferRefuse",
    "tid_of",
]
