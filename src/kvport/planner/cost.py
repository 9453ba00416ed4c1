"""The cost model: pure, I/O-free. ``evaluate(profile, request, load, freshness) -> Decision``.

Options for a prompt of ``N`` tokens whose first ``K`` tokens' KV sits on source ``S`` (a tier or a
peer link in the profile). At least the last prompt token is always computed (it yields the logits),
so the reusable prefix is ``R = min(K, N - 1)``; ``P(s, e)`` is the prefill model, ``Q = 1 +
compute_queue`` the processor-sharing slowdown of the compute, ``X(n) = latency + (backlog + n) / bw``
the link, ``I(n) = n / install_bps`` placing bytes into the engine's cache, ``bytes(n)`` from the spec::

    recompute        Q * P(0, N)
    load S           X(bytes(R)) + I(bytes(R)) + Q * P(R, N)
    load S + codec C bytes(R)/enc_C + X(bytes(R)/ratio_C) + bytes(R)/dec_C + I(bytes(R)) + Q * P(R, N)
    split S at h     max(Q * P(0, h), X(bytes(R - h))) + 2 I(bytes(R)) + Q * P(R, N)

Split recomputes the head ``[0, h)`` locally while the tail ``[h, R)`` of the cached KV moves (the
KV of token i depends only on tokens 0..i, so the two halves are independent); ``h`` is the block
boundary that balances the two sides; joining the two halves costs one more copy of the prefix
(hence ``2 I``). A codec is eligible only when its quality cost is within the
request's budget (default 0: lossless only).

Trust: a prefill model is used only for the request's model, on the profile's machine, younger than
``max_age_s``; a link only when present and younger than ``max_age_s``. When either is missing the
option's time is ``None`` and the choice falls back to recompute (always correct, never waits on a
link the planner cannot vouch for). Near-ties (within ``SIMPLER_MARGIN``) go to the simpler option:
recompute, then load, then split.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from kvport.errors import PlanInputError
from kvport.planner.profile import CodecCost, Link, PrefillModel, Profile
from kvport.spec import KVSpec

DEFAULT_MAX_AGE_S = 7 * 86400.0


class Action(enum.Enum):
    RECOMPUTE = "recompute"
    LOAD = "load"
    SPLIT = "split"
    STREAM = "stream"  # prefill/decode: a prefill engine computes the prompt and streams its KV (planner.pd)


_RANK = {Action.RECOMPUTE: 0, Action.LOAD: 1, Action.STREAM: 1, Action.SPLIT: 2}


class ProfileStatus(enum.Enum):
    OK = "ok"
    MISSING = "missing"
    STALE = "stale"


def check_int(name: str, v: object, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise PlanInputError(f"{name} must be an integer >= {lo}, got {v!r}")
    return v


@dataclass(frozen=True, slots=True)
class Cached:
    """``tokens`` leading prompt tokens whose KV ``source`` (a link name in the profile) holds."""

    source: str
    tokens: int
    backlog_bytes: int = 0  # bytes already queued on that link ahead of this request

    def __post_init__(self) -> None:
        if not self.source:
            raise PlanInputError("cached source name must not be empty")
        check_int(f"cached tokens on {self.source}", self.tokens, 0)
        check_int(f"backlog bytes on {self.source}", self.backlog_bytes, 0)


@dataclass(frozen=True, slots=True)
class Request:
    prompt_tokens: int
    spec: KVSpec
    cached: tuple[Cached, ...] = ()
    max_quality_cost: float = 0.0  # relative perplexity increase a codec may cost

    def __post_init__(self) -> None:
        check_int("prompt_tokens", self.prompt_tokens, 1)
        for c in self.cached:
            if c.tokens > self.prompt_tokens:
                raise PlanInputError(f"{c.source} caches {c.tokens} tokens of a {self.prompt_tokens}-token prompt")
        names = [c.source for c in self.cached]
        if len(set(names)) != len(names):
            raise PlanInputError(f"duplicate cached sources: {names}")
        q = self.max_quality_cost
        if isinstance(q, bool) or not isinstance(q, int | float) or not math.isfinite(q) or q < 0:
            raise PlanInputError(f"max_quality_cost must be a finite number >= 0, got {q!r}")


@dataclass(frozen=True, slots=True)
class Load:
    compute_queue: int = 0  # other requests sharing the compute that would run the prefill

    def __post_init__(self) -> None:
        check_int("compute_queue", self.compute_queue, 0)


@dataclass(frozen=True, slots=True)
class Freshness:
    now: float
    max_age_s: float = DEFAULT_MAX_AGE_S
    machine: str | None = None  # None: do not compare machines


@dataclass(frozen=True, slots=True)
class Option:
    action: Action
    source: str | None = None
    codec: str | None = None
    reuse_tokens: int = 0  # tokens whose KV is moved (split: including the recomputed head)
    head_tokens: int = 0  # split only: tokens [0, head) recomputed while [head, reuse) moves
    seconds: float | None = None  # None: cannot be predicted (see note)
    note: str = ""

    @property
    def label(self) -> str:
        if self.action is Action.RECOMPUTE:
            return "recompute"
        out = f"{self.action.value}:{self.source}"
        return out + (f"+{self.codec}" if self.codec else "")


@dataclass(frozen=True, slots=True)
class Decision:
    choice: Option
    options: tuple[Option, ...]
    reason: str
    status: ProfileStatus
    warnings: tuple[str, ...] = field(default=())

    @property
    def action(self) -> Action:
        return self.choice.action

    def seconds(self, label: str) -> float | None:
        return next((o.seconds for o in self.options if o.label == label), None)

    def as_dict(self) -> dict[str, object]:
        return {"action": self.action.value, "choice": self.choice.label, "reason": self.reason,
                "status": self.status.value, "warnings": list(self.warnings),
                "options": [{"label": o.label, "action": o.action.value, "source": o.source, "codec": o.codec,
                             "reuse_tokens": o.reuse_tokens, "head_tokens": o.head_tokens, "seconds": o.seconds,
                             "note": o.note} for o in self.options]}


# ---------------------------------------------------------------------- trust
def profile_status(profile: Profile | None, fresh: Freshness) -> tuple[ProfileStatus, str]:
    if profile is None:
        return ProfileStatus.MISSING, "no calibration profile (run `kvport calibrate`)"
    if fresh.machine is not None and profile.machine != fresh.machine:
        return ProfileStatus.STALE, f"profile was calibrated on another machine ({profile.machine})"
    if fresh.now - profile.created > fresh.max_age_s:
        return ProfileStatus.STALE, f"profile is {(fresh.now - profile.created) / 3600:.0f} h old"
    return ProfileStatus.OK, ""


def usable_prefill(profile: Profile | None, spec: KVSpec, fresh: Freshness) -> tuple[PrefillModel | None, str]:
    status, why = profile_status(profile, fresh)
    if profile is None or status is not ProfileStatus.OK:
        return None, why
    pf = profile.prefill
    if pf is None:
        return None, "profile has no prefill measurements"
    if pf.model_id != spec.model_id:
        return None, f"prefill was measured for {pf.model_id}, not {spec.model_id}"
    if fresh.now - pf.measured_at > fresh.max_age_s:
        return None, "prefill measurements are stale"
    return pf, ""


def usable_link(profile: Profile | None, name: str, fresh: Freshness) -> tuple[Link | None, str]:
    if profile is None:
        return None, "no profile"
    if fresh.machine is not None and profile.machine != fresh.machine:
        return None, "profile from another machine"
    lk = profile.link(name)
    if lk is None:
        return None, f"link {name!r} was never measured"
    if fresh.now - lk.measured_at > fresh.max_age_s:
        return None, f"link {name!r} measurement is stale"
    return lk, ""


# ---------------------------------------------------------------------- options
def _install(profile: Profile, nbytes: float) -> float:
    return 0.0 if profile.install_bps is None else nbytes / profile.install_bps


def _load(pf: PrefillModel, profile: Profile, lk: Link, req: Request, c: Cached, q: int,
          codec: CodecCost | None) -> Option:
    n = req.prompt_tokens
    r = min(c.tokens, n - 1)
    raw = float(req.spec.request_bytes(r))
    tail = pf.seconds(r, n) * q + _install(profile, raw)
    if codec is None:
        t = lk.seconds(c.backlog_bytes + raw) + tail
        note = f"{raw / 1e6:.1f} MB at {lk.bandwidth / 1e6:.0f} MB/s"
        return Option(Action.LOAD, c.source, None, r, 0, t, note)
    t = raw / codec.encode_bps + lk.seconds(c.backlog_bytes + raw / codec.ratio) + raw / codec.decode_bps + tail
    note = f"{raw / codec.ratio / 1e6:.1f} MB encoded ({codec.ratio:.2f}x), quality +{codec.quality_cost:.2%}"
    return Option(Action.LOAD, c.source, codec.name, r, 0, t, note)


def best_split(pf: PrefillModel, lk: Link, spec: KVSpec, reuse: int, backlog: int, q: int) -> tuple[int, float] | None:
    """(head h, overlapped seconds max(Q P(0,h), X(bytes(R-h)))) at the best block boundary 0 < h < R."""
    bs = spec.block_size
    blocks = (reuse - 1) // bs  # boundaries h = bs .. blocks*bs, all < reuse
    if blocks < 1:
        return None

    def cost(h: int) -> float:
        return max(pf.seconds(0, h) * q, lk.seconds(backlog + spec.request_bytes(reuse - h)))

    lo, hi = 1, blocks  # first boundary where compute >= transfer (compute rises, transfer falls)
    while lo < hi:
        mid = (lo + hi) // 2
        if pf.seconds(0, mid * bs) * q >= lk.seconds(backlog + spec.request_bytes(reuse - mid * bs)):
            hi = mid
        else:
            lo = mid + 1
    cands = {lo * bs, max(1, lo - 1) * bs}
    h = min(cands, key=lambda x: (cost(x), x))
    return h, cost(h)


def _split(pf: PrefillModel, profile: Profile, lk: Link, req: Request, c: Cached, q: int) -> Option:
    n = req.prompt_tokens
    r = min(c.tokens, n - 1)
    found = best_split(pf, lk, req.spec, r, c.backlog_bytes, q)
    if found is None:
        return Option(Action.SPLIT, c.source, None, r, 0, None, f"cached prefix of {r} tokens is under two blocks")
    h, overlap = found
    t = overlap + 2 * _install(profile, float(req.spec.request_bytes(r))) + pf.seconds(r, n) * q
    return Option(Action.SPLIT, c.source, None, r, h, t, f"recompute [0,{h}) while [{h},{r}) moves")


def options_for(profile: Profile | None, req: Request, load: Load, fresh: Freshness) -> tuple[list[Option], str, str]:
    """Every option with its predicted time (or None + why); also (prefill-why, first link-why)."""
    pf, pf_why = usable_prefill(profile, req.spec, fresh)
    q = 1 + load.compute_queue
    out = [Option(Action.RECOMPUTE, reuse_tokens=0,
                  seconds=None if pf is None else pf.seconds(0, req.prompt_tokens) * q,
                  note=pf_why or f"{req.prompt_tokens} tokens")]
    link_why = ""
    for c in req.cached:
        r = min(c.tokens, req.prompt_tokens - 1)
        lk, why = usable_link(profile, c.source, fresh)
        if r <= 0:
            out.append(Option(Action.LOAD, c.source, None, 0, 0, None, "nothing reusable"))
            continue
        if lk is None or pf is None or profile is None:
            link_why = link_why or why
            note = why or pf_why
            out.append(Option(Action.LOAD, c.source, None, r, 0, None, note))
            out.append(Option(Action.SPLIT, c.source, None, r, 0, None, note))
            continue
        out.append(_load(pf, profile, lk, req, c, q, None))
        for codec in profile.codecs:
            if codec.quality_cost <= req.max_quality_cost:
                out.append(_load(pf, profile, lk, req, c, q, codec))
            else:
                out.append(Option(Action.LOAD, c.source, codec.name, r, 0, None,
                                  f"quality +{codec.quality_cost:.2%} over budget +{req.max_quality_cost:.2%}"))
        out.append(_split(pf, profile, lk, req, c, q))
    return out, pf_why, link_why


SIMPLER_MARGIN = 0.03


def choose(options: list[Option], margin: float = SIMPLER_MARGIN) -> Option:
    """The fastest option, except that a simpler one (recompute < load < split) within ``margin`` of
    the fastest is preferred: a prediction that close is inside the model's error, and the simpler
    option has fewer moving parts."""
    known = [o for o in options if o.seconds is not None]
    if not known:
        return options[0]
    best = min(o.seconds for o in known if o.seconds is not None)
    close = [o for o in known if o.seconds is not None and o.seconds <= best * (1 + margin)]
    return min(close, key=lambda o: (_RANK[o.action], o.seconds))


def evaluate(profile: Profile | None, req: Request, load: Load | None = None,
             fresh: Freshness | None = None) -> Decision:
    """The decision for ``req``. Without ``fresh`` the profile is judged as of its own creation on any
    machine (a pure what-if); :class:`~kvport.planner.Planner` passes the clock and this machine."""
    fresh = fresh or Freshness(now=profile.created if profile is not None else 0.0)
    status, status_why = profile_status(profile, fresh)
    opts, pf_why, link_why = options_for(profile, req, load or Load(), fresh)
    warnings = tuple(w for w in (status_why,) if w)
    recompute = opts[0]
    if recompute.seconds is None:
        return Decision(recompute, tuple(opts), f"recompute (safe default): {pf_why}", status, warnings)
    choice = choose(opts)
    if choice.action is Action.RECOMPUTE:
        others = [o for o in opts[1:] if o.seconds is not None]
        if others:
            alt = min(others, key=lambda o: o.seconds or 0.0)
            reason = f"recompute {recompute.seconds:.3f} s beats {alt.label} {alt.seconds:.3f} s ({alt.note})"
        elif link_why:
            reason = f"recompute (safe default): {link_why}"
        else:
            reason = "recompute: no cached prefix to reuse"
    else:
        reason = (f"{choice.label} {choice.seconds:.3f} s beats recompute {recompute.seconds:.3f} s "
                  f"({choice.note})")
    return Decision(choice, tuple(opts), reason, status, warnings)
