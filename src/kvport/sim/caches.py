"""The simulated cache levels of one deployment: the store's own :class:`~kvport.store.index.TierIndex`
and eviction policies, holding block ids instead of bytes.

Levels, top first, as one prefill engine sees them::

    device    the engine's own prefix cache (``device_cache_tokens``; absent when 0)
    engine    tiers of scope "engine": one per engine (host RAM, local disk), exclusive with the device
    shared    tiers of scope "shared": one pool for every engine, written through by every prefill

A lookup walks the prompt's full blocks and stops at the first block no level holds (a block
counts only with its whole prefix, as :meth:`TieredStore.lookup` counts it). What is computed or
loaded lands in the top level; what the top evicts is demoted one engine level down (the store's
mover), what the last engine level evicts leaves; shared levels keep their copy when an engine
reads it (other engines may want it) and evict by their own policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvport.sim.deployment import Deployment, LinkSpec, TierSpec
from kvport.store.eviction import DEFAULT_POLICY, make_policy
from kvport.store.index import TierIndex


@dataclass(slots=True)
class Level:
    name: str
    index: TierIndex
    capacity: int  # blocks
    read: LinkSpec | None  # None: the engine's own memory (no transfer)
    shared: bool
    write_through: bool
    free_at: list[float] = field(default_factory=lambda: [0.0])  # its read path, FIFO
    hits: int = 0  # blocks
    read_bytes: int = 0
    written_bytes: int = 0
    evictions: int = 0


def _key(h: int) -> bytes:
    return h.to_bytes(8, "little")


class Hierarchy:
    """The levels of every prefill engine; ``chain(e)`` is engine ``e``'s view, top first."""

    def __init__(self, dep: Deployment, engines: int) -> None:
        self.block_bytes = dep.block_bytes
        shared = {t.name: self._level(t, dep) for t in dep.tiers if t.scope == "shared"}
        self.shared = list(shared.values())
        self.chains: list[list[Level]] = []
        self.device: list[Level | None] = []
        cap = dep.device_cache_tokens // dep.block_tokens
        for _ in range(engines):
            dev = (Level("device", TierIndex(make_policy(DEFAULT_POLICY), cap), cap, None, False, False)
                   if cap > 0 else None)
            self.device.append(dev)
            chain: list[Level] = [dev] if dev is not None else []
            for t in dep.tiers:
                chain.append(shared[t.name] if t.scope == "shared" else self._level(t, dep))
            self.chains.append(chain)

    def _level(self, t: TierSpec, dep: Deployment) -> Level:
        cap = t.capacity_bytes // dep.block_bytes
        return Level(t.name, TierIndex(make_policy(t.policy), cap), cap, t.read, t.scope == "shared",
                     t.write_through)

    def levels(self) -> list[Level]:
        """Every level once (engine levels of every engine, then the shared ones)."""
        seen: dict[int, Level] = {}
        for chain in self.chains:
            for lv in chain:
                seen.setdefault(id(lv), lv)
        return list(seen.values())

    def local_hit(self, e: int, blocks: Sequence[int]) -> int:
        """Leading blocks engine ``e`` holds in its own levels (the router's measure)."""
        own = [lv for lv in self.chains[e] if not lv.shared]
        n = 0
        for b in blocks:
            k = _key(b)
            if not any(k in lv.index for lv in own):
                break
            n += 1
        return n

    def lookup(self, e: int, blocks: Sequence[int]) -> list[Level]:
        """The level holding each leading block, up to the first block none holds."""
        chain = self.chains[e]
        out: list[Level] = []
        for b in blocks:
            k = _key(b)
            lv = next((lv for lv in chain if k in lv.index), None)
            if lv is None:
                break
            out.append(lv)
        return out

    def settle(self, e: int, blocks: Sequence[int], found: Sequence[Level], used: int) -> None:
        """After engine ``e`` ran a request: the first ``used`` blocks came from ``found`` (hits), the
        rest were computed (``found`` beyond ``used``: held below, recomputed by the planner's choice).
        Everything lands in the top level, leaving any exclusive engine level it was found in; shared
        levels keep their copy and are touched."""
        chain = self.chains[e]
        if not chain or not blocks:
            return
        top = chain[0]
        keys = [_key(b) for b in blocks]
        parent: bytes | None = None
        for i, k in enumerate(keys):
            src = found[i] if i < len(found) else None  # loaded, or found but recomputed: either way it is top now
            if src is not None and src is not top and not src.shared:
                src.index.remove(k)  # exclusive engine levels: the block moves up
            if top.read is not None and k not in top.index:  # a tier, not the engine's own memory: bytes written
                top.written_bytes += self.block_bytes
            top.index.add(k, 1, parent)
            parent = k
        for lv in chain[1:]:  # write-through to shared pools below the top
            if lv.shared and lv.write_through:
                parent = None
                for k in keys:
                    if k not in lv.index:
                        lv.written_bytes += self.block_bytes
                    lv.index.add(k, 1, parent)
                    parent = k
        for i, lv in enumerate(chain):
            self._shrink(lv, chain[i + 1] if i + 1 < len(chain) else None)

    def _shrink(self, lv: Level, below: Level | None) -> None:
        if lv.index.used <= lv.capacity:
            return
        for v in lv.index.victims():
            lv.index.remove(v, evicted=True)
            lv.evictions += 1
            if below is not None and not below.shared and not lv.shared:
                below.index.add(v, 1, None)  # demoted (its parent, if still above, stays above)
                below.written_bytes += self.block_bytes
            if lv.index.used <= lv.capacity:
                break
