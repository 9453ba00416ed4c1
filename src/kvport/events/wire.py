"""KV events on the wire, in the format of vLLM's own (``vllm.distributed.kv_events``), so that an
indexer built for vLLM (llm-d's, Dynamo's, vLLM's own subscriber) reads kvport's without a change.

A batch is one msgpack array; each event a map tagged by ``type`` (msgspec's tagged structs)::

    [ts: float, [event, ...], data_parallel_rank: int | nil]
    {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | nil,
     "token_ids": [int, ...], "block_size": int, "lora_id": nil, "medium": str | nil,
     "lora_name": nil, ["locality": "LOCAL" | "REMOTE"], ["ownership": "kvport:<tier>"]}
    {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": str | nil,
     ["locality": ...], ["ownership": ...]}
    {"type": "AllBlocksCleared"}

A hash ``h`` is bytes (kvport's 16-byte block keys) or an int (vLLM's own, from an engine). The
medium is vLLM's (``GPU``, ``CPU``, ``STORAGE``) so consumers can classify events they know nothing
else about; kvport names its tier in ``ownership`` (vLLM's field for a secondary tier's identifier)
and whether the tier is shared by other engines in ``locality`` (``REMOTE``: the shared tier, Redis).

Decoding is for bytes from the network: every count and length is capped (:class:`Caps`) before
anything is built, and whatever does not fit the format is a :class:`~kvport.errors.ProtocolError`
naming what was wrong (msgpack's own decoder is bounded by the same caps).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgpack

from kvport.errors import ProtocolError

BlockHash = bytes | int

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"
LOCAL, REMOTE = "LOCAL", "REMOTE"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    medium: str | None = None
    locality: str | None = None
    ownership: str | None = None  # kvport: "kvport:<tier name>"
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    medium: str | None = None  # kvport's own reading: which tier was cleared (not on vLLM's wire)


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class Caps:
    """What a decoder accepts from a peer."""

    max_bytes: int = 16 << 20  # one batch's payload
    max_events: int = 65536  # events in a batch
    max_hashes: int = 65536  # block hashes in one event
    max_tokens: int = 1 << 20  # token ids in one event
    max_str: int = 256  # a medium, locality, ownership or LoRA name
    max_hash_bytes: int = 64  # one bytes hash
    # keep each BlockStored's token ids (checked to be ints); an indexer that does not read them sets
    # False: their count is still capped, their values are dropped unread
    keep_token_ids: bool = True


DEFAULT_CAPS = Caps()


def _wire(e: Event) -> dict[str, Any]:
    if isinstance(e, BlockStored):
        out: dict[str, Any] = {"type": "BlockStored", "block_hashes": list(e.block_hashes),
                               "parent_block_hash": e.parent_block_hash, "token_ids": list(e.token_ids),
                               "block_size": e.block_size, "lora_id": None, "medium": e.medium,
                               "lora_name": e.lora_name}
    elif isinstance(e, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": list(e.block_hashes), "medium": e.medium}
    else:
        return {"type": "AllBlocksCleared"}
    if e.locality is not None:
        out["locality"] = e.locality
    if e.ownership is not None:
        out["ownership"] = e.ownership
    return out


def encode(batch: Batch) -> bytes:
    """The batch as vLLM's ``KVEventBatch`` encodes it."""
    out: bytes = msgpack.packb([batch.ts, [_wire(e) for e in batch.events], batch.data_parallel_rank],
                               use_bin_type=True)
    return out


def _hash(v: object, caps: Caps, what: str) -> BlockHash:
    if isinstance(v, bytes) and 0 < len(v) <= caps.max_hash_bytes:
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise ProtocolError(f"{what}: a block hash is bytes (1..{caps.max_hash_bytes}) or an int, got {type(v).__name__}")


def _hashes(v: object, caps: Caps, what: str) -> tuple[BlockHash, ...]:
    if type(v) is not list or len(v) > caps.max_hashes:
        raise ProtocolError(f"{what}: block_hashes must be a list of at most {caps.max_hashes}")
    # the common cases in one pass each: vLLM's 64-bit ints (msgpack gives plain ints, never bools
    # for a number), kvport's 16-byte keys
    if all(type(h) is int for h in v):
        return tuple(v)
    return tuple(_hash(h, caps, what) for h in v)


def _str(m: dict[str, Any], key: str, caps: Caps, what: str) -> str | None:
    v = m.get(key)
    if v is None:
        return None
    if type(v) is not str or len(v) > caps.max_str:
        raise ProtocolError(f"{what}: {key} must be a string of at most {caps.max_str} characters")
    return v


