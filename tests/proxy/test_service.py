"""``kvport proxy`` (kvport.proxy.service) against stand-in engines on 127.0.0.1: what it asks the
prefill engine, what it answers on /health, /metrics and /v1/models, how it bounds a client (head and
body deadlines, size, nesting, a token that is not ASCII), and a client that disconnects (the engine
requests closed at once, nothing recomputed, no traceback) -- issue 25, defects 9 and 11."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvport import metrics
from kvport.proxy.service import (
    MAX_BODY_BYTES,
    MAX_JSON_DEPTH,
    PDProxy,
    ProxyConfig,
    start_proxy,
)

HANG_S = 30.0  # a guard against a hang, never a measurement
HANDOFF = {"kvport": "a hand-off"}
Handler = Callable[["Engine", web.Request], Awaitable[web.StreamResponse]]


async def _answer(engine: Engine, request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body.get("kv_transfer_params", {}).get("do_remote_decode"):
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": HANDOFF})
    return web.json_response({"choices": [{"text": f"from {engine.name}"}]})


@dataclass
class Engine:
    """A stand-in vLLM engine: /health, /v1/models and a completions handler that records every body."""

    name: str
    handler: Handler = _answer
    bodies: list[dict[str, Any]] = field(default_factory=list)
    received: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # a request's connection closed under it
    port: int = 0
    tokenize_count: int | None = None  # answer /tokenize with this count (vLLM's route), else no such route
    tokenized: list[dict[str, Any]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.received.set()
        try:
            return await self.handler(self, request)
        except (asyncio.CancelledError, ConnectionError):
            self.closed.set()
            raise

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": f"model-of-{self.name}"}]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        self.tokenized.append(await request.json())
        return web.json_response({"count": self.tokenize_count, "tokens": list(range(self.tokenize_count or 0))})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        if self.tokenize_count is not None:
            app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/health", self._health)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Engine]:
        app = web.Application()
        self.routes(app)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.port = runner.addresses[0][1]
        try:
            yield self
        finally:
            await runner.cleanup()


def closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return int(s.getsockname()[1])


@asynccontextmanager
async def proxy(prefill: list[str], decode: list[str], **kw: Any) -> AsyncIterator[tuple[PDProxy, str]]:
    p = PDProxy(ProxyConfig(prefill=prefill, decode=decode, port=0, **kw))
    runner = await start_proxy(p)
    try:
        yield p, f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def deployment(decode_handler: Handler = _answer, **kw: Any) -> AsyncIterator[tuple[PDProxy, str, Engine,
                                                                                           Engine]]:
    async with Engine("prefill").running() as pre, Engine("decode", decode_handler).running() as dec, \
            proxy([pre.url], [dec.url], **kw) as (p, url):
        yield p, url, pre, dec


async def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, data=json.dumps(body), headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.text()


async def until(cond: Callable[[], bool]) -> None:
    async with asyncio.timeout(HANG_S):
        while not cond():
            await asyncio.sleep(0.01)


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def head(path: str, port: int, extra: str = "", length: int | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n" + extra).encode()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# ------------------------------------------------------------------ the prefill request (defect 9)
def test_the_prefill_request_is_the_prompt_only_and_the_decode_request_the_client_s() -> None:
    client = {"model": "m", "prompt": "hello", "max_tokens": 16, "n": 3, "best_of": 4, "prompt_logprobs": 2,
              "min_tokens": 5, "echo": True, "logprobs": 2, "use_beam_search": True, "temperature": 0.5,
              "stream": False, "stream_options": {"include_usage": True}}

    async def go() -> None:
        async with deployment() as (p, url, pre, dec):
            status, answer = await post(url + "/v1/completions", client)
            assert (status, answer["choices"][0]["text"]) == (200, "from decode")
            assert pre.bodies == [{"model": "m", "prompt": "hello", "max_tokens": 1, "n": 1, "temperature": 0.5,
                                   "stream": False, "kv_transfer_params": {"do_remote_decode": True}}]
            assert dec.bodies == [{**client, "kv_transfer_params": HANDOFF}]
            assert p.counts == {"pd": 1}
            # /metrics: the proxy's counters in Prometheus text
            status, text = await get(url + "/metrics")
            assert status == 200 and 'kvport_pd_proxy_requests_total{path="pd"}' in text
    run(go())


def test_the_proxy_s_own_time_is_measured_apart_from_the_engines() -> None:
    """What kvport's proxy adds to a request is its own histogram; the time awaiting the engines (here
    at least their sleeps) is counted apart, so a benchmark can tell the two."""
    async def slow_prefill(engine: Engine, request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.3)
        return await _answer(engine, request)

    async def slow_stream(engine: Engine, request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.2)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        await out.write(b"data: [DONE]\n\n")
        return out

    def read() -> dict[str, float]:
        return {"own": metrics.sample("pd_proxy_own_seconds_count", {"path": "pd"}) or 0.0,
                "own_s": metrics.sample("pd_proxy_own_seconds_sum", {"path": "pd"}) or 0.0,
                "prefill": metrics.sample("pd_proxy_engine_wait_seconds_total", {"role": "prefill"}) or 0.0,
                "answer": metrics.sample("pd_proxy_engine_wait_seconds_total", {"role": "answer"}) or 0.0}

    async def go() -> None:
        async with Engine("prefill", slow_prefill).running() as pre, Engine("decode", slow_stream).running() as dec, \
                proxy([pre.url], [dec.url]) as (_, url):
            before = read()
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions",
                                                            json={"prompt": "hi", "stream": True}) as r:
                assert r.status == 200 and b'"a"' in await r.read()
            after = read()
            d = {k: after[k] - before[k] for k in after}
            assert d["own"] == 1 and d["own_s"] >= 0  # one answered request timed
            assert d["prefill"] >= 0.3 and d["answer"] >= 0.2  # the engines' sleeps are theirs, not the proxy's
            # a request no engine answers is not timed
            async with Engine("dead", slow_prefill).running() as gone:
                url_gone = gone.url
            async with proxy([url_gone], [url_gone]) as (_, url2):
                status, _ = await post(url2 + "/v1/completions", {"prompt": "hi"})
                assert status == 502
            assert read()["own"] == after["own"]
    run(go())


def test_a_decode_engine_that_fails_before_answering_is_replaced_by_a_prefill_engine() -> None:
    async def refuse(engine: Engine, request: web.Request) -> web.StreamResponse:
        return web.Response(status=503)

    async def go() -> None:
        async with deployment(refuse) as (p, url, pre, _):
            status, answer = await post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 4})
            assert (status, answer["choices"][0]["text"]) == (200, "from prefill")
            assert pre.bodies[1] == {"prompt": "hi", "max_tokens": 4} and p.counts == {"fallback": 1}
    run(go())


def test_a_decode_stream_that_breaks_midway_ends_with_an_error_event() -> None:
    async def one_chunk_then_die(engine: Engine, request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        assert request.transport is not None
        request.transport.abort()
        return out

    async def go() -> None:
        async with deployment(one_chunk_then_die) as (p, url, pre, _), aiohttp.ClientSession() as s, \
                s.post(url + "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
            text = (await r.read()).decode()
            assert r.status == 200 and text.startswith('data: {"choices"') and "stream broke" in text
            assert p.counts == {"failed": 1, "pd": 1} and len(pre.bodies) == 1
    run(go())


# ------------------------------------------------------------------ /health, /v1/models (defect 11)
def test_health_reports_the_engines() -> None:
    async def go() -> None:
        async with Engine("prefill").running() as pre, Engine("decode").running() as dec:
            down = f"http://127.0.0.1:{closed_port()}"
            for prefill, decode, code, status in [([pre.url], [dec.url], 200, "ok"),
                                                  ([pre.url], [down], 200, "degraded"),
                                                  ([down], [dec.url, down], 200, "degraded"),
                                                  ([down], [down], 503, "down")]:
                async with proxy(prefill, decode) as (_, url):
                    got, text = await get(url + "/health")
                    report = json.loads(text)
                    assert (got, report["status"]) == (code, status)
                    for role, urls in (("prefill", prefill), ("decode", decode)):
                        assert set(report[role]) == set(urls)
                        assert all((state == "ok") == (u != down) for u, state in report[role].items())
    run(go())


def test_models_asks_any_engine_that_answers() -> None:
    async def go() -> None:
        async with Engine("prefill").running() as pre, Engine("decode").running() as dec:
            down = f"http://127.0.0.1:{closed_port()}"
            async with proxy([pre.url], [down]) as (_, url):
                status, text = await get(url + "/v1/models")
                assert (status, json.loads(text)["data"][0]["id"]) == (200, "model-of-prefill")
            async with proxy([pre.url], [dec.url]) as (_, url):
                status, text = await get(url + "/v1/models")
                assert (status, json.loads(text)["data"][0]["id"]) == (200, "model-of-decode")
            async with proxy([down], [down]) as (_, url):
                status, text = await get(url + "/v1/models")
                assert status == 502 and "no engine answered" in text
    run(go())


# ------------------------------------------------------------------ bounding a client
def test_a_client_that_does_not_finish_its_head_is_disconnected_before_authentication() -> None:
    async def go() -> None:
        async with deployment(auth_token="a-long-token", header_timeout_s=0.2) as (_, url, pre, dec):
            reader, writer = await asyncio.open_connection("127.0.0.1", port_of(url))
            writer.write(head("/v1/completions", port_of(url)))  # no blank line: the head never ends
            await writer.drain()
            async with asyncio.timeout(HANG_S):
                assert await reader.read() == b""  # closed, nothing answered
            writer.close()
            assert not pre.bodies and not dec.bodies
    run(go())


def test_a_client_that_does_not_finish_its_body_gets_408() -> None:
    async def go() -> None:
        async with deployment(body_timeout_s=0.2) as (_, url, pre, dec):
            reader, writer = await asyncio.open_connection("127.0.0.1", port_of(url))
            writer.write(head("/v1/completions", port_of(url), "\r\n" + '{"prompt": "hel', length=100))
            await writer.drain()
            async with asyncio.timeout(HANG_S):
                answer = await reader.read()  # the answer, then the connection closes
            writer.close()
            assert answer.startswith(b"HTTP/1.1 408") and not pre.bodies and not dec.bodies
    run(go())


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_cap_gets_413(chunked: bool) -> None:
    data = b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + (1 << 20)) + b'"}'

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(data), 1 << 20):
            yield data[i:i + (1 << 20)]

    async def go() -> None:
        async with deployment() as (_, url, pre, dec), aiohttp.ClientSession() as s, \
                s.post(url + "/v1/completions", data=pieces() if chunked else data) as r:
            assert r.status == 413 and "larger than" in (await r.json())["error"]["message"]
            assert not pre.bodies and not dec.bodies
    run(go())


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
def test_a_body_nested_too_deep_gets_400_in_one_line(depth: int) -> None:
    async def go() -> None:
        async with deployment() as (_, url, pre, dec), aiohttp.ClientSession() as s, \
                s.post(url + "/v1/completions", data='{"prompt": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}") as r:
            message = (await r.json())["error"]["message"]
            assert r.status == 400 and "nests deeper" in message and "\n" not in message
            assert not pre.bodies and not dec.bodies
    run(go())


def test_an_authorization_that_is_not_ascii_gets_401() -> None:
    async def go() -> None:
        async with deployment(auth_token="a-long-token") as (_, url, _pre, dec):
            for auth, code in [("Bearer \u00e9\u00e9", 401), ("Bearer wrong-token", 401), ("", 401),
                               ("Bearer a-long-token", 200)]:
                reader, writer = await asyncio.open_connection("127.0.0.1", port_of(url))
                body = b'{"prompt": "hi"}'
                line = f"Authorization: {auth}\r\n" if auth else ""
                writer.write(head("/v1/completions", port_of(url), f"{line}Connection: close\r\n\r\n",
                                  length=len(body)) + body)  # UTF-8 bytes in the header
                async with asyncio.timeout(HANG_S):
                    answer = await reader.read()
                writer.close()
                assert answer.startswith(f"HTTP/1.1 {code}".encode()), (auth, answer[:200])
            assert len(dec.bodies) == 1
    run(go())


# ------------------------------------------------------------------ a client that disconnects
async def _quiet(engine: Engine, request: web.Request) -> web.StreamResponse:
    """Answers nothing, ever (an engine that went quiet)."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _one_chunk_then_quiet(engine: Engine, request: web.Request) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    await out.write(b'data: {"choices": [{"text": "a"}]}\n\n')
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _chatty(engine: Engine, request: web.Request) -> web.StreamResponse:
    """Streams a chunk every few milliseconds until its reader goes away."""
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    async with asyncio.timeout(HANG_S):
        while True:
            await out.write(b'data: {"choices": [{"text": "a"}]}\n\n')
            await asyncio.sleep(0.005)


