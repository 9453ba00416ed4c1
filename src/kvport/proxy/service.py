"""A small prefill/decode proxy and KV-aware router speaking the OpenAI API, in front of vLLM engines.

``kvport proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200``: any OpenAI client
points at it (``/v1/completions``, ``/v1/chat/completions``, streamed or not; ``/v1/models`` and
``/health``, ``/metrics``). Per request, the pattern vLLM's disaggregated connectors use::

    client --> proxy --1--> prefill engine   the prompt only (:func:`prefill_body`): max_tokens 1, n 1,
                                             stream off, no best_of/logprobs/min_tokens,
                                             kv_transfer_params {"do_remote_decode": true}
                     <----- its answer's kv_transfer_params (where the KV is: kvport's hand-off)
                     --2--> decode engine    the client's body + those kv_transfer_params
                     <----- streamed back to the client as it comes

Stream or recompute, per request (``pd_policy``): ``stream`` (the default) always takes the path above;
``recompute`` sends the request straight to the decode engine, which computes the prompt itself; ``plan``
asks the live :class:`~kvport.planner.pd.PDPlanner` which of the two gives the first token sooner for
this prompt's length (counted by the decode engine's ``/tokenize`` unless the prompt is token ids) and
the engines' queues. The planner learns from every request the proxy serves, whatever path it took:
the prefill answer's time, and the decode engine's time to its first streamed token after a hand-off
or computing the prompt (only requests that found their engine idle). A client, or a benchmark, may
choose for one request with the header ``X-KVport-PD: stream | recompute | plan``; every answer says
what was done in ``X-KVport-PD-Path`` (``stream``, ``recompute``, ``no_handoff``, ``fallback``) and, when
the planner chose, its predictions in ``X-KVport-PD-Predicted``. ``GET /kvport/pd`` shows the planner's
curves, the predicted crossover length and its decisions.

Failures never hang a client and never give a wrong answer, since the decode engine recomputes
what it cannot load:

* prefill fails (refused, killed mid-request, an error status, past ``prefill_timeout_s``): the
  decode request goes without a hand-off and the decode engine computes the prompt itself;
* decode fails before its answer started (refused, killed before loading): the request goes,
  whole, to a prefill engine (a vLLM engine like any other), which computes it;
* decode fails mid-stream: the stream ends with an OpenAI-style error event (bytes already sent
  cannot be taken back);
* the client disconnects: its request is cancelled at once, the engine requests closed (the
  engines then abort them); nothing is recomputed for nobody.

A client is bounded before any engine is asked: ``header_timeout_s`` to send a request's head (from
the connection's opening or its previous answer), ``body_timeout_s`` to send the body, at most
:data:`MAX_BODY_BYTES` (413 past it) nested at most :data:`MAX_JSON_DEPTH` deep (400 past it).
``/health`` asks every engine's ``/health``: 200 ``ok`` when a prefill and a decode engine answer,
200 ``degraded`` when only one role does (requests are still served, without a hand-off or by a
prefill engine), 503 ``down`` when none does; the JSON body says which engine answered what.
``/v1/models`` asks the decode engines, then the prefill engines, until one answers.

Counters (``/metrics``): ``kvport_pd_proxy_requests_total{path}`` with path ``pd`` (handed over),
``recompute`` (chosen: the decode engine computed the prompt), ``no_handoff`` (prefill failed),
``fallback`` (decode failed, served by a prefill engine), ``failed`` and ``aborted`` (the client
disconnected first); ``kvport_pd_planner_decisions_total{action,why}``. Where an answered request's
time went before its first byte: ``kvport_pd_proxy_engine_wait_seconds_total{role}`` (awaiting the
prefill engine's answer; awaiting the answering engine's first chunk) and the proxy's own time, the
rest (``kvport_pd_proxy_own_seconds{path}``, a histogram: reading, tokenizing, routing, planning,
rewriting and relaying).

Which engine of a role (``route``, :mod:`kvport.proxy.routing`): round-robin (the default), the least
loaded, or the one whose predicted time to first token is lowest from the blocks it holds (its KV
events) and its load; ``engines`` instead of prefill and decode: each request goes whole to one of
them (``kv_both`` or plain engines), another one when it fails before answering. Answers carry
``X-KVport-Route`` (the engine; why) and ``X-KVport-Route-Ms``; ``GET /kvport/route``. Binds
127.0.0.1 by default; another address needs ``auth_token`` (``kvport proxy`` requires the length
``kvport serve`` does), which every request must then carry as ``Authorization: Bearer``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from kvport import metrics
from kvport.config import MIN_TOKEN_CHARS
from kvport.engines.vllm.params import HandoffAsk, parse_dests
from kvport.errors import ConfigError, KVPortError
from kvport.events.wire import BlockHash
from kvport.extras import require
from kvport.planner.cost import Action
from kvport.planner.pd import Curve, PDPlanner
from kvport.planner.profile import Link, LinkKind, Profile
from kvport.protocol.net import is_loopback
from kvport.proxy.routing import Engines, EventSource
from kvport.route.policy import PrefixRouter

try:
    import aiohttp
    from aiohttp import web
except ImportError:
    require("vllm", __name__)  # aiohttp comes with vLLM
    raise

log = logging.getLogger(__name__)

_REQUESTS = metrics.counter("pd_proxy_requests", "requests through the PD proxy, by path taken", ["path"])
_OWN = metrics.histogram("pd_proxy_own_seconds", "the proxy's own time per answered request, by path taken: from its "
                         "body read to its answer's first byte sent, less the time awaiting engines",
                         ["path"], buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0))
_WAITED = metrics.counter("pd_proxy_engine_wait_seconds", "seconds the proxy awaited engines before answers' first "
                          "bytes: the prefill engine's answer (prefill) and the answering engine's first chunk "
                          "(answer)", ["role"])
MAX_BODY_BYTES = 16 << 20  # a request body from a client is capped
MAX_JSON_DEPTH = 64  # nesting of a request body (a tool's JSON schema is a few levels; json.loads recurses)
_PD_PATHS = ("/v1/completions", "/v1/chat/completions")
PD_POLICIES = ("stream", "recompute", "plan")
ROUTE_POLICIES = PrefixRouter.POLICIES
ROUTE_HEADER = "X-KVport-Route"  # the engine chosen and why (prefix, least_loaded, round_robin)
ROUTE_MS_HEADER = "X-KVport-Route-Ms"  # milliseconds from the request's body to its engine chosen (tokenizing too)
PD_HEADER = "X-KVport-PD"  # a request's own policy (PD_POLICIES)
PATH_HEADER = "X-KVport-PD-Path"  # what the proxy did: stream, recompute, no_handoff, fallback
PREDICTED_HEADER = "X-KVport-PD-Predicted"  # the planner's predictions, when it chose
_TOKENIZE_TIMEOUT_S = 10.0
MAX_PROMPT_IDS = 1 << 20  # a prompt of token ids longer than this is not counted by the proxy
_PROBE_TIMEOUT_S = 2.0  # an engine's /health, for the proxy's /health
_MODELS_TIMEOUT_S = 10.0  # an engine's /v1/models
# fields of a client's body that would make the one-token prefill do more than the prompt: several
# sequences (n, best_of, beam search), the prompt's logprobs (prompt_logprobs; echo with logprobs),
# or refuse it (min_tokens above max_tokens 1). The decode request keeps them all.
_NOT_FOR_PREFILL = ("best_of", "use_beam_search", "prompt_logprobs", "echo", "logprobs", "top_logprobs",
                    "min_tokens", "stream_options")


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    prefill: Sequence[str]  # base URLs of the prefill engines (kv_role kv_producer)
    decode: Sequence[str]  # base URLs of the decode engines (kv_role kv_consumer)
    host: str = "127.0.0.1"
    port: int = 8000
    auth_token: str | None = field(default=None, repr=False)
    prefill_timeout_s: float = 300.0
    decode_timeout_s: float = 600.0
    header_timeout_s: float = 10.0  # a client sends a request's head within this (slowloris before auth)
    body_timeout_s: float = 30.0  # and its body within this
    # the decode engines' inboxes (kvport_pd_inbox, HOST:PORT, shm:NAME or nixl:HOST:PORT; at TP > 1 one per
    # rank, comma-separated, passed on as they are: prefill rank r streams to the r-th), in the order of
    # ``decode``: the prefill engine streams the prompt's KV there during the prefill; empty: hand-offs go
    # through the store
    decode_inbox: Sequence[str] = ()
    # stream | recompute | plan (module docstring); a request's X-KVport-PD header overrides it
    pd_policy: str = "stream"
    # the stream's link as the planner models it (both or neither): bytes per second and seconds
    pd_link_bps: float | None = None
    pd_link_latency_s: float = 0.0
    kv_bytes_per_token: int | None = None  # the model's KV bytes per token (the link term needs it)
    pd_explore_every: int = 8  # while the planner cannot predict, one request in this many takes the other path
    # engines that compute whole requests (kv_both, or no connector): each request goes to one of them, no PD;
    # given instead of prefill and decode
    engines: Sequence[str] = ()
    # which engine of a role gets a request (kvport.route.policy): round_robin, least_loaded or prefix
    route: str = "round_robin"
    # URL=ENDPOINT[,REPLAY_ENDPOINT]: where an engine publishes its KV events (vLLM's --kv-events-config)
    kv_events: Sequence[str] = ()
    route_block_size: int | None = None  # the engines' block size (else learned from their events)
    route_stale_s: float = 30.0  # an engine not heard from (events or /metrics) for this long is not chosen
    load_poll_s: float = 1.0  # every engine's /metrics is read this often
    route_profile: Profile | None = None  # the planner's calibration: the prefix policy's costs (else defaults)

    def __post_init__(self) -> None:
        if self.engines and (self.prefill or self.decode):
            raise ConfigError("give either engines (each computes whole requests) or prefill and decode engines")
        if not self.engines and (not self.prefill or not self.decode):
            raise ConfigError("the proxy needs at least one prefill and one decode engine URL, or engines")
        if self.route not in ROUTE_POLICIES:
            raise ConfigError(f"route is one of {', '.join(ROUTE_POLICIES)}, got {self.route!r}")
        if self.route_block_size is not None and self.route_block_size <= 0:
            raise ConfigError(f"route_block_size must be positive, got {self.route_block_size!r}")
        if not 0 < self.load_poll_s < self.route_stale_s:
            raise ConfigError("load_poll_s must be positive and shorter than route_stale_s")
        known = {u.rstrip("/") for u in [*self.prefill, *self.decode, *self.engines]}
        seen: set[str] = set()
        for spec in self.kv_events:
            url, sep, src = spec.partition("=")
            if not sep or url.rstrip("/") not in known:
                raise ConfigError(f"a KV event source is ENGINE_URL=ENDPOINT[,REPLAY] naming one of the engines, "
                                  f"got {spec!r}")
            if url.rstrip("/") in seen:
                raise ConfigError(f"two KV event sources for {url}: give one per engine")
            seen.add(url.rstrip("/"))
            EventSource.parse(src)
        if self.route_stale_s < 1.0:
            raise ConfigError(f"route_stale_s must be at least 1 second, got {self.route_stale_s!r}")
        for url in [*self.prefill, *self.decode, *self.engines]:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"engine URL must start with http:// or https://, got {url!r}")
        if self.decode_inbox and len(self.decode_inbox) != len(self.decode):
            raise ConfigError(f"{len(self.decode_inbox)} decode inboxes for {len(self.decode)} decode engines: "
                              "give one per engine, in the same order")
        for addr in self.decode_inbox:
            if parse_dests(addr) is None:
                raise ConfigError(f"a decode inbox is HOST:PORT, shm:NAME or nixl:HOST:PORT (one per rank, "
                                  f"comma-separated), got {addr!r}")
        if self.pd_policy not in PD_POLICIES:
            raise ConfigError(f"pd_policy is one of {', '.join(PD_POLICIES)}, got {self.pd_policy!r}")
        if self.pd_link_bps is not None and not 0 < self.pd_link_bps < float("inf"):
            raise ConfigError(f"pd_link_bps must be a positive number of bytes per second, got {self.pd_link_bps!r}")
        if not 0 <= self.pd_link_latency_s < 60:
            raise ConfigError(f"pd_link_latency_s must be in [0, 60), got {self.pd_link_latency_s!r}")
        if self.kv_bytes_per_token is not None and self.kv_bytes_per_token <= 0:
            raise ConfigError(f"kv_bytes_per_token must be positive, got {self.kv_bytes_per_token!r}")
        if self.pd_explore_every < 0:
            raise ConfigError(f"pd_explore_every must be >= 0, got {self.pd_explore_every!r}")
        for name in ("prefill_timeout_s", "decode_timeout_s", "header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if not is_loopback(self.host) and (not self.auth_token or len(self.auth_token) < MIN_TOKEN_CHARS):
            raise ConfigError(f"the proxy binds {self.host}, beyond this machine: it needs an auth token of at least "
                              f"{MIN_TOKEN_CHARS} characters (--auth-token or KVPORT_AUTH_TOKEN)")


class _Failed(Exception):
    """An engine did not answer usefully (the message says why)."""


@dataclass(slots=True)
class _Clock:
    """Where one request's time went in the proxy up to its answer's first byte: awaiting engines, or
    the proxy's own (reading, tokenizing, routing, planning, rewriting bodies, relaying)."""

    start: float = field(default_factory=time.monotonic)  # the request's body read
    prefill_s: float = 0.0  # awaiting the prefill engine's answer
    answer_s: float = 0.0  # awaiting the answering engine's first chunk (the whole answer when not streamed)
    first_chunk_s: float | None = None  # the answering engine's time to its first chunk (the planner learns it)
    first_byte: float | None = None  # when the answer's first byte went to the client
    path: str = "failed"

    def record(self) -> None:
        """Counted once the answer's first byte went out; a request that never answered is not timed."""
        if self.first_byte is None:
            return
        _WAITED.labels(role="prefill").inc(self.prefill_s)
        _WAITED.labels(role="answer").inc(self.answer_s)
        _OWN.labels(path=self.path).observe(max(0.0, self.first_byte - self.start - self.prefill_s - self.answer_s))


