"""Eviction policies as priority rules: the lowest priority leaf is evicted first.

A policy only assigns numbers; :class:`~kvport.store.index.TierIndex` keeps the prefix tree and the
heap of leaves. Priorities are floats, larger = keep longer:

* ``lru``: priority = a counter bumped on every insert and hit. The store touches a
  looked-up prefix from its last block back to its first, so a parent is always at least as recent
  as its children and the least recent block is a leaf.
* ``lfu``  (LFU with dynamic aging, "LFU-DA"): priority = L + hits, where L is the priority of the
  last evicted block. Frequent blocks stay; aging by L lets a once-hot block leave eventually.
  Ties (same priority) leave in insertion order.
* ``slru`` (segmented LRU in priority form): a block that has not been hit since it was inserted is
  *on probation*: it enters ``probation`` x (blocks held) ticks below the top of the LRU order, so it
  leaves earlier than in plain LRU unless it is hit; a hit moves it to the top like LRU (and out of
  probation). ``probation=0`` is plain LRU. The parent-before-child touch order of ``lru`` still
  holds for hits; a chain inserted in one go keeps its order too (each insert takes the next tick).
* ``fslru`` (default; :class:`FrequencySLRUPolicy`): ``slru`` whose probation and protection read a
  block's use count *including the uses it had before it last left the tier*, kept in a bounded
  history (a TinyLFU-like memory of counts beyond residency). Priority = tick + (blocks held) x
  ``extra(uses)``: ``-probation`` on the first use, 0 on the second, then a bonus that doubles with
  each doubling of the uses (0.25 on the 3rd, 0.5 on the 4th-5th, 1 on the 6th-9th, 2, at most 4).
  A block that comes back after it was evicted is thus no longer on probation, a one-off is, and a
  block used often outlives a recent one-off by several cache lifetimes. Counts halve every
  ``aging`` x (blocks held) uses, so old counts fade; the history (a FIFO of the counts of blocks
  that left) holds at most ``history`` x (blocks held) keys. ``probation`` adapts by hill climbing on
  the tier's own hit ratio (every ``window`` x (blocks held) uses: keep moving it by ``step`` while
  the ratio does not fall, turn back when it falls): the probation that pays depends on the capacity
  against the reuse distances. Why default: most KV blocks are used once (74% of the distinct full
  blocks of the Mooncake conversation trace) and a block's chance of another use grows with its uses
  (26% after one, 42% after two, 50% after three): the count forgotten at eviction is what tells a
  returning block from a one-off. Over the conversation and synthetic Mooncake traces at 5/10/20% of
  their distinct blocks it gains 2.6 points of the optimum on ``lru`` on average (``slru``: 0.5) and
  loses 0.5 point in its worst cell (``slru``: 1.4); figures and what else was tried in docs/store.md.

Every policy admits every block; a policy that ranks a new block lowest evicts it at the end of the
same batch, which is not admitting it. The offline optimum the trace bench compares with (Belady,
where the blocks just brought in are candidates too) has the same option.
"""

from __future__ import annotations

import abc
import itertools
from collections import OrderedDict

from kvport.errors import ConfigError

MAX_HISTORY_KEYS = 1 << 20  # fslru's remembered counts per tier, at most (a key and a count: ~140 bytes each)

class EvictionPolicy(abc.ABC):
    name: str

    @abc.abstractmethod
    def on_insert(self, key: bytes) -> float:
        """Priority of a newly inserted key."""

    @abc.abstractmethod
    def on_hit(self, key: bytes) -> float:
        """Priority of ``key`` after a hit."""

    def on_evict(self, key: bytes, priority: float) -> None:  # noqa: B027 - optional hook
        """``key`` left the tier at ``priority`` (through eviction)."""

    def on_remove(self, key: bytes) -> None:  # noqa: B027 - optional hook
        """``key`` left the tier (eviction, delete or lifetime end): drop per-key state."""


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        self._clock = itertools.count(1)

    def on_insert(self, key: bytes) -> float:
        return float(next(self._clock))

    def on_hit(self, key: bytes) -> float:
        return float(next(self._clock))


class LFUDAPolicy(EvictionPolicy):
    name = "lfu"

    def __init__(self) -> None:
        self._age = 0.0
        self._hits: dict[bytes, int] = {}

    def on_insert(self, key: bytes) -> float:
        self._hits[key] = 1
        return self._age + 1

    def on_hit(self, key: bytes) -> float:
        n = self._hits.get(key, 0) + 1
        self._hits[key] = n
        return self._age + n

    def on_evict(self, key: bytes, priority: float) -> None:
        self._age = max(self._age, priority)

    def on_remove(self, key: bytes) -> None:
        self._hits.pop(key, None)


