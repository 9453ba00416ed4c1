"""Values that cross the store's boundary: per-tier policy, lookup results, reservations, stats."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvport.errors import ConfigError
from kvport.ledger import Owner
from kvport.lifetime import Lifetime

TierChanges = Callable[[str, bool, bytes, "bytes | None"], None]
"""``(tier, stored, key, parent)``: a block entered (``stored``) or left a tier's index. Called under
the store's lock: a listener queues and returns (:class:`kvport.events.store.StoreEvents` does)."""


class WriteMode(enum.Enum):
    """How a tier below the top receives blocks.

    THROUGH: every put to a tier above is also written here at once (survives a crash of the upper
             tier; costs the lower tier's write time on every put).
    BEHIND:  like THROUGH, but written by the store's write-behind thread after the put returned
             (:mod:`kvport.store.behind`): a put costs the upper tier's write only.
    BACK:    blocks arrive only when an upper tier demotes them under pressure.
    """

    THROUGH = "through"
    BEHIND = "behind"
    BACK = "back"


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """Per-tier store settings. Eviction starts when a put would take the tier above
    ``high_watermark * capacity`` and stops at ``low_watermark * capacity``."""

    write: WriteMode = WriteMode.BACK
    high_watermark: float = 0.95
    low_watermark: float = 0.85

    def __post_init__(self) -> None:
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ConfigError(f"watermarks need 0 < low <= high <= 1, got {self.low_watermark}, {self.high_watermark}")


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest cached prefix of ``keys`` and the tier that holds each of its blocks.

    ``prefix_blocks`` counts leading keys that hit; ``tiers[i]`` / ``sizes[i]`` name the tier and the
    value length of ``keys[i]`` for ``i < prefix_blocks``. A key after the first miss is never a hit,
    even when cached: a block is only useful with its whole prefix."""

    keys: tuple[bytes, ...]
    prefix_blocks: int
    tiers: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def hit_keys(self) -> tuple[bytes, ...]:
        return self.keys[: self.prefix_blocks]

    @property
    def miss_keys(self) -> tuple[bytes, ...]:
        return self.keys[self.prefix_blocks :]

    @property
    def complete(self) -> bool:
        return self.prefix_blocks == len(self.keys)

    def in_tier(self, name: str) -> tuple[bytes, ...]:
        return tuple(k for k, t in zip(self.hit_keys, self.tiers, strict=True) if t == name)


@dataclass(frozen=True, slots=True)
class Reserved:
    """Room for one block in flight: receive its bytes into ``views`` (in order), then ``commit``."""

    key: bytes
    tier: str
    nbytes: int
    views: tuple[memoryview, ...]
    charge: int
    lifetime: Lifetime
    parent: bytes | None
    account: str | None
    ttl_s: float | None
    owner: Owner | None
    origin: Owner | None
    request_id: str | None


@dataclass(frozen=True, slots=True)
class ReadViews:
    """The block's bytes in the memory of tier ``tier`` (valid while the caller's lease or pin holds)."""

    tier: str
    length: int
    views: tuple[memoryview, ...]


@dataclass(frozen=True, slots=True)
class StoreStats:
    hits: Mapping[str, int]  # by tier
    misses: int
    bytes_in: Mapping[str, int]  # written into each tier
    bytes_out: Mapping[str, int]  # read out of each tier
    demotions: Mapping[str, int]  # blocks moved from this tier to a lower one
    drops: int  # blocks that left the store (eviction from the last tier, lifetime end, corruption)
    blocks: Mapping[str, int]
    used_bytes: Mapping[str, int]  # as the store accounts them (host: whole pages)
    broken: tuple[str, ...]  # tiers currently marked broken
