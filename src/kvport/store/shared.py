"""The shared-tier view: what this store knows of tiers other processes write too (Redis, the server).

* :meth:`SharedView.probe`: keys this store has not indexed are asked for in each healthy shared
  tier (one ``sizes_of`` round trip a tier, for the run of keys from a miss on); a hit is indexed as
  a PREFIX block under the previous key, up to the first key the tier lacks.
* :meth:`SharedView.confirm`: what this store found in a shared tier before is asked for again
  (one ``contains_many`` a tier), since another process may have evicted or deleted it, or a load
  found it damaged: the first block gone there is forgotten here with its descendants (the index
  entries only: it is not there) and the prefix ends before it.

A shared tier that does not answer (TierUnavailableError) is marked broken; its blocks read as misses.
"""

from __future__ import annotations

from kvport.errors import TierUnavailableError
from kvport.lifetime import Lifetime
from kvport.store.catalog import Catalog


class SharedView:
    def __init__(self, catalog: Catalog) -> None:
        self._cat = catalog
        self._shared = tuple(n for n in catalog.names if catalog.tiers[n].caps.shared)  # top first

    def probe(self, keys: tuple[bytes, ...], start: int) -> bool:
        """Ask healthy shared tiers about ``keys[start:]``; index their hits. True when any was new here."""
        found = False
        cat = self._cat
        for name in self._shared:
            t = cat.tiers[name]
            if not cat.health.healthy(t):
                continue
            try:
                sizes = t.sizes_of(keys[start:])  # one round trip to a remote tier, not one per key
                for j, size in enumerate(sizes):
                    if size is None:
                        break
                    k = keys[start + j]
                    if k in cat.idx[name]:
                        continue
                    parent = keys[start + j - 1] if start + j > 0 else None
                    cat.found(name, k, size, parent, Lifetime.PREFIX)
                    found = True
            except TierUnavailableError as exc:
                cat.health.mark_broken(t, exc)
        return found

    def confirm(self, keys: tuple[bytes, ...], tiers: list[str], upto: int) -> int:
        """How many blocks of the found prefix (``tiers[i]`` holds ``keys[i]``) still stand, of those
        among the first ``upto`` that a shared tier's index alone vouches for."""
        cut = len(tiers)
        if not self._shared:
            return cut
        cat = self._cat
        for name in dict.fromkeys(tiers[:upto]):
            t = cat.tiers[name]
            if not t.caps.shared:
                continue
            idx = [i for i in range(upto) if tiers[i] == name]
            try:
                have = t.contains_many([keys[i] for i in idx])
            except TierUnavailableError as exc:
                cat.health.mark_broken(t, exc)
                cut = min(cut, idx[0])
                continue
            gone = next((i for i, ok in zip(idx, have, strict=True) if not ok), None)
            if gone is not None:
                cut = min(cut, gone)
                cat.drop(keys[gone], gone_from=name)
        return cut
