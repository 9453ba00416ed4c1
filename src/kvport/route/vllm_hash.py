"""vLLM's prefix-cache block hashes, computed without vLLM: what its KV events name device blocks by,
so a router can look a request's blocks up in an engine's events (the proxy imports nothing of vLLM).

vLLM 0.32/0.33 with its defaults (``--prefix-caching-hash-algo sha256``, ``PYTHONHASHSEED`` unset,
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``)::

    NONE_HASH  = sha256(pickle("vllm-none-hash"))                      the parent of a prompt's first block
    h_i        = sha256(pickle((h_{i-1}, tuple(tokens of block i), extra_i)))   pickle protocol 5
    extra_i    = (("cache_salt", salt),) for the first block of a salted request, else None
                 (LoRA adapters, multimodal inputs and prompt embeddings add keys kvport does not model:
                 such requests simply match nothing)
    on the wire: int.from_bytes(h_i, "big") & (2^64 - 1)

Only full blocks are hashed. ``seed`` is ``PYTHONHASHSEED`` when the engines set it.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterator, Sequence

DEFAULT_SEED = "vllm-none-hash"
_MASK = (1 << 64) - 1


def _sha256(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def iter_block_hashes(tokens: Sequence[int], block_size: int, *, cache_salt: str | None = None,
                      seed: str = DEFAULT_SEED, as_int: bool = True) -> Iterator[bytes | int]:
    """The hashes of ``tokens``' full blocks, first to last, as a vLLM engine's KV events name them
    (lazily: a caller that stops early hashes no further)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    parent = _sha256(seed)
    for i in range(len(tokens) // block_size):
        extra = (("cache_salt", cache_salt),) if i == 0 and cache_salt else None
        parent = _sha256((parent, tuple(tokens[i * block_size : (i + 1) * block_size]), extra))
        yield int.from_bytes(parent, "big") & _MASK if as_int else parent


def block_hashes(tokens: Sequence[int], block_size: int, *, cache_salt: str | None = None,
                 seed: str = DEFAULT_SEED, as_int: bool = True) -> list[bytes | int]:
    """The hashes of ``tokens``' full blocks, as a vLLM engine's KV events name them."""
    return list(iter_block_hashes(tokens, block_size, cache_salt=cache_salt, seed=seed, as_int=as_int))


__all__ = ["DEFAULT_SEED", "block_hashes", "iter_block_hashes"]