@pytest.mark.parametrize(("stream", "handler"), [(False, _quiet), (True, _quiet), (True, _one_chunk_then_quiet),
                                                 (True, _chatty)])
def test_a_client_that_disconnects_cancels_its_request(stream: bool, handler: Handler,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def go() -> None:
        async with deployment(handler) as (p, url, pre, dec):
            reader, writer = await asyncio.open_connection("127.0.0.1", port_of(url))
            body = json.dumps({"prompt": "hi", "max_tokens": 64, "stream": stream}).encode()
            writer.write(head("/v1/completions", port_of(url), "\r\n", length=len(body)) + body)
            await writer.drain()
            async with asyncio.timeout(HANG_S):
                await dec.received.wait()
                if handler is not _quiet:
                    assert (await reader.readuntil(b"\n\n")).startswith(b"HTTP/1.1 200")
            writer.close()
            async with asyncio.timeout(HANG_S):  # the decode request is closed, not left to --decode-timeout
                await dec.closed.wait()
            await until(lambda: "aborted" in p.counts)
            assert p.counts == {"aborted": 1} and len(pre.bodies) == 1  # the prefill step only: no fallback
    run(go())
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]


# ------------------------------------------------------------------ stream or recompute, per request (issue 28)
def _tokens(body: dict[str, Any]) -> int:
    p = body.get("prompt", body.get("messages"))
    return len(p) if isinstance(p, list) else len(str(p).split())


