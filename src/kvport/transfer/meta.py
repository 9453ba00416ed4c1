"""KV-transfer metadata (the TRANSFER_BEGIN map) and the receiver's compatibility check.

Wire map (msgpack, str keys)::

    spec          KVSpec.as_dict() of the sender's KV (all COMPAT_FIELDS)
    fingerprint   bin16, KVSpec.fingerprint (checked against the spec map it arrived with)
    request_id    str (<= 256 chars)
    token_range   [start, end)  tokens covered; end - start == n_blocks * block_size
    block_keys    [bin16, ...]  one chained key per block, in token order
    layer_range   [lo, hi)      layers this transfer carries (all by default)
    codec         {"id": str, "params": map}
    chunk_bytes   int           payload bytes of one block-layer (== spec.bytes_per_layer_block for raw)

The receiver checks compatibility *before* any payload is accepted: the sender's spec must equal the
receiver's field by field (``KVSpec.first_mismatch``), the codec must be one the receiver accepts;
a mismatch is refused with IncompatibleSpecError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvport.errors import (
    AuthError,
    BackpressureTimeout,
    ChecksumError,
    IncompatibleSpecError,
    PeerError,
    ProtocolError,
    SpecError,
    TransferError,
)
from kvport.keys import KEY_BYTES
from kvport.spec import KVSpec

MAX_BLOCKS = 1 << 20
MAX_REQUEST_ID = 256


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


def check_compatible(mine: KVSpec, theirs: TransferMeta, codecs: tuple[str, ...] = ("raw",)) -> None:
    """Raise IncompatibleSpecError naming the first field that makes the sender's KV unusable here."""
    mm = mine.first_mismatch(theirs.spec)
    if mm is not None:
        raise IncompatibleSpecError(*mm)
    if theirs.codec_id not in codecs:
        raise IncompatibleSpecError("codec", codecs, theirs.codec_id)
    if theirs.codec_id == "raw" and theirs.block_layer_bytes != mine.bytes_per_layer_block:
        raise IncompatibleSpecError("chunk_bytes", mine.bytes_per_layer_block, theirs.block_layer_bytes)


def remote_error(m: dict[str, Any]) -> TransferError:
    """The typed error a peer's REFUSE / ABORT / ERROR metadata names (unknown names: TransferError)."""
    name, msg = m.get("error"), str(m.get("message", ""))[:1000]
    if name == "IncompatibleSpecError":
        return IncompatibleSpecError(str(m.get("field", "?")), m.get("expected"), m.get("got"))
    cls: type[TransferError] = {
        "ProtocolError": ProtocolError, "ChecksumError": ChecksumError, "PeerError": PeerError,
        "AuthError": AuthError, "BackpressureTimeout": BackpressureTimeout,
    }.get(str(name), TransferError)
    return cls(f"peer: {msg}" if msg else f"peer reported {name}")
