"""Helpers shared by the store tests: one-letter keys and evicting a TierIndex down to a capacity."""

from kvport.store import TierIndex


def k(c: str) -> bytes:
    return c.encode() * 16


def evict_to(ix: TierIndex, cap: int) -> list[str]:
    """Evict in policy order until ``used <= cap``; the letters of the evicted keys, in order."""
    out = []
    for v in ix.victims():
        if ix.used <= cap:
            break
        ix.remove(v, evicted=True)
        out.append(v[:1].decode())
    return out
