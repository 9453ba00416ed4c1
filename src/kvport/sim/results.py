"""What a simulation reports: latency percentiles, goodput at the SLO, hits per tier, bytes per link,
queueing and backpressure; one JSON-ready dict (:func:`summarize`).

Goodput, two ways (both DistServe's measure of "requests within both the TTFT and TPOT limits"):
``goodput_rps`` counts the requests inside both limits per second of the run's span (first arrival
to last token), as ``kvport bench pd`` measures it; ``slo_attainment`` is their share, and a run
meets the SLO when it is at least ``slo.attainment`` (90%). :func:`max_goodput` scales the trace's
arrivals to find the highest rate that still meets it (DistServe's per-device goodput divides that
rate by the devices).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from kvport.sim.engine import SimRequest, Simulator


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` in [0, 100]; None for no values."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _dist(xs: Sequence[float]) -> dict[str, float | None]:
    def r(v: float | None) -> float | None:
        return None if v is None else round(v, 6)

    return {"mean": r(sum(xs) / len(xs)) if xs else None, "p50": r(percentile(xs, 50)),
            "p90": r(percentile(xs, 90)), "p99": r(percentile(xs, 99))}


def ttft(r: SimRequest) -> float:
    return r.first_token - r.arrival


def tpot(r: SimRequest) -> float:
    n = r.trace.output_tokens
    return 0.0 if n <= 1 else (r.finish - r.first_token) / (n - 1)


def summarize(sim: Simulator, reqs: Sequence[SimRequest]) -> dict[str, Any]:
    dep = sim.dep
    done = [r for r in reqs if r.finish >= 0]
    ttfts = [ttft(r) for r in done]
    tpots = [tpot(r) for r in done if r.trace.output_tokens > 1]
    met = sum(1 for r in done if ttft(r) <= dep.slo.ttft_s and tpot(r) <= dep.slo.tpot_s)
    start = min((r.arrival for r in done), default=0.0)
    end = max((r.finish for r in done), default=0.0)
    span = max(end - start, 1e-9)
    prompt = sum(r.trace.input_tokens for r in done)
    levels = sim.caches.levels()  # one per engine for engine-scope tiers: added up by name below
    read: dict[str, int] = {}
    written: dict[str, int] = {}
    evicted: dict[str, int] = {}
    for lv in levels:
        evicted[lv.name] = evicted.get(lv.name, 0) + lv.evictions
        if lv.read is not None:
            read[lv.name] = read.get(lv.name, 0) + lv.read_bytes
            written[lv.name] = written.get(lv.name, 0) + lv.written_bytes
    by_level: dict[str, int] = {}
    for r in done:
        for name, n in r.hits_by_level.items():
            by_level[name] = by_level.get(name, 0) + n
    qwait = [r.prefill_start - r.arrival for r in done if r.prefill_start >= 0]
    attainment = met / len(reqs) if reqs else 0.0
    return {
        "requests": len(reqs), "completed": len(done), "rejected_too_long": len(sim.rejected),
        "span_s": round(span, 4),
        "ttft_s": _dist(ttfts), "tpot_s": _dist(tpots),
        "slo": {"ttft_s": dep.slo.ttft_s, "tpot_s": dep.slo.tpot_s, "attainment": dep.slo.attainment},
        "slo_met": met, "slo_attainment": round(attainment, 4),
        "meets_slo": attainment >= dep.slo.attainment,
        "throughput_rps": round(len(done) / span, 4), "goodput_rps": round(met / span, 4),
        "devices": dep.devices, "goodput_rps_per_device": round(met / span / dep.devices, 5),
        "hit_rate_tokens": round(sum(r.hit_tokens for r in done) / prompt, 4) if prompt else 0.0,
        "hit_rate_by_tier": {k: round(v / prompt, 4) for k, v in sorted(by_level.items())} if prompt else {},
        "planner_choices": dict(sorted(sim.planner_choices.items())),
        "bytes": {"handoff": sim.link_bytes["handoff"], **{f"{k}_read": v for k, v in read.items()},
                  **{f"{k}_written": v for k, v in written.items()}},
        "evictions": evicted,
        "queueing": {"prefill_wait_s": _dist(qwait),
                     "prefill_busy_share": round(sum(e.busy_s for e in sim.prefill_engines)
                                                 / (span * len(sim.prefill_engines)), 4)
                     if dep.mode == "pd" else None,
                     "decode_busy_share": round(sum(d.busy_s for d in sim.decoders) / (span * len(sim.decoders)), 4),
                     "decode_max_batch": max((d.max_running for d in sim.decoders), default=0)},
        "backpressure": {"decode_waits": sim.back.decode_waits, "decode_wait_s": round(sim.back.decode_wait_s, 4),
                         "prefill_stalls": sim.back.prefill_stalls,
                         "prefill_stall_s": round(sum(e.stalled_s for e in sim.prefill_engines), 4),
                         "max_waiting": sim.back.max_waiting, "credit_waits": sim.back.credit_waits,
                         "credit_wait_s": round(sim.back.credit_wait_s, 4)},
        "compute": {"prefill": dep.prefill_compute.basis, "decode": dep.decode_compute.basis},
    }


def max_goodput(run_at: Callable[[float], dict[str, Any]], *, base_rps: float, lo: float = 1 / 64,
                hi: float = 64.0, steps: int = 8) -> dict[str, Any]:
    """The highest arrival-rate multiple (trace time scale ``1/x``) at which the run still meets its
    SLO attainment, by bisection on a log scale between ``lo`` and ``hi``; ``run_at(x)`` simulates
    the trace at ``x`` times its rate."""
    if not run_at(lo)["meets_slo"]:
        return {"rate_multiple": 0.0, "rate_rps": 0.0, "note": f"misses the SLO even at {lo:g}x the trace's rate"}
    if run_at(hi)["meets_slo"]:
        return {"rate_multiple": hi, "rate_rps": round(hi * base_rps, 4), "note": f"meets the SLO up to {hi:g}x"}
    a, b = math.log(lo), math.log(hi)
    for _ in range(steps):
        m = (a + b) / 2
        if run_at(math.exp(m))["meets_slo"]:
            a = m
        else:
            b = m
    x = math.exp(a)
    return {"rate_multiple": round(x, 4), "rate_rps": round(x * base_rps, 4), "note": "bisection"}
