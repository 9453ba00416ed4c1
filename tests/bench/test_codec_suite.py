import json

import pytest

from kvport.cli.main import main


@pytest.mark.slow
def test_codec_suite_report_shape(capsys, tmp_path, model_dir) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "codec.json"
    argv = ["bench", "codec", "--quick", "--json", str(path), "--set", "tokens=64", "--set", "windows=1",
            "--set", 'codecs=["lossless", "int8", "mixed"]']
    assert main(argv) == 0
    saved = json.loads(path.read_text())
    assert json.loads(capsys.readouterr().out) == saved
    assert saved["suite"] == "codec" and set(saved) == {"format", "suite", "conditions", "limits", "results"}
    assert saved["limits"]["memcpy_gbps"] > 0
    cond = saved["conditions"]  # how it was made: the report says, and the command runs it again
    assert cond["mode"] == "quick" and cond["commit"]  # a checkout: its commit
    assert cond["command"] == ("kvport bench codec --quick --set 'codecs=[\"lossless\", \"int8\", \"mixed\"]' "
                               "--set tokens=64 --set windows=1")
    assert saved["conditions"]["kv_shape"] == [30, 3, 64, 64]
    codecs = saved["results"]["codecs"]
    assert set(codecs) == {"lossless", "int8", "mixed"}
    for name, r in codecs.items():
        for key in ("ratio", "encode_gbps", "decode_gbps", "ppl_delta_pct_code", "ppl_delta_pct_prose",
                    "top1_agreement_code", "kl_prose", "encode_vs_memcpy"):
            assert r[key] is not None, (name, key)
        assert r["ratio"] > 1.0
    assert codecs["lossless"]["max_abs_err_vs_amax"] == 0.0
