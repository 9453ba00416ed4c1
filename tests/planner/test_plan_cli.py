"""``kvport plan``: options, choice and crossover from a profile file; fallback without one."""

from __future__ import annotations

import json
import time

from kvport.cli.main import main
from kvport.planner import Link, LinkKind, PrefillModel, Profile, machine_id
from kvport.refmodel import MODEL_ID


def write_profile(path, now: float | None = None) -> None:  # type: ignore[no-untyped-def]
    now = time.time() if now is None else now
    pf = PrefillModel(model_id=MODEL_ID, threads=1, a=0.02, b=2e-3, c=1e-7, d=2e-7, measured_at=now)
    Profile(machine=machine_id(), created=now, prefill=pf,
            links=(Link("loopback", LinkKind.PEER, 500e6, 1e-4, now),)).save(path)


def test_plan_json_from_profile(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    prof = tmp_path / "p.json"
    write_profile(prof)
    args = ["plan", "--model", "smollm2-135m", "--dtype", "fp32", "--tokens", "2048", "--cached", "1984",
            "--profile", str(prof), "--json"]
    assert main([*args, "--bandwidth", "1GB/s"]) == 0
    fast = json.loads(capsys.readouterr().out)
    assert fast["status"] == "ok" and fast["action"] == "load" and fast["choice"] == "load:peer"
    labels = {o["label"]: o["seconds"] for o in fast["options"]}
    assert labels["load:peer"] < labels["recompute"]
    assert main([*args, "--bandwidth", "1MB/s"]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert slow["action"] != "load"  # recompute, or split recomputing nearly all of it
    assert slow["crossover"]["suffix_tokens"] == 64
    assert slow["crossover"]["recompute_wins_at_shortest"] is True
    # per token: recompute ~2 ms, moving 46 KB at 1 MB/s ~46 ms: recompute wins at every length
    assert slow["crossover"]["lengths"] == []


def test_plan_text_names_choice_and_crossover(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    prof = tmp_path / "p.json"
    write_profile(prof)
    assert main(["plan", "--model", "smollm2-135m", "--dtype", "fp32", "--tokens", "1024", "--cached", "960",
                 "--bandwidth", "20MB/s", "--profile", str(prof)]) == 0
    out = capsys.readouterr().out
    assert "choice" in out and "crossover" in out and "recompute" in out and "load:peer" in out


def test_plan_without_profile_falls_back(tmp_path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KVPORT_PROFILE", str(tmp_path / "none.json"))
    assert main(["plan", "--model", "smollm2-135m", "--tokens", "1024", "--cached", "960",
                 "--bandwidth", "10GB/s", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "missing" and out["action"] == "recompute"
    assert "safe default" in out["reason"]


def test_plan_bad_inputs_exit_2(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    prof = tmp_path / "p.json"
    write_profile(prof)
    base = ["plan", "--model", "smollm2-135m", "--profile", str(prof)]
    assert main([*base, "--tokens", "-5", "--cached", "0"]) == 2
    assert main([*base, "--tokens", "100", "--cached", "200"]) == 2
    assert main([*base, "--tokens", "100", "--cached", "50", "--bandwidth", "0MB/s"]) == 2
    (tmp_path / "bad.json").write_text("{")
    assert main(["plan", "--model", "smollm2-135m", "--tokens", "10", "--cached", "5", "--profile",
                 str(tmp_path / "bad.json")]) == 2
    assert "error" in capsys.readouterr().err
