"""``Planner``: the cost model plus a live profile that observations keep current.

Live updates are exponential moving averages with weight ``alpha`` on the newest observation:

- ``observe_transfer(nbytes, seconds, link)``: the link's *seconds per byte* (after its latency) is
  averaged, so one slow transfer moves the bandwidth at once and a persistently slow link takes over
  within a few transfers; the link's ``measured_at`` is refreshed. An unknown link is created from
  its first observation (source ``"observed"``, latency 0).
- ``observe_prefill(tokens, seconds, cached)``: the ratio observed / modelled is averaged into the
  prefill model's ``scale`` (the shape a, b, c, d stays as calibrated).

The profile is immutable; the planner swaps in a new one under a lock, so ``decide`` sees either the
old or the new profile, never a mix. Every decision increments
``kvport_planner_decisions_total{action}`` and is logged at INFO with its reason; fallbacks also
increment ``kvport_planner_fallbacks_total{status}`` and log a WARNING once per distinct reason.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from kvport import metrics
from kvport.config import Settings
from kvport.errors import PlanInputError, ProfileError
from kvport.planner.cost import (
    DEFAULT_MAX_AGE_S,
    Decision,
    Freshness,
    Load,
    ProfileStatus,
    Request,
    evaluate,
    profile_status,
)
from kvport.planner.profile import Link, LinkKind, Profile, machine_id

log = logging.getLogger("kvport.planner")

_DECISIONS = metrics.counter("planner_decisions_total", "planner decisions by chosen action", ["action"])
_FALLBACKS = metrics.counter("planner_fallbacks_total", "decisions made without a usable profile", ["status"])
_PREDICTED = metrics.histogram("planner_predicted_seconds", "predicted seconds of the chosen option", ["action"],
                               buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
_LINK_BW = metrics.gauge("planner_link_bandwidth_bytes_per_second", "current link bandwidth estimate", ["link"])
_PREFILL_SCALE = metrics.gauge("planner_prefill_scale", "observed / calibrated prefill time (EMA)")


def _positive(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        raise PlanInputError(f"{name} must be a finite number > 0, got {v!r}")
    return float(v)


class Planner:
    def __init__(self, profile: Profile | None, *, alpha: float = 0.3, max_age_s: float = DEFAULT_MAX_AGE_S,
                 machine: str | None = None, clock: Callable[[], float] = time.time) -> None:
        if not 0 < alpha <= 1:
            raise PlanInputError(f"alpha must be in (0, 1], got {alpha!r}")
        self._profile = profile
        self._alpha = alpha
        self._max_age_s = _positive("max_age_s", max_age_s)
        self._machine = machine
        self._clock = clock
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        if profile is not None:
            for lk in profile.links:
                _LINK_BW.labels(lk.name).set(lk.bandwidth)

    @classmethod
    def from_settings(cls, settings: Settings, *, alpha: float = 0.3, max_age_s: float = DEFAULT_MAX_AGE_S) -> Planner:
        """The profile at ``settings.profile_path``; missing or malformed -> a planner without one (it says so)."""
        try:
            profile: Profile | None = Profile.load(settings.profile_path)
        except ProfileError as exc:
            log.warning("planner: %s; deciding with safe defaults (recompute)", exc)
            profile = None
        return cls(profile, alpha=alpha, max_age_s=max_age_s, machine=machine_id())

    @property
    def profile(self) -> Profile | None:
        return self._profile

    def freshness(self) -> Freshness:
        return Freshness(now=self._clock(), max_age_s=self._max_age_s, machine=self._machine)

    def status(self) -> ProfileStatus:
        return profile_status(self._profile, self.freshness())[0]

    # ------------------------------------------------------------------ decisions
    def decide(self, request: Request, load: Load | None = None) -> Decision:
        d = evaluate(self._profile, request, load, self.freshness())
        _DECISIONS.labels(d.action.value).inc()
        if d.choice.seconds is not None:
            _PREDICTED.labels(d.action.value).observe(d.choice.seconds)
        if d.status is not ProfileStatus.OK or d.choice.seconds is None:
            _FALLBACKS.labels(d.status.value).inc()
            if d.reason not in self._warned:
                self._warned.add(d.reason)
                log.warning("planner fallback (%s): %s", d.status.value, d.reason)
        log.info("planner: %s tokens=%d -> %s", request.spec.model_id, request.prompt_tokens, d.reason)
        return d

    # ------------------------------------------------------------------ live updates
    def observe_transfer(self, nbytes: int, seconds: float, link: str, kind: LinkKind = LinkKind.PEER) -> Link:
        """Fold one finished transfer of ``nbytes`` in ``seconds`` over ``link`` into its estimate."""
        _positive("nbytes", nbytes)
        _positive("seconds", seconds)
        if not link:
            raise PlanInputError("link name must not be empty")
        now = self._clock()
        with self._lock:
            prof = self._profile or Profile(machine=self._machine or machine_id(), created=now)
            old = prof.link(link)
            if old is None:
                new = Link(link, kind, nbytes / seconds, 0.0, now, source="observed")
            else:
                moving = seconds - old.latency
                if moving <= 0:  # faster than the latency alone: no bandwidth information, only freshness
                    new = replace(old, measured_at=now)
                else:
                    spb = (1 - self._alpha) / old.bandwidth + self._alpha * moving / nbytes
                    new = replace(old, bandwidth=1.0 / spb, measured_at=now)
            self._profile = prof.with_link(new)
        _LINK_BW.labels(link).set(new.bandwidth)
        log.debug("planner: link %s now %.1f MB/s", link, new.bandwidth / 1e6)
        return new

    def observe_prefill(self, tokens: int, seconds: float, cached: int = 0) -> float | None:
        """Fold one prefill of ``tokens`` new tokens after ``cached`` into the scale; returns the new scale."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
            raise PlanInputError(f"tokens must be a positive integer, got {tokens!r}")
        if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
            raise PlanInputError(f"cached must be an integer >= 0, got {cached!r}")
        _positive("seconds", seconds)
        with self._lock:
            prof = self._profile
            if prof is None or prof.prefill is None:
                log.debug("planner: prefill observation ignored (no calibrated prefill model)")
                return None
            pf = prof.prefill
            predicted = pf.raw_seconds(cached, cached + tokens)
            scale = (1 - self._alpha) * pf.scale + self._alpha * (seconds / predicted)
            self._profile = prof.with_prefill(replace(pf, scale=scale))
        _PREFILL_SCALE.set(scale)
        return scale
