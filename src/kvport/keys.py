"""Chained block keys: a block's identity everywhere (every tier, the wire, the ledger).

::

    root      = H("kvport.keys.v1" | algo | block_size | spec fingerprint | tenant salt | codec id)
    key[0]    = H(root   | tokens[0 : B]   as little-endian int32)
    key[i]    = H(key[i-1] | tokens[iB : (i+1)B])

``H`` is xxh3-128 (default, fast, not adversarially collision-resistant) or sha256 truncated to
128 bits (use it when tenants may craft colliding prompts). A key is therefore 16 bytes for every
algorithm: usable as a dict key, as a file name (``key.hex()``) and as a fixed-width wire field.
Because every key chains from the root, the extra keys (model, tenant, codec) change *every* key of
the prefix, and a block's key fixes its whole prefix: equal keys mean equal prefixes.

Under tensor parallelism the chain is the model's at width 1 (``KVSpec.whole``) and each rank's
blocks are keyed by :func:`head_keys` for the KV heads it holds: a rank of one TP width never reads
a block of another, and every rank (or re-shard piece) holding the same heads finds the same keys.

Tokens are converted to one contiguous int32 array once; the loop is one hash call per block and
no per-token Python work (measured by ``kvport bench hash`` against raw xxh3 of the same bytes).
A trailing partial block gets no key unless ``include_partial=True``.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvport.errors import KeyingError

KEY_BYTES = 16
BlockKey = bytes
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


class HashAlgo(enum.Enum):
    XXH3_128 = "xxh3_128"
    SHA256 = "sha256"


def _sha256_128(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:KEY_BYTES]


_HASHERS: dict[HashAlgo, Callable[[bytes], bytes]] = {
    HashAlgo.XXH3_128: xxhash.xxh3_128_digest,
    HashAlgo.SHA256: _sha256_128,
}


@dataclass(frozen=True, slots=True)
class KeyContext:
    """Everything besides the tokens that makes a block's KV what it is."""

    block_size: int
    spec_fingerprint: bytes = b""
    tenant_salt: bytes = b""
    codec_id: str = "raw"
    algo: HashAlgo = HashAlgo.XXH3_128

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise KeyingError(f"block_size must be a positive integer, got {self.block_size!r}")

    @property
    def root(self) -> bytes:
        parts = (
            b"kvport.keys.v1",
            self.algo.value.encode(),
            str(self.block_size).encode(),
            self.spec_fingerprint,
            self.tenant_salt,
            self.codec_id.encode(),
        )
        # length-prefix every part so that no two contexts serialize alike
        blob = b"".join(len(p).to_bytes(4, "little") + p for p in parts)
        return _HASHERS[self.algo](blob)

    def with_tenant(self, salt: bytes) -> KeyContext:
        return KeyContext(self.block_size, self.spec_fingerprint, salt, self.codec_id, self.algo)


def _check_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise KeyingError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise KeyingError(f"tokens must be integers, got dtype {arr.dtype}")
    return arr


def _range_check(arr: np.ndarray) -> None:
    if arr.size and (arr.dtype.itemsize > 4 or arr.dtype == np.uint32):
        lo, hi = int(arr.min()), int(arr.max())
        if lo < _INT32_MIN or hi > _INT32_MAX:
            raise KeyingError(f"token ids must fit in int32, got range [{lo}, {hi}]")


def as_token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Contiguous little-endian int32 copy/view of the tokens, validated without a Python loop."""
    arr = _check_tokens(tokens)
    _range_check(arr)
    return np.ascontiguousarray(arr, dtype="<i4")


_CHUNK_TOKENS = 1 << 16  # int64 -> int32 conversion goes through a reused 256 KiB scratch buffer


def chain_keys(
    tokens: Sequence[int] | np.ndarray,
    ctx: KeyContext,
    parent: BlockKey | None = None,
    include_partial: bool = False,
) -> list[BlockKey]:
    """Keys of the consecutive blocks of ``tokens``; ``parent`` continues an earlier chain."""
    arr = _check_tokens(tokens)
    if parent is not None and len(parent) != KEY_BYTES:
        raise KeyingError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    h = _HASHERS[ctx.algo]
    bs = ctx.block_size
    n_full = len(arr) // bs
    prev = ctx.root if parent is None else parent
    keys: list[bytes] = []
    append = keys.append
    step = bs * 4
    if arr.dtype == np.dtype("<i4") and arr.flags.c_contiguous:
        chunks: list[tuple[int, np.ndarray]] = [(0, arr)]
        per = max(n_full, 1)
    else:  # convert chunk by chunk into one reused buffer: no large fresh allocation (page faults)
        _range_check(arr)
        per = max(1, _CHUNK_TOKENS // bs)
        chunks = [(b0, arr[b0 * bs : min(n_full, b0 + per) * bs]) for b0 in range(0, n_full, per)]
    scratch = np.empty(0 if len(chunks) == 1 and arr.dtype == np.dtype("<i4") else per * bs, dtype="<i4")
    for b0, part in chunks:
        if part.dtype != np.dtype("<i4") or not part.flags.c_contiguous:
            np.copyto(scratch[: part.size], part, casting="unsafe")
            part = scratch[: part.size]
        mv = part.data.cast("B")
        end = min(per, n_full - b0) * step
        for off in range(0, end, step):  # one hash call per block: measured by `kvport bench hash`
            prev = h(prev + mv[off : off + step])
            append(prev)
    if include_partial and len(arr) % bs:
        tail = np.ascontiguousarray(arr[n_full * bs :], dtype="<i4").tobytes()
        keys.append(h(prev + tail + b"\xffpartial"))
    return keys


def head_keys(keys: Sequence[BlockKey], lo: int, hi: int, num_heads: int,
              algo: HashAlgo = HashAlgo.XXH3_128) -> list[BlockKey]:
    """The keys of the KV heads ``[lo, hi)`` of blocks keyed ``keys`` (the chain of all
    ``num_heads`` heads, at tensor-parallel width 1): ``keys`` themselves for every head, else each
    key hashed with the range, so a rank of any TP width (or a re-shard's piece) stores its heads
    under keys of their own, and equal keys still mean equal bytes (the same heads of the same prefix).
    One hash call per block, with the chain's own hash (``algo``: its ``KeyContext.algo``)."""
    if not 0 <= lo < hi <= num_heads:
        raise KeyingError(f"heads [{lo}, {hi}) of {num_heads}")
    if (lo, hi) == (0, num_heads):
        return list(keys)
    tag = b"kvport.heads.v1" + lo.to_bytes(2, "little") + hi.to_bytes(2, "little")
    h = _HASHERS[algo]
    return [h(k + tag) for k in keys]


def key_hex(key: BlockKey) -> str:
    return key.hex()


def key_from_hex(text: str) -> BlockKey:
    try:
        key = bytes.fromhex(text)
    except ValueError as exc:
        raise KeyingError(f"not a hex key: {text!r}") from exc
    if len(key) != KEY_BYTES:
        raise KeyingError(f"a key is {KEY_BYTES} bytes, got {len(key)}")
    return key