def timed(per_token_s: float, fixed_s: float, handoff_s: float | None = None) -> Handler:
    """A stand-in engine that takes ``fixed_s + per_token_s x tokens`` to its first streamed chunk
    (``handoff_s`` instead when the request names a hand-off), or answers a prefill request after
    that long. The sleeps stand in for compute; the margins between the engines are 4x or more."""
    async def handle(engine: Engine, request: web.Request) -> web.StreamResponse:
        body = engine.bodies[-1]
        handed = "kv_transfer_params" in body and not body["kv_transfer_params"].get("do_remote_decode")
        await asyncio.sleep(handoff_s if handed and handoff_s is not None else fixed_s + per_token_s * _tokens(body))
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": HANDOFF})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(f'data: {{"choices": [{{"text": "{engine.name}"}}]}}\n\ndata: [DONE]\n\n'.encode())
        return out
    return handle


async def stream_post(url: str, body: dict[str, Any], policy: str | None = None) -> tuple[int, str, dict[str, str]]:
    headers = {} if policy is None else {"X-KVport-PD": policy}
    async with aiohttp.ClientSession() as s, s.post(url, json={**body, "stream": True}, headers=headers) as r:
        return r.status, (await r.read()).decode(), dict(r.headers)


@asynccontextmanager
async def pd_deployment(**kw: Any) -> AsyncIterator[tuple[PDProxy, str, Engine, Engine]]:
    """A prefill engine 0.2 ms a token, a decode engine computing 2 ms a token, a 60 ms hand-off."""
    async with Engine("prefill", timed(0.0002, 0.005)).running() as pre, \
            Engine("decode", timed(0.002, 0.005, handoff_s=0.06)).running() as dec, \
            proxy([pre.url], [dec.url], **kw) as (p, url):
        yield p, url, pre, dec


