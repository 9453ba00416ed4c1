"""Which layout a host gets (kvport.deploy.layout): from a ``kvport bench pd`` report when one is given,
the measured winner at the rate asked; without one, the rule the docs state, with its reason; a file
that is not such a report is refused with a clear error, never guessed from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvport.deploy.layout import PD_MIN_CPUS, choose, from_report
from kvport.deploy.vllm_serve import _main, recipe
from kvport.errors import UserInputError


def report(rows: dict[str, tuple[float, float, float, float]]) -> dict[str, Any]:
    """rate -> (pd goodput, pd mean TTFT, colocated goodput, colocated mean TTFT)."""
    return {"suite": "pd", "results": {"e2e": {"rates": {
        k: {"pd": {"goodput_rps": g1, "ttft_mean_s": t1}, "colocated": {"goodput_rps": g2, "ttft_mean_s": t2}}
        for k, (g1, t1, g2, t2) in rows.items()}}}}


def test_the_measured_winner_at_the_rate_asked() -> None:
    rep = report({"0.2": (0.2, 1.0, 0.2, 2.0), "1": (0.3, 9.0, 0.6, 3.0)})
    assert from_report(rep, 0.25).name == "pd"  # same goodput, lower TTFT
    assert from_report(rep, 0.9).name == "colocated"  # higher goodput
    got = from_report(rep, 0.9)
    assert "1 req/s" in got.why and "goodput 0.3 vs 0.6" in got.why


def test_without_a_rate_the_layout_that_won_more_rates() -> None:
    rep = report({"0.2": (0.2, 4.0, 0.2, 1.7), "0.5": (0.4, 6.0, 0.5, 2.0), "1": (0.9, 1.0, 0.5, 9.0)})
    assert from_report(rep).name == "colocated"


def test_without_a_report_the_rule_says_it_was_not_measured_here() -> None:
    small, big = choose(cpus=2), choose(cpus=PD_MIN_CPUS)
    assert small.name == "colocated" and "measured" in small.why
    assert big.name == "pd" and "not measured on this host" in big.why


@pytest.mark.parametrize("bad", [{"suite": "tiers", "results": {}}, {"suite": "pd", "results": {"e2e": {}}},
                                 report({"0.2": (0.2, 1.0, 0.2, 2.0)}) | {"suite": "route"}])
def test_a_file_that_is_not_a_pd_report_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(UserInputError, match="kvport bench pd"):
        from_report(bad)


def test_rows_without_figures_are_refused_not_guessed() -> None:
    rep = report({"0.2": (0.2, 1.0, 0.2, 2.0)})
    rep["results"]["e2e"]["rates"]["0.2"]["pd"]["goodput_rps"] = None
    with pytest.raises(UserInputError, match="no goodput or TTFT"):
        from_report(rep)


def test_the_recipe_prints_the_chosen_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "pd.json"
    path.write_text(json.dumps(report({"0.2": (0.2, 4.0, 0.2, 1.7)})))
    assert _main(["M", "--layout", "auto", "--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# layout colocated: measured by kvport bench pd") and out.endswith(recipe("M", "colocated"))
    colocated = recipe("M", "colocated")
    assert "kv_both" in colocated and "kvport proxy" not in colocated and "VLLM_CPU_OMP_THREADS_BIND=0-1" in colocated
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(UserInputError, match="not a JSON object"):
        _main(["M", "--layout", "auto", "--report", str(tmp_path / "bad.json")])
