"""Re-shard with real rank processes of the transformers engine (the reference model, transformers'
``tp_plan`` over gloo): prefill TP=3 -> decode TP=1 and TP=1 -> TP=3 answer as one process does,
every decode rank loads the whole prompt prefix, and the wire carries the KV's size exactly once."""

import json

import pytest

from kvport.cli.main import main


@pytest.mark.slow
def test_reshard_between_tp3_and_tp1_answers_as_one_process(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "reshard.json"
    args = ["bench", "reshard", "--quick", "--set", "tokens=97", "--set", "max_new_tokens=6",
            "--set", "cases=3-1,1-3", "--json", str(path)]
    assert main(args) == 0
    report = json.loads(path.read_text())
    assert json.loads(capsys.readouterr().out) == report and report["suite"] == "reshard"
    kv = report["limits"]["kv_bytes"]
    assert kv == 6 * 30 * 2 * 3 * 16 * 64 * 4  # 6 full blocks of 16 tokens (the 97th token is computed)
    assert len(report["limits"]["one_process_tokens"]) == 6
    for case in ("tp3_to_tp1", "tp1_to_tp3"):
        r = report["results"][case]
        assert r["errors"] == []
        assert r["tokens_equal"] is True
        assert r["cached_tokens"] == 96  # every decode rank loaded every block: nothing recomputed
        assert r["wire_bytes"] == r["received_bytes"] == kv  # each byte on the wire once
        assert sorted(h for _, *h in r["pieces"]) == [[0, 1], [1, 2], [2, 3]]  # each head exactly once
    assert report["results"]["all_tokens_equal"] is True


@pytest.mark.slow
def test_a_prefill_rank_lost_before_its_hand_off_makes_the_group_recompute_the_same_answer(  # type: ignore[no-untyped-def]
        capsys, tmp_path) -> None:
    """TP 3 -> 3, prefill rank 1 sends nothing: decode rank 1 names its missing head at its deadline,
    ranks 0 and 2 hold theirs, and the group agrees on no prefix (one all-reduce) and recomputes:
    the answer stays the one process's, and nothing waits past the deadline."""
    path = tmp_path / "reshard.json"
    args = ["bench", "reshard", "--quick", "--set", "tokens=97", "--set", "max_new_tokens=6", "--set", "cases=3-3",
            "--set", "drop=1", "--set", "take_s=3", "--json", str(path)]
    assert main(args) == 0
    capsys.readouterr()
    report = json.loads(path.read_text())
    r = report["results"]["tp3_to_tp3"]
    assert r["tokens_equal"] is True
    assert r["cached_tokens"] == 0  # ranks 0 and 2 held their heads, but a forward is the group's
    assert r["wire_bytes"] == r["received_bytes"] == 2 * report["limits"]["kv_bytes"] // 3  # the two that came
    assert len(r["errors"]) == 1 and "heads [(1, 2)] of [1, 2) never arrived within 3 s" in r["errors"][0]