def _event(m: object, caps: Caps, i: int) -> Event:
    if type(m) is not dict:
        raise ProtocolError(f"event {i}: an event is a map tagged by 'type'")
    kind = m.get("type")
    if kind == "BlockStored":
        what = f"event {i}"
        tokens, size, parent = m.get("token_ids", []), m.get("block_size", 0), m.get("parent_block_hash")
        if type(tokens) is not list or len(tokens) > caps.max_tokens or \
                (caps.keep_token_ids and not all(type(t) is int for t in tokens)):
            raise ProtocolError(f"{what}: token_ids must be a list of at most {caps.max_tokens} ints")
        if type(size) is not int or not 0 <= size <= 1 << 20:
            raise ProtocolError(f"{what}: block_size must be an int in [0, 2^20]")
        return BlockStored(_hashes(m.get("block_hashes"), caps, what),
                           None if parent is None else _hash(parent, caps, what),
                           tuple(tokens) if caps.keep_token_ids else (), size,
                           _str(m, "medium", caps, what), _str(m, "locality", caps, what),
                           _str(m, "ownership", caps, what), _str(m, "lora_name", caps, what))
    if kind == "BlockRemoved":
        what = f"event {i}"
        return BlockRemoved(_hashes(m.get("block_hashes"), caps, what), _str(m, "medium", caps, what),
                            _str(m, "locality", caps, what), _str(m, "ownership", caps, what))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ProtocolError(f"event {i}: unknown event type {str(kind)[:40]!r}")


@functools.lru_cache(maxsize=8)
def _fast(caps: Caps) -> Any:
    """A msgspec decoder of the format with ``caps`` as its types' bounds (None without msgspec, which
    comes with ``kvport[events]`` and with vLLM): it decodes and checks a batch in C, 5-10x faster than
    :func:`_checked`, which stays the reference and says what is wrong when this one refuses."""
    try:
        import msgspec
    except ImportError:
        return None
    from msgspec import Meta

    h = int | Annotated[bytes, Meta(min_length=1, max_length=caps.max_hash_bytes)]  # ints: msgpack's 64 bits
    hashes = Annotated[list[h], Meta(max_length=caps.max_hashes)]  # type: ignore[valid-type]
    s = Annotated[str, Meta(max_length=caps.max_str)] | None
    tokens = Annotated[list[int], Meta(max_length=caps.max_tokens)] if caps.keep_token_ids else \
        Annotated[list[Any], Meta(max_length=caps.max_tokens)]

    # built with defstruct: the bounds are this ``caps``'s (and this module's annotations are strings)
    _Stored: Any = msgspec.defstruct("_Stored", [
        ("block_hashes", hashes), ("parent_block_hash", h | None, None), ("token_ids", tokens, []),
        ("block_size", Annotated[int, Meta(ge=0, le=1 << 20)], 0), ("medium", s, None), ("locality", s, None),
        ("ownership", s, None), ("lora_name", s, None)], tag="BlockStored", gc=False)
    _Removed: Any = msgspec.defstruct("_Removed", [
        ("block_hashes", hashes), ("medium", s, None), ("locality", s, None), ("ownership", s, None)],
        tag="BlockRemoved", gc=False)
    _Cleared: Any = msgspec.defstruct("_Cleared", [], tag="AllBlocksCleared", gc=False)
    _Batch = msgspec.defstruct("_Batch", [
        ("ts", float), ("events", Annotated[list[_Stored | _Removed | _Cleared],  # type: ignore[valid-type]
                                            Meta(max_length=caps.max_events)]),
        ("data_parallel_rank", Annotated[int, Meta(ge=0, lt=1 << 16)] | None, None)], array_like=True, gc=False)

    dec = msgspec.msgpack.Decoder(_Batch)
    keep = caps.keep_token_ids

    def fast(payload: bytes | memoryview) -> Batch | None:
        try:
            b: Any = dec.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        if not math.isfinite(b.ts):
            return None
        out: list[Event] = []
        e: Any
        for e in b.events:
            if type(e) is _Stored:
                p = e.parent_block_hash
                out.append(BlockStored(tuple(e.block_hashes), p, tuple(e.token_ids) if keep else (), e.block_size,
                                       e.medium, e.locality, e.ownership, e.lora_name))
            elif type(e) is _Removed:
                out.append(BlockRemoved(tuple(e.block_hashes), e.medium, e.locality, e.ownership))
            else:
                out.append(AllBlocksCleared())
        return Batch(float(b.ts), tuple(out), b.data_parallel_rank)

    return fast


def decode(payload: bytes | memoryview, caps: Caps = DEFAULT_CAPS) -> Batch:
    """A batch from a peer's bytes, every part checked (ProtocolError naming what is wrong)."""
    if len(payload) > caps.max_bytes:
        raise ProtocolError(f"an event batch of {len(payload)} bytes is over the cap of {caps.max_bytes}")
    fast = _fast(caps)
    if fast is not None:
        got: Batch | None = fast(payload)
        if got is not None:
            return got
    return _checked(payload, caps)  # the reference: it names what is wrong


def _checked(payload: bytes | memoryview, caps: Caps) -> Batch:
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
    return Batch(float(ts), tuple(_event(e, caps, i) for i, e in enumerate(events)), rank)


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


__all__ = ["DEFAULT_CAPS", "LOCAL", "MEDIUM_CPU", "MEDIUM_GPU", "MEDIUM_STORAGE", "REMOTE", "AllBlocksCleared",
           "Batch", "Batcher", "BlockHash", "BlockRemoved", "BlockStored", "Caps", "Event", "decode", "encode"]
