"""The router's choice (kvport.route.policy): the lowest predicted TTFT, held prefix against load;
least-loaded when nobody holds anything; never an engine that is down or not heard from."""

from __future__ import annotations

import pytest

from kvport.errors import ConfigError
from kvport.route.index import Match, Place
from kvport.route.policy import Costs, EngineState, PrefixRouter

COSTS = Costs(prefill_fixed_s=0.01, prefill_token_s=1e-3, load_block_s=(0.0, 1e-3, 4e-3, 8e-3, 8e-3))


def test_the_engine_holding_the_prefix_wins_until_its_queue_costs_more() -> None:
    r = PrefixRouter("prefix", COSTS)
    engines = [EngineState("a"), EngineState("b")]
    held = [Match("b", 30, (Place.DEVICE,) * 30)]  # 960 of 1000 tokens (32-token blocks) on b's device
    got = r.choose(engines, held, 1000, 32)
    assert got is not None and (got.engine, got.why, got.held_blocks) == ("b", "prefix", 30)
    assert got.scores["a"] == pytest.approx(0.01 + 1.0) and got.scores["b"] == pytest.approx(0.01 + 0.04)
    busy = [EngineState("a"), EngineState("b", running=30)]  # 31 x 0.05 > 1.01: the idle engine recomputes
    got = r.choose(busy, held, 1000, 32)
    assert got is not None and got.engine == "a" and got.why == "least_loaded"


def test_a_device_hit_beats_the_same_prefix_on_remote_storage() -> None:
    r = PrefixRouter("prefix", COSTS)
    held = [Match("a", 10, (Place.REMOTE_STORAGE,) * 10), Match("b", 10, (Place.DEVICE,) * 10)]
    got = r.choose([EngineState("a"), EngineState("b")], held, 400, 32)
    assert got is not None and got.engine == "b"


def test_nobody_holding_anything_is_least_loaded_and_the_last_token_is_always_computed() -> None:
    r = PrefixRouter("prefix", COSTS)
    got = r.choose([EngineState("a", running=2), EngineState("b", running=1)], [], 100, 32)
    assert got is not None and (got.engine, got.why) == ("b", "least_loaded")
    whole = Match("a", 4, (Place.DEVICE,) * 4)  # 128 tokens held of a 128-token prompt: 3 blocks usable
    assert r.ttft(EngineState("a"), whole, 128, 32) == pytest.approx(0.01 + 32e-3)


def test_an_engine_down_or_not_heard_from_is_never_chosen() -> None:
    r = PrefixRouter("prefix", COSTS, stale_s=5.0)
    held = [Match("a", 30, (Place.DEVICE,) * 30)]
    got = r.choose([EngineState("a", heard_s_ago=9.0), EngineState("b")], held, 1000, 32)
    assert got is not None and got.engine == "b"
    assert r.choose([EngineState("a", up=False), EngineState("b", heard_s_ago=None)], held, 1000, 32) is None


def test_the_baselines_and_bad_settings() -> None:
    rr = PrefixRouter("round_robin")
    engines = [EngineState("a", running=5), EngineState("b")]
    assert [rr.choose(engines, [], 10, 32).engine for _ in range(4)] == ["a", "b", "a", "b"]  # type: ignore[union-attr]
    ll = PrefixRouter("least_loaded")
    assert {ll.choose(engines, [Match("a", 9, (0,) * 9)], 500, 32).engine for _ in range(3)} == {"b"}  # type: ignore[union-attr]
    with pytest.raises(ConfigError):
        PrefixRouter("random")
    with pytest.raises(ConfigError):
        Costs(load_block_s=(0.0,))
    with pytest.raises(ConfigError):
        Costs(prefill_token_s=float("nan"))


def test_costs_from_the_planner_s_calibration_profile() -> None:
    from kvport.planner.profile import Link, LinkKind, PrefillModel, Profile

    pf = PrefillModel("m", 2, a=0.02, b=5e-4, c=0.0, d=0.0, measured_at=0.0)
    prof = Profile("here", 0.0, pf, (Link("host", LinkKind.TIER, 10e9, 0.0, 0.0),
                                      Link("disk", LinkKind.TIER, 2e9, 1e-4, 0.0),
                                      Link("peer", LinkKind.PEER, 1e9, 1e-3, 0.0)))
    c = Costs.from_profile(prof, block_bytes=4 << 20)
    assert c.prefill_fixed_s == pytest.approx(0.02 + 5e-4) and c.prefill_token_s == pytest.approx(5e-4)
    assert c.load_block_s[Place.DEVICE] == 0.0
    assert c.load_block_s[Place.HOST] == pytest.approx((4 << 20) / 10e9)
    assert c.load_block_s[Place.LOCAL_STORAGE] == pytest.approx(1e-4 + (4 << 20) / 2e9)
    assert c.load_block_s[Place.REMOTE_STORAGE] == pytest.approx(1e-3 + (4 << 20) / 1e9)
    # without the block's size only the prefill comes from the profile; without links the defaults stay
    assert Costs.from_profile(prof, None).load_block_s == Costs().load_block_s
    assert Costs.from_profile(Profile("here", 0.0), 1 << 20) == Costs()


def test_ties_are_taken_in_turn() -> None:
    for policy in ("least_loaded", "prefix"):  # prefix: when nobody holds anything
        r = PrefixRouter(policy, COSTS)
        engines = [EngineState("a"), EngineState("b"), EngineState("c")]
        got = [r.choose(engines, [], 100, 32).engine for _ in range(6)]  # type: ignore[union-attr]
        assert sorted(got) == ["a", "a", "b", "b", "c", "c"], got
