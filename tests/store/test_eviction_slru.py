"""Exact admission / eviction orders of the ``slru`` policy (segmented LRU in priority form)."""

import pytest

from kvport.errors import ConfigError
from kvport.store import TieredStore, TierIndex, make_policy
from kvport.store.eviction import DEFAULT_POLICY, POLICIES, LRUPolicy, SLRUPolicy
from kvport.tiers import HostTier

from ._helpers import evict_to, k


def test_slru_priorities_exact() -> None:
    p = SLRUPolicy(0.5)
    assert p.on_insert(k("a")) == 1 - 0.5 * 1  # tick 1, 1 block held
    assert p.on_insert(k("b")) == 2 - 0.5 * 2
    p.on_remove(k("a"))  # a block that leaves no longer counts
    assert p.on_insert(k("c")) == 3 - 0.5 * 2
    assert p.on_hit(k("b")) == 4  # a hit goes to the top, like LRU
    assert p.on_insert(k("d")) == 5 - 0.5 * 3


def test_slru_with_no_probation_is_lru() -> None:
    s, lru = SLRUPolicy(0.0), LRUPolicy()
    for c in "abc":
        assert s.on_insert(k(c)) == lru.on_insert(k(c))
    assert s.on_hit(k("a")) == lru.on_hit(k("a"))


def test_never_hit_block_leaves_before_an_older_hit_block() -> None:
    """Same events through slru and lru: they part when a new, never-hit block meets an older hit one."""

    def trace(policy: str) -> list[list[str]]:
        ix = TierIndex(make_policy(policy), 4)
        for c in "abcd":
            ix.add(k(c), 1)  # slru: a .5  b 1  c 1.5  d 2 (all on probation)
        ix.touch(k("a"))  # 5
        ix.touch(k("b"))  # 6
        out = []
        ix.add(k("e"), 1)  # 7 - 2.5 = 4.5
        out.append(evict_to(ix, 4))
        ix.add(k("f"), 1)  # 8 - 2.5 = 5.5
        out.append(evict_to(ix, 4))
        ix.add(k("g"), 1)  # 9 - 2.5 = 6.5: e (4.5, never hit) is below a (5)
        out.append(evict_to(ix, 4))
        ix.touch(k("f"))  # 10: a hit takes f off probation
        ix.add(k("h"), 1)  # 11 - 2.5 = 8.5
        out.append(evict_to(ix, 4))
        return out

    assert trace("slru") == [["c"], ["d"], ["e"], ["a"]]
    assert trace("lru") == [["c"], ["d"], ["a"], ["b"]]


def test_slru_evicts_leaves_only_then_their_parents() -> None:
    ix = TierIndex(make_policy("slru"), 3)
    ix.add(k("r"), 1)  # .5
    ix.touch(k("r"))  # 2
    ix.add(k("x"), 1, k("r"))  # 3 - 1 = 2
    ix.add(k("y"), 1, k("x"))  # 4 - 1.5 = 2.5
    ix.add(k("z"), 1)  # 5 - 2 = 3
    # x (2) is below y (2.5) but has a child: the leaf y goes first, then x, then r (2) before z (3)
    assert evict_to(ix, 3) == ["y"]
    assert evict_to(ix, 2) == ["x"]
    assert evict_to(ix, 1) == ["r"]
    assert [x[:1].decode() for x in ix] == ["z"]


def test_replay_of_a_tiny_trace_differs_from_lru_exactly() -> None:
    """Request by request as the trace bench replays: hit prefix touched last-block-first, misses
    inserted under it, leaves evicted down to the capacity after each request."""
    from kvport.bench.trace import replay

    reqs = [[0, 1], [2], [3], [0, 1], [2], [4], [5], [0, 1], [2]]
    # capacity 4. slru ticks: 0:.5 1:1 2:1.5 3:2; request 4 touches 1:5 0:6; request 5 touches 2:7;
    # request 6 adds 4 (8 - 5/2 = 5.5) and evicts 3 (2); request 7 adds 5 (6.5) and evicts the leaf 1 (5);
    # request 8 hits 0 (10), adds 1 (8.5) and evicts the never-hit 4 (5.5), so request 9 hits 2.
    # lru: 4 (8) is newer than 2 (7), so request 8 evicts 2 and request 9 misses it (and evicts 4).
    assert replay(reqs, 4, "slru") == {"hit_rate": 5 / 12, "evictions": 3}
    assert replay(reqs, 4, "lru") == {"hit_rate": 4 / 12, "evictions": 4}


def test_slru_is_registered() -> None:
    assert "slru" in POLICIES and DEFAULT_POLICY != "slru"  # the default is fslru (test_eviction_fslru.py)
    assert isinstance(make_policy("slru"), SLRUPolicy)
    assert make_policy("slru").name == "slru"
    with pytest.raises(ConfigError):
        SLRUPolicy(1.0)
    with pytest.raises(ConfigError):
        make_policy("arc")


def test_tiered_store_selects_the_policy_by_name() -> None:
    store = TieredStore([HostTier(4 * 64, 64, name="host")], eviction="slru")
    assert store._idx["host"].policy.name == "slru"
    store = TieredStore([HostTier(4 * 64, 64, name="host")], eviction="lru")
    assert store._idx["host"].policy.name == "lru"
