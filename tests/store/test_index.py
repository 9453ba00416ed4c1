from kvport.store import TierIndex, make_policy

from ._helpers import evict_to, k


def test_lru_exact_order() -> None:
    ix = TierIndex(make_policy("lru"), 3)
    for c in "abc":
        ix.add(k(c), 1)
    ix.touch(k("a"))
    ix.add(k("d"), 1)
    assert evict_to(ix, 3) == ["b"]
    ix.add(k("e"), 1)
    assert evict_to(ix, 3) == ["c"]
    ix.touch(k("a"))
    ix.add(k("f"), 1)
    ix.add(k("g"), 1)
    assert evict_to(ix, 3) == ["d", "e"]
    assert sorted(x[:1].decode() for x in ix) == ["a", "f", "g"]


def test_lfu_exact_order_with_aging() -> None:
    ix = TierIndex(make_policy("lfu"), 3)
    for c in "abc":
        ix.add(k(c), 1)
    ix.touch(k("a"))
    ix.touch(k("a"))
    ix.touch(k("c"))  # hits: a=3, b=1, c=2
    ix.add(k("d"), 1)  # enters at age 0 + 1
    assert evict_to(ix, 3) == ["b"]  # b and d tie at 1: the older leaves first; the age becomes 1
    ix.add(k("e"), 1)  # enters at 1 + 1
    assert evict_to(ix, 3) == ["d"]
    ix.add(k("f"), 1)
    assert evict_to(ix, 3) == ["c"]  # c and e tie at 2: the older leaves; a (3 hits) outlives the recent
    assert sorted(x[:1].decode() for x in ix) == ["a", "e", "f"]


def test_leaves_of_the_prefix_tree_leave_first() -> None:
    ix = TierIndex(make_policy("lru"), 4)
    ix.add(k("a"), 1)
    ix.add(k("b"), 1, parent=k("a"))
    ix.add(k("c"), 1, parent=k("b"))
    ix.add(k("x"), 1)
    # a is the least recent, but a parent never leaves before its children
    ix.add(k("y"), 1)
    assert evict_to(ix, 4) == ["c"]
    ix.add(k("z"), 1)
    assert evict_to(ix, 4) == ["b"]
    ix.add(k("w"), 1)
    assert evict_to(ix, 4) == ["a"]
    assert ix.children(k("a")) == 0


def test_refused_keys_are_skipped_and_kept() -> None:
    ix = TierIndex(make_policy("lru"), 2)
    for c in "abc":
        ix.add(k(c), 1)
    order = []
    for v in ix.victims(lambda key: key != k("a")):
        ix.remove(v, evicted=True)
        order.append(v[:1].decode())
        if ix.used <= 2:
            break
    assert order == ["b"]
    assert k("a") in ix
    assert next(iter(ix.victims())) == k("a")  # still a candidate once allowed


def test_hits_without_eviction_keep_the_heap_bounded() -> None:
    """Every hit leaves a stale heap item behind; a pool that is only read compacts them away
    (the heap stays within 2 x entries + 64), and the eviction order is the one the hits made."""
    for policy in ("lru", "lfu", "slru"):
        ix = TierIndex(make_policy(policy), 100)
        ix.add(k("r"), 1)
        ix.add(k("s"), 1, parent=k("r"))  # r is no leaf: its hits push nothing
        letters = "abcdefgh"
        for c in letters:
            ix.add(k(c), 1)
        most = 0
        for i in range(20_000):
            ix.touch(k(letters[i % len(letters)]) if i % 3 else k("r"))
            most = max(most, ix.heap_items)
        assert most <= 2 * len(ix) + 64, policy
        if policy != "lfu":
            for c in reversed(letters):
                ix.touch(k(c))
            # s was never hit; r (its parent) leaves next; then the letters, least recent first
            assert evict_to(ix, 0) == ["s", "r", *reversed(letters)], policy
