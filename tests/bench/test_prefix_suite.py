import json

import pytest

from kvport.cli.main import main


@pytest.mark.slow
def test_prefix_suite_report_shape(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "prefix.json"
    args = ["bench", "prefix", "--quick", "--set", "tokens=128", "--set", "cached=96", "--set", "trials=1",
            "--set", "vllm=false", "--json", str(path)]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads(path.read_text())
    assert printed == saved and saved["suite"] == "prefix"
    assert saved["limits"]["memcpy_gbps"] > 0
    hf = saved["results"]["hf"]
    assert hf["cached_tokens"] == 96 and hf["computed_tokens_hit"] == 32
    assert hf["first_token_equal"] is True
    for k in ("ttft_speedup", "zero_hit_overhead", "load_vs_memcpy"):
        assert isinstance(hf[k], float)
    assert saved["results"]["vllm"]["ttft_speedup"] is None  # skipped: never guessed
    assert "reason" in saved["results"]["vllm"]
