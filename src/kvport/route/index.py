"""PrefixIndex: for every engine, which blocks it holds and where, built from KV events. Pure, no I/O.

::

    engines   name -> _Engine: blocks {hash: places bitmask}, last_seen, next seq, counters
    places    one bit per (medium, tier) an engine has reported: GPU, CPU, STORAGE LOCAL, STORAGE
              REMOTE, each kvport tier by its ownership name ("kvport:host"); a block is held while
              any bit is set (stored in two tiers, removed from one: still held in the other)
    shared    a pseudo-engine for tiers every engine reads (a disk folder the engines share, kvport
              serve, Redis): whatever engine reports a block with locality REMOTE, it goes here, and
              it counts for every engine at its own place; it never goes stale (the tier outlives
              any one engine), only its own removals and the caps take its blocks out

Memory is bounded: at most ``max_blocks_per_engine`` per engine and ``max_blocks`` in all; past
either, the engine's oldest entries (insertion order, the order its blocks were first reported)
go, and ``trimmed`` counts them. An engine not heard from for ``stale_s`` leaves the index whole
(:meth:`expire`), and so does one that reports a restart (``AllBlocksCleared`` of everything).

A lookup (:meth:`match`) answers the longest leading run of a request's block hashes an engine holds
(a block is useful only with its whole prefix) and, per block, the best place it is in: the router
(:mod:`kvport.route.policy`) turns that into the prefill tokens it would save.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvport.errors import ConfigError
from kvport.events.wire import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    REMOTE,
    AllBlocksCleared,
    Batch,
    BlockHash,
    BlockRemoved,
    BlockStored,
)

SHARED = "*shared*"  # the pseudo-engine of tiers every engine reads
MAX_PLACES = 32  # distinct (medium, locality, ownership) places one engine may report


class Place:
    """Where a block can be read from, best first (the order a router prefers them)."""

    DEVICE, HOST, LOCAL_STORAGE, REMOTE_STORAGE, UNKNOWN = 0, 1, 2, 3, 4
    NAMES = ("device", "host", "local storage", "remote storage", "unknown")

    @staticmethod
    def of(medium: str | None, locality: str | None) -> int:
        if medium == MEDIUM_GPU:
            return Place.DEVICE
        if medium == MEDIUM_CPU:
            return Place.HOST if locality != REMOTE else Place.REMOTE_STORAGE
        if medium == MEDIUM_STORAGE:
            return Place.REMOTE_STORAGE if locality == REMOTE else Place.LOCAL_STORAGE
        return Place.UNKNOWN if medium is not None else Place.DEVICE  # vLLM's own events name no medium


@dataclass(slots=True)
class _Engine:
    blocks: dict[BlockHash, int] = field(default_factory=dict)  # hash -> bitmask of place ids
    places: dict[tuple[str | None, str | None, str | None], int] = field(default_factory=dict)  # -> bit
    kinds: list[int] = field(default_factory=list)  # bit -> Place
    last_seen: float = 0.0
    next_seq: int | None = None
    events: int = 0


@dataclass(frozen=True, slots=True)
class Match:
    """The leading blocks an engine holds: ``blocks`` of them; ``places[i]`` the best Place of block i."""

    engine: str
    blocks: int
    places: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Applied:
    """What one batch did: events applied; ``gap`` the sequence numbers missing before it (a replay
    is due) or 0; ``duplicate`` True when the batch was seen before (dropped)."""

    events: int
    gap: int = 0
    duplicate: bool = False


class PrefixIndex:
    def __init__(self, *, max_blocks_per_engine: int = 1_000_000, max_blocks: int = 4_000_000,
                 max_engines: int = 1024, stale_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < max_blocks_per_engine <= max_blocks or max_engines <= 0 or not stale_s > 0:
            raise ConfigError("a prefix index needs 0 < max_blocks_per_engine <= max_blocks, engines and stale_s > 0")
        self.max_per_engine, self.max_blocks, self.max_engines = max_blocks_per_engine, max_blocks, max_engines
        self.stale_s = stale_s
        self.clock = clock
        self._engines: dict[str, _Engine] = {}
        self.blocks = 0  # entries over all engines
        self.trimmed = self.unknown_engines = self.removed_unknown = 0

    # ------------------------------------------------------------------ events in
    def apply(self, engine: str, batch: Batch, seq: int | None = None) -> Applied:
        """Fold one batch from ``engine`` (its ``seq`` when it came from a sequenced stream) in."""
        e = self._engines.get(engine)
        if e is None:
            if len(self._engines) >= self.max_engines:
                self.unknown_engines += 1
                return Applied(0)
            e = self._engines[engine] = _Engine()
        e.last_seen = self.clock()
        gap = 0
        if seq is not None:
            if e.next_seq is not None and seq < e.next_seq:
                return Applied(0, duplicate=True)
            if e.next_seq is not None and seq > e.next_seq:
                gap = seq - e.next_seq
            e.next_seq = seq + 1
        n = 0
        own = e
        shared: _Engine | None = None
        for ev in batch.events:
            e = own
            if not isinstance(ev, AllBlocksCleared) and ev.locality == REMOTE and engine != SHARED:
                if shared is None:
                    shared = self._shared()
                e = shared
            if isinstance(ev, BlockStored):
                bit = self._bit(e, ev.medium, ev.locality, ev.ownership)
                blocks = e.blocks
                for h in ev.block_hashes:
                    old = blocks.get(h)
                    if old is None:
                        blocks[h] = bit
                        self.blocks += 1
                    else:
                        blocks[h] = old | bit
                n += len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                bit = self._bit(e, ev.medium, ev.locality, ev.ownership)
                blocks = e.blocks
                for h in ev.block_hashes:
                    old = blocks.get(h)
                    if old is None:
                        self.removed_unknown += 1
                    elif old & ~bit:
                        blocks[h] = old & ~bit
                    else:
                        del blocks[h]
                        self.blocks -= 1
                n += len(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):  # the engine's device cache (vLLM's reset): its other places stay
                dev = sum(1 << b for b, k in enumerate(e.kinds) if k == Place.DEVICE)
                if ev.medium not in (None, MEDIUM_GPU):  # kvport's: that medium's places
                    dev = sum(bit for (m, _, _), bit in e.places.items() if m == ev.medium)
                keep = {h: m & ~dev for h, m in e.blocks.items() if m & ~dev}
                self.blocks -= len(e.blocks) - len(keep)
                e.blocks = keep
                n += 1
        own.events += n
        self._trim(own)
        if shared is not None:
            shared.last_seen = own.last_seen
            self._trim(shared)
        return Applied(n, gap)

    def _shared(self) -> _Engine:
        e = self._engines.get(SHARED)
        if e is None:
            e = self._engines[SHARED] = _Engine()
        return e

    def _bit(self, e: _Engine, medium: str | None, locality: str | None, ownership: str | None) -> int:
        key = (medium, locality, ownership)
        bit = e.places.get(key)
        if bit is None:
            if len(e.places) >= MAX_PLACES:  # a publisher inventing places: they share the last bit
                return 1 << (MAX_PLACES - 1)
            bit = e.places[key] = 1 << len(e.kinds)
            e.kinds.append(Place.of(medium, locality))
        return bit

    def _trim(self, e: _Engine) -> None:
        over = len(e.blocks) - self.max_per_engine
        if over > 0:  # its oldest, in one pass
            for h in list(itertools.islice(e.blocks, over)):
                del e.blocks[h]
            self.blocks -= over
            self.trimmed += over
        while self.blocks > self.max_blocks:  # the largest engine gives up its oldest, all at once
            biggest = max(self._engines.values(), key=lambda x: len(x.blocks))
            n = min(self.blocks - self.max_blocks, len(biggest.blocks))
            for h in list(itertools.islice(biggest.blocks, n)):
                del biggest.blocks[h]
            self.blocks -= n
            self.trimmed += n

    def touch(self, engine: str) -> None:
        """The engine was heard from another way (it answered its ``/metrics``): alive, keep its
        blocks (an idle engine publishes nothing)."""
        e = self._engines.get(engine)
        if e is not None:
            e.last_seen = self.clock()

    def expect(self, engine: str, next_seq: int) -> None:
        """After a replay that could not give everything: take ``next_seq`` as the next batch."""
        e = self._engines.get(engine)
        if e is not None:
            e.next_seq = next_seq

    # ------------------------------------------------------------------ engines
    def forget(self, engine: str) -> None:
        e = self._engines.pop(engine, None)
        if e is not None:
            self.blocks -= len(e.blocks)

    def expire(self) -> list[str]:
        """Engines not heard from for ``stale_s`` leave (the shared tier's pseudo-engine stays)."""
        now = self.clock()
        gone = [n for n, e in self._engines.items() if now - e.last_seen > self.stale_s and n != SHARED]
        for n in gone:
            self.forget(n)
        return gone

    def engines(self) -> list[str]:
        return [n for n in self._engines if n != SHARED]

    def heard(self, engine: str) -> float | None:
        e = self._engines.get(engine)
        return None if e is None else e.last_seen

    def size(self, engine: str) -> int:
        e = self._engines.get(engine)
        return 0 if e is None else len(e.blocks)

    # ------------------------------------------------------------------ lookups
    def match(self, engine: str, hashes: Sequence[BlockHash]) -> Match:
        """The leading blocks of ``hashes`` that ``engine`` holds, or can read from a shared tier,
        with the best place of each."""
        e = self._engines.get(engine)
        s = self._engines.get(SHARED) if engine != SHARED else None
        if e is None and s is None:
            return Match(engine, 0, ())
        empty: dict[BlockHash, int] = {}
        blocks, kinds = (e.blocks, e.kinds) if e is not None else (empty, [])
        sblocks, skinds = (s.blocks, s.kinds) if s is not None else (empty, [])
        places: list[int] = []
        for h in hashes:
            mine, theirs = blocks.get(h, 0), sblocks.get(h, 0)
            if not mine and not theirs:
                break
            places.append(min(_best(mine, kinds), _best(theirs, skinds)))
        return Match(engine, len(places), tuple(places))

    def anyone_holds(self, h: BlockHash) -> bool:
        """Whether any engine (or the shared tier) holds block ``h``."""
        return any(h in e.blocks for e in self._engines.values())

    def match_all(self, hashes: Sequence[BlockHash], engines: Iterable[str] | None = None) -> list[Match]:
        return [self.match(n, hashes) for n in (self.engines() if engines is None else engines)]

    def stats(self) -> dict[str, object]:
        return {"engines": {n: {"blocks": len(e.blocks), "events": e.events, "next_seq": e.next_seq}
                            for n, e in self._engines.items()},
                "blocks": self.blocks, "trimmed": self.trimmed, "removed_unknown": self.removed_unknown,
                "unknown_engines": self.unknown_engines}


def _best(mask: int, kinds: list[int]) -> int:
    """The best Place among the bits of ``mask``."""
    best = Place.UNKNOWN
    bit = 0
    while mask:
        if mask & 1 and kinds[bit] < best:
            best = kinds[bit]
        mask >>= 1
        bit += 1
    return best


__all__ = ["MAX_PLACES", "SHARED", "Applied", "Match", "Place", "PrefixIndex"]
