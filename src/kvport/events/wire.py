"""KV events on the wire, in the format of vLLM's own (``vllm.distributed.kv_events``), so that an
indexer built for vLLM (llm-d's, Dynamo's, vLLM's own subscriber) reads kvport's without a change.

A batch is one msgpack array; each event a map tagged by ``type`` (msgspec's tagged structs)::

    [ts: float, [event, ...], data_parallel_rank: int | nil]
    {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | nil,
     "token_ids": [int, ...], "block_size": int, "lora_id": int | nil, "medium": str | nil,
     "lora_name": str | nil, "locality": "LOCAL" | "REMOTE" | nil, "ownership": "kvport:<tier>" | nil}
    {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": str | nil, "locality": ..., "ownership": ...}
    {"type": "AllBlocksCleared", "medium": str | nil}

A hash ``h`` is bytes (kvport's 16-byte block keys) or an int (vLLM's own, from an engine). The
medium is vLLM's (``GPU``, ``CPU``, ``STORAGE``) so consumers can classify events they know nothing
else about; kvport names its tier in ``ownership`` (vLLM's field for a secondary tier's identifier)
and whether the tier is shared by other engines in ``locality`` (``REMOTE``: the shared tier, Redis).

The events are msgspec structs (vLLM's own library for them): encoding and decoding run in C,
~1M events a second each way on one core here. Decoding is for bytes from the network: every count
and length is bounded by the types while they are read (the hard caps), a :class:`Caps` may tighten
them, and whatever does not fit the format is a :class:`~kvport.errors.ProtocolError` naming what
was wrong (a field-by-field reading in Python says so; it runs only for a batch msgspec refused).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgpack
import msgspec
from msgspec import Meta

from kvport.errors import ProtocolError

# the hard caps: what the types themselves bound while decoding (a Caps may only be tighter)
MAX_BATCH_BYTES = 16 << 20
MAX_EVENTS = 65536
MAX_HASHES = 65536
MAX_TOKENS = 1 << 20
MAX_STR = 256
MAX_HASH_BYTES = 64

BlockHash = int | bytes
_Hash = int | Annotated[bytes, Meta(min_length=1, max_length=MAX_HASH_BYTES)]  # ints: msgpack's 64 bits
_Str = Annotated[str, Meta(max_length=MAX_STR)] | None
_Hashes = Annotated[tuple[_Hash, ...], Meta(max_length=MAX_HASHES)]

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"
LOCAL, REMOTE = "LOCAL", "REMOTE"


# msgspec structs, tagged by class name under "type" as vLLM's are; every field on the wire (vLLM's
# decoder requires lora_id, medium and lora_name; it ignores locality and ownership before 0.33)
class BlockStored(msgspec.Struct, tag=True, frozen=True, gc=False):
    block_hashes: _Hashes
    parent_block_hash: _Hash | None = None
    token_ids: Annotated[tuple[int, ...], Meta(max_length=MAX_TOKENS)] = ()
    block_size: Annotated[int, Meta(ge=0, le=1 << 20)] = 0
    medium: _Str = None
    locality: _Str = None
    ownership: _Str = None  # kvport: "kvport:<tier name>"
    lora_name: _Str = None
    lora_id: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, frozen=True, gc=False):
    block_hashes: _Hashes
    medium: _Str = None
    locality: _Str = None
    ownership: _Str = None


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True, gc=False):
    medium: _Str = None  # kvport's own reading: which tier was cleared (vLLM's decoder ignores it)


Event = BlockStored | BlockRemoved | AllBlocksCleared


class Batch(msgspec.Struct, array_like=True, frozen=True, gc=False):
    ts: float
    events: Annotated[tuple[Event, ...], Meta(max_length=MAX_EVENTS)]
    data_parallel_rank: Annotated[int, Meta(ge=0, lt=1 << 16)] | None = None


@dataclass(frozen=True, slots=True)
class Caps:
    """What a decoder accepts from a peer (each at most the hard cap of the same name)."""

    max_bytes: int = MAX_BATCH_BYTES  # one batch's payload
    max_events: int = MAX_EVENTS  # events in a batch
    max_hashes: int = MAX_HASHES  # block hashes in one event
    max_tokens: int = MAX_TOKENS  # token ids in one event
    max_str: int = MAX_STR  # a medium, locality, ownership or LoRA name
    max_hash_bytes: int = MAX_HASH_BYTES  # one bytes hash

    def __post_init__(self) -> None:
        hard = (MAX_BATCH_BYTES, MAX_EVENTS, MAX_HASHES, MAX_TOKENS, MAX_STR, MAX_HASH_BYTES)
        mine = (self.max_bytes, self.max_events, self.max_hashes, self.max_tokens, self.max_str, self.max_hash_bytes)
        if not all(0 < m <= h for m, h in zip(mine, hard, strict=True)):
            raise ValueError("event caps must be positive and at most the hard caps")


DEFAULT_CAPS = Caps()
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Batch)


def encode(batch: Batch) -> bytes:
    """The batch as vLLM's ``KVEventBatch`` encodes it."""
    return _ENCODER.encode(batch)