class SLRUPolicy(EvictionPolicy):
    name = "slru"

    def __init__(self, probation: float = 0.5) -> None:
        if not 0.0 <= probation < 1.0:
            raise ConfigError(f"slru probation must be in [0, 1), got {probation}")
        self.probation = probation
        self._clock = 0
        self._live: set[bytes] = set()

    def on_insert(self, key: bytes) -> float:
        self._clock += 1
        self._live.add(key)
        return self._clock - self.probation * len(self._live)

    def on_hit(self, key: bytes) -> float:
        self._clock += 1
        return float(self._clock)

    def on_remove(self, key: bytes) -> None:
        self._live.discard(key)


class FrequencySLRUPolicy(EvictionPolicy):
    """``slru`` with use counts that outlive residency, aging, and a self-tuning probation.

    State, all bounded by (blocks held) = ``n``: ``_uses`` (the n resident keys' counts), ``_history``
    (at most ``history`` x n counts of keys that left, and never more than :data:`MAX_HISTORY_KEYS`:
    ~140 MB at most, whatever the tier's size; oldest dropped first). Work: O(1) per call
    plus one halving pass over both every ``aging`` x n calls (amortised O(1 + history / aging))."""

    name = "fslru"

    def __init__(self, probation: float = 0.5, bonus: float = 0.25, max_bonus: float = 4.0, history: float = 16.0,
                 aging: float = 20.0, window: float = 0.5, step: float = 0.05, max_probation: float = 0.95) -> None:
        if not 0.0 <= probation <= max_probation < 1.0:
            raise ConfigError(f"fslru probation must be in [0, max_probation], max_probation < 1: "
                              f"got {probation}, {max_probation}")
        if min(bonus, max_bonus, history, step) < 0 or aging <= 0 or window <= 0:
            raise ConfigError("fslru bonus, max_bonus, history and step must be >= 0, aging and window > 0")
        self.probation = probation
        self.bonus, self.max_bonus = bonus, max_bonus
        self.history, self.aging, self.window = history, aging, window
        self.step, self.max_probation = step, max_probation
        self._clock = 0
        self._uses: dict[bytes, int] = {}
        self._history: OrderedDict[bytes, int] = OrderedDict()
        self._since_aging = 0
        self._calls = self._hits = 0  # the current hill-climbing window
        self._last_ratio: float | None = None
        self._direction = 1.0

    @property
    def history_keys(self) -> int:
        """Keys whose counts are remembered after they left (at most ``history`` x blocks held)."""
        return len(self._history)

    def uses(self, key: bytes) -> int:
        """The remembered use count of ``key`` (resident or not; 0 when forgotten)."""
        return self._uses.get(key, self._history.get(key, 0))

    def _priority(self, uses: int) -> float:
        """tick + (blocks held) x extra: -probation at 1 use, 0 at 2, then bonus x 2^floor(log2(uses - 2))
        (x1 at 3 uses, x2 at 4-5, x4 at 6-9, x8 at 10-17 ...), at most max_bonus."""
        if uses <= 1:
            extra = -self.probation
        elif uses == 2:
            extra = 0.0
        else:
            extra = min(self.max_bonus, self.bonus * (1 << ((uses - 2).bit_length() - 1)))
        return self._clock + extra * len(self._uses)

    def _tick(self, hit: bool) -> None:
        self._clock += 1
        self._since_aging += 1
        if self._since_aging > self.aging * max(len(self._uses), 1):
            self._halve()
        self._calls += 1
        self._hits += hit
        if self._calls >= self.window * max(len(self._uses), 64):
            ratio = self._hits / self._calls
            if self._last_ratio is not None and ratio < self._last_ratio:
                self._direction = -self._direction
            self._last_ratio = ratio
            self.probation = min(self.max_probation, max(0.0, self.probation + self._direction * self.step))
            self._calls = self._hits = 0

    def _halve(self) -> None:
        """Aging: every count halves (a resident key keeps at least 1; a forgotten count of 0 goes)."""
        self._since_aging = 0
        for k, n in self._uses.items():
            self._uses[k] = max(1, n // 2)
        for k in list(self._history):
            n = self._history[k] // 2
            if n:
                self._history[k] = n
            else:
                del self._history[k]

    def on_insert(self, key: bytes) -> float:
        uses = self._history.pop(key, 0) + 1
        self._uses[key] = uses
        self._tick(hit=False)
        return self._priority(uses)

    def on_hit(self, key: bytes) -> float:
        uses = self._uses.get(key, 0) + 1
        self._uses[key] = uses
        self._tick(hit=True)
        return self._priority(uses)

    def on_remove(self, key: bytes) -> None:
        uses = self._uses.pop(key, None)
        if uses is None:
            return
        self._history[key] = uses
        self._history.move_to_end(key)
        cap = min(self.history * max(len(self._uses), 1), MAX_HISTORY_KEYS)
        while len(self._history) > cap:
            self._history.popitem(last=False)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUDAPolicy, "slru": SLRUPolicy,
                                             "fslru": FrequencySLRUPolicy}


DEFAULT_POLICY = "fslru"


def make_policy(name: str = DEFAULT_POLICY) -> EvictionPolicy:
    cls = POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown eviction policy {name!r}: expected one of {', '.join(POLICIES)}")
    return cls()
