"""The vLLM measurement's summary: ratios from engine results, None where nothing was measured."""

from __future__ import annotations

from typing import Any

import pytest

from kvport.deploy import vllm_bench as bench
from kvport.deploy.vllm_measure import max_logprob_diff, prefix_ttft, random_tokens, summarize
from kvport.errors import EngineError


def target(ttft: float | None, lps: list[float], toks: list[int], connector: dict[str, Any] | None = None,
           hits: float | None = 0.0) -> dict[str, Any]:
    return {"ttft_s": ttft, "wall_s": 9.0, "token_ids": toks, "logprobs": lps, "num_cached_tokens": hits,
            "external_hits": hits, "connector": connector}


def test_summary_ratios_and_quality() -> None:
    rec = {"startup_s": 5.0, "targets": [target(2.0, [-1.0, -2.0], [5, 6]), target(4.0, [-1.0], [7]),
                                         target(0.1, [-3.0], [8])]}  # last: vLLM's own prefix cache
    store = {"startup_s": 5.0, "targets": [target(2.2, [-1.0], [1], {"save_s": 0.05}),
                                           target(4.4, [-1.0], [1], {"save_s": 0.07})]}
    conn = {"load_read_s": 0.02, "load_copy_s": 0.01, "blocks_loaded": 60, "blocks_failed": 0}
    load = {"startup_s": 5.0, "targets": [target(0.2, [-1.00001, -2.0], [5, 6], conn, 1920.0),
                                          target(0.4, [-1.0], [7], conn, 1920.0)]}
    s = summarize(rec, store, load, prompt_tokens=2048, cached_tokens=1920, bytes_per_token=1000, repeats=2)
    assert s["ttft_recompute_s"] == pytest.approx(3.0) and s["ttft_loaded_s"] == pytest.approx(0.3)
    assert s["ttft_speedup"] == pytest.approx(10.0)
    assert s["zero_hit_overhead"] == pytest.approx(0.1)
    assert s["ttft_vllm_prefix_cache_s"] == pytest.approx(0.1)
    assert s["loaded_vs_vllm_prefix_cache"] == pytest.approx(3.0)
    assert s["logprob_max_abs_diff"] == pytest.approx(1e-5) and s["tokens_equal"]
    assert s["external_hits"] == [1920.0, 1920.0] and s["load_bytes"] == 1_920_000
    assert s["load_read_gbps"] == pytest.approx(1_920_000 / 0.02 / 1e9)


def test_summary_says_none_when_a_value_was_not_measured() -> None:
    rec = {"targets": [target(None, [-1.0], [5])]}  # no vLLM latency: falls back to the call's wall time
    load = {"targets": [target(None, [-1.5], [9], None)]}
    s = summarize(rec, {"targets": []}, load, prompt_tokens=64, cached_tokens=32, bytes_per_token=10, repeats=1)
    assert s["ttft_store_s"] is None and s["zero_hit_overhead"] is None and s["ttft_vllm_prefix_cache_s"] is None
    assert s["loaded_vs_vllm_prefix_cache"] is None
    assert s["load_read_s"] is None and s["load_read_gbps"] is None
    assert s["ttft_speedup"] == pytest.approx(1.0)
    assert s["tokens_equal"] is False and s["logprob_max_abs_diff"] == pytest.approx(0.5)


def test_inputs_are_checked_before_any_engine_starts() -> None:
    with pytest.raises(EngineError):
        prefix_ttft("/nonexistent", 2048, 1900)  # not whole blocks
    with pytest.raises(EngineError):
        bench.prefix_ttft(tokens=64, cached=16)  # rounds to 0 blocks
    with pytest.raises(EngineError):
        bench.engine_threads_env(0)
    assert bench.engine_threads_env(None) == {}
    assert bench.engine_threads_env(1)["OMP_NUM_THREADS"] == "1"
    assert random_tokens(3, 50) == random_tokens(3, 50) != random_tokens(4, 50)
    assert max_logprob_diff([], []) == (0.0, True)
