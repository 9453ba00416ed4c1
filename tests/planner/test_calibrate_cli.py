"""``kvport calibrate --quick``: a real (small) calibration of the reference model into a profile file."""

from __future__ import annotations

import json

import pytest

from kvport.cli.main import main
from kvport.planner import LinkKind, Profile
from kvport.refmodel import MODEL_ID


@pytest.mark.slow
def test_calibrate_quick_writes_a_usable_profile(tmp_path, model_dir, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KVPORT_HOME", str(tmp_path))
    monkeypatch.setenv("KVPORT_MODEL_DIR", str(model_dir))
    path = tmp_path / "profile.json"
    assert main(["calibrate", "--quick", "--no-codecs", "--threads", "1", "--profile", str(path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    prof = Profile.load(path)
    assert printed == prof.as_dict()
    assert prof.prefill is not None and prof.prefill.model_id == MODEL_ID and prof.prefill.threads == 1
    assert len(prof.prefill.points) == 4 and any(p.start > 0 for p in prof.prefill.points)
    assert prof.prefill.seconds(0, 64) > 0
    kinds = {lk.name: lk.kind for lk in prof.links}
    assert kinds == {"host": LinkKind.TIER, "disk": LinkKind.TIER, "loopback": LinkKind.PEER}
    assert prof.install_bps is not None and prof.install_bps > 0
    assert not (tmp_path / "calibrate" / "kvport-calibrate-disk.bin").exists()
    # the saved profile drives the what-if CLI for the same model
    assert main(["plan", "--model", "smollm2-135m", "--dtype", "fp32", "--tokens", "512", "--cached", "448",
                 "--profile", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["status"] == "ok" and all(o["seconds"] is not None for o in plan["options"])


@pytest.mark.slow
def test_calibrate_takes_codec_quality_from_the_given_results(tmp_path, model_dir, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KVPORT_HOME", str(tmp_path))
    monkeypatch.setenv("KVPORT_MODEL_DIR", str(model_dir))
    results = tmp_path / "int8-only.json"
    results.write_text(json.dumps({
        "conditions": {"model": MODEL_ID, "tokens_per_window": 64, "windows_per_set": 1, "kv_dtype": "fp32"},
        "codecs": {"int8": {"codec": "int8", "key": "int8", "ppl_delta_pct_code": 0.4,
                            "ppl_delta_pct_prose": 0.9}}}))
    path = tmp_path / "profile.json"
    assert main(["calibrate", "--quick", "--threads", "1", "--profile", str(path), "--quality", str(results)]) == 0
    out = capsys.readouterr().out
    prof = Profile.load(path)
    costs = {c.name: c.quality_cost for c in prof.codecs}
    assert costs == {"int8": pytest.approx(0.009), "lossless": 0.0}  # worst set; lossless by construction
    assert str(results) in next(c.quality_source for c in prof.codecs if c.name == "int8")
    left = [line for line in out.splitlines() if "left out" in line]
    assert len(left) == 2 and any("kivi4" in line for line in left) and any("mixed" in line for line in left)
