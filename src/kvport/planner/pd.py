"""Prefill/decode, per request: stream the prompt's KV from a prefill engine, or let the decode engine
compute the prompt itself? Pure cost model (:func:`evaluate_pd`) and a live planner (:class:`PDPlanner`)
that a proxy in front of the engines (:mod:`kvport.proxy.service`) feeds with what it observes.

Both options end with the decode engine's first token, for a prompt of ``n`` tokens::

    stream     Qp P(n) + max(0, X(bytes(n)) - Qp P(n)) + H(n)
    recompute  Qd D(n)

    P  the prefill engine's answer to the one-token prefill request, timed by the proxy (the hop
       to it over its link included)
    H  the decode engine's first token once the request names the hand-off: the stream's last
       layers, taking the blocks from its inbox, one step
    D  the decode engine's first token computing the whole prompt
    X  the link the stream crosses, ``latency + bytes / bandwidth``, when known: the stream overlaps
       the prefill layer by layer, so only what the link cannot keep up with shows (nothing while
       the link outruns the KV the prefill produces)
    Q  1 + the requests the proxy has running on that engine (processor sharing)

Streaming pays when the prefill engine computes faster than the decode engine would (a
compute-rich prefill host, or a decode engine busy with other requests) by more than the hand-off
costs; short prompts cost little to compute, so the hop, the hand-off and the extra step dominate
and recompute wins below a crossover length (:func:`pd_crossover`) that the link moves.

``P``, ``H`` and ``D`` are curves ``a + b n + c n^2`` fitted (:func:`kvport.planner.fit.fit_prefill`,
relative least squares, non-negative) to the proxy's own observations, over a sliding window of the
latest :data:`WINDOW` per curve, and only of requests that found their engine idle (queued ones would
teach the curve the queue). So the model is calibrated on the deployment it decides for, and
follows its engines as they warm up or slow down. A curve with observations at fewer than
:data:`MIN_LENGTHS` distinct lengths cannot predict: the planner then takes the deployment's default
(stream) and sends every ``explore_every``-th request the other way, to learn it. Near-ties (within
:data:`~kvport.planner.cost.SIMPLER_MARGIN`) go to recompute, the option with fewer moving parts.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvport import metrics
from kvport.errors import PlanInputError, ProfileError
from kvport.planner.cost import Action, Decision, Option, ProfileStatus, check_int, choose
from kvport.planner.fit import fit_prefill
from kvport.planner.profile import Link, PrefillModel, PrefillPoint

WINDOW = 48  # observations kept per curve (the newest)
MIN_LENGTHS = 3  # distinct prompt lengths a curve needs before it predicts
EXPLORE_EVERY = 8  # default: while a curve cannot predict, one request in this many takes the other path

_DECISIONS = metrics.counter("pd_planner_decisions", "prefill/decode planner choices per request, by action and why",
                             ["action", "why"])


class Curve(enum.Enum):
    PREFILL = "prefill"  # P: the prefill engine's one-token answer, seen from the proxy
    HANDOFF = "handoff"  # H: the decode engine's first token after a streamed hand-off
    DECODE = "decode"  # D: the decode engine's first token computing the prompt


@dataclass(frozen=True, slots=True)
class PDModels:
    """The fitted curves (None: not enough observations yet), the stream's link and the KV size per
    token (both None when unknown: the link term is then left out, H's fit carries the link's cost at
    the lengths it saw)."""

    prefill: PrefillModel | None = None
    handoff: PrefillModel | None = None
    decode: PrefillModel | None = None
    link: Link | None = None
    kv_bytes_per_token: int | None = None

    def curve(self, c: Curve) -> PrefillModel | None:
        return {Curve.PREFILL: self.prefill, Curve.HANDOFF: self.handoff, Curve.DECODE: self.decode}[c]


def _queue(name: str, v: int) -> int:
    return 1 + check_int(name, v, 0)


def stream_seconds(m: PDModels, n: int, prefill_queue: int = 0) -> float | None:
    if m.prefill is None or m.handoff is None:
        return None
    p = _queue("prefill_queue", prefill_queue) * m.prefill.seconds(0, n)
    tail = 0.0
    if m.link is not None and m.kv_bytes_per_token:
        tail = max(0.0, m.link.seconds(float(m.kv_bytes_per_token) * n) - p)
    return p + tail + m.handoff.seconds(0, n)


def recompute_seconds(m: PDModels, n: int, decode_queue: int = 0) -> float | None:
    return None if m.decode is None else _queue("decode_queue", decode_queue) * m.decode.seconds(0, n)


def evaluate_pd(m: PDModels, prompt_tokens: int, *, prefill_queue: int = 0, decode_queue: int = 0) -> Decision:
    """Stream or recompute for a prompt of ``prompt_tokens``; a curve missing makes that option's time
    None, and the choice then falls to the option the caller treats as its default (see PDPlanner)."""
    n = check_int("prompt_tokens", prompt_tokens, 1)
    s = stream_seconds(m, n, prefill_queue)
    r = recompute_seconds(m, n, decode_queue)
    stream = Option(Action.STREAM, "prefill", None, n, 0, s,
                    "prefill engine computes, its KV streams to the decode engine" if s is not None else
                    "stream: not enough observations of the prefill engine or the hand-off yet")
    recompute = Option(Action.RECOMPUTE, None, None, 0, 0, r,
                       f"decode engine computes {n} tokens" if r is not None else
                       "recompute: not enough observations of the decode engine computing prompts yet")
    opts = (recompute, stream)
    if s is None or r is None:
        missing = [o.note for o in opts if o.seconds is None]
        return Decision(stream if s is not None else recompute, opts, "; ".join(missing), ProfileStatus.MISSING)
    choice = choose(list(opts))
    other = stream if choice is recompute else recompute
    reason = f"{choice.label} {choice.seconds:.3f} s beats {other.label} {other.seconds:.3f} s ({n} tokens)"
    return Decision(choice, opts, reason, ProfileStatus.OK)


def pd_crossover(m: PDModels, lo: int = 1, hi: int = 131072) -> tuple[int, ...] | None:
    """Prompt lengths in ``[lo, hi]`` where stream and recompute swap places (each bisected to one
    token), or None when a curve is missing."""
    def diff(n: int) -> float:
        s, r = stream_seconds(m, n), recompute_seconds(m, n)
        if s is None or r is None:
            raise PlanInputError("curve missing")
        return s - r

    check_int("lo", lo, 1)
    if hi <= lo:
        raise PlanInputError(f"crossover range [{lo}, {hi}] is empty")
    if m.prefill is None or m.handoff is None or m.decode is None:
        return None
    grid = sorted({lo, hi, *(int(lo * 1.05 ** k) for k in range(1, 400) if lo * 1.05 ** k < hi)})
    out: list[int] = []
    prev_n, prev = grid[0], diff(grid[0])
    for n in grid[1:]:
        d = diff(n)
        if (d < 0) != (prev < 0):
            a, b = prev_n, n
            while b - a > 1:
                mid = (a + b) // 2
                if (diff(mid) < 0) == (prev < 0):
                    a = mid
                else:
                    b = mid
            out.append(b)
        prev_n, prev = n, d
    return tuple(out)


class PDPlanner:
    """The live planner of one proxy: observations in (:meth:`observe`), decisions out (:meth:`decide`).
    Thread-safe; the fitted models are swapped whole under a lock."""

    def __init__(self, *, link: Link | None = None, kv_bytes_per_token: int | None = None,
                 default: Action = Action.STREAM, explore_every: int = EXPLORE_EVERY,
                 clock: Callable[[], float] = time.time) -> None:
        if default not in (Action.STREAM, Action.RECOMPUTE):
            raise PlanInputError(f"the default must be stream or recompute, got {default}")
        if kv_bytes_per_token is not None:
            check_int("kv_bytes_per_token", kv_bytes_per_token, 1)
        self.default = default
        self.explore_every = check_int("explore_every", explore_every, 0)  # 0: never explore
        self._clock = clock
        self._lock = threading.Lock()
        self._points: dict[Curve, deque[PrefillPoint]] = {c: deque(maxlen=WINDOW) for c in Curve}
        self._models = PDModels(link=link, kv_bytes_per_token=kv_bytes_per_token)
        self._asked = 0
        self.counts: dict[str, int] = {}

    @property
    def models(self) -> PDModels:
        return self._models

    def observe(self, curve: Curve, tokens: int, seconds: float) -> None:
        """One observation of ``curve`` for a prompt of ``tokens`` (its engine was idle), refit."""
        check_int("tokens", tokens, 1)
        if not isinstance(seconds, int | float) or not 0 < seconds < 3600:
            raise PlanInputError(f"an observed time must be in (0, 3600) seconds, got {seconds!r}")
        with self._lock:
            pts = self._points[curve]
            pts.append(PrefillPoint(0, tokens, float(seconds)))
            fitted: PrefillModel | None = None
            if len({p.end for p in pts}) >= MIN_LENGTHS:
                try:
                    fitted = fit_prefill(list(pts), model_id="pd", threads=0, measured_at=self._clock())
                except ProfileError:
                    fitted = None
            m = self._models
            self._models = PDModels(
                prefill=fitted if curve is Curve.PREFILL else m.prefill,
                handoff=fitted if curve is Curve.HANDOFF else m.handoff,
                decode=fitted if curve is Curve.DECODE else m.decode,
                link=m.link, kv_bytes_per_token=m.kv_bytes_per_token)

    def decide(self, prompt_tokens: int, *, prefill_queue: int = 0, decode_queue: int = 0) -> Decision:
        d = evaluate_pd(self._models, prompt_tokens, prefill_queue=prefill_queue, decode_queue=decode_queue)
        why = "model"
        if d.status is not ProfileStatus.OK:
            with self._lock:
                self._asked += 1
                explore = self.explore_every > 0 and self._asked % self.explore_every == 0
            want = self.default
            if explore:  # learn the path the model lacks (or, when both lack, the one that is not the default)
                want = Action.RECOMPUTE if self.default is Action.STREAM else Action.STREAM
                why = "explore"
            else:
                why = "default"
            pick = next(o for o in d.options if o.action is want)
            d = Decision(pick, d.options, f"{why} ({d.reason})", d.status)
        _DECISIONS.labels(action=d.action.value, why=why).inc()
        with self._lock:
            key = f"{d.action.value}:{why}"
            self.counts[key] = self.counts.get(key, 0) + 1
        return d

    def snapshot(self) -> dict[str, Any]:
        """The planner's state as JSON: each curve's fit and points, the link, the decisions so far, and
        the crossover lengths up to 4x the longest prompt observed (no further from the data)."""
        m = self._models

        def curve(c: Curve) -> dict[str, Any]:
            f = m.curve(c)
            return {"fitted": None if f is None else {"a": f.a, "b": f.b, "c": f.c},
                    "points": [[p.end, round(p.seconds, 5)] for p in self._points[c]]}

        with self._lock:
            counts = dict(self.counts)
            seen = max((p.end for pts in self._points.values() for p in pts), default=1)
        return {"curves": {c.value: curve(c) for c in Curve}, "default": self.default.value,
                "link": None if m.link is None else {"bandwidth": m.link.bandwidth, "latency": m.link.latency},
                "kv_bytes_per_token": m.kv_bytes_per_token,
                "crossover_tokens": _list(pd_crossover(m, 1, max(2, 4 * seen))),
                "decisions": counts}


def _list(x: tuple[int, ...] | None) -> list[int] | None:
    return None if x is None else list(x)


__all__ = ["EXPLORE_EVERY", "MIN_LENGTHS", "WINDOW", "Curve", "PDModels", "PDPlanner", "evaluate_pd", "pd_crossover",
           "recompute_seconds", "stream_seconds"]
