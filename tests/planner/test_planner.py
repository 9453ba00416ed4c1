"""The live planner: recalibration changes decisions; missing/stale profiles fall back to recompute."""

from __future__ import annotations

import pytest

from kvport import metrics
from kvport.config import Settings
from kvport.errors import PlanInputError
from kvport.planner import Action, Cached, Planner, ProfileStatus, Request
from tests.planner.conftest import MACHINE, NOW, linear_prefill, profile_with


def planner_for(profile, now: float = NOW) -> Planner:  # type: ignore[no-untyped-def]
    return Planner(profile, machine=MACHINE, clock=lambda: now)


def test_link_that_slows_down_changes_the_decision(spec) -> None:  # type: ignore[no-untyped-def]
    pl = planner_for(profile_with(1e9, linear_prefill(spec.model_id, a=0.02), latency=1e-3))
    req = Request(1024, spec, (Cached("peer", 1024),))
    assert pl.decide(req).action is Action.LOAD
    bw = []
    for _ in range(8):  # the link now moves 4 MB in 4 s: 1 MB/s, far below the 46 MB/s crossover
        bw.append(pl.observe_transfer(4_000_000, 4.0 + 1e-3, "peer").bandwidth)
    assert bw == sorted(bw, reverse=True) and bw[-1] == pytest.approx(1e6, rel=0.15)
    assert pl.decide(req).action is Action.RECOMPUTE
    for _ in range(20):  # and recovers (averaging seconds per byte: recovery takes more transfers)
        last = pl.observe_transfer(40_000_000, 0.04 + 1e-3, "peer")
    assert last.bandwidth > 300e6
    assert pl.decide(req).action is not Action.RECOMPUTE


def test_slower_prefill_changes_the_decision(spec) -> None:  # type: ignore[no-untyped-def]
    pl = planner_for(profile_with(2e6, linear_prefill(spec.model_id, a=0.02), latency=1e-3))
    req = Request(1024, spec, (Cached("peer", 1024),))
    assert pl.decide(req).action is Action.RECOMPUTE  # 1.04 s vs 23.6 s of transfer
    for _ in range(10):  # the engine measures prefills 3x slower than calibrated (e.g. a busy box)
        scale = pl.observe_prefill(512, 3 * (0.02 + 0.512))
    assert scale == pytest.approx(3.0, rel=0.1)
    d = pl.decide(req)
    assert d.action is not Action.RECOMPUTE
    assert d.seconds("recompute") == pytest.approx(3 * 1.044, rel=0.1)


def test_unknown_link_is_learned_from_observations(spec) -> None:  # type: ignore[no-untyped-def]
    pl = planner_for(profile_with(1e9, linear_prefill(spec.model_id, a=0.02)))
    req = Request(1024, spec, (Cached("remote", 1024),))
    d = pl.decide(req)
    assert d.action is Action.RECOMPUTE and "never measured" in d.reason
    pl.observe_transfer(100_000_000, 0.1, "remote")
    assert pl.decide(req).action is Action.LOAD
    assert pl.profile is not None and pl.profile.link("remote").source == "observed"  # type: ignore[union-attr]


def test_missing_profile_falls_back_to_recompute(spec, tmp_path) -> None:  # type: ignore[no-untyped-def]
    settings = Settings.from_env({"KVPORT_HOME": str(tmp_path)})
    pl = Planner.from_settings(settings)
    d = pl.decide(Request(4096, spec, (Cached("peer", 4000),)))
    assert pl.status() is ProfileStatus.MISSING and d.status is ProfileStatus.MISSING
    assert d.action is Action.RECOMPUTE
    assert "safe default" in d.reason and "kvport calibrate" in d.reason
    assert all(o.seconds is None for o in d.options)
    assert pl.observe_prefill(100, 1.0) is None  # nothing to correct


def test_malformed_profile_file_falls_back(spec, tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "profile.json").write_text("{broken")
    pl = Planner.from_settings(Settings.from_env({"KVPORT_HOME": str(tmp_path)}))
    assert pl.decide(Request(64, spec, (Cached("peer", 60),))).action is Action.RECOMPUTE


def test_stale_profile_falls_back_and_says_so(spec) -> None:  # type: ignore[no-untyped-def]
    prof = profile_with(10e9, linear_prefill(spec.model_id))
    req = Request(1024, spec, (Cached("peer", 1024),))
    assert planner_for(prof, NOW + 3600).decide(req).action is Action.LOAD
    old = planner_for(prof, NOW + 30 * 86400).decide(req)
    assert old.status is ProfileStatus.STALE and old.action is Action.RECOMPUTE
    assert "old" in old.warnings[0] and "safe default" in old.reason
    other = Planner(prof, machine="another-cpu x64", clock=lambda: NOW).decide(req)
    assert other.status is ProfileStatus.STALE and other.action is Action.RECOMPUTE
    assert "another machine" in other.reason


def test_prefill_for_another_model_is_not_used(spec) -> None:  # type: ignore[no-untyped-def]
    pl = planner_for(profile_with(10e9, linear_prefill("some/other-model")))
    d = pl.decide(Request(1024, spec, (Cached("peer", 1024),)))
    assert d.action is Action.RECOMPUTE and "some/other-model" in d.reason


def test_decisions_reach_metrics_and_logs(spec, caplog) -> None:  # type: ignore[no-untyped-def]
    pl = planner_for(profile_with(10e9, linear_prefill(spec.model_id)))
    before = metrics.sample("planner_decisions_total", {"action": "load"}) or 0.0
    with caplog.at_level("INFO", logger="kvport.planner"):
        d = pl.decide(Request(1024, spec, (Cached("peer", 1024),)))
    assert d.action is Action.LOAD
    assert metrics.sample("planner_decisions_total", {"action": "load"}) == before + 1
    assert any(d.reason in r.getMessage() for r in caplog.records)
    pl.observe_transfer(1_000_000, 0.01, "peer")
    assert metrics.sample("planner_link_bandwidth_bytes_per_second", {"link": "peer"}) == pytest.approx(
        pl.profile.link("peer").bandwidth)  # type: ignore[union-attr]


@pytest.mark.parametrize("call", [
    lambda p: p.observe_transfer(0, 1.0, "peer"),
    lambda p: p.observe_transfer(100, 0.0, "peer"),
    lambda p: p.observe_transfer(100, float("nan"), "peer"),
    lambda p: p.observe_transfer(100, 1.0, ""),
    lambda p: p.observe_prefill(0, 1.0),
    lambda p: p.observe_prefill(10, -1.0),
    lambda p: p.observe_prefill(10, 1.0, cached=-3),
])
def test_bad_observations_are_typed(spec, call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PlanInputError):
        call(planner_for(profile_with(1e9, linear_prefill(spec.model_id))))


def test_bad_planner_settings() -> None:
    with pytest.raises(PlanInputError):
        Planner(None, alpha=0.0)
    with pytest.raises(PlanInputError):
        Planner(None, max_age_s=0)
