import json

import pytest

from kvport.bench.trace import belady, default_trace, replay
from kvport.cli.main import main


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
    # slru (the default) does as LRU here: 4 (6 - 5/2 = 3.5) is below 6 (11 - 6/2 = 8)
    assert r["policy"] == "slru"
    assert r["hit_rate"] == r["slru_hit_rate"] == r["lru_hit_rate"] == round(6 / 13, 5)
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
            for name in ("lru", "lfu", "slru"):
                assert 0 <= row[f"{name}_hit_rate"] <= row["optimal_hit_rate"]


def test_replay_counts_prefix_hits_only_and_belady_is_an_upper_bound() -> None:
    reqs = [[0, 1, 2], [0, 3], [0, 1, 2], [0, 3, 4], [0, 1, 5]]
    assert replay(reqs, capacity=100)["hit_rate"] == (1 + 3 + 2 + 2) / 14
    for cap in (2, 3, 4):
        for policy in ("lru", "lfu", "slru"):
            assert belady(reqs, cap) >= replay(reqs, cap, policy)["hit_rate"]


@pytest.mark.skipif(default_trace() is None, reason="the Mooncake trace is not in ../shared/traces")
def test_quick_default_trace_runs(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "trace", "--quick"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["conditions"]["requests"] == 1500
    assert 0 <= rep["results"]["hit_rate"] <= rep["results"]["optimal_hit_rate"] <= 1
