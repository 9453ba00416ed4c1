"""``kvport proxy --route`` (kvport.proxy.routing) with stand-in engines on 127.0.0.1 that serve
/metrics and /tokenize, and a real ZeroMQ publisher (kvport's, in vLLM's format) saying which engine
holds which of vLLM's block hashes: prefix routing sends a request where its prefix is, least-loaded
and round-robin do what they say, an engine that stops answering gets nothing, a publisher that
restarts is forgotten, and the PD roles route the same way (issue 29)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

pytest.importorskip("zmq")

from kvport.events.bus import EventPublisher
from kvport.events.wire import AllBlocksCleared, BlockStored
from kvport.proxy.routing import EventSource, load_of
from kvport.proxy.service import ROUTE_HEADER, PDProxy, ProxyConfig, start_proxy
from kvport.route.vllm_hash import block_hashes

from .test_service import Engine, run, until

BS = 16
PROMPT = list(range(100, 100 + 5 * BS + 3))  # 5 full blocks


class Loaded(Engine):
    """A stand-in engine with vLLM's load gauges on /metrics (``load``: running + waiting)."""

    load: int = 0
    metrics_status: int = 200

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics_status == 0:  # gone: the connection drops without an answer
            assert request.transport is not None
            request.transport.close()
            raise asyncio.CancelledError
        if self.metrics_status != 200:
            return web.Response(status=self.metrics_status)
        return web.Response(text=f'vllm:num_requests_running{{engine="0",model_name="m"}} {self.load}.0\n'
                                 f'vllm:num_requests_waiting{{engine="0",model_name="m"}} 0.0\n')

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_post("/tokenize", self._tokenize)  # always: vLLM's, counting tokenize_count (or none)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)


def holds(tokens: list[int], n_blocks: int, salt: str | None = None) -> BlockStored:
    hashes = block_hashes(tokens, BS, cache_salt=salt)[:n_blocks]
    return BlockStored(tuple(hashes), None, tuple(tokens[: n_blocks * BS]), BS)


@asynccontextmanager
async def routed(tmp: Path, n: int = 2, **kw: Any) -> AsyncIterator[tuple[PDProxy, str, list[Loaded],
                                                                           list[EventPublisher]]]:
    engines = [Loaded(f"e{i}") for i in range(n)]
    pubs = [EventPublisher(f"ipc://{tmp}/ev{i}", f"ipc://{tmp}/ev{i}-replay") for i in range(n)]
    try:
        async with _running(engines) as urls:
            events = [f"{u}={p.endpoint},{p.replay_endpoint}" for u, p in zip(urls, pubs, strict=True)]
            p = PDProxy(ProxyConfig(prefill=(), decode=(), engines=urls, port=0, kv_events=events, load_poll_s=0.05,
                                    **kw))
            runner = await start_proxy(p)
            try:
                yield p, f"http://127.0.0.1:{runner.addresses[0][1]}", engines, pubs
            finally:
                await runner.cleanup()
    finally:
        for pub in pubs:
            pub.close()


@asynccontextmanager
async def _running(engines: list[Loaded]) -> AsyncIterator[list[str]]:
    if not engines:
        yield []
        return
    async with engines[0].running(), _running(engines[1:]) as rest:
        yield [engines[0].url, *rest]


async def ask(url: str, body: dict[str, Any]) -> str:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", data=json.dumps(body)) as r:
        assert r.status == 200, await r.text()
        return r.headers[ROUTE_HEADER]


async def publish_until_heard(p: PDProxy, pub: EventPublisher, url: str, event: Any, blocks: int) -> None:
    """Publish (again, until the proxy's subscription has joined: PUB drops what is sent before)."""
    async with asyncio.timeout(30):
        while p.engines.index.size(url) != blocks:
            pub.publish([event])
            await asyncio.sleep(0.05)


