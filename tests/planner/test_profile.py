"""Profile JSON round trip, malformed files as ProfileError, and the prefill fit."""

from __future__ import annotations

import json

import pytest

from kvport.errors import ProfileError
from kvport.planner import CodecCost, Link, LinkKind, PrefillModel, PrefillPoint, Profile, fit_prefill
from tests.planner.conftest import NOW, linear_prefill, profile_with


def test_round_trip(tmp_path, spec) -> None:  # type: ignore[no-untyped-def]
    pf = PrefillModel(model_id=spec.model_id, threads=2, a=0.01, b=1e-3, c=1e-7, d=3e-7, x=0.002, measured_at=NOW,
                      scale=1.2, points=(PrefillPoint(0, 64, 0.08), PrefillPoint(64, 96, 0.05)))
    codec = CodecCost("int8", 3.9, 1e9, 2e9, 0.0008, NOW)
    prof = profile_with(1e8, pf, latency=2e-4, codecs=(codec,), install_bps=5e9)
    path = tmp_path / "sub" / "profile.json"
    prof.save(path)
    assert Profile.load(path) == prof
    assert not (tmp_path / "sub" / "profile.json.tmp").exists()


@pytest.mark.parametrize("text, match", [
    ("{not json", "malformed profile JSON"),
    ("[]", "JSON object"),
    (json.dumps({"version": 99}), "version"),
    (json.dumps({"version": 1, "machine": "m"}), "malformed"),
    (json.dumps({"version": 1, "machine": "m", "created": 1, "links": [
        {"name": "peer", "kind": "peer", "bandwidth": 0, "latency": 0, "measured_at": 1}]}), "bandwidth"),
    (json.dumps({"version": 1, "machine": "m", "created": 1, "links": [
        {"name": "peer", "kind": "warp", "bandwidth": 1, "latency": 0, "measured_at": 1}]}), "malformed"),
    (json.dumps({"version": 1, "machine": "m", "created": 1, "prefill": {
        "model_id": "x", "threads": 1, "a": -1, "b": 1, "c": 0, "d": 0, "measured_at": 1}}), "prefill.a"),
])
def test_malformed_profiles_are_profile_errors(tmp_path, text, match) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=match):
        Profile.load(path)


def test_missing_file_is_profile_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ProfileError, match="kvport calibrate"):
        Profile.load(tmp_path / "nope.json")


def test_entries_validate(spec) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ProfileError):
        Link("peer", LinkKind.PEER, float("inf"), 0.0, NOW)
    with pytest.raises(ProfileError):
        Link("peer", LinkKind.PEER, 1e9, -1.0, NOW)
    with pytest.raises(ProfileError):
        CodecCost("int8", 0.0, 1e9, 1e9, 0.0, NOW)
    with pytest.raises(ProfileError):
        PrefillModel(model_id="m", threads=1, a=0, b=0, c=0, d=0, measured_at=NOW)
    with pytest.raises(ProfileError, match="duplicate"):
        profile_with(1e9, linear_prefill(spec.model_id)).__class__(
            machine="m", created=NOW, links=(Link("a", LinkKind.PEER, 1, 0, NOW),) * 2)


def test_fit_recovers_exact_coefficients() -> None:
    a, b, c, d, x = 0.015, 8e-4, 3e-7, 5e-7, 0.01
    truth = PrefillModel(model_id="m", threads=2, a=a, b=b, c=c, d=d, x=x, measured_at=NOW)
    pts = [PrefillPoint(0, n, truth.raw_seconds(0, n)) for n in (32, 128, 512, 1024, 2048)]
    pts += [PrefillPoint(s, s + 64, truth.raw_seconds(s, s + 64)) for s in (256, 1024, 1984)]
    fit = fit_prefill(pts, model_id="m", threads=2, measured_at=NOW)
    for name, want in zip("abcdx", (a, b, c, d, x), strict=True):
        assert getattr(fit, name) == pytest.approx(want, rel=1e-6)
    assert fit.points == tuple(pts)


def test_fit_stays_non_negative_on_noisy_linear_data() -> None:
    pts = [PrefillPoint(0, n, 1e-3 * n * f) for n, f in ((100, 1.05), (200, 0.97), (400, 1.02), (800, 0.99))]
    fit = fit_prefill(pts, model_id="m", threads=1, measured_at=NOW)
    assert min(fit.a, fit.b, fit.c, fit.d) >= 0
    assert fit.raw_seconds(0, 600) == pytest.approx(0.6, rel=0.05)


def test_fit_needs_three_points() -> None:
    with pytest.raises(ProfileError):
        fit_prefill([PrefillPoint(0, 10, 0.1), PrefillPoint(0, 20, 0.2), PrefillPoint(0, 30, 0.0)],
                    model_id="m", threads=1, measured_at=NOW)
