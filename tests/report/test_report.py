"""kvport report: reports read or refused, missing fields shown as unknown, the page rendered by Chromium."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvport import __version__
from kvport.bench.harness import REPORT_FORMAT
from kvport.cli.main import main
from kvport.report import markdown
from kvport.report.results import load


def _report(suite: str, results: dict[str, Any], **over: Any) -> dict[str, Any]:
    doc = {"format": REPORT_FORMAT, "suite": suite, "limits": {},
           "conditions": {"mode": "full", "started": "2026-12-06T10:00:00+0000", "commit": "abc123",
                          "command": f"kvport bench {suite}", "versions": {"kvport": __version__}},
           "results": results}
    doc.update(over)
    return doc


def _write(folder: Path, name: str, doc: object) -> Path:
    path = folder / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def test_files_that_are_not_reports_are_refused_with_their_reason_and_others_are_noted(tmp_path: Path) -> None:
    _write(tmp_path, "a.json", "{not json")
    _write(tmp_path, "b.json", [1, 2])
    _write(tmp_path, "c.json", {"results": {}})
    _write(tmp_path, "d.json", {"suite": "hash", "results": 3})
    _write(tmp_path, "e.json", _report("hash", {"blocks_per_second_16": 5e6}, format=99,
                                       conditions={"versions": {"kvport": "0.0.1"}}))
    inputs = load([tmp_path])
    why = dict((Path(p).name, w) for p, w in inputs.refused)
    assert set(why) == {"a.json", "b.json", "c.json", "d.json"}
    assert "not a kvport bench report" in why["c.json"] and "no 'results' object" in why["d.json"]
    notes = inputs.reports["hash"].notes
    assert any("format 99" in n for n in notes) and any("kvport 0.0.1" in n for n in notes)


def test_a_field_a_report_lacks_is_unknown_never_guessed(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from kvport.report.figures import draw_all

    _write(tmp_path, "transfer.json", _report("transfer", {"tcp_gbps": 1.8, "overload": {"lost_blocks": 0}},
                                              limits={"memcpy_gbps": 7.0}))
    drawn = {d.key: d for d in draw_all(load([tmp_path]))}
    over = drawn["overload_over_time"]  # no timeline in this report: unknown, naming the field
    assert over.svg is None and "transfer: results.overload.timeline" in over.missing
    bars = drawn["throughput_vs_limit"]  # tcp_gbps without raw_socket_gbps: no bar drawn from half a pair
    assert bars.svg is None and "transfer: limits.raw_socket_gbps" in bars.missing
    assert drawn["hit_rate_vs_capacity"].missing == ["not run: kvport bench trace"]
    md = markdown.render(load([tmp_path]))
    assert "| TCP GB/s | 1.8 |" in md and "| TCP vs raw socket | unknown |" in md
    assert "Regenerate: `kvport bench transfer`" in md and "commit abc123," in md


def test_the_reference_keeps_a_document_s_introduction_and_rewrites_its_figures(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    _write(results, "hash.json", _report("hash", {"blocks_per_second_16": 5000000}, limits={"raw_gbps": 9.5}))
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nHow to run them, by hand.\n\n{markdown.MARKER}\n\n## FIGURES-OF-OLD\n")
    assert main(["report", str(results), "--no-html", "--markdown", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nHow to run them, by hand.\n\n" + markdown.MARKER)
    assert "FIGURES-OF-OLD" not in text and "| chained keys/s, 16 tokens a block | 5000000 |" in text
    assert "Limits measured in the same run: `raw_gbps` 9.5" in text
    # a file without the marker is written whole
    other = tmp_path / "other.md"
    other.write_text("anything\n")
    assert main(["report", str(results), "--no-html", "--markdown", str(other)]) == 0
    assert other.read_text().startswith("# Benchmarks\n") and "anything" not in other.read_text()


def test_the_page_and_the_reference_come_from_quick_runs_and_render_in_chromium(tmp_path: Path,
                                                                                 model_dir: Path) -> None:
    pytest.importorskip("matplotlib")
    from kvport.report.browser import check, find_browser

    assert find_browser() is not None, "no Chromium: `make setup` installs the Debian package"
    results = tmp_path / "results"
    assert main(["bench", "codec", "--quick", "--json", str(results / "codec.json"), "--set", "tokens=64",
                 "--set", "windows=1", "--set", 'codecs=["int8", "kivi4"]']) == 0
    page, ref = tmp_path / "report.html", tmp_path / "benchmarks.md"
    assert main(["report", "--run", "quick", "--suites", "tiers,transfer,planner,trace", "--results", str(results),
                 "--out", str(page), "--markdown", str(ref), "--check"]) == 0
    text = page.read_text()
    for key in ("ttft_vs_length", "hit_rate_vs_capacity", "throughput_vs_limit", "codec_size_quality",
                "overload_over_time"):
        assert f'id="fig-{key}"' in text, key  # drawn, from the quick runs' JSON
    assert "Unknown: not run: kvport bench demo" in text  # the one suite not run says so
    res = check(page)
    assert res.ok and res.figures_loaded == "5/5", res
    md = ref.read_text()
    for suite in ("codec", "planner", "tiers", "trace", "transfer"):
        assert f"## {suite}: " in md and f"Regenerate: `kvport bench {suite} --quick" in md


def test_the_simulator_figure_plots_predictions_against_measurements(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from kvport.report.figures import draw_all

    results = {"demo_ttft_error": 0.1, "load_goodput_error": 0.02, "trace_seconds": 12.0,
               "published": {"within_2x": 16, "within_1_3x": 15, "worst_ratio": 1.3,
                             "cases": [{"case": "ttft_128", "published": 0.046, "predicted": 0.047},
                                       {"case": "transfer_128", "published": 0.00054, "predicted": 0.0006}]},
               "demo": {"turns": [{"measured_s": 6.5, "predicted_s": 6.1}, {"measured_s": 0.6, "predicted_s": 0.5}]},
               "load": {"cells": [{"layout": "pd", "measured_goodput_rps": 0.36, "predicted_goodput_rps": 0.35}]}}
    _write(tmp_path, "simulate.json", _report("simulate", results))
    drawn = {d.key: d for d in draw_all(load([tmp_path]))}
    assert drawn["simulated_vs_measured"].svg is not None
    md = markdown.render(load([tmp_path]))
    assert "| demo: median error of predicted per-turn TTFT | 0.1 |" in md
    assert "| published cases within 2x (of those predicted) | 16 |" in md
