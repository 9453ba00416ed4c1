"""Which engine gets a request: the one whose predicted time to first token is the lowest. Pure.

For a prompt of ``n`` tokens (``b`` per block) and an engine that holds the request's first ``h``
blocks (:class:`~kvport.route.index.Match`, each block at its best place), with ``q`` requests running::

    ttft(engine) = (1 + q) * (compute(n - h b) + sum over held blocks of load(place))

``compute(t)`` is the engine's prefill of ``t`` tokens (``a + c t``, :class:`Costs`), ``load(place)``
what reading one block from there costs (device: nothing; host, local storage, a remote tier:
seconds per block), both from the planner's calibration profile when given (:meth:`Costs.from_profile`).
Prefix routing minimises that; its two fallbacks:

* no engine holds anything of the prompt: least loaded (fewest running, then round-robin order);
* an engine not heard from within ``stale_s`` (neither its KV events nor its load, which the caller
  polls) is never chosen, whatever the policy, nor is one the caller marks down: with none left the
  answer is None (the caller answers 503).

``round_robin`` and ``least_loaded`` are the baselines the benchmark compares against.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvport.errors import ConfigError
from kvport.planner.profile import LinkKind, Profile
from kvport.route.index import Match, Place


@dataclass(frozen=True, slots=True)
class Costs:
    """Seconds: a prefill is ``prefill_fixed_s + prefill_token_s`` a token; reading one block from a
    place costs ``load_block_s[place]``."""

    prefill_fixed_s: float = 0.02
    prefill_token_s: float = 1e-3
    load_block_s: tuple[float, ...] = (0.0, 2e-4, 2e-3, 6e-3, 6e-3)  # by Place: device host local remote unknown

    def __post_init__(self) -> None:
        vals = (self.prefill_fixed_s, self.prefill_token_s, *self.load_block_s)
        if len(self.load_block_s) != len(Place.NAMES) or not all(math.isfinite(v) and v >= 0 for v in vals):
            raise ConfigError(f"route costs must be finite and >= 0, one load cost per place ({len(Place.NAMES)})")

    def compute(self, tokens: int) -> float:
        return self.prefill_fixed_s + self.prefill_token_s * max(0, tokens)

    @classmethod
    def from_profile(cls, profile: Profile, block_bytes: int | None) -> Costs:
        """The planner's calibration (``kvport calibrate``) as routing costs: the prefill model's
        time for one token and its slope to 2,048; each place's load, one block of ``block_bytes``
        over the profile's link to it (host, disk; a kvport server, Redis or a peer for remote
        storage). What the profile lacks keeps its default."""
        base = cls()
        fixed, per = base.prefill_fixed_s, base.prefill_token_s
        pf = profile.prefill
        if pf is not None:
            one = pf.seconds(0, 1)
            fixed, per = max(0.0, one), max(0.0, (pf.seconds(0, 2048) - one) / 2047)
        loads = list(base.load_block_s)
        if block_bytes:
            links = {lk.name: lk for lk in profile.links}
            remote = links.get("server") or links.get("redis") or next(
                (lk for lk in profile.links if lk.kind is LinkKind.PEER), None)
            for place, link in ((Place.HOST, links.get("host")), (Place.LOCAL_STORAGE, links.get("disk")),
                                (Place.REMOTE_STORAGE, remote)):
                if link is not None:
                    loads[place] = link.seconds(block_bytes)
            loads[Place.UNKNOWN] = max(loads)
        return cls(fixed, per, tuple(loads))


@dataclass(frozen=True, slots=True)
class EngineState:
    name: str
    running: int = 0  # requests the router has in flight there
    heard_s_ago: float | None = 0.0  # since the index last heard from it (None: never)
    up: bool = True


@dataclass(frozen=True, slots=True)
class Route:
    engine: str
    why: str  # "prefix", "least_loaded" (nobody holds anything), "round_robin"
    held_blocks: int = 0
    predicted_s: float | None = None
    scores: dict[str, float] = field(default_factory=dict)


class PrefixRouter:
    """Chooses an engine per request; ``policy``: ``prefix``, ``least_loaded`` or ``round_robin``."""

    POLICIES = ("prefix", "least_loaded", "round_robin")

    def __init__(self, policy: str = "prefix", costs: Costs | None = None, stale_s: float = 30.0) -> None:
        if policy not in self.POLICIES:
            raise ConfigError(f"a route policy is one of {', '.join(self.POLICIES)}, got {policy!r}")
        self.policy = policy
        self.costs = costs or Costs()
        self.stale_s = stale_s
        self._rr = itertools.count()

    def eligible(self, engines: Sequence[EngineState]) -> list[EngineState]:
        return [e for e in engines if e.up and e.heard_s_ago is not None and e.heard_s_ago <= self.stale_s]

    def choose(self, engines: Sequence[EngineState], matches: Sequence[Match], prompt_tokens: int,
               block_size: int) -> Route | None:
        """The engine for a request (None: no engine is up). ``matches``: what the index answered
        for the request's blocks on each engine (missing engines hold nothing)."""
        up = self.eligible(engines)
        if not up:
            return None
        if self.policy == "round_robin":
            return Route(up[next(self._rr) % len(up)].name, "round_robin")
        k = next(self._rr)  # ties taken in turn
        least = min(enumerate(up), key=lambda t: (t[1].running, (t[0] - k) % len(up)))[1]
        if self.policy == "least_loaded":
            return Route(least.name, "least_loaded")
        held = {m.engine: m for m in matches}
        scores = {e.name: self.ttft(e, held.get(e.name), prompt_tokens, block_size) for e in up}
        best = min(up, key=lambda e: (scores[e.name], e.running))
        if held.get(best.name) is None or held[best.name].blocks == 0:
            return Route(least.name, "least_loaded", scores=scores)
        return Route(best.name, "prefix", held[best.name].blocks, scores[best.name], scores)

    def ttft(self, e: EngineState, m: Match | None, prompt_tokens: int, block_size: int) -> float:
        c = self.costs
        held = 0 if m is None else min(m.blocks, max(0, (prompt_tokens - 1) // block_size))
        load = 0.0 if m is None else sum(c.load_block_s[p] for p in m.places[:held])
        return (1 + e.running) * (c.compute(prompt_tokens - held * block_size) + load)


__all__ = ["Costs", "EngineState", "PrefixRouter", "Route"]
