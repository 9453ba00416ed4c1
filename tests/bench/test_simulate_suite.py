"""``kvport bench simulate``: its parts on inputs whose answers are known (the demo is not run here: its
replay is checked on a demo report written by hand)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from kvport.bench.simulate import MOONCAKE_PD_ROWS, demo_replay, load_replay, published_cases
from kvport.cli.main import main
from kvport.planner import Link, LinkKind, PrefillModel


def _rate(ttft: float, goodput: float, tpot: float, prefill_s: float, answer_s: float | None) -> dict[str, Any]:
    bd: dict[str, Any] = {"answer": {"prefill_s": answer_s if answer_s is not None else prefill_s}}
    if answer_s is not None:
        bd["prefill"] = {"prefill_s": prefill_s}
    return {"ttft_mean_s": ttft, "goodput_rps": goodput, "tpot_mean_s": tpot, "prompt_tokens_mean": 680.0,
            "breakdown": bd}


def _pd_report() -> dict[str, Any]:
    return {"suite": "pd", "conditions": {"commit": "x", "mode": "full", "e2e": {
        "rates_per_s": [0.2, 1.0], "prefixes": 4, "prefix_tokens": 512, "suffix_tokens": 128, "sessions": 8,
        "turns": 2, "answer_tokens": 32, "ttft_slo_s": 2.5, "tpot_slo_s": 0.25}},
        "results": {"e2e": {"rates": {
            "0.2": {"pd": _rate(0.6, 0.36, 0.085, 0.35, 0.15), "colocated": _rate(0.27, 0.36, 0.068, 0.2, None)},
            "1": {"pd": _rate(0.6, 0.70, 0.093, 0.34, 0.15), "colocated": _rate(0.25, 0.72, 0.071, 0.19, None)}}}}}


def test_load_replay_calibrates_at_the_lowest_rate_and_predicts_the_others() -> None:
    out = load_replay(_pd_report())
    cells = {(c["rate"], c["layout"]): c for c in out["cells"]}
    assert set(cells) == {(0.2, "pd"), (0.2, "colocated"), (1.0, "pd"), (1.0, "colocated")}
    assert cells[(0.2, "pd")]["calibration"] and not cells[(1.0, "pd")]["calibration"]
    # calibrated: the colocated engine's mean TTFT at 0.2 req/s is the measured one (its overhead fitted)
    assert cells[(0.2, "colocated")]["predicted_ttft_mean_s"] == pytest.approx(0.27, abs=0.005)
    # 16 requests arrive over ~80 s at 0.2 req/s and ~16 s at 1 req/s: goodput follows the arrivals
    assert cells[(1.0, "pd")]["predicted_goodput_rps"] > 2 * cells[(0.2, "pd")]["predicted_goodput_rps"]
    assert out["goodput_error"] == max(c["goodput_error"] for c in out["cells"])


def test_a_pd_report_without_rates_is_refused() -> None:
    with pytest.raises(Exception, match=r"results\.e2e"):
        load_replay({"suite": "pd", "conditions": {}, "results": {}})


def test_published_cases_predict_every_row_and_name_the_two_they_were_fitted_on() -> None:
    out = published_cases()
    ttft = {c["prompt_tokens"]: c for c in out["cases"] if c["case"].startswith("ttft_")}
    assert set(ttft) == set(MOONCAKE_PD_ROWS)
    assert [t for t, c in ttft.items() if c["calibration"]] == [128, 2048]
    assert ttft[2048]["ratio"] == pytest.approx(1.0, abs=0.01)  # the row its efficiency was fitted on
    # longer prompts take longer, as published
    assert [ttft[t]["predicted"] for t in sorted(ttft)] == sorted(ttft[t]["predicted"] for t in ttft)
    assert out["predicted_cases"] == 16
    assert 0 < out["model"]["prefill_efficiency"] < 0.5  # TP 8 of an 8B model: below the data-sheet guess


def test_demo_replay_loads_what_an_earlier_turn_left_in_the_tiers() -> None:
    # two turns of one session: the second extends the first; host tier reads at 1 GB/s
    pf = PrefillModel("HuggingFaceTB/SmolLM2-135M-Instruct", 1, a=0.0, b=0.001, c=0.0, d=0.0, measured_at=time.time())
    links = {"host": Link("host", LinkKind.TIER, 1e9, 0.0, time.time()),
             "loopback": Link("loopback", LinkKind.PEER, 5e8, 1e-4, time.time())}
    first = list(range(10))
    summary = {"conditions": {"block_size": 16, "shared_tier_pool_bytes": 1 << 30, "max_new_tokens": 4},
               "per_turn": [
                   {"rid": "u1-r1", "start_s": 0.0, "block_ids": first, "prompt_tokens": 170, "session": "s",
                    "ttft_kvport_s": 0.17},
                   {"rid": "u1-r2", "start_s": 5.0, "block_ids": [*first, 10, 11], "prompt_tokens": 200,
                    "session": "s", "ttft_kvport_s": 0.05}]}
    out = demo_replay(summary, pf, links, None, 0.01)
    a, b = out["turns"]
    assert a["predicted_s"] == pytest.approx(0.17)  # 170 tokens at 1 ms
    assert b["predicted_hit_tokens"] == 160 and b["predicted_choice"] == "load"  # the first turn's 10 blocks
    kv = 160 * 30 * 2 * 3 * 64 * 4  # SmolLM2-135M fp32: 30 layers, 3 KV heads of 64
    assert b["predicted_s"] == pytest.approx(kv / 1e9 + 0.040, rel=1e-3)  # read, then 40 tokens at 1 ms
    assert out["median_error"] == pytest.approx((a["error"] + b["error"]) / 2, abs=1e-4)


def test_the_suite_runs_without_the_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pd = tmp_path / "pd.json"
    pd.write_text(json.dumps(_pd_report()))
    assert main(["bench", "simulate", "--quick", "--set", "demo=false", "--set", f"pd={pd}",
                 "--set", "requests=300"]) == 0
    rep = json.loads(capsys.readouterr().out)
    r = rep["results"]
    assert rep["suite"] == "simulate" and rep["conditions"]["mode"] == "quick"
    assert r["trace"]["requests"] == 300 and r["trace_seconds"] > 0
    assert r["demo_ttft_error"] is None
    assert r["load_goodput_error"] == r["load"]["goodput_error"]
    assert r["published"]["predicted_cases"] == 16
