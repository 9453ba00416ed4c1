"""The default policy ``fslru``: slru with use counts that outlive residency, aging, and a probation
tuned by hill climbing. Exact priorities and orders on tiny pools; no timing."""

import random

import pytest

from kvport.errors import ConfigError
from kvport.store import TieredStore, TierIndex
from kvport.store.eviction import DEFAULT_POLICY, POLICIES, FrequencySLRUPolicy, SLRUPolicy, make_policy
from kvport.tiers import HostTier

from ._helpers import evict_to, k


def test_priorities_exact() -> None:
    p = FrequencySLRUPolicy(step=0.0)  # probation stays 0.5; bonus 0.25, doubling with the uses
    assert p.on_insert(k("a")) == 1 - 0.5 * 1  # first use: on probation, 1 block held
    assert p.on_insert(k("b")) == 2 - 0.5 * 2
    assert p.on_hit(k("a")) == 3  # second use: the top of the LRU order
    assert p.on_hit(k("a")) == 4 + 0.25 * 2  # third use: protected
    assert p.on_hit(k("a")) == 5 + 0.5 * 2  # fourth and fifth: doubled
    for tick in (6, 7, 8, 9):
        assert p.on_hit(k("a")) == tick + (0.5 if tick == 6 else 1.0) * 2  # sixth to ninth: 1
    for _ in range(100):
        last = p.on_hit(k("a"))
    assert last == p._clock + 4.0 * 2  # at most max_bonus
    p.on_remove(k("b"))
    assert p.uses(k("b")) == 1 and p.history_keys == 1  # remembered after it left
    assert p.on_insert(k("b")) == p._clock + 0 * 2  # back: its second use, not on probation
    assert p.on_insert(k("c")) == p._clock - 0.5 * 3  # a one-off inserted later ranks below it
    assert p.history_keys == 0


def test_a_returning_block_outranks_a_one_off() -> None:
    """Same events through fslru and slru: slru puts the block that comes back on probation again."""

    def trace(policy: str) -> list[str]:
        ix = TierIndex(make_policy(policy) if policy == "slru" else FrequencySLRUPolicy(step=0.0), 2)
        for c in "abc":
            ix.add(k(c), 1)  # .5, 1, 1.5 in both
        out = evict_to(ix, 2)  # a
        ix.add(k("a"), 1)  # fslru: its second use, 4 + 0; slru: 4 - .5 x 3 = 2.5
        ix.add(k("d"), 1)  # a one-off, newer: 5 - .5 x 4 = 3 in both
        return out + evict_to(ix, 1)

    assert trace("fslru") == ["a", "b", "c", "d"]
    assert trace("slru") == ["a", "b", "c", "a"]


def test_memory_stays_bounded_by_the_blocks_held() -> None:
    policy = FrequencySLRUPolicy(history=2.0)
    ix = TierIndex(policy, 8)
    rng = random.Random(7)
    for i in range(5000):
        key = f"r{rng.randrange(40):015d}" if i % 3 == 0 else f"{i:016d}"
        ix.add(key.encode(), 1)
        evict_to(ix, 8)
        assert policy.history_keys <= 2 * len(ix)
    assert policy.uses(f"{10:016d}".encode()) == 0  # a one-off long gone is forgotten


def test_aging_halves_counts_until_old_ones_fade() -> None:
    p = FrequencySLRUPolicy(aging=4.0, step=0.0)
    p.on_insert(k("a"))
    for _ in range(3):
        p.on_hit(k("a"))
    assert p.uses(k("a")) == 4  # 4 calls: no halving yet (one every 4 x blocks held)
    p.on_remove(k("a"))
    p.on_insert(k("x"))
    counts = []
    for _ in range(30):
        p.on_hit(k("x"))
        counts.append(p.uses(k("a")))
    assert counts == sorted(counts, reverse=True) and {2, 1} <= set(counts) and counts[-1] == 0  # then forgotten
    assert p.history_keys == 0
    assert p.uses(k("x")) >= 1  # a resident block never falls below one use
    held = 2
    assert p.on_insert(k("a")) == p._clock - 0.5 * held  # faded: a first use again, on probation


def test_probation_climbs_while_the_hit_ratio_rises_and_turns_when_it_falls() -> None:
    p = FrequencySLRUPolicy(probation=0.5, step=0.1, window=0.5)  # a window: 0.5 x max(held, 64) = 32 calls
    misses = iter(range(10_000))

    def window(hits: int, miss: int) -> float:
        for _ in range(hits):
            p.on_hit(k("r"))
        for _ in range(miss):
            m = next(misses).to_bytes(16, "little")
            p.on_insert(m)
            p.on_remove(m)  # only r stays held
        return p.probation

    p.on_insert(k("r"))
    assert window(0, 31) == pytest.approx(0.6)  # the first window sets the reference and moves up
    assert window(0, 32) == pytest.approx(0.7)  # not worse: keep going
    assert window(16, 16) == pytest.approx(0.8)  # better: keep going
    assert window(0, 32) == pytest.approx(0.7)  # worse: turn back
    assert window(0, 32) == pytest.approx(0.6)
    assert FrequencySLRUPolicy(step=0.0).probation == 0.5


def test_a_parent_never_leaves_before_its_children() -> None:
    ix = TierIndex(make_policy("fslru"), 12)
    parent_of: dict[bytes, bytes | None] = {}
    rng = random.Random(3)
    for _ in range(3000):
        chain = [rng.randrange(4)] + [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
        keys = [repr(chain[: i + 1]).encode().ljust(16, b".") for i in range(len(chain))]
        n = 0
        while n < len(keys) and keys[n] in ix:
            n += 1
        for key in reversed(keys[:n]):
            ix.touch(key)
        parent = keys[n - 1] if n else None
        for key in keys[n:]:
            ix.add(key, 1, parent)
            parent_of[key] = parent
            parent = key
        evict_to(ix, 12)
        assert all((up := parent_of[key]) is None or up in ix for key in ix)


def test_fslru_is_the_default_and_checks_its_settings() -> None:
    assert DEFAULT_POLICY == "fslru"
    assert set(POLICIES) == {"lru", "lfu", "slru", "fslru"}
    assert isinstance(make_policy(), FrequencySLRUPolicy)
    assert isinstance(make_policy("slru"), SLRUPolicy)
    assert TieredStore([HostTier(4 * 64, 64, name="host")])._idx["host"].policy.name == "fslru"
    for bad in ({"probation": 1.0}, {"probation": -0.1}, {"history": -1.0}, {"aging": 0.0}, {"window": 0.0},
                {"step": -0.1}, {"bonus": -0.5}, {"max_bonus": -1.0}):
        with pytest.raises(ConfigError):
            FrequencySLRUPolicy(**bad)  # type: ignore[arg-type]
