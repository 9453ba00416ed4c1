"""Scheduler-side planning of KVPortConnector: lookups, loads, saves (no vLLM, no I/O)."""

from __future__ import annotations

import pytest

from kvport.engines.vllm.plan import BlockCopy, ScheduledRequest, StepPlanner
from kvport.errors import EngineError
from kvport.keys import KeyContext, chain_keys
from kvport.spec import DType, KVSpec, Layout

B = 4
SPEC = KVSpec("m", num_layers=2, num_kv_heads=1, head_dim=4, dtype=DType.FP32, block_size=B, layout=Layout.VLLM_CPU)
CTX = KeyContext(block_size=B, spec_fingerprint=SPEC.fingerprint)


def planner(stored: set[bytes]) -> StepPlanner:
    return StepPlanner(CTX, stored.__contains__)


def prompt(n: int, base: int = 10) -> list[int]:
    return list(range(base, base + n))


def test_lookup_counts_leading_stored_blocks_and_leaves_one_token_to_compute() -> None:
    p = prompt(16)  # 4 full blocks
    keys = chain_keys(p, CTX)
    pl = planner(set(keys))
    # all 4 blocks stored, but the last prompt token must be computed: 3 blocks = 12 tokens
    assert pl.lookup("r", p, 0) == 12
    assert pl.lookup("r", p, 8) == 4  # vLLM already holds 8 tokens locally
    assert pl.lookup("r", p, 12) == 0
    pl2 = planner({keys[0], keys[2]})  # a hole: only the leading run counts
    assert pl2.lookup("r", p, 0) == 4


def test_keys_of_another_spec_or_tenant_never_match() -> None:
    p = prompt(12)
    other = KeyContext(block_size=B, spec_fingerprint=SPEC.with_(revision="other").fingerprint)
    pl = planner(set(chain_keys(p, other)))
    assert pl.lookup("r", p, 0) == 0
    pl = planner(set(chain_keys(p, CTX)))
    assert pl.lookup("r", p, 0) == 8
    assert pl.lookup("salted", p, 0, salt=b"tenant-a") == 0


def test_accepted_hit_becomes_a_load_into_the_allocated_blocks_then_saves_the_rest() -> None:
    p = prompt(14)  # 3 full blocks + 2 tokens
    keys = chain_keys(p, CTX)
    pl = planner({keys[0], keys[1]})
    assert pl.lookup("r", p, 0) == 8
    pl.after_alloc("r", 8)
    plan = pl.step([ScheduledRequest("r", 8, 6, [7, 3, 9, 1], True)])
    assert plan.loads == (BlockCopy("r", (keys[0], keys[1]), (7, 3)),)
    # block 2 is computed this step and is a full prompt block; block 3 is partial: not saved
    assert plan.saves == (BlockCopy("r", (keys[2],), (9,), parent=keys[1]),)  # under its parent: the chain kept
    # decode steps save nothing more (generated tokens are not keyed)
    plan = pl.step([ScheduledRequest("r", 14, 1, [5], False)])
    assert plan.loads == () and plan.saves == ()


def test_chunked_prefill_saves_each_block_once_as_it_completes() -> None:
    p = prompt(20)
    keys = chain_keys(p, CTX)
    pl = planner(set())
    assert pl.lookup("r", p, 0) == 0
    pl.after_alloc("r", 0)
    a = pl.step([ScheduledRequest("r", 0, 6, [0, 1], True)])  # tokens 0..5: block 0 complete
    b = pl.step([ScheduledRequest("r", 6, 6, [2], False)])  # tokens 6..11: blocks 1, 2
    c = pl.step([ScheduledRequest("r", 12, 8, [3, 4], False)])  # 12..19: blocks 3, 4
    assert [s.block_ids for s in a.saves] == [(0,)]
    assert [s.block_ids for s in b.saves] == [(1, 2)]
    assert [s.block_ids for s in c.saves] == [(3, 4)]
    assert [k for plan in (a, b, c) for s in plan.saves for k in s.keys] == keys


