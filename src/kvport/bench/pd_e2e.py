"""The end-to-end part of ``kvport bench pd``: what a client of the OpenAI API sees, through ``kvport
proxy`` (a prefill engine on some cores, a decode engine on the others) against one colocated engine
with vLLM's own prefix cache on all of them, at several request rates of one workload.

Workload (:func:`workload`): ``prefixes`` shared system prompts of ~``prefix_tokens`` tokens (texts of
:mod:`kvport.workers.material`, cut at whole lines), ``sessions`` chats each opening with one of them
(session ``s`` takes prefix ``s % prefixes``) and a user message of ~``suffix_tokens`` tokens of its own
(log lines drawn for that session), then short follow-ups, ``turns`` turns; answers of
``answer_tokens`` tokens, greedy. Requests arrive open-loop, Poisson at the rate measured (seeded):
arrival ``i`` is turn ``i // sessions`` of session ``i % sessions``, sent at its arrival time or when
that session's previous answer is in, whichever is later (a client needs the answer to write the next
turn). Every rate has sessions of its own; the shared prefixes are warmed once before the first rate
(one request each), so each rate starts from a deployment whose system prompts are cached.

Per rate and layout (:func:`summarize`): TTFT (client-side, from sending a request to its first
streamed token: mean, median, p90), TPOT ((answer time - TTFT) / (tokens - 1), mean), throughput
(answered requests over the span from the first send to the last answer) and goodput (those meeting
``TTFT <= ttft_slo_s`` and ``TPOT <= tpot_slo_s``, per second of the same span). Per layout, where
the time went (:func:`breakdown`, per request, from the engines' and the proxy's /metrics read before
and after the rate): vLLM's queue and prefill time on each engine, kvport's connector time on each
(``kvport_vllm_connector_seconds``: lookups, step planning, saves and streams on the prefill engine,
loads on the decode engine) and the proxy's own time (``kvport_pd_proxy_own_seconds``: the time to an
answer's first byte not spent awaiting an engine). kvport's own time per request is the proxy's plus
the connectors': what kvport adds to a request, the engines' compute left out.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvport.evidence.timing import ratio
from kvport.workers import material

# kvport's connector ops on a request's way to its first token (keep_streamed is after it)
PREFILL_OPS = ("lookup", "schedule", "save", "stream")
DECODE_OPS = ("lookup", "schedule", "load", "load_async")
FOLLOW_UPS = ("Which of those took longest, and why?", "Summarise that in one sentence.",
              "What should be checked first?", "Anything else unusual?")


@dataclass(frozen=True, slots=True)
class E2EOptions:
    rates: tuple[float, ...]
    prefixes: int
    prefix_tokens: int
    suffix_tokens: int
    sessions: int
    turns: int
    answer_tokens: int
    ttft_slo_s: float
    tpot_slo_s: float
    seed: int = 31


@dataclass(slots=True)
class Sent:
    """One request as the client saw it."""

    session: int
    turn: int
    arrival_s: float  # scheduled, from the rate's start
    sent_s: float = 0.0  # actually sent (later when the session's previous answer came after the arrival)
    ttft_s: float | None = None
    wall_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    error: str | None = None
    answered_at: float = 0.0


@dataclass(slots=True)
class E2EChat:
    messages: list[dict[str, str]]
    prefix: int
    answers: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ workload
def _prefix_texts() -> list[str]:
    return [material.CHAT_SYSTEM + "\n\n" + material.INCIDENT_LOG, material.TOOL_PROMPT, material.QUOTA_MODULE,
            material.QUOTA_TESTS]


def _cut(text: str, tokens: int, count: Callable[[str], int]) -> str:
    """``text``'s first whole lines, as many as come nearest ``tokens`` tokens (at least one line)."""
    lines = text.splitlines(keepends=True)
    lo, hi = 1, len(lines)
    while lo < hi:  # the most lines whose count stays within
        mid = (lo + hi + 1) // 2
        if count("".join(lines[:mid])) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    if lo < len(lines) and count("".join(lines[:lo + 1])) - tokens < tokens - count("".join(lines[:lo])):
        lo += 1  # one line more comes nearer
    return "".join(lines[:lo])


def _suffix(rng: random.Random, tokens: int, count: Callable[[str], int]) -> str:
    """A user message of ~``tokens`` tokens: log lines of this session's own, then a question."""
    lines = []
    while True:
        node, ms = rng.randrange(1, 9), rng.randrange(20, 2400)
        lines.append(f"03:{rng.randrange(60):02d}:{rng.randrange(60):02d} node-{node} req={rng.getrandbits(32):08x} "
                     f"GET /v2/photos/{rng.randrange(10**6)} dur={ms}ms\n")
        if count("".join(lines)) >= tokens - 28:  # the head and the question are ~28 tokens
            break
    return "Here are more lines from tonight:\n" + "".join(lines) + "Which request was slowest, and on which node?"


