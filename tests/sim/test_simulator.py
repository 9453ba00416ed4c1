"""The simulator against small traces whose answers are computed by hand."""

from __future__ import annotations

import pytest

from kvport.errors import SimInputError
from kvport.sim import SLO, Deployment, FittedCompute, LinkSpec, Simulator, TierSpec, TraceRequest, summarize
from kvport.sim.deployment import LinearPrefill
from kvport.spec import from_preset

SPEC = from_preset("llama-3.1-8b")  # 131072 bytes of KV per token
BT = 16  # block tokens of these traces


def compute(a: float = 0.0, b: float = 0.001, step: float = 0.01, per_ctx: float = 0.0) -> FittedCompute:
    return FittedCompute(LinearPrefill(a, b), step, 0.0, per_ctx)


def dep(**kw: object) -> Deployment:
    base: dict[str, object] = {"prefill_compute": compute(), "decode_compute": compute(), "block_tokens": BT,
                               "link": LinkSpec(SPEC.bytes_per_token * 1000.0), "slo": SLO(10.0, 1.0)}
    base.update(kw)
    return Deployment(SPEC, **base)  # type: ignore[arg-type]


def req(t: float, n: int, out: int = 4, ids: tuple[int, ...] | None = None, **kw: object) -> TraceRequest:
    return TraceRequest(t, n, out, tuple(range(n // BT)) if ids is None else ids, **kw)  # type: ignore[arg-type]


def run(d: Deployment, trace: list[TraceRequest]) -> tuple[Simulator, list]:
    sim = Simulator(d)
    return sim, sim.run(trace)


def test_one_request_after_the_prefill() -> None:
    # prefill 100 tokens at 1 ms each = 0.1 s; hand-off after it: 100 tokens at 1000 tokens/s = 0.1 s;
    # the decode engine's first step 0.01 s -> TTFT 0.21 s; 3 more steps -> TPOT 0.01 s
    sim, (r,) = run(dep(stream="after"), [req(0.0, 100)])
    assert r.prefill_end == pytest.approx(0.1)
    assert r.transfer_end == pytest.approx(0.2)
    assert r.first_token == pytest.approx(0.21)
    assert r.finish == pytest.approx(0.24)
    s = summarize(sim, [r])
    assert s["ttft_s"]["p50"] == pytest.approx(0.21)
    assert s["tpot_s"]["mean"] == pytest.approx(0.01)
    assert s["bytes"]["handoff"] == SPEC.request_bytes(100)


def test_layerwise_stream_hides_the_transfer_behind_the_compute() -> None:
    # the same request streamed layer by layer: the link (0.1 s) runs beside the compute (0.1 s);
    # the last layer leaves 0.1 / 32 layers after the compute
    _, (r,) = run(dep(stream="layerwise"), [req(0.0, 100)])
    assert r.transfer_end == pytest.approx(0.1 + 0.1 / SPEC.num_layers)
    assert r.first_token == pytest.approx(0.1 + 0.1 / SPEC.num_layers + 0.01)


def test_second_request_queues_behind_the_first() -> None:
    _, (a, b) = run(dep(stream="after"), [req(0.0, 100, ids=(1,) * 0), req(0.0, 100, ids=())])
    assert b.prefill_start == pytest.approx(a.prefill_end)  # one prefill engine, FIFO
    assert b.prefill_end == pytest.approx(0.2)


def test_prefix_cached_on_the_engine_is_not_computed_again() -> None:
    d = dep(device_cache_tokens=10_000, stream="after")
    ids = tuple(range(6))  # 96 tokens of full blocks
    _, (a, b) = run(d, [req(0.0, 100, ids=ids), req(5.0, 100, ids=ids)])
    assert a.cached == 0 and a.choice == "recompute"
    assert b.cached == 96 and b.choice == "cached"  # the device's blocks: free, no read
    assert b.prefill_end - b.prefill_start == pytest.approx(0.004)  # 4 tokens at 1 ms


def test_the_planner_loads_from_a_fast_tier_and_recomputes_past_a_slow_one() -> None:
    ids = tuple(range(6))
    trace = [req(0.0, 100, ids=ids), req(5.0, 100, ids=ids)]
    block = SPEC.request_bytes(BT)
    fast = TierSpec("pool", 100 * block, LinkSpec(6 * block / 0.01), scope="shared")  # 6 blocks in 10 ms
    slow = TierSpec("pool", 100 * block, LinkSpec(6 * block / 1.0), scope="shared")  # ... in 1 s
    _, (_, b) = run(dep(tiers=(fast,), stream="after"), trace)
    assert b.choice == "load" and b.loaded_tokens == 96
    assert b.prefill_end - b.prefill_start == pytest.approx(0.01 + 0.004)
    _, (_, b) = run(dep(tiers=(slow,), stream="after"), trace)
    assert b.choice == "recompute" and b.cached == 0  # 1 s + 4 ms > 0.1 s
    _, (_, b) = run(dep(tiers=(slow,), stream="after", planner=False), trace)
    assert b.choice == "load"  # without the planner it loads whatever it finds


def test_eviction_demotes_to_the_engine_tier_below() -> None:
    block = SPEC.request_bytes(BT)
    host = TierSpec("host", 100 * block, LinkSpec(1e15))
    d = dep(device_cache_tokens=2 * BT, tiers=(host,), stream="after")  # the device holds 2 blocks
    a_ids, b_ids = (1, 2), (3, 4)
    sim, reqs = run(d, [req(0.0, 40, ids=a_ids), req(1.0, 40, ids=b_ids), req(2.0, 40, ids=a_ids)])
    assert reqs[2].hits_by_level == {"host": 32}  # a's blocks left the device for the host tier
    assert reqs[2].choice == "load"
    s = summarize(sim, reqs)
    assert s["evictions"]["device"] >= 2
    assert s["hit_rate_by_tier"]["host"] == pytest.approx(32 / 120, abs=1e-4)


def test_backpressure_holds_the_second_hand_off_until_the_first_answer_frees_room() -> None:
    # the decode engine holds 150 tokens: one request of 100 + 4 at a time
    d = dep(decode_kv_tokens=150, stream="after")
    sim, (a, b) = run(d, [req(0.0, 100), req(0.0, 100, ids=())])
    assert b.transfer_start == pytest.approx(a.finish)  # admitted when a's last token freed its KV
    s = summarize(sim, [a, b])
    assert s["completed"] == 2 and s["backpressure"]["decode_waits"] == 1
    assert s["backpressure"]["decode_wait_s"] == pytest.approx(a.finish - b.prefill_end)


def test_a_prefill_engine_holding_its_limit_stops_starting_work() -> None:
    d = dep(decode_kv_tokens=150, stream="after", hold=1)
    sim, (a, b, c) = run(d, [req(0.0, 100), req(0.0, 100, ids=()), req(0.0, 100, ids=())])
    assert c.prefill_start >= b.transfer_start  # b's KV had to leave before c could start
    assert sim.back.prefill_stalls >= 1
    assert all(r.finish > 0 for r in (a, b, c))  # nothing lost


def test_a_request_no_engine_can_hold_is_refused_and_counted() -> None:
    sim, (r,) = run(dep(decode_kv_tokens=50), [req(0.0, 100)])
    assert r.finish < 0 and sim.rejected == [0]
    assert summarize(sim, [r])["slo_attainment"] == 0.0


def test_colocated_chunks_the_prompt_beside_the_decodes() -> None:
    # 300 tokens in chunks of 128: 3 steps of prefill (0.128 + 0.128 + 0.044 s), the first token at
    # the end of the last chunk, then 3 decode steps of 0.01 s
    d = dep(mode="colocated", chunk_tokens=128)
    _, (r,) = run(d, [req(0.0, 300)])
    assert r.first_token == pytest.approx(0.3)
    assert r.finish == pytest.approx(0.33)


def test_a_session_turn_waits_for_the_previous_answer() -> None:
    d = dep(stream="after")
    _, (a, b) = run(d, [req(0.0, 100), req(0.05, 120, after=0, delay_s=0.5)])
    assert b.arrival == pytest.approx(a.finish + 0.5)


def test_goodput_counts_requests_inside_both_limits() -> None:
    # TTFT 0.21 s for the first, 0.31 s for the second (queued behind its prefill and hand-off): an SLO
    # of 0.3 s keeps one of two
    sim, reqs = run(dep(stream="after", slo=SLO(0.3, 1.0)), [req(0.0, 100), req(0.0, 100, ids=())])
    s = summarize(sim, reqs)
    assert s["slo_met"] == 1 and s["slo_attainment"] == 0.5 and not s["meets_slo"]
    assert s["goodput_rps"] == pytest.approx(1 / s["span_s"], rel=1e-3)
    assert s["goodput_rps_per_device"] == pytest.approx(s["goodput_rps"] / 2, rel=1e-3)


@pytest.mark.parametrize(("kw", "field"), [
    ({"link": None}, "link"),
    ({"prefill": 0}, "prefill engines"),
    ({"decode": 0}, "decode engines"),
    ({"mode": "both"}, "mode"),
    ({"stream": "later"}, "stream"),
    ({"max_batch": 0}, "max_batch"),
])
def test_a_deployment_that_cannot_run_names_its_field(kw: dict[str, object], field: str) -> None:
    if kw == {"link": None}:
        with pytest.raises(SimInputError, match="link bandwidth"):
            LinkSpec(0.0)
        return
    with pytest.raises(SimInputError, match=field):
        dep(**kw)


def test_a_tier_too_small_for_one_block_is_refused() -> None:
    with pytest.raises(SimInputError, match="tier pool: capacity_bytes"):
        dep(tiers=(TierSpec("pool", 1000, LinkSpec(1e9), scope="shared"),))
    with pytest.raises(SimInputError, match="policy"):
        TierSpec("pool", 1 << 30, LinkSpec(1e9), policy="random")


def test_two_prefill_engines_share_the_load_and_their_tiers_add_up() -> None:
    block = SPEC.request_bytes(BT)
    host = TierSpec("host", 100 * block, LinkSpec(1e15))
    d = dep(prefill=2, device_cache_tokens=2 * BT, tiers=(host,), stream="after")
    # no prefix in common: the second request goes to the idle engine, not behind the first
    sim, (a, b) = run(d, [req(0.0, 100, ids=(1, 2)), req(0.0, 100, ids=(3, 4))])
    assert (a.engine, b.engine) == (0, 1) and b.prefill_start == 0.0
    # each engine's device evicts into its own host tier: the summary adds them up by name
    sim, reqs = run(d, [req(0.0, 40, ids=(1, 2)), req(0.0, 40, ids=(3, 4)), req(1.0, 40, ids=(5, 6)),
                        req(1.0, 40, ids=(7, 8))])
    s = summarize(sim, reqs)
    per_engine = [lv for lv in sim.caches.levels() if lv.name == "host"]
    assert len(per_engine) == 2
    assert s["bytes"]["host_written"] == sum(lv.written_bytes for lv in per_engine) == 4 * block
    assert s["evictions"]["device"] == 4


def test_the_router_sends_a_prefix_to_the_engine_that_holds_it() -> None:
    d = dep(prefill=2, device_cache_tokens=100 * BT, stream="after")
    _, reqs = run(d, [req(0.0, 100, ids=(1, 2, 3)), req(0.0, 100, ids=(7, 8, 9)), req(1.0, 100, ids=(7, 8, 9))])
    assert reqs[2].engine == reqs[1].engine and reqs[2].choice == "cached"


def test_recomputing_past_a_tier_hit_leaves_one_copy() -> None:
    block = SPEC.request_bytes(BT)
    slow_host = TierSpec("host", 100 * block, LinkSpec(block / 10.0))  # 10 s a block: the planner recomputes
    d = dep(device_cache_tokens=2 * BT, tiers=(slow_host,), stream="after")
    sim, reqs = run(d, [req(0.0, 40, ids=(1, 2)), req(1.0, 40, ids=(3, 4)), req(2.0, 40, ids=(1, 2))])
    assert reqs[2].choice == "recompute"
    device = sim.caches.device[0]
    host = sim.caches.chains[0][1]
    assert device is not None
    for k in device.index:  # exclusive levels: a block is on the device or in the host tier, not both
        assert k not in host.index


def test_ids_that_are_not_chained_do_not_break_the_lookup() -> None:
    block = SPEC.request_bytes(BT)
    d = dep(device_cache_tokens=3 * BT, tiers=(TierSpec("host", 100 * block, LinkSpec(1e12)),), stream="after")
    trace = [req(0.0, 20, ids=(6,)), req(1.0, 40, ids=(5, 7)), req(2.0, 20, ids=(8,)), req(3.0, 40, ids=(6, 7))]
    _sim, reqs = run(d, trace)
    assert all(r.finish > 0 for r in reqs)


def test_the_first_token_from_the_prefill_engine() -> None:
    # the demo's workers: TTFT is the prefill's (0.1 s); the decode engine then makes 3 more tokens
    _, (r,) = run(dep(stream="after", first_token="prefill"), [req(0.0, 100)])
    assert r.first_token == pytest.approx(0.1)
    assert r.finish == pytest.approx(0.2 + 3 * 0.01)
    _, (one,) = run(dep(stream="after", first_token="prefill"), [req(0.0, 100, out=1)])
    assert one.finish == pytest.approx(0.2)  # nothing left to decode once the KV is there


def test_whole_blocks_are_handed_over_and_the_decode_engine_computes_the_tail() -> None:
    # 100 tokens: 96 in whole blocks of 16 move (0.096 s at 1000 tokens/s); the decode engine computes
    # 4 tokens (4 ms at its prefill rate) in the step it joins, then the first token (10 ms)
    _, (r,) = run(dep(stream="after", handoff_block_tokens=16), [req(0.0, 100)])
    assert r.handoff_bytes == SPEC.request_bytes(96)
    assert r.transfer_end == pytest.approx(0.1 + 0.096)
    assert r.first_token == pytest.approx(0.196 + 0.004 + 0.01)


def test_a_codec_moves_fewer_bytes_at_its_speed() -> None:
    from kvport.sim import CodecSpec

    nbytes = SPEC.request_bytes(100)
    codec = CodecSpec("int8", 2.0, nbytes / 0.01, nbytes / 0.02)  # encode 10 ms, decode 20 ms
    sim, (r,) = run(dep(stream="after", codec=codec), [req(0.0, 100)])
    assert r.transfer_end - r.transfer_start == pytest.approx(0.05 + 0.01 + 0.02)
    assert sim.link_bytes["handoff"] == nbytes // 2


def test_max_batch_holds_the_third_answer_back() -> None:
    d = dep(stream="after", max_batch=2, prefill_compute=compute(b=1e-6))
    _, reqs = run(d, [req(0.0, 100, out=10, ids=()) for _ in range(3)])
    first_two = sorted(r.finish for r in reqs)[:2]
    assert max(r.first_token for r in reqs) >= min(first_two)  # the third joins when one of two leaves


def test_colocated_admission_waits_for_room_and_loses_nothing() -> None:
    d = dep(mode="colocated", decode_kv_tokens=150)
    sim, (a, b) = run(d, [req(0.0, 100), req(0.0, 100, ids=())])
    assert b.prefill_start == pytest.approx(a.finish)
    # b waited from when it reached the head of the queue (a's prompt done) until a's last token
    assert sim.back.decode_waits == 1 and sim.back.decode_wait_s == pytest.approx(a.finish - a.prefill_end)


def test_a_follower_of_a_refused_request_still_arrives() -> None:
    sim, (_a, b) = run(dep(decode_kv_tokens=150), [req(0.0, 200), req(0.0, 100, ids=(), after=0, delay_s=1.0)])
    assert sim.rejected == [0] and b.finish > 0 and b.arrival == pytest.approx(1.0)


def test_a_trace_naming_a_later_request_is_refused_and_a_simulator_runs_once() -> None:
    sim = Simulator(dep())
    with pytest.raises(SimInputError, match="'after' must name an earlier request"):
        sim.run([req(0.0, 100, after=1), req(0.0, 100)])
    sim = Simulator(dep())
    sim.run([req(0.0, 100)])
    with pytest.raises(SimInputError, match="runs one trace"):
        sim.run([req(0.0, 100)])


def test_tier_order_and_names_are_checked() -> None:
    block = SPEC.request_bytes(BT)
    pool = TierSpec("pool", 10 * block, LinkSpec(1e9), scope="shared")
    host = TierSpec("host", 10 * block, LinkSpec(1e9))
    with pytest.raises(SimInputError, match="engine tier must come before the shared"):
        dep(tiers=(pool, host))
    with pytest.raises(SimInputError, match="'device'"):
        dep(tiers=(TierSpec("device", 10 * block, LinkSpec(1e9)),))
    with pytest.raises(SimInputError, match="holds no block"):
        dep(device_cache_tokens=8)
    with pytest.raises(SimInputError, match="colocated"):
        dep(mode="colocated", device_cache_tokens=1 << 20, decode_kv_tokens=1 << 20)


def test_max_goodput_bisects_to_the_rate_where_the_slo_breaks() -> None:
    from kvport.sim import max_goodput

    # a made-up system that meets its SLO up to 3x the trace's rate
    out = max_goodput(lambda x: {"meets_slo": x <= 3.0}, base_rps=2.0, steps=20)
    assert out["rate_multiple"] == pytest.approx(3.0, rel=1e-3)
    assert out["rate_rps"] == pytest.approx(6.0, rel=1e-3)
    assert max_goodput(lambda x: {"meets_slo": False}, base_rps=2.0)["rate_rps"] == 0.0


def test_a_credit_window_holds_the_prefill_until_the_decode_engine_takes_the_stream() -> None:
    # the decode engine takes one request at a time (max_batch 1), 10 tokens at 10 ms; the link moves
    # 1000 tokens/s; the window holds 20 tokens' KV. The second prefill (0.1 -> 0.2 s) streams to an
    # engine still decoding the first until 0.2 + 0.1 + 10 x 0.01 = ~0.41 s: its last layer waits
    # until all but the window (80 tokens, 0.08 s) has left after that
    window = SPEC.request_bytes(20)
    d = dep(stream="layerwise", max_batch=1, handoff_window_bytes=window, first_token="prefill")
    sim, (a, b) = run(d, [req(0.0, 100, out=10), req(0.0, 100, out=10, ids=())])
    assert a.prefill_end == pytest.approx(0.1)  # nothing ahead of it: the stream keeps up
    assert b.transfer_start == pytest.approx(a.finish, abs=0.011)  # one step's estimate
    assert b.prefill_end == pytest.approx(b.transfer_start + 0.08, rel=1e-6)
    assert b.first_token == b.prefill_end  # the demo's TTFT: the prefill worker's first token
    assert sim.back.credit_waits == 1 and sim.back.credit_wait_s == pytest.approx(b.prefill_end - 0.2)
    # through a codec of ratio 2 those 80 tokens' KV take half the link time (0.04 s): the bytes on the wire
    from kvport.sim import CodecSpec

    fast = CodecSpec("int8", 2.0, 1e15, 1e15)
    _, (_, bc) = run(dep(stream="layerwise", max_batch=1, handoff_window_bytes=window, first_token="prefill",
                         codec=fast), [req(0.0, 100, out=10), req(0.0, 100, out=10, ids=())])
    assert bc.prefill_end == pytest.approx(bc.transfer_start + 0.04, rel=1e-6)
    # without the window the prefill never waits for the decode engine
    _, (_, b2) = run(dep(stream="layerwise", max_batch=1, first_token="prefill"),
                     [req(0.0, 100, out=10), req(0.0, 100, out=10, ids=())])
    assert b2.prefill_end == pytest.approx(0.2)