def decode(payload: bytes | memoryview, caps: Caps = DEFAULT_CAPS) -> Batch:
    """A batch from a peer's bytes, every part checked (ProtocolError naming what is wrong).

    msgspec decodes and bounds it in C (the types carry the hard caps); a ``caps`` tighter than the
    defaults is checked on what it built; anything msgspec refuses is read again by :func:`_checked`,
    which says what is wrong."""
    if len(payload) > caps.max_bytes:
        raise ProtocolError(f"an event batch of {len(payload)} bytes is over the cap of {caps.max_bytes}")
    try:
        b = _DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _checked(payload, caps)  # raises, naming what is wrong
    if not math.isfinite(b.ts):
        raise ProtocolError("an event batch's ts must be a finite number")
    if caps is not DEFAULT_CAPS and caps != DEFAULT_CAPS:
        _within(b, caps)
    return b


def _within(b: Batch, caps: Caps) -> None:
    if len(b.events) > caps.max_events:
        raise ProtocolError(f"an event batch holds a list of at most {caps.max_events} events")
    for i, e in enumerate(b.events):
        if isinstance(e, AllBlocksCleared):
            continue
        if len(e.block_hashes) > caps.max_hashes:
            raise ProtocolError(f"event {i}: block_hashes must be a list of at most {caps.max_hashes}")
        if any(isinstance(h, bytes) and len(h) > caps.max_hash_bytes for h in e.block_hashes):
            raise ProtocolError(f"event {i}: a block hash is bytes (1..{caps.max_hash_bytes}) or an int")
        strs = (e.medium, e.locality, e.ownership) + ((e.lora_name,) if isinstance(e, BlockStored) else ())
        if any(v is not None and len(v) > caps.max_str for v in strs):
            raise ProtocolError(f"event {i}: a medium, locality, ownership or LoRA name is at most {caps.max_str} "
                                "characters")
        if isinstance(e, BlockStored) and len(e.token_ids) > caps.max_tokens:
            raise ProtocolError(f"event {i}: token_ids must be a list of at most {caps.max_tokens} ints")


def _hash(v: object, caps: Caps, what: str) -> BlockHash:
    if isinstance(v, bytes) and 0 < len(v) <= caps.max_hash_bytes:
        return v
    if isinstance(v, int) and not isinstance(v, bool) and -(1 << 63) <= v < 1 << 64:
        return v
    raise ProtocolError(f"{what}: a block hash is bytes (1..{caps.max_hash_bytes}) or an int, got {type(v).__name__}")


def _hashes(v: object, caps: Caps, what: str) -> tuple[BlockHash, ...]:
    if not isinstance(v, list) or len(v) > caps.max_hashes:
        raise ProtocolError(f"{what}: block_hashes must be a list of at most {caps.max_hashes}")
    return tuple(_hash(h, caps, what) for h in v)


def _str(m: dict[str, Any], key: str, caps: Caps, what: str) -> str | None:
    v = m.get(key)
    if v is None:
        return None
    if not isinstance(v, str) or len(v) > caps.max_str:
        raise ProtocolError(f"{what}: {key} must be a string of at most {caps.max_str} characters")
    return v