def workload(o: E2EOptions, counter: Callable[[str], int], rate_index: int) -> list[E2EChat]:
    """The sessions of one rate (their openings; later turns are written from the answers)."""
    prefixes = [_cut(t, o.prefix_tokens, counter) for t in _prefix_texts()]
    rng = random.Random(o.seed * 1000 + rate_index)
    out = []
    for s in range(o.sessions):
        p = s % o.prefixes
        out.append(E2EChat([{"role": "system", "content": prefixes[p % len(prefixes)]},
                            {"role": "user", "content": _suffix(rng, o.suffix_tokens, counter)}], p))
    return out


def warmups(o: E2EOptions, counter: Callable[[str], int]) -> list[list[dict[str, str]]]:
    """One chat per shared prefix, never measured: each rate then starts with the prefixes cached."""
    prefixes = [_cut(t, o.prefix_tokens, counter) for t in _prefix_texts()]
    return [[{"role": "system", "content": prefixes[p % len(prefixes)]}, {"role": "user", "content": "Ready?"}]
            for p in range(o.prefixes)]


def arrivals(rate: float, n: int, seed: int) -> list[float]:
    """``n`` Poisson arrival times at ``rate`` per second, the first at 0."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ------------------------------------------------------------------ the client
Ask = Callable[[list[dict[str, str]]], Any]  # sends a chat, returns the Answer (bench.pd.request's)


def run_rate(ask: Ask, sessions: list[E2EChat], turns: int, rate: float, seed: int) -> list[Sent]:
    """Every session's turns, open-loop at ``rate`` (module docstring); one thread per session."""
    n = len(sessions)
    times = arrivals(rate, n * turns, seed)
    sent = [Sent(i % n, i // n, times[i]) for i in range(n * turns)]
    t0 = time.perf_counter()

    def one(s: int) -> None:
        sess = sessions[s]
        for t in range(turns):
            rec = sent[t * n + s]
            wait = t0 + rec.arrival_s - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            rec.sent_s = time.perf_counter() - t0
            try:
                a = ask(sess.messages)
            except Exception as exc:  # any failure is a request not answered: counted, the session stops
                rec.error = f"{type(exc).__name__}: {exc}"[:200]
                return
            rec.answered_at = time.perf_counter() - t0
            rec.ttft_s, rec.wall_s, rec.text = a.ttft_s, a.wall_s, a.text
            rec.prompt_tokens = int(a.usage.get("prompt_tokens", 0))
            rec.completion_tokens = int(a.usage.get("completion_tokens", 0))
            sess.messages = [*sess.messages, {"role": "assistant", "content": a.text},
                             {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]

    threads = [threading.Thread(target=one, args=(s,), daemon=True) for s in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(1800)
    return sent


def _pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 4)


def _mean(xs: Sequence[float]) -> float | None:
    return round(statistics.mean(xs), 4) if xs else None


def summarize(sent: Sequence[Sent], o: E2EOptions) -> dict[str, Any]:
    ok = [r for r in sent if r.error is None and r.ttft_s is not None and r.wall_s is not None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [((r.wall_s or 0.0) - (r.ttft_s or 0.0)) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    span = (max(r.answered_at for r in ok) - min(r.sent_s for r in sent)) if ok else None
    good = [r for r in ok if (r.ttft_s or 0.0) <= o.ttft_slo_s and (r.completion_tokens <= 1 or
            ((r.wall_s or 0.0) - (r.ttft_s or 0.0)) / (r.completion_tokens - 1) <= o.tpot_slo_s)]
    return {"requests": len(sent), "answered": len(ok), "errors": [r.error for r in sent if r.error][:3],
            "ttft_mean_s": _mean(ttft), "ttft_median_s": _pct(ttft, 0.5), "ttft_p90_s": _pct(ttft, 0.9),
            "tpot_mean_s": _mean(tpot),
            "throughput_rps": round(len(ok) / span, 4) if span else None,
            "goodput_rps": round(len(good) / span, 4) if span else None,
            "slo_met": len(good), "span_s": round(span, 3) if span else None,
            "prompt_tokens_mean": _mean([float(r.prompt_tokens) for r in ok]),
            "send_delay_mean_s": _mean([max(0.0, r.sent_s - r.arrival_s) for r in sent])}


# ------------------------------------------------------------------ where the time went
Reader = Callable[[str, str], float]  # (url, sample name with labels as prefix) -> summed value


@dataclass(frozen=True, slots=True)
class Probe:
    """The /metrics figures one layout's breakdown reads, per engine (and the proxy's, for PD)."""

    prefill: str | None  # the prefill engine's URL (PD), else None
    answer: str  # the engine that answers (decode, or the colocated one)
    proxy: str | None

    def read(self, metric: Callable[..., float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for role, url in (("prefill", self.prefill), ("answer", self.answer)):
            if url is None:
                continue
            for h in ("request_queue_time_seconds", "request_prefill_time_seconds", "time_to_first_token_seconds"):
                out[f"{role}.{h}.sum"] = metric(url, f"vllm:{h}_sum")
                out[f"{role}.{h}.count"] = metric(url, f"vllm:{h}_count")
            for op in PREFILL_OPS if role == "prefill" else DECODE_OPS:
                out[f"{role}.kvport.{op}"] = metric(url, "kvport_vllm_connector_seconds_total", op=op)
            out[f"{role}.kvport.keep_streamed"] = metric(url, "kvport_vllm_connector_seconds_total", op="keep_streamed")
            out[f"{role}.cache.hits"] = metric(url, "vllm:prefix_cache_hits_total")
            out[f"{role}.cache.queries"] = metric(url, "vllm:prefix_cache_queries_total")
        if self.proxy is not None:
            out["proxy.own.sum"] = metric(self.proxy, "kvport_pd_proxy_own_seconds_sum")
            out["proxy.own.count"] = metric(self.proxy, "kvport_pd_proxy_own_seconds_count")
            out["proxy.wait.prefill"] = metric(self.proxy, "kvport_pd_proxy_engine_wait_seconds_total", role="prefill")
            out["proxy.wait.answer"] = metric(self.proxy, "kvport_pd_proxy_engine_wait_seconds_total", role="answer")
        return out


def breakdown(before: dict[str, float], after: dict[str, float], answered: int) -> dict[str, Any]:
    """Per request, seconds (and vLLM's prefix cache hit rate per engine) over one rate's requests."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}

    def per(sum_key: str, count_key: str) -> float | None:
        return round(d[sum_key] / d[count_key], 4) if d.get(count_key) else None

    def mean(role: str, h: str) -> float | None:  # a vLLM histogram's mean over the rate
        return per(f"{role}.{h}.sum", f"{role}.{h}.count")

    out: dict[str, Any] = {}
    for role in ("prefill", "answer"):
        if f"{role}.request_queue_time_seconds.sum" not in d:
            continue
        out[role] = {
            "queue_s": mean(role, "request_queue_time_seconds"),
            "prefill_s": mean(role, "request_prefill_time_seconds"),
            "engine_ttft_s": mean(role, "time_to_first_token_seconds"),
            "kvport_s": round(sum(v for k, v in d.items() if k.startswith(f"{role}.kvport.")
                                  and not k.endswith("keep_streamed")) / answered, 5) if answered else None,
            "kvport_by_op_s": {k.rsplit(".", 1)[1]: round(v / answered, 5) for k, v in d.items()
                               if k.startswith(f"{role}.kvport.")} if answered else {},
            "prefix_cache_hit_rate": ratio(d.get(f"{role}.cache.hits"), d.get(f"{role}.cache.queries") or None),
        }
    if "proxy.own.sum" in d:
        out["proxy"] = {"own_s": per("proxy.own.sum", "proxy.own.count"),
                        "awaiting_prefill_s": round(d["proxy.wait.prefill"] / answered, 4) if answered else None,
                        "awaiting_answer_s": round(d["proxy.wait.answer"] / answered, 4) if answered else None}
    parts = [out.get("prefill", {}).get("kvport_s"), out.get("answer", {}).get("kvport_s"),
             out.get("proxy", {}).get("own_s")]
    known = [p for p in parts if p is not None]
    out["kvport_own_s"] = round(sum(known), 5) if known and (out.get("proxy") or "prefill" not in out) else None
    return out


def verdict(rows: dict[str, dict[str, Any]], at: str) -> dict[str, Any]:
    """Where PD stands against the colocated engine at rate ``at`` (a key of ``rows``), and why: the
    prefill engine's compute against the colocated engine's, queueing, the hand-off, the proxy."""
    row = rows.get(at, {})
    pd, colo = row.get("pd", {}), row.get("colocated", {})
    pb, cb = pd.get("breakdown", {}), colo.get("breakdown", {})
    pre, ans, cans = pb.get("prefill", {}), pb.get("answer", {}), cb.get("answer", {})
    return {
        "rate": at,
        "ttft_vs_colocated": ratio(pd.get("ttft_mean_s"), colo.get("ttft_mean_s")),
        "tpot_vs_colocated": ratio(pd.get("tpot_mean_s"), colo.get("tpot_mean_s")),
        "goodput_vs_colocated": ratio(pd.get("goodput_rps"), colo.get("goodput_rps")),
        # the prefill engine's compute per request over the colocated engine's (vLLM's prefill time:
        # from scheduled to first token, the connector's steps inside)
        "prefill_compute_vs_colocated": ratio(pre.get("prefill_s"), cans.get("prefill_s")),
        "prefill_queue_s": pre.get("queue_s"),
        "decode_queue_s": ans.get("queue_s"),
        "colocated_queue_s": cans.get("queue_s"),
        "handoff_s": _sum(pre.get("kvport_s"), ans.get("kvport_s")),
        "proxy_own_s": pb.get("proxy", {}).get("own_s"),
        "kvport_own_s": pb.get("kvport_own_s"),
        "kvport_own_vs_ttft": ratio(pb.get("kvport_own_s"), pd.get("ttft_mean_s")),
    }


def _sum(*xs: float | None) -> float | None:
    return None if any(x is None for x in xs) else round(sum(x for x in xs if x is not None), 5)


def rate_key(rate: float) -> str:
    return f"{rate:g}"


def token_counter(model: Path) -> Callable[[str], int]:
    """Tokens of a text with the model's own tokenizer (the workload's lengths are in its tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])