class _ClientGone(Exception):
    """The client's connection closed while the proxy wrote ``response`` to it."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("the client disconnected")
        self.response = response


def prefill_body(body: dict[str, Any], inbox: str | None) -> dict[str, Any]:
    """The prefill engine's request for a client's ``body``: its prompt and sampling, one token,
    one sequence, not streamed, asking for a hand-off (streamed to ``inbox`` when given)."""
    pre = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    pre.update(max_tokens=1, n=1, stream=False, kv_transfer_params=HandoffAsk(inbox).to_params())
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    return pre


def nested_deeper(value: Any, limit: int) -> bool:
    """Whether JSON ``value`` nests more than ``limit`` arrays/objects deep (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth >= limit:
                return True
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


class PDProxy:
    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self.prefill_urls = [u.rstrip("/") for u in cfg.prefill]
        self.decode_urls = [u.rstrip("/") for u in cfg.decode]
        self.engine_urls = [u.rstrip("/") for u in cfg.engines]  # colocated: whole requests, no PD
        inboxes: list[str | None] = [*cfg.decode_inbox] or [None] * len(cfg.decode)
        self._inbox = dict(zip(self.decode_urls, inboxes, strict=True))
        events = {}
        for spec in cfg.kv_events:
            url, _, src = spec.partition("=")
            events[url.rstrip("/")] = EventSource.parse(src)
        self.engines = Engines([*self.prefill_urls, *self.decode_urls, *self.engine_urls], events, policy=cfg.route,
                               block_size=cfg.route_block_size, stale_s=cfg.route_stale_s, poll_s=cfg.load_poll_s,
                               profile=cfg.route_profile, kv_bytes_per_token=cfg.kv_bytes_per_token)
        self._poller: asyncio.Task[None] | None = None
        self._tokenized = 0
        self._session: aiohttp.ClientSession | None = None
        self.counts: dict[str, int] = {}
        link = None if cfg.pd_link_bps is None else Link("pd-stream", LinkKind.PEER, cfg.pd_link_bps,
                                                           cfg.pd_link_latency_s, time.time(), "configured")
        self.planner = PDPlanner(link=link, kv_bytes_per_token=cfg.kv_bytes_per_token,
                                 explore_every=cfg.pd_explore_every)
        self._busy = {u: 0 for u in self.engines.urls}  # requests running on each engine

    # ---------------------------------------------------------------- app
    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._auth])
        for path in _PD_PATHS:
            app.router.add_post(path, self._handle)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/kvport/pd", self._pd_state)
        app.router.add_get("/kvport/route", self._route_state)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        token = self.cfg.auth_token
        if token:
            try:  # bytes: compare_digest refuses a str that is not ASCII
                given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                given = b""
            if not hmac.compare_digest(given, f"Bearer {token}".encode("utf-8", "surrogateescape")):
                return _error(401, "missing or wrong bearer token")
        resp: web.StreamResponse = await handler(request)
        return resp

    async def _start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        self.engines.start()
        self._poller = asyncio.create_task(self.engines.poll_load(self._session))

    async def _stop(self, app: web.Application) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await asyncio.to_thread(self.engines.stop)
        if self._session is not None:
            await self._session.close()

    def _count(self, path: str) -> None:
        self.counts[path] = self.counts.get(path, 0) + 1
        _REQUESTS.labels(path=path).inc()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("proxy not started")
        return self._session

    async def _probe(self, url: str) -> str:
        """``ok`` when the engine's /health answers 200, else why not."""
        try:
            async with self.session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=_PROBE_TIMEOUT_S)) as r:
                return "ok" if r.status == 200 else f"answered {r.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

    async def _health(self, request: web.Request) -> web.Response:
        states = dict(zip(self.engines.urls, await asyncio.gather(*(self._probe(u) for u in self.engines.urls)),
                          strict=True))
        if self.engine_urls:  # colocated: ok when every engine answers, degraded when some do
            engines = {u: states[u] for u in self.engine_urls}
            ok = [v == "ok" for v in engines.values()]
            status = "ok" if all(ok) else "degraded" if any(ok) else "down"
            return web.json_response({"status": status, "engines": engines}, status=503 if status == "down" else 200)
        prefill = {u: states[u] for u in self.prefill_urls}
        decode = {u: states[u] for u in self.decode_urls}
        up = ["ok" in prefill.values(), "ok" in decode.values()]
        status = "ok" if all(up) else "degraded" if any(up) else "down"
        return web.json_response({"status": status, "prefill": prefill, "decode": decode},
                                 status=503 if status == "down" else 200)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _pd_state(self, request: web.Request) -> web.Response:
        return web.json_response({"policy": self.cfg.pd_policy, "requests": dict(self.counts),
                                  "busy": dict(self._busy), **self.planner.snapshot()})

    async def _route_state(self, request: web.Request) -> web.Response:
        return web.json_response({"busy": dict(self._busy), **self.engines.state()})

    async def _models(self, request: web.Request) -> web.Response:
        why: list[str] = []
        for url in [*self.decode_urls, *self.prefill_urls, *self.engine_urls]:
            try:
                async with self.session.get(url + "/v1/models",
                                            timeout=aiohttp.ClientTimeout(total=_MODELS_TIMEOUT_S)) as r:
                    if r.status == 200:
                        return web.Response(body=await r.read(), content_type="application/json")
                    why.append(f"{url} answered {r.status}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                why.append(f"{url}: {type(exc).__name__}")
        return _error(502, f"no engine answered /v1/models: {'; '.join(why)}")

    # ---------------------------------------------------------------- one request
    async def _read_body(self, request: web.Request) -> dict[str, Any] | web.Response:
        """The client's JSON object, or the error answer: 408 (too slow), 413 (too large), 400."""
        # a body too large is not read: aiohttp reads and drops what the client still sends (for a
        # while), so the client reads the 413 instead of a reset
        too_large = _error(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            return too_large
        try:
            async with asyncio.timeout(self.cfg.body_timeout_s):
                data = await request.read()
        except TimeoutError:
            slow = _error(408, f"the body was not sent within {self.cfg.body_timeout_s:g} s")
            slow.force_close()
            return slow
        except web.HTTPRequestEntityTooLarge:
            return too_large
        except ConnectionError:  # the client left mid-body: aiohttp drops the answer quietly
            return _error(400, "the body was cut")
        try:
            body = json.loads(data)
        except RecursionError:
            return _error(400, f"the body nests deeper than {MAX_JSON_DEPTH} levels")
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            return _error(400, "the body must be a JSON object")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        if nested_deeper(body, MAX_JSON_DEPTH):
            return _error(400, f"the body nests deeper than {MAX_JSON_DEPTH} levels")
        return body

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            return body
        # the client left: aiohttp cancels this handler when its connection closes (or a write to it
        # fails first); the engine requests are closed on the way out, and nothing is recomputed
        clock = _Clock()
        try:
            resp = await self._pd(request, body, clock)
            clock.record()
            return resp
        except _ClientGone as gone:
            self._aborted(request)
            return gone.response  # aiohttp finds the connection closed and lets it go quietly
        except asyncio.CancelledError:
            self._aborted(request)
            raise

    def _aborted(self, request: web.Request) -> None:
        self._count("aborted")
        log.info("kvport proxy: the client disconnected; its request to %s is cancelled", request.path)

    async def _pd(self, request: web.Request, body: dict[str, Any], clock: _Clock) -> web.StreamResponse:
        path = request.path
        policy = request.headers.get(PD_HEADER, self.cfg.pd_policy).strip().lower()
        if policy not in PD_POLICIES:
            return _error(400, f"{PD_HEADER} is one of {', '.join(PD_POLICIES)}, got {policy[:40]!r}")
        t0 = time.monotonic()
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        # the prompt's tokens only when something uses them: the planner, or a choice its blocks can change
        useful = any(self.engines.useful(u) for u in (self.engine_urls, self.decode_urls, self.prefill_urls))
        ids = await self._prompt_ids(path, body, count=policy == "plan" or useful)
        tokens = len(ids) if ids is not None else None
        held = self.engines.held_hashes(ids, salt) if ids and useful else []  # hashed once, as far as held
        n = tokens or 0
        if self.engine_urls:
            return await self._colocated(request, path, body, n, held, t0, clock)
        # the decode engine first: the prefill streams the KV to its inbox
        picked = self._route("decode", self.decode_urls, n, held)
        if picked is None:  # no decode engine is up: a prefill engine computes the request
            return await self._fallback(request, path, body, n, held, {}, "no decode engine is up", clock)
        decode, route = picked
        inbox = self._inbox[decode]
        headers: dict[str, str] = {ROUTE_HEADER: f"{decode}; {route}",
                                   ROUTE_MS_HEADER: f"{(time.monotonic() - t0) * 1e3:.2f}"}
        action: Action
        if policy == "plan":
            action = self.planner.default
            if tokens is not None:
                d = self.planner.decide(tokens, prefill_queue=min(self._busy[u] for u in self.prefill_urls),
                                        decode_queue=self._busy[decode])
                action = d.action
                headers[PREDICTED_HEADER] = "; ".join(
                    f"{o.action.value}={o.seconds:.4f}" for o in d.options if o.seconds is not None) or "unknown"
        else:
            action = Action.STREAM if policy == "stream" else Action.RECOMPUTE
        handed = None
        url = None
        if action is Action.STREAM:
            pre = self._route("prefill", self.prefill_urls, n, held)
            url = None if pre is None else pre[0]
        if url is not None:
            idle = self._busy[url] == 0
            t0 = time.monotonic()
            handed = await self._prefill_step(url, path, body, inbox)
            clock.prefill_s += time.monotonic() - t0
            if handed is not None and idle and tokens is not None:
                self._observe(Curve.PREFILL, tokens, time.monotonic() - t0)
        decode_body = dict(body)
        if handed is not None:
            decode_body["kv_transfer_params"] = handed
        else:
            decode_body.pop("kv_transfer_params", None)
        taken = "pd" if handed is not None else "recompute" if action is Action.RECOMPUTE else "no_handoff"
        headers[PATH_HEADER] = "stream" if taken == "pd" else taken
        idle = self._busy[decode] == 0
        try:
            resp = await self._forward(request, decode, path, decode_body, headers, clock)
            self._count(taken)
            clock.path = taken
            first = clock.first_chunk_s
            if first is not None and idle and tokens is not None and taken in ("pd", "recompute"):
                self._observe(Curve.HANDOFF if taken == "pd" else Curve.DECODE, tokens, first)
            return resp
        except _Failed as exc:
            return await self._fallback(request, path, body, n, held, headers, f"decode engine failed: {exc}", clock)

    async def _fallback(self, request: web.Request, path: str, body: dict[str, Any], n: int, held: list[BlockHash],
                        headers: dict[str, str], why: str, clock: _Clock) -> web.StreamResponse:
        """No decode engine answered: a prefill engine (a vLLM engine like any other) computes the request."""
        log.warning("kvport proxy: %s before answering; a prefill engine computes the request", why)
        plain = dict(body)
        plain.pop("kv_transfer_params", None)
        headers[PATH_HEADER] = "fallback"
        try:
            back = self._route("prefill", self.prefill_urls, n, held)
            if back is None:
                raise _Failed("no prefill engine is up either")
            headers[ROUTE_HEADER] = f"{back[0]}; {back[1]}"
            resp = await self._forward(request, back[0], path, plain, headers, clock)
            self._count("fallback")
            clock.path = "fallback"
            return resp
        except _Failed as exc:
            self._count("failed")
            return _error(502, f"no engine could answer: {exc}")

    def _route(self, role: str, urls: Sequence[str], tokens: int, held: list[BlockHash]) -> tuple[str, str] | None:
        """The engine of ``role`` for this request, and why; None when none of them is up. One engine
        of a role is always taken (there is nothing to choose, and nothing to wait for)."""
        if len(urls) == 1:
            return urls[0], "only"
        got = self.engines.choose(role, urls, self._busy, tokens, held)
        return None if got is None else (got.engine, got.why)

    async def _colocated(self, request: web.Request, path: str, body: dict[str, Any], tokens: int,
                         held: list[BlockHash], t0: float, clock: _Clock) -> web.StreamResponse:
        """Whole requests, no PD: to the engine the route policy picks; another one when it fails
        before answering."""
        tried: list[str] = []
        for _ in range(min(2, len(self.engine_urls))):
            left = [u for u in self.engine_urls if u not in tried]
            picked = self._route("engine", left, tokens, held)
            if picked is None:
                break
            url, why = picked
            tried.append(url)
            headers = {ROUTE_HEADER: f"{url}; {why}", ROUTE_MS_HEADER: f"{(time.monotonic() - t0) * 1e3:.2f}"}
            try:
                resp = await self._forward(request, url, path, body, headers, clock)
                self._count("routed")
                clock.path = "routed"
                return resp
            except _Failed as exc:
                log.warning("kvport proxy: %s failed before answering (%s); another engine takes the request", url, exc)
        self._count("failed")
        return _error(503 if not tried else 502, "no engine could answer" if tried else
                      f"no engine is up (none has answered its /metrics within {self.cfg.route_stale_s:g} s)")

    def _observe(self, curve: Curve, tokens: int, seconds: float) -> None:
        try:
            self.planner.observe(curve, tokens, seconds)
        except KVPortError as exc:  # an impossible time: not learned from
            log.debug("kvport proxy: observation not used: %s", exc)

    async def _prompt_ids(self, path: str, body: dict[str, Any], *, count: bool) -> list[int] | None:
        """The prompt's token ids: a completion prompt of token ids as it is; otherwise, when ``count``,
        from an engine's ``/tokenize`` (its own tokenizer and chat template: the ids it will hash its
        blocks from). None when they cannot be known (the planner then takes its default, the router
        matches nothing)."""
        prompt = body.get("prompt")
        if path == "/v1/completions" and isinstance(prompt, list) and 0 < len(prompt) <= MAX_PROMPT_IDS \
                and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        if not count:
            return None
        if path == "/v1/completions":
            if not isinstance(prompt, str):
                return None  # a batch of prompts: one decision cannot cover them
            ask: dict[str, Any] = {"prompt": prompt}
        else:
            ask = {k: body[k] for k in ("messages", "add_generation_prompt", "continue_final_message",
                                        "chat_template", "chat_template_kwargs", "tools") if k in body}
            if not isinstance(ask.get("messages"), list):
                return None
        if isinstance(body.get("model"), str):
            ask["model"] = body["model"]
        urls = self.decode_urls or self.engine_urls
        up = [u for u in urls if self.engines.up.get(u, True)] or urls
        self._tokenized += 1
        url = up[self._tokenized % len(up)]  # in turn: no one engine tokenizes for all
        try:
            async with self.session.post(url + "/tokenize", json=ask,
                                         timeout=aiohttp.ClientTimeout(total=_TOKENIZE_TIMEOUT_S)) as r:
                got = await r.json() if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, ValueError) as exc:
            log.warning("kvport proxy: %s/tokenize failed (%s); the planner takes its default", url, exc)
            return None
        ids = got.get("tokens") if isinstance(got, dict) else None
        if not isinstance(ids, list) or not 0 < len(ids) <= MAX_PROMPT_IDS \
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return None
        return ids

    async def _prefill_step(self, engine: str, path: str, body: dict[str, Any], inbox: str | None) \
            -> dict[str, Any] | None:
        """Step 1: the prompt computed on prefill engine ``engine`` (streaming its KV to ``inbox`` when
        given); its hand-off, or None when it failed. The answer's ``kv_transfer_params`` go to the decode
        engine as sent: it is the one that reads them (:meth:`~kvport.engines.vllm.params.HandoffAnswer.parse`),
        counts what is wrong with them and recomputes, and a proxy older or newer than the engines
        passes on fields it does not know."""
        pre = prefill_body(body, inbox)
        url = engine + path
        self._busy[engine] += 1
        try:
            async with self.session.post(url, json=pre,
                                         timeout=aiohttp.ClientTimeout(total=self.cfg.prefill_timeout_s)) as r:
                if r.status != 200:
                    raise _Failed(f"{url} answered {r.status}: {(await r.text())[:200]}")
                answer = await r.json()
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, _Failed) as exc:
            log.warning("kvport proxy: prefill failed (%s: %s); the decode engine computes the prompt",
                        type(exc).__name__, exc)
            return None
        finally:
            self._busy[engine] -= 1
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        return params if isinstance(params, dict) else None

    async def _forward(self, request: web.Request, engine: str, path: str, body: dict[str, Any],
                       headers: dict[str, str], clock: _Clock) -> web.StreamResponse:
        """POST ``body`` to ``engine``'s ``path`` and relay the answer (streamed as it comes), with
        ``headers`` added; ``clock`` gets the time awaiting the engine and when the first byte went out.
        _Failed when nothing was sent to the client yet; an error event ends a stream that broke midway."""
        self._busy[engine] += 1
        try:
            return await self._relay(request, engine + path, body, headers, clock)
        finally:
            self._busy[engine] -= 1

    async def _relay(self, request: web.Request, url: str, body: dict[str, Any], headers: dict[str, str],
                     clock: _Clock) -> web.StreamResponse:
        t0 = time.monotonic()
        try:
            upstream = await self.session.post(url, json=body,
                                               timeout=aiohttp.ClientTimeout(total=self.cfg.decode_timeout_s))
        except (aiohttp.ClientError, TimeoutError) as exc:
            clock.answer_s += time.monotonic() - t0
            raise _Failed(f"{url}: {type(exc).__name__}: {exc}") from None
        async with upstream:
            if upstream.status >= 500:
                clock.answer_s += time.monotonic() - t0
                raise _Failed(f"{url} answered {upstream.status}")
            ctype = upstream.headers.get("Content-Type", "application/json")
            if not body.get("stream"):
                try:
                    data = await upstream.read()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    clock.answer_s += time.monotonic() - t0
                    raise _Failed(f"{url}: answer cut: {exc}") from None
                clock.answer_s += time.monotonic() - t0
                clock.first_byte = time.monotonic()  # aiohttp writes it on return: the proxy's work is done
                return web.Response(status=upstream.status, body=data, headers={"Content-Type": ctype, **headers})
            out = web.StreamResponse(status=upstream.status, headers={"Content-Type": ctype,
                                                                      "Cache-Control": "no-cache", **headers})
            chunks = upstream.content.iter_any()
            started = False
            while True:
                try:  # the engine's side: an error here is the engine's
                    chunk = await anext(chunks, None)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    if not started:
                        clock.answer_s += time.monotonic() - t0
                        raise _Failed(f"{url}: stream cut before its first byte: {exc}") from None
                    msg = json.dumps({"error": {"message": f"decode engine stream broke: {exc}",
                                                "type": "kvport_proxy"}})
                    await _send(out, request, f"data: {msg}\n\n".encode())
                    self._count("failed")
                    break
                if chunk is None:
                    break
                if not started:
                    clock.first_chunk_s = time.monotonic() - t0
                    clock.answer_s += clock.first_chunk_s
                await _send(out, request, chunk)  # the client's side: an error here is the client's
                if not started:
                    clock.first_byte = time.monotonic()
                started = True
            await _send(out, request, b"")
            try:
                await out.write_eof()
            except ConnectionError:
                raise _ClientGone(out) from None
            return out


