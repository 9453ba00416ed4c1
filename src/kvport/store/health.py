"""Broken-tier tracking: a tier that raised TierUnavailableError is skipped until a probe succeeds.

States per tier: healthy -> broken(retry_at) on an unavailability error; while broken, the first
call after ``retry_at`` probes the tier once: success -> healthy (``recovered`` callback), failure ->
broken with a new ``retry_at``. The ``tier_broken`` gauge is 1 while broken, and each change of
state is one log line (a tier that went down, say a stopped shared tier, is never only a counter).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvport.errors import TierError
from kvport.metrics import gauge
from kvport.tiers.base import Tier

_BROKEN = gauge("tier_broken", "1 while the store treats the tier as down", ["tier"])
_PROBE_KEY = b"\x00" * 16
log = logging.getLogger(__name__)


class TierHealth:
    def __init__(self, clock: Callable[[], float], retry_s: float, on_recover: Callable[[str], None]) -> None:
        self._clock = clock
        self._retry_s = retry_s
        self._retry_at: dict[str, float] = {}
        self._on_recover = on_recover

    def mark_broken(self, tier: Tier, why: BaseException | None = None) -> None:
        if tier.name not in self._retry_at:
            log.warning("kvport: tier %s is down (%s); skipped, probed again every %.0f s", tier.name,
                        "unavailable" if why is None else f"{type(why).__name__}: {why}", self._retry_s)
        self._retry_at[tier.name] = self._clock() + self._retry_s
        _BROKEN.labels(tier.name).set(1)

    def healthy(self, tier: Tier) -> bool:
        at = self._retry_at.get(tier.name)
        if at is None:
            return True
        if self._clock() < at:
            return False
        try:
            tier.contains(_PROBE_KEY)
        except TierError:
            self._retry_at[tier.name] = self._clock() + self._retry_s
            return False
        del self._retry_at[tier.name]
        _BROKEN.labels(tier.name).set(0)
        log.warning("kvport: tier %s is back", tier.name)
        self._on_recover(tier.name)
        return True

    @property
    def broken(self) -> tuple[str, ...]:
        return tuple(sorted(self._retry_at))
