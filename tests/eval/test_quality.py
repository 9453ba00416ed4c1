"""The quality harness on the real reference model, kept small (a few hundred tokens)."""

from __future__ import annotations

import json
import re

import pytest

from kvport.cli.main import main
from kvport.codec import get_codec
from kvport.eval import QualityOptions, evaluate, provenance
from kvport.eval.texts import windows


@pytest.fixture(scope="module")
def model_and_tok(model_dir):  # type: ignore[no-untyped-def]
    from kvport.refmodel import load

    return load(model_dir)


@pytest.mark.slow
def test_raw_is_the_baseline_and_int8_is_close(model_and_tok) -> None:  # type: ignore[no-untyped-def]
    model, tok = model_and_tok
    rep = evaluate(model, tok, [get_codec("raw"), get_codec("int8"), get_codec("kivi4")],
                   QualityOptions(tokens=128, windows=1))
    d = rep.as_dict()
    assert set(d["baseline_ppl"]) == {"code", "prose"}
    raw, int8, kivi = d["codecs"]["raw"], d["codecs"]["int8"], d["codecs"]["kivi4"]
    for name in ("code", "prose"):
        # fp32 KV through the raw codec is bit-exact: the same forward as the baseline
        assert raw[f"ppl_delta_pct_{name}"] == 0.0 and raw[f"top1_agreement_{name}"] == 1.0
        assert abs(int8[f"ppl_delta_pct_{name}"]) < 1.0 and int8[f"top1_agreement_{name}"] > 0.9
        assert kivi[f"kl_{name}"] > int8[f"kl_{name}"] > 0.0  # 4 bits lose more than 8
    assert 1.85 < int8["ratio"] < 1.95
    assert kivi["ratio"] > 3.5  # two 64-token groups per range
    assert rep.conditions["tokens_per_window"] == 128 and rep.conditions["windows_per_set"] == 1


@pytest.mark.slow
def test_cli_eval_quality_prints_json(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "q.json"
    assert main(["eval", "quality", "--codec", "mixed", "--tokens", "96", "--windows", "1", "--sets", "prose",
                 "--json", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == json.loads(path.read_text())
    q = out["codecs"]["mixed"]
    assert q["params"]["sinks"] == 4 and q["ppl_delta_pct_prose"] is not None and q["ratio"] > 1.0
    assert out["provenance"]["command"] == ("kvport eval quality --codec mixed --tokens 96 --windows 1 "
                                            "--sets prose --kv-dtype fp32")
    assert main(["eval", "quality", "--codec", "nope", "--tokens", "8"]) == 2


def test_provenance_names_the_command_date_and_source() -> None:
    p = provenance(["eval", "quality", "--codec", "a b"])
    assert p["command"] == "kvport eval quality --codec 'a b'"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", p["date"])
    assert p["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", p["commit"])
    assert all(f.startswith("src/kvport/") for f in p["uncommitted"])


def test_text_windows_are_deterministic(model_and_tok) -> None:  # type: ignore[no-untyped-def]
    _, tok = model_and_tok
    for name in ("code", "prose"):
        a = windows(tok, name, 64, 2)
        b = windows(tok, name, 64, 2)
        assert [w.tolist() for w in a] == [w.tolist() for w in b]
        assert all(w.numel() == 64 for w in a) and a[0].tolist() != a[1].tolist()
