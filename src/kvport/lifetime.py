"""A block's lifetime class (how long it lives): one of the three decisions kept apart.

The rules that map each class to tiers and TTLs are the store's (:mod:`kvport.store.lifetime`); the
class itself travels with a block on the wire (a PUT into the shared tier names it) and in the
ledger's record of a hand-off to the pool.
"""

from __future__ import annotations

import enum


class Lifetime(enum.Enum):
    REQUEST = "request"  # one request: dropped when it ends, unless promoted
    SESSION = "session"  # a multi-turn session: dropped ``ttl_s`` after its last use
    PREFIX = "prefix"  # a shared prefix: leaves only through eviction

    @property
    def rank(self) -> int:
        """Promotion order: a block's lifetime only moves up (REQUEST < SESSION < PREFIX)."""
        return {"request": 0, "session": 1, "prefix": 2}[self.value]
