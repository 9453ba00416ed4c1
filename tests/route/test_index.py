"""PrefixIndex (kvport.route.index): blocks per engine and place from events, the longest held prefix,
removals per place, gaps and duplicates, bounded memory, engines that go quiet."""

from __future__ import annotations

import pytest

from kvport.errors import ConfigError
from kvport.events.wire import AllBlocksCleared, Batch, BlockRemoved, BlockStored
from kvport.route.index import Place, PrefixIndex

H = [bytes([i]) * 16 for i in range(10)]


def stored(hashes: list[bytes], medium: str | None = "GPU", locality: str | None = None,
           ownership: str | None = None) -> BlockStored:
    return BlockStored(tuple(hashes), None, (), 16, medium, locality, ownership)


def batch(*events: object) -> Batch:
    return Batch(0.0, tuple(events))  # type: ignore[arg-type]


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_longest_held_prefix_and_the_best_place_of_each_block() -> None:
    ix = PrefixIndex()
    ix.apply("a", batch(stored(H[:4], "CPU", "LOCAL", "kvport:host"), stored(H[:2], "GPU")))
    ix.apply("b", batch(stored(H[:6], "STORAGE", "REMOTE", "kvport:redis")))
    m = ix.match("a", H[:6])  # a's own places first, then what every engine reads from Redis
    assert m.blocks == 6 and m.places == (Place.DEVICE, Place.DEVICE, Place.HOST, Place.HOST,
                                          Place.REMOTE_STORAGE, Place.REMOTE_STORAGE)
    assert ix.match("b", H[:6]).places == (Place.REMOTE_STORAGE,) * 6
    assert ix.match("a", [H[0], H[7], H[1]]).blocks == 1  # a block counts only with its whole prefix before it
    ix.apply("c", batch(stored(H[:1], "GPU")))
    assert ix.match("c", H[:6]).places == (Place.DEVICE,) + (Place.REMOTE_STORAGE,) * 5
    assert ix.blocks == 11


def test_a_block_removed_from_one_place_stays_held_in_another() -> None:
    ix = PrefixIndex()
    ix.apply("a", batch(stored(H[:3], "GPU"), stored(H[:3], "CPU", "LOCAL", "kvport:host")))
    ix.apply("a", batch(BlockRemoved((H[0], H[1]), "GPU")))
    assert ix.match("a", H[:3]).places == (Place.HOST, Place.HOST, Place.DEVICE)
    ix.apply("a", batch(BlockRemoved((H[0],), "CPU", "LOCAL", "kvport:host")))
    assert ix.match("a", H[:3]).blocks == 0 and ix.blocks == 2
    ix.apply("a", batch(BlockRemoved((H[9],), "GPU")))  # never stored: counted, nothing else
    assert ix.removed_unknown == 1
    ix.apply("a", batch(AllBlocksCleared()))  # vLLM's: its device cache; kvport's host tier still holds two
    assert ix.size("a") == 2 and ix.match("a", H[1:3]).places == (Place.HOST, Place.HOST)
    ix.apply("a", batch(AllBlocksCleared("CPU")))  # kvport's, naming the tier's medium
    assert ix.size("a") == 0 and ix.blocks == 0


def test_sequence_numbers_find_gaps_and_drop_duplicates() -> None:
    ix = PrefixIndex()
    assert ix.apply("a", batch(stored(H[:1])), seq=0).gap == 0
    assert ix.apply("a", batch(stored(H[1:2])), seq=1).gap == 0
    assert ix.apply("a", batch(stored(H[5:6])), seq=4).gap == 2  # 2 and 3 missing: a replay is due
    dup = ix.apply("a", batch(stored(H[7:8])), seq=3)
    assert dup.duplicate and ix.size("a") == 3  # arrived after 4: too late, dropped (the replay covers it)


def test_memory_is_bounded_per_engine_and_in_all() -> None:
    ix = PrefixIndex(max_blocks_per_engine=4, max_blocks=6)
    ix.apply("a", batch(stored(H[:6])))
    assert ix.size("a") == 4 and ix.match("a", H[2:6]).blocks == 4  # the oldest went first
    ix.apply("b", batch(stored(H[:4])))
    assert ix.blocks == 6 and ix.size("a") + ix.size("b") == 6 and ix.trimmed == 4
    with pytest.raises(ConfigError):
        PrefixIndex(max_blocks_per_engine=10, max_blocks=5)


def test_an_engine_not_heard_from_leaves_the_index() -> None:
    clock = Clock()
    ix = PrefixIndex(stale_s=5.0, clock=clock)
    ix.apply("a", batch(stored(H[:3])))
    clock.t = 3.0
    ix.apply("b", batch(stored(H[:2])))
    clock.t = 6.0
    assert ix.expire() == ["a"] and ix.engines() == ["b"] and ix.blocks == 2
    assert ix.heard("b") == 3.0 and ix.heard("a") is None


def test_engines_and_places_are_capped() -> None:
    ix = PrefixIndex(max_engines=2)
    for name in ("a", "b", "c"):
        ix.apply(name, batch(stored(H[:1])))
    assert ix.engines() == ["a", "b"] and ix.unknown_engines == 1
    for i in range(40):  # a publisher inventing places: they share the last bit, the index does not grow
        ix.apply("a", batch(stored(H[:1], "STORAGE", "LOCAL", f"kvport:t{i}")))
    assert ix.match("a", H[:1]).blocks == 1


def test_a_shared_tier_counts_for_every_engine_and_outlives_them() -> None:
    clock = Clock()
    ix = PrefixIndex(stale_s=5.0, clock=clock)
    ix.apply("a", batch(stored(H[:3], "GPU"), stored(H[:3], "STORAGE", "REMOTE", "kvport:disk")))
    assert ix.match("b", H[:4]).places == (Place.REMOTE_STORAGE,) * 3  # b never published: it reads the tier
    ix.apply("a", batch(AllBlocksCleared()))  # a's cache, not the shared tier
    assert ix.match("a", H[:3]).places == (Place.REMOTE_STORAGE,) * 3
    clock.t = 10.0
    assert ix.expire() == ["a"]  # a went quiet; the tier it wrote to did not
    assert ix.match("b", H[:3]).blocks == 3
    ix.apply("b", batch(BlockRemoved((H[1],), "STORAGE", "REMOTE", "kvport:disk")))  # evicted there
    assert ix.match("b", H[:3]).blocks == 1
