"""Codec quality costs from ``kvport eval quality`` results: parsing, merging, the shipped defaults,
and calibration using them (a codec without a result stays out of the profile)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvport.cli.main import main
from kvport.codec import codec_ids, codec_key, get_codec
from kvport.errors import ProfileError
from kvport.planner.calibrate import calibrate, codecs_left_out, measure_codecs, profiled_codecs
from kvport.planner.quality import QualityTable, default_results, load_results, parse_results
from kvport.refmodel import MODEL_ID
from kvport.spec import from_preset

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def result(codecs: dict[str, dict[str, object]], model: str = MODEL) -> dict[str, object]:
    """A result shaped as ``kvport eval quality --json`` writes it (only the fields calibration reads)."""
    return {"provenance": {"date": "2026-12-01T12:00:00Z", "command": "kvport eval quality ..."},
            "conditions": {"model": model, "tokens_per_window": 1024, "windows_per_set": 4, "kv_dtype": "fp32"},
            "codecs": {name: {"codec": name.split("(")[0], "key": name, **figs} for name, figs in codecs.items()}}


def write(tmp_path, name: str, data: object):  # type: ignore[no-untyped-def]
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_cost_is_the_worst_text_set_and_noise_below_zero_counts_as_zero() -> None:
    t = parse_results(result({"int8": {"ppl_delta_pct_code": -0.03, "ppl_delta_pct_prose": -0.10},
                              "kivi4": {"ppl_delta_pct_code": 2.5, "ppl_delta_pct_prose": 3.0}}), "r.json")
    assert t.model == MODEL
    kivi = t.lookup("kivi4", lossless=False)
    assert kivi is not None and math.isclose(kivi.cost, 0.03)
    assert "r.json" in kivi.source and "prose +3.00%" in kivi.source and "4x1024" in kivi.source
    int8 = t.lookup("int8", lossless=False)
    assert int8 is not None and int8.cost == 0.0
    lossless = t.lookup("lossless", lossless=True)  # not in the file: 0 by construction
    assert lossless is not None and lossless.cost == 0.0
    assert t.lookup("mixed", lossless=False) is None


def test_a_result_for_other_params_does_not_cost_the_default_codec() -> None:
    other = codec_key(get_codec("kivi4", group=128))
    t = parse_results(result({other: {"ppl_delta_pct_code": 4.7, "ppl_delta_pct_prose": 3.3}}), "r")
    default = codec_key(get_codec("kivi4"))
    assert default != other and t.lookup(default, lossless=False) is None
    assert f"measured: {other}" in t.why_missing(default)
    assert set(codecs_left_out(t, ("kivi4",))) == {"kivi4"}


def test_several_files_merge_in_order(tmp_path) -> None:  # type: ignore[no-untyped-def]
    a = write(tmp_path, "a.json", result({"int8": {"ppl_delta_pct_code": 1.0}, "kivi4": {"ppl_delta_pct_code": 3.0}}))
    b = write(tmp_path, "b.json", result({"kivi4": {"ppl_delta_pct_code": 2.0}}))
    t = load_results([a, b])
    assert t.files == (str(a), str(b))
    got = {k: (c.cost, c.source.split(":")[0]) for k, c in t.costs.items()}
    assert got == {"int8": (0.01, str(a)), "kivi4": (0.02, str(b))}
    other = write(tmp_path, "c.json", result({"int8": {"ppl_delta_pct_code": 1.0}}, model="someone/else"))
    with pytest.raises(ProfileError, match="different models"):
        load_results([a, other])


@pytest.mark.parametrize("text, match", [
    ("{not json", "not JSON"),
    ("[]", "JSON object"),
    (json.dumps({"codecs": {}}), "conditions.model"),
    (json.dumps(result({})), "no codecs"),
    (json.dumps({**result({}), "codecs": {"int8": {"codec": "int8"}}}), "has no key"),
    (json.dumps(result({"int8": {"ppl_delta_pct_code": "0.1"}})), "ppl_delta_pct_code"),
    (json.dumps(result({"int8": {"ppl_delta_pct_code": None}})), "ppl_delta_pct_code"),
    (json.dumps(result({"int8": {"ratio": 1.9}})), "no ppl_delta_pct_"),
])
def test_malformed_results_are_one_line_profile_errors(tmp_path, text, match) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "q.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=match) as err:
        load_results([path])
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_missing_file_is_a_profile_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ProfileError, match="cannot read quality results"):
        load_results([tmp_path / "nope.json"])


def test_shipped_defaults_cover_every_registered_codec() -> None:
    t = default_results()
    assert t.model == MODEL_ID
    for name in codec_ids():
        codec = get_codec(name)
        cost = t.lookup(codec_key(codec), codec.lossless)
        assert cost is not None, name
        assert codec.lossless or codec_key(codec) in t.costs  # lossy ones measured, not assumed
    assert codecs_left_out(t) == {}
    assert "mixed" in profiled_codecs() and "raw" not in profiled_codecs()


def test_shipped_defaults_say_where_they_come_from() -> None:
    from importlib import resources

    from kvport.planner.quality import DEFAULT_RESULTS

    data = json.loads(resources.files("kvport.planner").joinpath(DEFAULT_RESULTS).read_text())
    prov = data["provenance"]
    assert prov["command"].startswith("kvport eval quality") and prov["date"] and prov["commit"]
    assert data["conditions"]["model"] == MODEL_ID
    assert set(data["codecs"]) == set(codec_ids())


def test_measured_codecs_take_costs_from_the_results_and_leave_unmeasured_ones_out(tmp_path) -> None:  # type: ignore[no-untyped-def]
    table = load_results([write(tmp_path, "mine.json", result({"int8": {"ppl_delta_pct_code": 0.5,
                                                                        "ppl_delta_pct_prose": 0.25}}))])
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 3, 128, 64, generator=gen)
    v = torch.randn(2, 3, 128, 64, generator=gen)
    costs = measure_codecs(k, v, table, names=("int8", "kivi4", "lossless"), trials=1)
    by_name = {c.name: c for c in costs}
    assert set(by_name) == {"int8", "lossless"}
    assert by_name["int8"].quality_cost == pytest.approx(0.005) and "mine.json" in by_name["int8"].quality_source
    assert by_name["lossless"].quality_cost == 0.0
    left = codecs_left_out(table, ("int8", "kivi4", "lossless"))
    assert set(left) == {"kivi4"} and "no quality result for kivi4" in left["kivi4"]


def test_calibrate_refuses_results_of_another_model_before_measuring() -> None:
    spec = from_preset("smollm2-135m", dtype="fp32")
    with pytest.raises(ProfileError, match="not the profiled"):
        calibrate(None, None, spec, quality=QualityTable("someone/else"))  # model unused: fails first


def test_cli_bad_quality_file_is_one_line_exit_2(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    bad = write(tmp_path, "bad.json", {"codecs": {}})
    assert main(["calibrate", "--quality", str(bad), "--profile", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(bad) in err and "conditions.model" in err
    assert not (tmp_path / "p.json").exists()