def test_local_cache_hit_blocks_are_saved_when_the_store_lacks_them() -> None:
    p = prompt(12)
    keys = chain_keys(p, CTX)
    pl = planner(set())
    assert pl.lookup("r", p, 8) == 0  # vLLM's own cache holds 8 tokens, kvport none
    plan = pl.step([ScheduledRequest("r", 8, 4, [4, 5, 6], True)])
    assert plan.saves == (BlockCopy("r", tuple(keys), (4, 5, 6)),)


def test_preempted_request_replaces_its_block_table() -> None:
    p = prompt(8)
    pl = planner(set())
    pl.lookup("r", p, 0)
    pl.step([ScheduledRequest("r", 0, 4, [1], True)])
    plan = pl.step([ScheduledRequest("r", 0, 8, [6, 2], True)])  # resumed: new table, block 1 saved before
    keys = chain_keys(p, CTX)
    assert plan.saves == (BlockCopy("r", (keys[1],), (2,), parent=keys[0]),)


def test_finish_drops_state_and_a_load_beyond_the_lookup_is_refused() -> None:
    p = prompt(12)
    pl = planner(set(chain_keys(p, CTX)))
    assert pl.lookup("r", p, 0) == 8
    with pytest.raises(EngineError):
        pl.after_alloc("r", 12)
    pl.finish("r")
    assert len(pl) == 0
    assert pl.step([ScheduledRequest("r", 0, 12, [1, 2, 3], True)]).saves == ()


def test_saves_come_in_runs_of_consecutive_blocks_each_under_its_parent() -> None:
    p = prompt(16)
    keys = chain_keys(p, CTX)
    pl = planner({keys[1]})  # the store already holds block 1 (another engine saved it)
    pl.lookup("r", p, 0)
    plan = pl.step([ScheduledRequest("r", 0, 16, [5, 6, 7, 8], True)])
    assert plan.saves == (BlockCopy("r", (keys[0],), (5,), parent=None),
                          BlockCopy("r", (keys[2], keys[3]), (7, 8), parent=keys[1]))


def test_with_the_live_token_list_generated_blocks_are_saved_as_they_fill_and_chain_on_the_prompt() -> None:
    p = prompt(6)  # 1 full block + 2 tokens
    tokens = list(p)  # vLLM's Request.all_token_ids: grows as tokens are sampled
    stored: set[bytes] = set()
    pl = planner(stored)
    assert pl.lookup("r", p, 0, tokens=tokens) == 0
    plan = pl.step([ScheduledRequest("r", 0, 6, [4, 8], True)])
    assert [c.block_ids for c in plan.saves] == [(4,)]
    stored.update(k for c in plan.saves for k in c.keys)
    tokens.append(50)  # sampled by the prefill step; decode step 1 computes its KV (position 6)
    assert pl.step([ScheduledRequest("r", 6, 1, None, False)]).saves == ()
    tokens.append(51)  # position 7 completes block 1: prompt tokens 4, 5 + generated 50, 51
    plan = pl.step([ScheduledRequest("r", 7, 1, None, False)])
    whole = chain_keys([*p, 50, 51], CTX)
    assert plan.saves == (BlockCopy("r", (whole[1],), (8,), parent=whole[0]),)
    # the next turn's prompt (this turn's prompt + answer + more) finds both blocks
    stored.update(k for c in plan.saves for k in c.keys)
    assert planner(stored).lookup("turn2", [*p, 50, 51, 60, 61, 62], 0) == 8
    # without the token list (kvport_save_generated false) only prompt blocks are saved
    pl2 = planner(set())
    pl2.lookup("q", p, 0)
    pl2.step([ScheduledRequest("q", 0, 6, [1, 2], True)])
    assert pl2.step([ScheduledRequest("q", 7, 1, None, False)]).saves == ()
    assert pl.prompt_keys("r") == (whole[0],) and pl.prompt_keys("nobody") == ()


