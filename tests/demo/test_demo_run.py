"""The main job end to end on a tiny workload: real processes, a real kvport server, the real model."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from kvport.demo.run import DemoOptions, run


@pytest.mark.slow
def test_tiny_demo_outputs_equal_baseline_and_reuse_survives_a_decode_restart(model_dir: Path, tmp_path: Path) -> None:
    out = io.StringIO()
    summary = run(DemoOptions(users=1, rounds=2, max_new_tokens=4, restart_before_round=2,
                              measure_link=False, show_progress=False),
                  json_path=tmp_path / "demo.json", console=Console(file=out, width=200))
    assert summary["errors"] == [] and summary["decode_fallbacks"] == []
    assert summary["completed"] == 2
    assert summary["outputs_equal_baseline"], summary["mismatched_turns"]
    # turn 2 extends turn 1: its prompt's KV comes from the shared tier, after the decode worker restarted
    assert summary["decode_restarts"] == 1
    assert summary["after_restart"]["turns"] == 1 and summary["after_restart"]["hit_tokens"] > 0
    assert summary["hit_rate_tokens_after_round_1"] > 0.5
    first, second = summary["per_turn"]
    assert first["hit_tokens"] == 0 and second["hit_tokens"] >= (first["prompt_tokens"] // 16) * 16
    assert summary["hit_blocks_by_tier"].get("shared", 0) > 0  # stored by the decode worker, read by prefill
    assert summary["transfer"]["committed"] == 2 and summary["transfer"]["failed"] == []
    own = summary["ownership"]  # every commit a hand-off recorded on both sides; engines free what they held
    n_blocks = sum(-(-t["prompt_tokens"] // 16) for t in summary["per_turn"])
    assert own["handed_off_blocks"] == own["acquired_blocks"] == n_blocks
    assert own["engine_blocks_owned_after_requests"] == 0
    assert summary["transfer"]["ideal_s"] is None  # the link was not measured: not guessed
    assert summary["bytes_moved"]["prefill_to_decode"] > 0 and summary["bytes_moved"]["stored_to_shared_tier"] > 0
    assert sum(summary["planner"].values()) == 2
    assert (tmp_path / "demo.json").is_file()
    assert "= baseline" in out.getvalue()
