"""Exact decisions of the cost model at known crossovers, with hand-built profiles."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvport.errors import PlanInputError
from kvport.planner import (
    Action,
    Cached,
    CodecCost,
    Freshness,
    Link,
    LinkKind,
    Load,
    PrefillModel,
    ProfileStatus,
    Request,
    crossover,
    evaluate,
)
from tests.planner.conftest import MACHINE, NOW, linear_prefill, profile_with

FRESH = Freshness(now=NOW, machine=MACHINE)


def test_linear_crossover_bandwidth_is_exact(spec) -> None:  # type: ignore[no-untyped-def]
    # recompute N ms vs load (N-1) tokens * 46080 B / bw + 1 ms for the last token:
    # equal exactly at bw = 46080 B / 1 ms = 46.08 MB/s, whatever N is.
    pf = linear_prefill(spec.model_id)
    req = Request(1024, spec, (Cached("peer", 1024),))
    below = evaluate(profile_with(45e6, pf), req, fresh=FRESH)
    above = evaluate(profile_with(47e6, pf), req, fresh=FRESH)
    assert below.seconds("recompute") == pytest.approx(1.024)
    assert below.seconds("load:peer") == pytest.approx(1023 * 46080 / 45e6 + 1e-3)
    assert below.seconds("load:peer") > below.seconds("recompute")  # type: ignore[operator]
    assert above.seconds("load:peer") < above.seconds("recompute")  # type: ignore[operator]
    # right at the crossover the overlapped split halves the time and beats both
    at = evaluate(profile_with(46.08e6, pf), req, fresh=FRESH)
    assert at.action is Action.SPLIT
    assert at.choice.seconds == pytest.approx(0.5 * 1.023 + 1e-3, rel=0.02)
    assert 0 < at.choice.head_tokens < 1023 and at.choice.head_tokens % spec.block_size == 0


def test_far_from_crossover_pure_options_win(spec) -> None:  # type: ignore[no-untyped-def]
    pf = linear_prefill(spec.model_id, a=0.02)  # a forward costs 20 ms even for one token
    req = Request(1024, spec, (Cached("peer", 1024),))
    fast = evaluate(profile_with(10e9, pf, latency=1e-3), req, fresh=FRESH)
    slow = evaluate(profile_with(1e6, pf, latency=1e-3), req, fresh=FRESH)
    assert fast.action is Action.LOAD and fast.choice.reuse_tokens == 1023
    assert slow.action is Action.RECOMPUTE
    assert "beats" in fast.reason and "load:peer" in fast.reason
    assert {o.label for o in fast.options} == {"recompute", "load:peer", "split:peer"}


def test_superlinear_crossover_length_matches_closed_form(spec) -> None:  # type: ignore[no-untyped-def]
    a, b, c, d = 0.02, 4e-4, 2e-7, 4e-7
    pf = PrefillModel(model_id=spec.model_id, threads=2, a=a, b=b, c=c, d=d, measured_at=NOW)
    bw, s, bpt = 90e6, 32, spec.bytes_per_token
    cr = crossover(profile_with(bw, pf), spec, "peer", s, lo=64, hi=65536, fresh=FRESH)
    # load(N) - recompute(N) = (N-s) bpt/bw + b s + c s^2 + d s (N-s) - b N - c N^2  (the a's cancel)
    poly = np.array([-c, bpt / bw + d * s - b, -s * bpt / bw + b * s + c * s * s - d * s * s])
    root = max(r.real for r in np.roots(poly) if abs(r.imag) < 1e-9)
    assert cr.recompute_wins_at_lo is True
    assert cr.lengths == (math.ceil(root),)
    assert "recompute wins below" in cr.describe()


def test_compute_queue_favours_transfer(spec) -> None:  # type: ignore[no-untyped-def]
    pf = linear_prefill(spec.model_id)
    req = Request(1024, spec, (Cached("peer", 1024),))
    prof = profile_with(30e6, pf)  # recompute wins when idle (crossover 46 MB/s)
    assert evaluate(prof, req, Load(compute_queue=0), FRESH).action is not Action.LOAD
    busy = evaluate(prof, req, Load(compute_queue=3), FRESH)
    assert busy.action is not Action.RECOMPUTE
    assert busy.seconds("recompute") == pytest.approx(4 * 1.024)
    assert busy.seconds("load:peer") < busy.seconds("recompute")  # type: ignore[operator]


def test_backlog_on_link_favours_recompute(spec) -> None:  # type: ignore[no-untyped-def]
    pf = linear_prefill(spec.model_id, a=0.02)
    prof = profile_with(1e9, pf)
    idle = evaluate(prof, Request(1024, spec, (Cached("peer", 1024),)), fresh=FRESH)
    jammed = evaluate(prof, Request(1024, spec, (Cached("peer", 1024, backlog_bytes=2_000_000_000),)), fresh=FRESH)
    assert idle.action is Action.LOAD
    assert jammed.action is Action.RECOMPUTE


def test_codec_only_within_quality_budget(spec) -> None:  # type: ignore[no-untyped-def]
    pf = linear_prefill(spec.model_id)
    int8 = CodecCost("int8", ratio=4.0, encode_bps=5e9, decode_bps=5e9, quality_cost=0.001, measured_at=NOW)
    prof = profile_with(30e6, pf, codecs=(int8,))
    req = Request(1024, spec, (Cached("peer", 1024),))
    strict = evaluate(prof, req, fresh=FRESH)
    assert strict.choice.codec is None
    assert strict.seconds("load:peer+int8") is None
    lenient = evaluate(prof, Request(1024, spec, (Cached("peer", 1024),), max_quality_cost=0.01), fresh=FRESH)
    assert lenient.choice.label == "load:peer+int8"
    raw = 1023 * 46080
    assert lenient.choice.seconds == pytest.approx(raw / 5e9 * 2 + raw / 4 / 30e6 + 1e-3)


def test_best_source_among_tiers_and_peers(spec) -> None:  # type: ignore[no-untyped-def]
    pf = linear_prefill(spec.model_id)
    prof = profile_with(100e6, pf).with_link(Link("host", LinkKind.TIER, 10e9, 1e-5, NOW))
    req = Request(2048, spec, (Cached("peer", 2048), Cached("host", 1024)))
    d = evaluate(prof, req, fresh=FRESH)
    # host: 1024 tokens in ~5 ms + 1024 recomputed (1.024 s); peer: 2047 tokens at 100 MB/s (0.94 s) + 1 ms,
    # and overlapped with recomputing a head the peer's split is faster still
    assert d.choice.source == "peer"
    assert d.seconds("load:peer") == pytest.approx(2047 * 46080 / 100e6 + 1e-3)
    assert d.seconds("load:peer") < d.seconds("load:host") < d.seconds("recompute")  # type: ignore[operator]
    assert d.seconds("load:host") == pytest.approx(1e-5 + 1024 * 46080 / 10e9 + 1.024)


def test_install_cost_counts(spec) -> None:  # type: ignore[no-untyped-def]
    pf = linear_prefill(spec.model_id)
    req = Request(101, spec, (Cached("peer", 100),))
    d = evaluate(profile_with(1e9, pf, install_bps=1e9), req, fresh=FRESH)
    assert d.seconds("load:peer") == pytest.approx(2 * 100 * 46080 / 1e9 + 1e-3)


def test_nothing_cached_means_recompute(spec) -> None:  # type: ignore[no-untyped-def]
    pf = linear_prefill(spec.model_id)
    d = evaluate(profile_with(1e9, pf), Request(10, spec), fresh=FRESH)
    assert d.action is Action.RECOMPUTE and d.status is ProfileStatus.OK
    one = evaluate(profile_with(1e9, pf), Request(1, spec, (Cached("peer", 1),)), fresh=FRESH)
    assert one.action is Action.RECOMPUTE  # the last token is always computed
    assert one.options[1].note == "nothing reusable"


@pytest.mark.parametrize("make", [
    lambda s: Request(0, s),
    lambda s: Request(-5, s),
    lambda s: Request(10, s, (Cached("peer", -1),)),
    lambda s: Request(10, s, (Cached("peer", 11),)),
    lambda s: Request(10, s, (Cached("peer", 5), Cached("peer", 6))),
    lambda s: Request(10, s, max_quality_cost=-0.1),
    lambda s: Request(10, s, max_quality_cost=float("nan")),
    lambda s: Request(10.5, s),
    lambda s: Cached("", 3),
    lambda s: Cached("peer", 3, backlog_bytes=-1),
    lambda s: Load(compute_queue=-1),
])
def test_nonsense_inputs_are_typed(spec, make) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PlanInputError):
        make(spec)


def test_crossover_bad_range(spec) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PlanInputError):
        crossover(profile_with(1e9, linear_prefill(spec.model_id)), spec, "peer", 0)
    with pytest.raises(PlanInputError):
        crossover(profile_with(1e9, linear_prefill(spec.model_id)), spec, "peer", 16, lo=100, hi=50)