def test_an_async_hit_is_handed_to_the_next_step_with_the_blocks_vllm_allocated_and_not_loaded_again() -> None:
    p = prompt(14)
    keys = chain_keys(p, CTX)
    pl = planner(set(keys))
    assert pl.lookup("r", p, 4) == 8  # block 0 in vLLM's own cache, blocks 1-2 from the store
    pl.after_alloc("r", 8, block_ids=[7, 3, 9, 1])  # all of the request's blocks, local ones first
    plan = pl.step([])  # the request waits for its KV: not scheduled, its load goes out anyway
    assert plan.async_loads == (BlockCopy("r", (keys[1], keys[2]), (3, 9), keys[0]),) and plan.loads == ()
    assert pl.step([]).async_loads == ()  # handed out once
    # scheduled once loaded: no load again, nothing to save (every full block came from the store)
    plan = pl.step([ScheduledRequest("r", 12, 2, [7, 3, 9, 1], True)])
    assert plan.loads == () and plan.saves == ()
    with pytest.raises(EngineError):
        pl.lookup("q", p, 0)
        pl.after_alloc("q", 8, block_ids=[1])  # fewer blocks than the load needs


def test_a_hand_off_goes_to_the_next_step_once_with_the_prompt_keys_only() -> None:
    p = prompt(10)  # 2 full prompt blocks and a partial one
    keys = chain_keys(p, CTX)
    pl = planner(set())
    assert pl.lookup("r", p, 0, tokens=[*p, 1, 2]) == 0
    pl.step([ScheduledRequest("r", 0, 10, [5, 6, 7], True)])
    handed = pl.hand_off("r", 7.5)
    pl.finish("r")  # vLLM's request_finished: the state goes, the hand-off stays queued
    assert handed == tuple(keys[:2])
    plan = pl.step([])
    assert [(h.req_id, h.keys, h.lease_s) for h in plan.handoffs] == [("r", tuple(keys[:2]), 7.5)]
    assert pl.step([]).handoffs == ()  # given to the worker once
    assert pl.hand_off("never-seen", 1.0) == ()  # a request the planner never saw: nothing to lease


class _Store:
    """What the scheduler asks of the store: which keys it holds."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys

    def contains(self, key: bytes) -> bool:
        return key in self.keys

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        return [k in self.keys for k in keys]

    def lookup(self, keys: list[bytes]) -> object:
        n = next((i for i, k in enumerate(keys) if k not in self.keys), len(keys))
        return type("Hit", (), {"prefix_blocks": n})()


def test_at_tp3_a_block_is_held_only_when_every_rank_holds_its_heads_and_each_rank_plans_in_its_keys() -> None:
    from kvport.engines.vllm.plan import RankKeys, StepPlan, StreamCopy
    from kvport.keys import head_keys

    spec = SPEC.with_(num_kv_heads=3, tp_size=3)
    ctx = KeyContext(block_size=B, spec_fingerprint=spec.whole.fingerprint)
    chain = chain_keys(prompt(5 * B), ctx)
    ranks = [RankKeys(spec.for_rank(r, 3), ctx) for r in range(3)]
    per_rank = [head_keys(chain, r, r + 1, 3) for r in range(3)]
    assert len({k for ks in per_rank for k in ks} | set(chain)) == 4 * len(chain)  # every rank's keys its own
    assert ranks[1].of(chain) == tuple(per_rank[1])
    # ranks 0 and 2 hold 4 blocks, rank 1 only 2: the scheduler sees 2, and block 3 as not held
    store = _Store({*per_rank[0][:4], *per_rank[1][:2], *per_rank[2][:4]})
    assert ranks[0].prefix(store)(chain) == 2
    assert ranks[0].contains_many(store)(chain) == [True, True, False, False, False]
    assert ranks[0].contains(store)(chain[1]) and not ranks[0].contains(store)(chain[3])
    # a worker's plan: its keys, its parent, its inbox among the decode ranks'
    copy = BlockCopy("r", tuple(chain[2:4]), (7, 8), parent=chain[1])
    sc = StreamCopy("s", "h:1,h:2,h:3", copy, 2)
    plan = ranks[2].plan(StepPlan(loads=(copy,), saves=(copy,), streams=(sc,)))
    assert plan.loads[0].keys == plan.saves[0].keys == tuple(per_rank[2][2:4])
    assert plan.loads[0].parent == per_rank[2][1] and plan.loads[0].block_ids == (7, 8)
    assert plan.streams[0].dest == "h:3" and plan.streams[0].copy.keys == tuple(per_rank[2][2:4])
    # at TP 1 the keys are the chain itself
    one = RankKeys(SPEC, CTX)
    assert one.of(chain) == tuple(chain) and one.plan(StepPlan(loads=(copy,))).loads == (copy,)
