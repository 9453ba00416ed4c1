"""The prefill/decode cost model and its live planner (kvport.planner.pd): stream or recompute per
request, fitted from observations, the link's excess over the prefill, exploration while a curve is
unknown, the crossover, bad input."""

from __future__ import annotations

import pytest

from kvport.errors import PlanInputError
from kvport.planner.cost import Action, ProfileStatus
from kvport.planner.pd import (
    MIN_LENGTHS,
    WINDOW,
    Curve,
    PDModels,
    PDPlanner,
    evaluate_pd,
    pd_crossover,
    recompute_seconds,
    stream_seconds,
)
from kvport.planner.profile import Link, LinkKind, PrefillModel


def curve(a: float, b: float, c: float = 0.0) -> PrefillModel:
    return PrefillModel(model_id="pd", threads=0, a=a, b=b, c=c, d=0.0, measured_at=0.0)


# a compute-rich prefill host (0.5 ms a token), a decode engine twice as slow, a 61 ms hand-off
FAST = PDModels(prefill=curve(0.02, 0.0005), handoff=curve(0.061, 0.0001), decode=curve(0.01, 0.001))


def test_short_prompts_recompute_and_long_ones_stream_where_the_curves_cross() -> None:
    # stream(n) = 0.081 + 0.0006 n, recompute(n) = 0.01 + 0.001 n: equal at n = 177.5
    assert stream_seconds(FAST, 100) == pytest.approx(0.141) and recompute_seconds(FAST, 100) == pytest.approx(0.11)
    short, long = evaluate_pd(FAST, 50), evaluate_pd(FAST, 1000)
    assert short.action is Action.RECOMPUTE and long.action is Action.STREAM
    assert short.status is ProfileStatus.OK and "beats" in long.reason
    assert pd_crossover(FAST, 1, 10_000) == (178,)


def test_a_link_slower_than_the_prefill_s_kv_shows_its_excess() -> None:
    # 1 MB a token over 100 MB/s: 10 ms a token on the wire, the prefill produces it in 0.5 ms
    slow = PDModels(prefill=FAST.prefill, handoff=FAST.handoff, decode=FAST.decode,
                    link=Link("l", LinkKind.PEER, 100e6, 0.001, 0.0), kv_bytes_per_token=1_000_000)
    p = 0.02 + 0.0005 * 1000
    assert stream_seconds(slow, 1000) == pytest.approx(p + (0.001 + 10.0 - p) + 0.061 + 0.1)
    assert evaluate_pd(slow, 1000).action is Action.RECOMPUTE
    fast_link = PDModels(FAST.prefill, FAST.handoff, FAST.decode, Link("l", LinkKind.PEER, 1e12, 0.0, 0.0), 1000)
    assert stream_seconds(fast_link, 1000) == stream_seconds(FAST, 1000)  # a link that keeps up adds nothing


def test_queues_slow_the_engine_they_wait_on() -> None:
    assert evaluate_pd(FAST, 1000, prefill_queue=3).action is Action.RECOMPUTE  # 4 x 0.52 + 0.161 > 1.01
    assert evaluate_pd(FAST, 100, decode_queue=2).action is Action.STREAM  # 3 x 0.11 > 0.141


def test_a_near_tie_goes_to_recompute() -> None:
    tie = PDModels(prefill=curve(0.0, 0.0005), handoff=curve(0.0, 0.0005), decode=curve(0.0, 0.00102))
    assert evaluate_pd(tie, 1000).action is Action.RECOMPUTE  # stream 2% faster: inside the margin


def test_the_planner_learns_its_curves_from_observations_only() -> None:
    pl = PDPlanner(explore_every=0)
    assert evaluate_pd(pl.models, 500).status is ProfileStatus.MISSING
    for n in (50, 200, 800):
        pl.observe(Curve.PREFILL, n, 0.02 + 0.0005 * n)
        pl.observe(Curve.HANDOFF, n, 0.061 + 0.0001 * n)
        assert pl.decide(n).action is Action.STREAM  # the default while recompute is unknown
        pl.observe(Curve.DECODE, n, 0.01 + 0.001 * n)
    assert pl.models.decode is not None and pl.models.decode.b == pytest.approx(0.001, rel=1e-6)
    assert pl.decide(50).action is Action.RECOMPUTE and pl.decide(1000).action is Action.STREAM
    snap = pl.snapshot()
    assert snap["crossover_tokens"] == [178] and len(snap["curves"]["decode"]["points"]) == 3
    assert snap["decisions"] == {"stream:default": 3, "recompute:model": 1, "stream:model": 1}


def test_a_curve_needs_distinct_lengths_and_keeps_only_its_window() -> None:
    pl = PDPlanner()
    for _ in range(10):
        pl.observe(Curve.DECODE, 100, 0.1)
    pl.observe(Curve.DECODE, 200, 0.2)
    assert pl.models.decode is None  # two lengths < MIN_LENGTHS
    assert MIN_LENGTHS == 3
    pl.observe(Curve.DECODE, 400, 0.4)
    assert pl.models.decode is not None
    for n in range(1, WINDOW + 1):  # the old points leave the window: the curve follows the engine
        pl.observe(Curve.DECODE, 10 * n, 0.01 * n * 3)
    assert pl.models.decode is not None and pl.models.decode.seconds(0, 100) == pytest.approx(0.3, rel=1e-3)
    assert all(p[0] % 10 == 0 for p in pl.snapshot()["curves"]["decode"]["points"])


def test_while_a_curve_is_unknown_every_nth_request_explores_the_other_path() -> None:
    pl = PDPlanner(explore_every=4)
    actions = [pl.decide(100).action for _ in range(8)]
    assert actions == [Action.STREAM] * 3 + [Action.RECOMPUTE] + [Action.STREAM] * 3 + [Action.RECOMPUTE]
    assert pl.decide(100).reason.startswith("default (")
    rec = PDPlanner(default=Action.RECOMPUTE, explore_every=2)
    assert [rec.decide(10).action for _ in range(2)] == [Action.RECOMPUTE, Action.STREAM]


@pytest.mark.parametrize("bad", [0, -1, 3600, float("nan"), float("inf"), "1"])
def test_an_impossible_observation_is_refused(bad: object) -> None:
    with pytest.raises(PlanInputError):
        PDPlanner().observe(Curve.PREFILL, 10, bad)  # type: ignore[arg-type]


def test_bad_planner_input_is_a_typed_error() -> None:
    with pytest.raises(PlanInputError):
        PDPlanner().observe(Curve.PREFILL, 0, 1.0)
    with pytest.raises(PlanInputError):
        evaluate_pd(FAST, 0)
    with pytest.raises(PlanInputError):
        evaluate_pd(FAST, 10, decode_queue=-1)
    with pytest.raises(PlanInputError):
        PDPlanner(default=Action.LOAD)
    with pytest.raises(PlanInputError):
        PDPlanner(kv_bytes_per_token=0)
    with pytest.raises(PlanInputError):
        pd_crossover(FAST, 100, 100)
    assert pd_crossover(PDModels(), 1, 100) is None