def test_a_request_s_header_chooses_stream_or_recompute_and_the_answer_says_which() -> None:
    async def go() -> None:
        async with pd_deployment() as (p, url, pre, dec):
            body = {"prompt": [1, 2, 3, 4], "max_tokens": 2}
            status, text, headers = await stream_post(url + "/v1/completions", body, "recompute")
            assert (status, headers["X-KVport-PD-Path"]) == (200, "recompute") and "decode" in text
            assert pre.bodies == [] and "kv_transfer_params" not in dec.bodies[0]  # the decode engine computes
            status, _, headers = await stream_post(url + "/v1/completions", body, "stream")
            assert headers["X-KVport-PD-Path"] == "stream" and dec.bodies[1]["kv_transfer_params"] == HANDOFF
            assert p.counts == {"recompute": 1, "pd": 1}
            status, text, _ = await stream_post(url + "/v1/completions", body, "sideways")
            assert status == 400 and "X-KVport-PD" in text and len(dec.bodies) == 2
            # what the proxy timed went to the planner: one point per curve, at the prompt's 4 tokens
            curves = p.planner.snapshot()["curves"]
            assert [[pt[0] for pt in curves[c]["points"]] for c in ("prefill", "handoff", "decode")] == [[4]] * 3
    run(go())


def test_the_planner_recomputes_short_prompts_and_streams_long_ones_as_it_learned() -> None:
    async def go() -> None:
        async with pd_deployment(pd_policy="plan", pd_explore_every=0) as (_, url, _pre, _dec):
            for n in (10, 100, 300):  # calibration: each path forced, three lengths
                for policy in ("stream", "recompute"):
                    await stream_post(url + "/v1/completions", {"prompt": list(range(n))}, policy)
            # stream(n) ~ 0.005 + 0.0002 n + 0.06, recompute(n) ~ 0.005 + 0.002 n: they cross near 33 tokens
            _, _, short = await stream_post(url + "/v1/completions", {"prompt": list(range(5))})
            _, _, long = await stream_post(url + "/v1/completions", {"prompt": list(range(400))})
            assert short["X-KVport-PD-Path"] == "recompute" and long["X-KVport-PD-Path"] == "stream"
            assert "recompute=" in long["X-KVport-PD-Predicted"] and "stream=" in long["X-KVport-PD-Predicted"]
            status, state = await get(url + "/kvport/pd")
            got = json.loads(state)
            assert status == 200 and got["policy"] == "plan" and 5 < got["crossover_tokens"][0] < 150
            assert got["decisions"] == {"recompute:model": 1, "stream:model": 1}
    run(go())


