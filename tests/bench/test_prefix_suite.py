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


def test_prefix_engine_option_checked(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "prefix", "--quick", "--set", "engine=tgi"]) != 0
    assert "engine=tgi" in capsys.readouterr().err
    assert main(["bench", "prefix", "--quick", "--set", "engine=sglang", "--set", "attention=flash"]) != 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_prefix_sglang_report_shape(capsys, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """kvport's HiCache backend vs SGLang's file backend vs recompute, in real SGLang servers (small)."""
    pytest.importorskip("sglang")
    from pathlib import Path

    shims = Path(__file__).resolve().parents[1] / "support" / "sglang_cpu"
    monkeypatch.setenv("PYTHONPATH", str(shims))  # the stand-ins on this CPU: for the SGLang servers
    monkeypatch.syspath_prepend(str(shims))  # and for the in-process part
    path = tmp_path / "prefix.json"
    args = ["bench", "prefix", "--quick", "--set", "engine=sglang", "--set", "tokens=384", "--set", "cached=320",
            "--set", "trials=1", "--json", str(path)]
    assert main(args) == 0
    saved = json.loads(path.read_text())
    sg = saved["results"]["sglang"]
    assert "reason" not in sg, sg["reason"]
    assert set(saved["results"]) == {"sglang"} and saved["conditions"]["engine"] == "sglang"
    assert sg["tokens_equal"] is True
    assert sg["kvport"]["storage_tokens"] == [320] and sg["file"]["storage_tokens"] == [320]  # SGLang prefetches >= 256
    for k in ("ttft_speedup", "ttft_vs_file_backend", "raw_disk_read_gbps"):
        assert isinstance(sg[k], float) and sg[k] > 0
    assert sg["backend_only"]["load_s"]["kvport"] > 0 and sg["backend_only"]["memcpy_gbps"] > 0