def test_prefix_routing_sends_a_request_where_its_prefix_is(tmp_path: Path) -> None:
    async def go() -> None:
        async with routed(tmp_path, route="prefix") as (p, url, (e0, e1), (_, pub1)):
            await until(lambda: len(p.engines.polled) == 2)
            await publish_until_heard(p, pub1, e1.url, holds(PROMPT, 4), 4)
            assert p.engines.block_size == BS  # learned from the events
            for _ in range(3):  # every time, not by turn
                assert (await ask(url, {"prompt": PROMPT, "max_tokens": 1})).startswith(f"{e1.url}; prefix")
            # another salt is another prefix: nobody holds it, the least loaded gets it
            e1.load = 5
            await until(lambda: p.engines.load[e1.url] == 5)
            assert (await ask(url, {"prompt": PROMPT, "cache_salt": "s"})).startswith(f"{e0.url}; least_loaded")
            # held, but its engine is much busier: the predicted TTFT weighs both
            e1.load = 50
            await until(lambda: p.engines.load[e1.url] == 50)
            assert (await ask(url, {"prompt": PROMPT})).startswith(e0.url)
            # a text prompt: counted by the engine's /tokenize (the stand-in answers 0..n-1)
            e0.tokenize_count, e1.tokenize_count, e1.load = 2 * BS, 2 * BS, 0
            await publish_until_heard(p, pub1, e1.url, holds(list(range(2 * BS)), 2), 6)
            await until(lambda: p.engines.load[e1.url] == 0)
            assert (await ask(url, {"prompt": "some text"})).startswith(f"{e1.url}; prefix")
            # the engine cleared its cache: it holds nothing now
            pub1.publish([AllBlocksCleared()])
            await until(lambda: p.engines.index.size(e1.url) == 0)
            assert "least_loaded" in await ask(url, {"prompt": PROMPT})
            state = p.engines.state()
            assert state["decisions"]["prefix"] >= 4 and state["engines"][e1.url]["events"] is True
    run(go())


def test_least_loaded_and_round_robin(tmp_path: Path) -> None:
    async def go() -> None:
        async with routed(tmp_path, route="least_loaded") as (p, url, (e0, e1), _):
            e0.load = 3
            await until(lambda: p.engines.load[e0.url] == 3)
            assert {(await ask(url, {"prompt": PROMPT})).split(";")[0] for _ in range(4)} == {e1.url}
        async with routed(tmp_path, route="round_robin") as (p, url, (e0, e1), _):
            got = [(await ask(url, {"prompt": PROMPT})).split(";")[0] for _ in range(4)]
            assert sorted(got) == sorted([e0.url, e1.url] * 2) and got[0] != got[1]
    run(go())


def test_an_engine_that_stops_answering_gets_nothing_and_comes_back(tmp_path: Path) -> None:
    async def go() -> None:
        async with routed(tmp_path, route="prefix") as (p, url, (e0, e1), (_, pub1)):
            await publish_until_heard(p, pub1, e1.url, holds(PROMPT, 4), 4)
            e1.metrics_status = 404  # an answer, though not vLLM's: alive (no load known), still chosen
            await asyncio.sleep(0.2)
            assert p.engines.up[e1.url] and (await ask(url, {"prompt": PROMPT})).startswith(f"{e1.url}; prefix")
            e1.metrics_status = 0  # no answer at all: down for routing, though it holds the prefix
            await until(lambda: not p.engines.up[e1.url])
            for _ in range(3):
                assert (await ask(url, {"prompt": PROMPT})).startswith(e0.url)
            e1.metrics_status = 200
            await until(lambda: p.engines.up[e1.url])
            assert (await ask(url, {"prompt": PROMPT})).startswith(f"{e1.url}; prefix")
        # every engine silent past the staleness timeout: 503, no engine asked
        async with routed(tmp_path, route="round_robin", route_stale_s=1.0) as (p, url, engines, _):
            for e in engines:
                e.metrics_status = 0
            await asyncio.sleep(1.5)
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={"prompt": PROMPT}) as r:
                assert r.status == 503 and "no engine is up" in (await r.json())["error"]["message"]
            assert all(not e.bodies for e in engines)
    run(go())


