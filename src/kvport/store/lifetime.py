"""Lifetime classes and the policy table that maps each class to tiers and TTLs.

==========  ===========================================  ==========================================
class       kept until                                   then
==========  ===========================================  ==========================================
REQUEST     ``end_request(request_id)``                  dropped, unless promoted (``promote``)
SESSION     ``ttl_s`` after its last put / hit           dropped by ``expire()`` (also on put)
PREFIX      never dropped by lifetime                    leaves only through eviction (LRU/LFU)
==========  ===========================================  ==========================================

Every class may also be evicted under byte pressure (a pinned or leased block never is). Each rule
lists the tiers a block of that class may occupy, top first: ``put`` writes to the first of them
with room, eviction demotes along the list, and leaving the last one drops the block.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvport.errors import ConfigError
from kvport.lifetime import Lifetime


@dataclass(frozen=True, slots=True)
class LifetimeRule:
    tiers: tuple[str, ...] | None = None  # None: every tier of the store, in the store's order
    ttl_s: float | None = None  # SESSION: idle time before expiry; None: no expiry

    def __post_init__(self) -> None:
        if self.ttl_s is not None and not self.ttl_s > 0:
            raise ConfigError(f"lifetime ttl_s must be positive, got {self.ttl_s}")
        if self.tiers is not None and not self.tiers:
            raise ConfigError("a lifetime rule needs at least one tier (or None for all)")


def _default_rules() -> Mapping[Lifetime, LifetimeRule]:
    return MappingProxyType({
        Lifetime.REQUEST: LifetimeRule(tiers=None, ttl_s=None),
        Lifetime.SESSION: LifetimeRule(tiers=None, ttl_s=600.0),
        Lifetime.PREFIX: LifetimeRule(tiers=None, ttl_s=None),
    })


@dataclass(frozen=True, slots=True)
class LifetimePolicy:
    rules: Mapping[Lifetime, LifetimeRule] = field(default_factory=_default_rules)

    def __post_init__(self) -> None:
        missing = [lt.value for lt in Lifetime if lt not in self.rules]
        if missing:
            raise ConfigError(f"lifetime policy lacks rules for {', '.join(missing)}")

    def rule(self, lifetime: Lifetime) -> LifetimeRule:
        return self.rules[lifetime]

    def idle_ttl(self, lifetime: Lifetime, own_ttl_s: float | None = None) -> float | None:
        """A block's idle TTL: its own (``own_ttl_s``, any class), else its class's (SESSION only)."""
        if own_ttl_s is not None:
            return own_ttl_s
        return self.rules[lifetime].ttl_s if lifetime is Lifetime.SESSION else None

    def tiers_for(self, lifetime: Lifetime, all_tiers: tuple[str, ...]) -> tuple[str, ...]:
        names = self.rules[lifetime].tiers
        if names is None:
            return all_tiers
        unknown = [n for n in names if n not in all_tiers]
        if unknown:
            raise ConfigError(f"lifetime {lifetime.value} names unknown tiers {unknown}; store has {all_tiers}")
        return tuple(n for n in all_tiers if n in names)  # always in the store's top-down order

    def with_rule(self, lifetime: Lifetime, rule: LifetimeRule) -> LifetimePolicy:
        rules = dict(self.rules)
        rules[lifetime] = rule
        return LifetimePolicy(MappingProxyType(rules))
