"""Traces read strictly, the sweep's grid and answer, and ``kvport simulate`` as a user runs it."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest

from kvport.cli.main import main
from kvport.errors import SimInputError
from kvport.sim import SLO, Deployment, FittedCompute, LinkSpec, TraceRequest, parse_lines, read_trace, write_trace
from kvport.sim.deployment import LinearPrefill
from kvport.sim.sweep import Grid, Ratio, sweep
from kvport.spec import from_preset
from kvport.units import parse_bandwidth


def line(**kw: object) -> str:
    row: dict[str, object] = {"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [0, 1]}
    row.update(kw)
    return json.dumps({k: v for k, v in row.items() if v is not None})


def test_a_mooncake_line_is_read_with_its_blocks() -> None:
    (r,) = parse_lines([line(timestamp=1500, input_length=1100, hash_ids=[4, 5, 6])])
    assert r.arrival_s == 1.5 and r.input_tokens == 1100 and r.output_tokens == 8
    assert r.full_blocks(512) == (4, 5)  # the third id covers a partial block


@pytest.mark.parametrize(("bad", "field"), [
    ("{not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    (line(timestamp=None), "'timestamp'"),
    (line(timestamp=-1), "'timestamp'"),
    (line(input_length=0), "'input_length'"),
    (line(input_length="12"), "'input_length'"),
    (line(output_length=None), "'output_length'"),
    (line(hash_ids=[1, -2]), "'hash_ids'"),
    (line(hash_ids="0,1"), "'hash_ids'"),
    (line(input_length=1 << 30), "'input_length'"),
])
def test_a_malformed_line_names_its_line_and_field(bad: str, field: str) -> None:
    with pytest.raises(SimInputError, match=f"t line 2: .*{field}"):
        parse_lines([line(), bad], name="t")


def test_out_of_order_timestamps_are_refused() -> None:
    with pytest.raises(SimInputError, match="t line 2: field 'timestamp' 500 ms is before the previous line's 1000"):
        parse_lines([line(timestamp=1000), line(timestamp=500)], name="t")


def test_after_must_name_an_earlier_request() -> None:
    with pytest.raises(SimInputError, match="'after'"):
        parse_lines([line(after=0)], name="t")
    with pytest.raises(SimInputError, match="'after'"):
        parse_lines([line(), line(after=1)], name="t")
    _, b = parse_lines([line(), line(after=0, delay_ms=250)])
    assert b.after == 0 and b.delay_s == 0.25


def test_empty_trace_and_bad_scale_are_refused() -> None:
    with pytest.raises(SimInputError, match="no requests"):
        parse_lines(["", "  "], name="t")
    with pytest.raises(SimInputError, match="scale"):
        parse_lines([line()], scale=0.0)


def test_write_then_read_gives_the_same_requests(tmp_path: Path) -> None:
    reqs = [TraceRequest(0.0, 100, 4, (1, 2)), TraceRequest(0.5, 200, 8, (1, 3), after=0, delay_s=0.1, session="s")]
    write_trace(tmp_path / "t.jsonl", reqs)
    assert read_trace(tmp_path / "t.jsonl") == reqs
    with lzma.open(tmp_path / "t.jsonl.xz", "wt") as f:
        f.write((tmp_path / "t.jsonl").read_text())
    assert read_trace(tmp_path / "t.jsonl.xz", scale=2.0)[1].arrival_s == 1.0


def test_sweep_grid_parses_and_refuses_nonsense() -> None:
    g = Grid.parse("ratio=1:1,1:2,2c; tier=1GiB,2GiB; link=25Gbps", parse_bandwidth)
    assert [r.label for r in g.ratios] == ["1:1", "1:2", "2c"]
    assert g.tier_bytes == (1 << 30, 2 << 30) and g.link_bps == (25e9 / 8,)
    for bad in ("tier=1GiB", "ratio=1:0", "ratio=x", "ratio=1:1;speed=2", "ratio=1:1;tier"):
        with pytest.raises(SimInputError):
            Grid.parse(bad, parse_bandwidth)
    assert Ratio.parse("3c") == Ratio(3, 0)


def test_sweep_finds_that_a_decode_bound_trace_wants_more_decode_engines() -> None:
    # prefill is cheap, each answer takes 45 steps of 20 ms (0.9 s) on an engine decoding one at a
    # time, and one arrives every 0.5 s: one decode engine falls behind, two keep up, four keep up
    # with devices to spare; so 1:2 has the most goodput per device
    spec = from_preset("llama-3.2-1b")
    fast = FittedCompute(LinearPrefill(0.0, 1e-5), 0.02)
    base = Deployment(spec, fast, fast, link=LinkSpec(1e12), max_batch=1, block_tokens=16, slo=SLO(0.5, 0.1))
    trace = [TraceRequest(0.5 * i, 64, 45, (i,)) for i in range(40)]
    out = sweep(base, Grid((Ratio(1, 1), Ratio(1, 2), Ratio(1, 4))), trace)
    per = {c["ratio"]: c["goodput_rps_per_device"] for c in out["cells"]}
    assert per["1:2"] > per["1:1"] and per["1:2"] > per["1:4"]
    assert out["best"]["ratio"] == "1:2"


def _trace_file(tmp_path: Path, n: int = 30) -> Path:
    p = tmp_path / "small.jsonl"
    p.write_text("".join(line(timestamp=200 * i, input_length=2048 + 64 * i, output_length=16,
                              hash_ids=[0, 1, 2, 100 + i, 200 + i]) + "\n" for i in range(n)))
    return p


def test_simulate_command_reports_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "--trace", str(_trace_file(tmp_path)), "--model", "llama-3.1-8b", "--device", "h100",
               "--prefill", "1", "--decode", "2", "--link", "100Gbps",
               "--tier", "pool:shared:1TiB:100Gbps:0.0002", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    r = out["results"]
    assert r["requests"] == r["completed"] == 30
    assert out["conditions"]["compute"].startswith("roofline (h100")
    # the shared 3-block prefix (1536 tokens) of every request after the first
    assert r["hit_rate_tokens"] == pytest.approx(29 * 1536 / sum(2048 + 64 * i for i in range(30)), abs=1e-4)
    assert 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p90"]
    assert r["bytes"]["handoff"] > 0


def test_simulate_sweep_picks_a_cell(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "--trace", str(_trace_file(tmp_path)), "--sweep", "ratio=1:1,2:1,2c", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)["sweep"]
    assert len(out["cells"]) == 3 and out["best"]["ratio"] in {"1:1", "2:1", "2c"}


@pytest.mark.parametrize(("args", "message"), [
    (["--device", "tpu9"], "unknown device"),
    (["--tier", "pool:shared:0:100Gbps"], "capacity"),
    (["--tier", "pool:everywhere:1TiB:100Gbps"], "scope"),
    (["--link", "0Gbps"], "--link"),
    (["--model", "llama-3.1-70b", "--device", "l40s"], "does not fit"),
    (["--sweep", "tier=1TiB"], "ratio"),
])
def test_simulate_bad_input_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               args: list[str], message: str) -> None:
    rc = main(["simulate", "--trace", str(_trace_file(tmp_path, 3)), *args])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_simulate_names_the_bad_line_of_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(line() + "\n" + line(timestamp=5, input_length=-3) + "\n")
    assert main(["simulate", "--trace", str(p)]) == 2
    assert "bad.jsonl line 2: field 'input_length'" in capsys.readouterr().err


@pytest.mark.parametrize(("bad", "field"), [
    (line(hash_ids=[2**64]), "'hash_ids'"),
    (line(timestamp=10**400), "'timestamp'"),
    ("[" * 100_000 + "]" * 100_000, "not JSON"),
])
def test_lines_past_every_cap_are_refused(bad: str, field: str) -> None:
    with pytest.raises(SimInputError, match=field):
        parse_lines([bad], name="t")


def test_a_truncated_xz_trace_is_refused(tmp_path: Path) -> None:
    whole = lzma.compress(("".join(line(timestamp=i) + "\n" for i in range(2000))).encode())
    (tmp_path / "t.jsonl.xz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(SimInputError, match="cannot read trace"):
        read_trace(tmp_path / "t.jsonl.xz")


def test_a_profile_named_but_unusable_is_an_error_not_a_roofline(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "--trace", str(_trace_file(tmp_path, 3)), "--model", "smollm2-135m", "--device", "cpu",
               "--profile", str(tmp_path / "missing.json")])
    assert rc == 2 and "--profile" in capsys.readouterr().err


def test_decode_engines_with_colocated_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", str(_trace_file(tmp_path, 3)), "--colocated", "--decode", "2"]) == 2
    assert "--decode" in capsys.readouterr().err