def test_the_planner_counts_a_text_prompt_with_the_decode_engine_s_tokenizer() -> None:
    async def go() -> None:
        async with Engine("prefill", timed(0.0002, 0.005)).running() as pre, \
                Engine("decode", timed(0.002, 0.005, handoff_s=0.06), tokenize_count=7).running() as dec, \
                proxy([pre.url], [dec.url], pd_policy="plan") as (p, url):
            _, _, headers = await stream_post(url + "/v1/completions", {"prompt": "a b c", "model": "m"})
            assert dec.tokenized == [{"prompt": "a b c", "model": "m"}]  # asked once, with the client's model
            assert headers["X-KVport-PD-Path"] == "stream"  # nothing learned yet: the default
            assert [pt[0] for pt in p.planner.snapshot()["curves"]["prefill"]["points"]] == [7]
            msgs = [{"role": "user", "content": "hi"}]
            status, _, _ = await stream_post(url + "/v1/chat/completions",
                                             {"messages": msgs, "add_generation_prompt": True})
            assert status == 200 and dec.tokenized[1] == {"messages": msgs, "add_generation_prompt": True}
            # a batch of prompts: one decision cannot cover them, so the planner is not asked
            assert await p._prompt_ids("/v1/completions", {"prompt": [[1, 2], [3]]}, count=True) is None
        # an engine without /tokenize: the count is unknown, the planner's default, no error
        async with pd_deployment(pd_policy="plan") as (p, url, pre, dec):
            status, _, headers = await stream_post(url + "/v1/completions", {"prompt": "a b c"})
            assert (status, headers["X-KVport-PD-Path"]) == (200, "stream") and p.planner.counts == {}
    run(go())