def test_a_restarted_publisher_is_forgotten_and_relearned(tmp_path: Path) -> None:
    async def go() -> None:
        async with routed(tmp_path, route="prefix") as (p, _url, (_, e1), pubs):
            for _ in range(3):
                await publish_until_heard(p, pubs[1], e1.url, holds(PROMPT, 4), 4)
            pubs[1].publish([holds(PROMPT, 5)])
            await until(lambda: p.engines.index.size(e1.url) == 5)
            pubs[1].close()  # the engine restarts: a new publisher on the same endpoints, sequence from 0
            pubs[1] = EventPublisher(f"ipc://{tmp_path}/ev1", f"ipc://{tmp_path}/ev1-replay")
            await publish_until_heard(p, pubs[1], e1.url, holds(PROMPT, 2), 2)
            assert p.engines.index.size(e1.url) == 2  # the old five are gone with the old process
    run(go())


def test_pd_roles_are_routed_too(tmp_path: Path) -> None:
    async def go() -> None:
        pre, dec0, dec1 = Loaded("prefill"), Loaded("d0"), Loaded("d1")
        pub = EventPublisher(f"ipc://{tmp_path}/d1", f"ipc://{tmp_path}/d1-replay")
        try:
            async with _running([pre, dec0, dec1]) as (pu, d0, d1):
                p = PDProxy(ProxyConfig(prefill=[pu], decode=[d0, d1], port=0, route="prefix", load_poll_s=0.05,
                                        kv_events=[f"{d1}={pub.endpoint},{pub.replay_endpoint}"]))
                runner = await start_proxy(p)
                try:
                    await publish_until_heard(p, pub, d1, holds(PROMPT, 5), 5)
                    purl = f"http://127.0.0.1:{runner.addresses[0][1]}"
                    assert (await ask(purl, {"prompt": PROMPT})).startswith(f"{d1}; prefix")
                    assert dec1.bodies and not dec0.bodies and pre.bodies  # streamed from the prefill engine
                finally:
                    await runner.cleanup()
        finally:
            pub.close()
    run(go())


def test_load_of_sums_vllm_s_gauges_and_skips_the_rest() -> None:
    text = ('# HELP vllm:num_requests_running x\nvllm:num_requests_running{engine="0"} 2.0\n'
            'vllm:num_requests_waiting{engine="0"} 3.0\nvllm:num_requests_running{engine="1"} nan-ish\n'
            'vllm:other 9\n')
    assert load_of(text) == 5


@pytest.mark.parametrize("spec", ["", "tcp://a:1,tcp://b:2,tcp://c:3", "http://x", "tcp://a:1,udp://b"])
def test_a_bad_event_source_is_refused(spec: str) -> None:
    from kvport.errors import ConfigError

    with pytest.raises(ConfigError, match="KV event source"):
        EventSource.parse(spec)


def test_the_policy_s_costs_come_from_a_calibration_profile(tmp_path: Path) -> None:
    from kvport.planner.profile import Link, LinkKind, PrefillModel, Profile

    prof = Profile("here", 0.0, PrefillModel("m", 2, a=0.01, b=2e-4, c=0.0, d=0.0, measured_at=0.0),
                   (Link("disk", LinkKind.TIER, 1e9, 0.0, 0.0),))

    async def go() -> None:
        async with routed(tmp_path, route="prefix", route_profile=prof, kv_bytes_per_token=1000) as (p, url, _, pubs):
            assert p.engines.state()["costs"]["from"] == "defaults"  # no block size yet: nothing to size a load
            await publish_until_heard(p, pubs[0], p.engines.urls[0], holds(PROMPT, 2), 2)
            await ask(url, {"prompt": PROMPT})
            costs = p.engines.state()["costs"]
            assert costs["from"] == "profile" and costs["prefill_token_s"] == pytest.approx(2e-4)
            assert costs["load_block_s"]["local storage"] == pytest.approx(BS * 1000 / 1e9)
    run(go())