def _event(m: object, caps: Caps, i: int) -> Event:
    what = f"event {i}"
    if not isinstance(m, dict):
        raise ProtocolError(f"{what}: an event is a map tagged by 'type'")
    kind = m.get("type")
    if kind == "AllBlocksCleared":
        return AllBlocksCleared(_str(m, "medium", caps, what))
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(m.get("block_hashes"), caps, what), _str(m, "medium", caps, what),
                            _str(m, "locality", caps, what), _str(m, "ownership", caps, what))
    if kind == "BlockStored":
        tokens, size, parent = m.get("token_ids", []), m.get("block_size", 0), m.get("parent_block_hash")
        if not isinstance(tokens, list) or len(tokens) > caps.max_tokens or \
                not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ProtocolError(f"{what}: token_ids must be a list of at most {caps.max_tokens} ints")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= 1 << 20:
            raise ProtocolError(f"{what}: block_size must be an int in [0, 2^20]")
        lora_id = m.get("lora_id")
        if lora_id is not None and (not isinstance(lora_id, int) or isinstance(lora_id, bool)):
            raise ProtocolError(f"{what}: lora_id must be an int or nil")
        return BlockStored(_hashes(m.get("block_hashes"), caps, what),
                           None if parent is None else _hash(parent, caps, what), tuple(tokens), size,
                           _str(m, "medium", caps, what), _str(m, "locality", caps, what),
                           _str(m, "ownership", caps, what), _str(m, "lora_name", caps, what), lora_id)
    raise ProtocolError(f"{what}: unknown event type {str(kind)[:40]!r}")


def _checked(payload: bytes | memoryview, caps: Caps) -> Batch:
    """The batch read field by field in Python: slow, and it names what is wrong (``decode`` comes
    here only with a batch msgspec refused; what this one then takes after all is refused too, with
    msgspec's reason)."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True,
                              max_bin_len=caps.max_bytes, max_str_len=caps.max_bytes,
                              max_array_len=max(caps.max_events, caps.max_hashes, caps.max_tokens),
                              max_map_len=64, max_ext_len=0)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"an event batch that is not msgpack: {exc}") from exc
    if not isinstance(raw, list) or len(raw) < 2:  # fields after these: a later vLLM's, ignored as vLLM does
        raise ProtocolError("an event batch is [ts, events, data_parallel_rank]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) >= 3 else None
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise ProtocolError("an event batch's ts must be a finite number")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < 1 << 16):
        raise ProtocolError("an event batch's data_parallel_rank must be a small int or nil")
    if not isinstance(events, list) or len(events) > caps.max_events:
        raise ProtocolError(f"an event batch holds a list of at most {caps.max_events} events")
    for i, e in enumerate(events):
        _event(e, caps, i)
    try:  # what msgspec refused and this reading did not: msgspec's reason
        _DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"a malformed event batch: {exc}") from exc
    raise ProtocolError("a malformed event batch")  # pragma: no cover - msgspec took it after all


@dataclass(slots=True)
class Batcher:
    """Events collected into batches of at most ``max_events`` (a publisher flushes on a timer too)."""

    max_events: int = 1024
    pending: list[Event] = field(default_factory=list)

    def add(self, events: Sequence[Event]) -> list[list[Event]]:
        """Queue ``events``; the batches now full, to publish."""
        self.pending.extend(events)
        out = []
        while len(self.pending) >= self.max_events:
            out.append(self.pending[: self.max_events])
            del self.pending[: self.max_events]
        return out

    def flush(self) -> list[Event]:
        out, self.pending = self.pending, []
        return out


__all__ = ["DEFAULT_CAPS", "LOCAL", "MAX_BATCH_BYTES", "MEDIUM_CPU", "MEDIUM_GPU", "MEDIUM_STORAGE", "REMOTE",
           "AllBlocksCleared", "Batch", "Batcher", "BlockHash", "BlockRemoved", "BlockStored", "Caps", "Event",
           "decode", "encode"]
