import json
import lzma

import pytest

from kvport.bench import trace
from kvport.bench.trace import TRACE_NAME, TRACES, belady, default_trace, find_trace, int8_blocks_per_raw_block, replay
from kvport.cli.main import main
from kvport.config import Settings
from kvport.errors import UserInputError
from kvport.store.eviction import DEFAULT_POLICY, POLICIES

ROWS = [{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]},
        {"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [0, 2]}]


def test_trace_suite_on_a_small_trace_file(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    rows = [
        {"timestamp": 0, "input_length": 2048, "output_length": 1, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 1, "input_length": 1100, "output_length": 1, "hash_ids": [0, 4, 5]},  # 2 full blocks
        {"timestamp": 2, "input_length": 2560, "output_length": 1, "hash_ids": [0, 1, 2, 3, 6]},
        {"timestamp": 3, "input_length": 1024, "output_length": 1, "hash_ids": [0, 4]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["bench", "trace", "--trace", str(path), "--capacity", "5"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["suite"] == "trace"
    c = rep["conditions"]
    assert (c["requests"], c["block_refs"], c["distinct_blocks"], c["capacity_blocks"]) == (4, 13, 6, 5)
    r = rep["results"]
    # request 2 hits 0; request 3 hits 0,1,2,3 and adds 6, one over capacity: LRU evicts the oldest
    # leaf (4), Belady the block never used again (6), so request 4 hits 0 (LRU) or 0,4 (Belady).
    # slru does as LRU here: 4 (6 - 5/2 = 3.5) is below 6 (11 - 6/2 = 8)
    assert r["policy"] == DEFAULT_POLICY
    assert r["hit_rate"] == r[f"{DEFAULT_POLICY}_hit_rate"] <= r["optimal_hit_rate"]
    assert r["slru_hit_rate"] == r["lru_hit_rate"] == round(6 / 13, 5)
    assert r["optimal_hit_rate"] == round(7 / 13, 5)
    assert r["hit_rate_vs_optimal"] == round(6 / 7, 4)
    assert r["lru_evictions"] == 2  # 4 after request 3; 4 re-added by request 4 pushes one more out
    assert r["lfu_hit_rate"] == r["lru_hit_rate"]
    assert r["slru_evictions"] == 2
    assert "sweep" not in r


def test_trace_sweep_reports_every_policy_per_capacity_and_half(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    rows = [{"timestamp": i, "input_length": 512 * len(h), "output_length": 1, "hash_ids": h}
            for i, h in enumerate([[0, 1], [2], [3], [0, 1], [2], [4], [5], [0, 1], [2], [0, 1, 6]])]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["bench", "trace", "--trace", str(path), "--capacity", "4", "--set", "sweep=true"]) == 0
    sw = json.loads(capsys.readouterr().out)["results"]["sweep"]
    assert set(sw) == {"all", "first_half", "second_half"}
    for part in sw.values():
        assert set(part) == {"5%", "10%", "20%"}
        for row in part.values():
            for name in POLICIES:
                assert 0 <= row[f"{name}_hit_rate"] <= row["optimal_hit_rate"]


def test_replay_counts_prefix_hits_only_and_belady_is_an_upper_bound() -> None:
    reqs = [[0, 1, 2], [0, 3], [0, 1, 2], [0, 3, 4], [0, 1, 5]]
    assert replay(reqs, capacity=100)["hit_rate"] == (1 + 3 + 2 + 2) / 14
    for cap in (2, 3, 4):
        for policy in POLICIES:
            assert belady(reqs, cap) >= replay(reqs, cap, policy)["hit_rate"]


@pytest.mark.skipif(default_trace() is None, reason="no Mooncake trace (KVPORT_TRACE_DIR or ../shared/traces)")
def test_quick_default_trace_runs(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "trace", "--quick"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["conditions"]["requests"] == 1500
    assert 0 <= rep["results"]["hit_rate"] <= rep["results"]["optimal_hit_rate"] <= 1


def _write_trace(path):  # type: ignore[no-untyped-def]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    return path


def test_trace_is_found_by_flag_then_setting_then_checkout(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    flag = _write_trace(tmp_path / "flag.jsonl")
    setting = _write_trace(tmp_path / "setting" / TRACE_NAME)
    checkout = _write_trace(tmp_path / "checkout" / TRACE_NAME)
    monkeypatch.setattr(trace, "checkout_traces", lambda: [tmp_path / "empty", checkout.parent])
    with_dir = Settings.from_env({"KVPORT_TRACE_DIR": str(setting.parent)})
    without = Settings.from_env({})
    assert find_trace(str(flag), with_dir) == flag
    assert find_trace(None, with_dir) == setting
    assert find_trace(None, without) == checkout
    assert default_trace(without) == checkout


def test_cli_reads_the_trace_folder_setting(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    path = _write_trace(tmp_path / TRACE_NAME)
    monkeypatch.setenv("KVPORT_TRACE_DIR", str(tmp_path))
    assert main(["bench", "trace", "--capacity", "2"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["conditions"]["trace"] == str(path) and rep["conditions"]["requests"] == 2


def test_missing_trace_is_one_line_naming_the_options(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("KVPORT_TRACE_DIR", raising=False)
    monkeypatch.setattr(trace, "checkout_traces", lambda: [tmp_path / "nothing"])
    with pytest.raises(UserInputError, match="--trace PATH or set KVPORT_TRACE_DIR"):
        find_trace(None, Settings.from_env({}))
    assert default_trace(Settings.from_env({})) is None
    assert main(["bench", "trace"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--trace" in err and "KVPORT_TRACE_DIR" in err
    # a trace folder named explicitly must hold the trace: no silent fall-through to the checkout's
    monkeypatch.setenv("KVPORT_TRACE_DIR", str(tmp_path))
    assert main(["bench", "trace"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"KVPORT_TRACE_DIR={tmp_path}" in err


def _cells_consistent(r: dict) -> None:  # type: ignore[type-arg]
    """The summary fields are what the per-trace tables say."""
    assert set(r["traces"]) == set(TRACES)
    gains = {}
    for name, t in r["traces"].items():
        assert set(t["capacities"]) == {"5%", "10%", "20%"}
        for cell, row in t["capacities"].items():
            for policy in POLICIES:
                assert 0 <= row[f"{policy}_hit_rate"] <= row["optimal_hit_rate"]
            gains[f"{name} {cell}"] = row["default_minus_lru"]
            want = (row[f"{DEFAULT_POLICY}_hit_rate"] - row["lru_hit_rate"]) / row["optimal_hit_rate"]
            assert row["default_minus_lru"] == pytest.approx(want, abs=1e-4)
            assert abs(row["int8_capacity_blocks"] - row["capacity_blocks"] * r["int8"]["blocks_per_raw_block"]) < 1
    assert r["policy"] == DEFAULT_POLICY
    assert r["mean_gain_over_lru"] == pytest.approx(sum(gains.values()) / len(gains), abs=1e-4)
    assert r["worst_cell_vs_lru"] == min(gains.values()) == gains[r["worst_cell"]]
    ten = r["traces"]["conversation"]["capacities"]["10%"]
    assert r["int8_same_bytes_10pct_vs_optimal"] == ten["int8_vs_optimal"]


def _rows(ids: list[list[int]]) -> str:
    return "\n".join(json.dumps({"timestamp": i, "input_length": 512 * len(h), "output_length": 1, "hash_ids": h})
                     for i, h in enumerate(ids)) + "\n"


def test_all_traces_report_every_policy_per_capacity_and_the_summary(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    reqs = [[i % 7, 100 + i % 5, 200 + i] for i in range(60)] + [[0, 100, 300 + i] for i in range(40)]
    (tmp_path / TRACES["conversation"]).write_text(_rows(reqs))
    with lzma.open(tmp_path / f"{TRACES['synthetic']}.xz", "wt") as f:  # a shipped trace is xz-compressed
        f.write(_rows(reqs[::-1]))
    monkeypatch.setenv("KVPORT_TRACE_DIR", str(tmp_path))
    assert main(["bench", "trace", "--set", "traces=all"]) == 0
    rep = json.loads(capsys.readouterr().out)
    c = rep["conditions"]["traces"]
    assert c["synthetic"]["trace"].endswith(".xz")
    assert c["synthetic"]["requests"] == c["conversation"]["requests"] == 100
    _cells_consistent(rep["results"])
    ratio = int8_blocks_per_raw_block()
    assert ratio is None or 1.8 < ratio < 2.0  # int8: a row of D values in D + 3 bytes instead of 2D
    q = rep["results"]["int8"]
    assert q["ppl_delta_pct"] is None or (q["ppl_delta_pct"] >= 0 and q["model"] and q["source"])


def test_all_traces_read_a_named_quality_result_and_refuse_a_bad_one(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    for name in TRACES.values():
        (tmp_path / name).write_text(_rows([[0, 1], [0, 2], [0, 1]]))
    monkeypatch.setenv("KVPORT_TRACE_DIR", str(tmp_path))
    quality = tmp_path / "q.json"
    quality.write_text(json.dumps({"conditions": {"model": "m"}, "codecs": {"int8": {
        "key": "int8", "ppl_delta_pct_code": 0.5, "ppl_delta_pct_prose": 1.25}}}))
    assert main(["bench", "trace", "--set", "traces=all", "--set", f"quality={quality}"]) == 0
    q = json.loads(capsys.readouterr().out)["results"]["int8"]
    assert (q["ppl_delta_pct"], q["model"]) == (1.25, "m") and "prose +1.25%" in q["source"]
    quality.write_text("{}")
    assert main(["bench", "trace", "--set", "traces=all", "--set", f"quality={quality}"]) == 2
    assert "quality" in capsys.readouterr().err
    assert main(["bench", "trace", "--set", "traces=toolagent"]) == 2
    assert "traces" in capsys.readouterr().err


@pytest.mark.skipif(any(default_trace(name=n) is None for n in TRACES.values()),
                    reason="no Mooncake traces (the checkout's traces/, KVPORT_TRACE_DIR or ../shared/traces)")
def test_quick_all_traces_runs(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "trace", "--quick", "--set", "traces=all"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert {t["requests"] for t in rep["conditions"]["traces"].values()} == {1500}
    _cells_consistent(rep["results"])
