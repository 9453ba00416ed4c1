"""Timing and rates: the median of trials, decimal GB/s, and a ratio that stays unknown when a side is.

Every suite and every physical limit times with :func:`time_it` and reports rates with :func:`gbps`
(decimal: 1 GB/s = 1e9 bytes/s), so that a ratio of the two compares like with like. Timing rule for
this small, noisy machine: one thread on copy paths, buffers allocated once and reused, several
trials with the median reported next to min and max.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Timing:
    median_s: float
    min_s: float
    max_s: float
    trials: int

    def rate(self, amount: float) -> float:
        """amount per second at the median time."""
        return amount / self.median_s

    def as_dict(self) -> dict[str, float]:
        return {"median_s": self.median_s, "min_s": self.min_s, "max_s": self.max_s, "trials": self.trials}


def time_it(fn: Callable[[], object], trials: int = 5, warmup: int = 1) -> Timing:
    for _ in range(warmup):
        fn()
    ts: list[float] = []
    for _ in range(trials):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return Timing(statistics.median(ts), min(ts), max(ts), trials)


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB/s."""
    return nbytes / seconds / 1e9


def ratio(measured: float | None, limit: float | None) -> float | None:
    """measured / limit, or None (unknown) when either side was not measured."""
    if measured is None or limit is None or limit <= 0:
        return None
    return round(measured / limit, 4)