async def _send(out: web.StreamResponse, request: web.Request, data: bytes) -> None:
    """Write ``data`` to the client (the head first); _ClientGone when its connection is closed."""
    try:
        if not out.prepared:
            await out.prepare(request)
        if data:
            await out.write(data)
    except ConnectionError:  # aiohttp's "cannot write to closing transport"
        raise _ClientGone(out) from None


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "kvport_proxy", "code": status}}, status=status)


async def start_proxy(proxy: PDProxy) -> web.AppRunner:
    """Listen on ``proxy.cfg``'s host and port (``runner.addresses`` has the port); ``runner.cleanup()`` stops.

    aiohttp's keep-alive timer is the head deadline: it closes a connection that has not sent a
    whole request head ``header_timeout_s`` after its opening or its previous answer. Handlers are
    cancelled when their client's connection closes (handler_cancellation), which closes the engine
    requests they hold."""
    cfg = proxy.cfg
    runner = web.AppRunner(proxy.app(), access_log=None, handler_cancellation=True,
                           keepalive_timeout=cfg.header_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    return runner


async def serve_proxy(cfg: ProxyConfig, ready: asyncio.Event | None = None) -> None:
    """Run the proxy until cancelled."""
    runner = await start_proxy(PDProxy(cfg))
    log.info("kvport proxy on %s:%d: prefill %s, decode %s", cfg.host, cfg.port, list(cfg.prefill), list(cfg.decode))
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
