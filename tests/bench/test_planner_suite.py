"""``kvport bench planner --quick`` (two lengths, two bandwidths): the report's shape and the correctness
of the measured paths (KV moved over the throttled link reproduces recompute's logits)."""

from __future__ import annotations

import json

import pytest

from kvport.cli.main import main


@pytest.mark.slow
def test_planner_suite_report_shape(capsys, tmp_path, model_dir) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "planner.json"
    assert main(["bench", "planner", "--quick", "--set", "lengths=[32,64]", "--set", "factors=[1,10]",
                 "--json", str(path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    rep = json.loads(path.read_text())
    assert printed == rep and rep["suite"] == "planner"
    assert set(rep) == {"format", "suite", "conditions", "limits", "results"}
    for k in ("cpu_count", "loadavg_start", "loadavg_end", "versions", "threads", "lengths", "suffix_tokens"):
        assert k in rep["conditions"]
    assert rep["limits"]["loopback_tcp_gbps"] > 0 and rep["limits"]["memcpy_gbps"] > 0
    res = rep["results"]
    bws = res["bandwidths_mbps"]
    assert 1 <= len(bws) <= 2 and len(res["cells"]) == 2 * len(bws) and len(res["crossover"]) == len(bws)
    for cell in res["cells"]:
        assert cell["tokens"] in (32, 64)
        assert set(cell["measured_s"]) >= {"recompute", "load"}
        assert set(cell["predicted_s"]) == {"recompute", "load", "split"}
        assert cell["best"] in cell["measured_s"]
        for who in ("online", "static"):
            assert cell[who]["action"] in cell["predicted_s"] and cell[who]["regret"] >= 0
    assert 0 <= res["within_10pct_of_best"] <= 1 and res["max_regret"] >= 0
    assert set(res["static_profile"]) == {"within_10pct_of_best", "max_regret"}
    for cr in res["crossover"]:
        assert {"measured_tokens", "predicted_tokens", "recompute_wins_at_shortest"} <= set(cr)
    assert res["max_logit_abs_diff_vs_recompute"] < 1e-3
    assert isinstance(res["split_beats_both"]["cells"], int)
