"""Crossover: the prompt lengths where pure load and recompute swap places, from the cost model.

The uncached suffix is held fixed (a new turn of ``suffix_tokens`` after a cached conversation), the
prompt length ``N`` is scanned on a geometric grid over ``[lo, hi]`` and every sign change of
``load(N) - recompute(N)`` is bisected to one token.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvport.errors import PlanInputError
from kvport.planner.cost import Action, Cached, Freshness, Load, Request, check_int, options_for
from kvport.planner.profile import Profile
from kvport.spec import KVSpec


@dataclass(frozen=True, slots=True)
class Crossover:
    """Prompt lengths in ``[lo, hi]`` where pure load and recompute swap places (suffix held fixed)."""

    source: str
    suffix_tokens: int
    lo: int
    hi: int
    lengths: tuple[int, ...]
    recompute_wins_at_lo: bool | None  # None: the model could not predict

    def describe(self) -> str:
        if self.recompute_wins_at_lo is None:
            return "unknown (no usable profile)"
        first, second = ("recompute", "load") if self.recompute_wins_at_lo else ("load", "recompute")
        if not self.lengths:
            return f"{first} wins for every prompt length in [{self.lo}, {self.hi}]"
        parts = [f"{first} wins below {self.lengths[0]} tokens, {second} above"]
        if len(self.lengths) > 1:
            parts.append(f"(further swaps at {', '.join(map(str, self.lengths[1:]))})")
        return " ".join(parts)


def crossover(profile: Profile | None, spec: KVSpec, source: str, suffix_tokens: int, *, lo: int | None = None,
              hi: int = 131072, load: Load | None = None, fresh: Freshness | None = None) -> Crossover:
    check_int("suffix_tokens", suffix_tokens, 1)
    lo = max(suffix_tokens + 1, lo or 1)
    if hi <= lo:
        raise PlanInputError(f"crossover range [{lo}, {hi}] is empty")
    fresh = fresh or Freshness(now=profile.created if profile is not None else 0.0)
    ld = load or Load()

    def diff(n: int) -> float | None:
        req = Request(n, spec, (Cached(source, n - suffix_tokens),))
        opts, _, _ = options_for(profile, req, ld, fresh)
        rec = opts[0].seconds
        pure = next((o.seconds for o in opts if o.action is Action.LOAD and o.codec is None), None)
        return None if rec is None or pure is None else pure - rec

    d0 = diff(lo)
    if d0 is None:
        return Crossover(source, suffix_tokens, lo, hi, (), None)

    def known(n: int) -> float:  # same profile and trust as at ``lo``, so always predictable
        d = diff(n)
        return d0 if d is None else d
    grid = sorted({lo, hi, *(int(lo * 1.25**i) for i in range(200) if lo * 1.25**i < hi)})
    swaps: list[int] = []
    prev_n, prev_d = grid[0], d0
    for n in grid[1:]:
        d = known(n)
        if (d < 0) != (prev_d < 0):
            a, b = prev_n, n  # bisect to one token: first n whose sign equals d's
            while b - a > 1:
                m = (a + b) // 2
                if (known(m) < 0) == (d < 0):
                    b = m
                else:
                    a = m
            swaps.append(b)
        prev_n, prev_d = n, d
    return Crossover(source, suffix_tokens, lo, hi, tuple(swaps), d0 >= 0)
