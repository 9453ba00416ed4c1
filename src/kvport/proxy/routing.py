"""What the routing proxy knows of its engines: the KV blocks each holds (their KV events) and their
load (their ``/metrics``), and the choice made from both (:class:`~kvport.route.policy.PrefixRouter`).

::

    each engine's KV events (vLLM's --kv-events-config: ZeroMQ PUB + replay; kvport's connector adds
          |                  its tiers' blocks to them)
          |  one Subscription each (from_start: a late proxy learns what is held), one thread (zmq.Poller)
          v
    PrefixIndex  engine URL -> {block hash -> places}
          ^ match(request's block hashes)
    Engines.choose(role's URLs, tokens, cache_salt) -- PrefixRouter --> the engine for this request
          ^ running requests: the proxy's own in flight, or the engine's /metrics (running + waiting)
    load poller (asyncio task): GET /metrics of every engine every ``poll_s``; an answer is a heartbeat

A request's block hashes are vLLM's own (:mod:`kvport.route.vllm_hash`: the engine's token ids from
``/tokenize`` or the prompt itself, the block size the engine's events carry, the request's
``cache_salt``), so they are what an engine's events name its blocks by. An engine is chosen only
when heard from (an event or a ``/metrics`` answer) within ``stale_s``; one whose poll failed is down
until it answers again. Engines that publish nothing are routed on load alone.

The thread owns the ZeroMQ sockets; the index is shared under a lock (the event loop only reads it,
for a few microseconds a request).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvport import metrics
from kvport.errors import ConfigError
from kvport.events.wire import BlockHash, BlockStored
from kvport.planner.profile import Profile
from kvport.route.index import Place, PrefixIndex
from kvport.route.policy import Costs, EngineState, PrefixRouter, Route
from kvport.route.vllm_hash import iter_block_hashes

log = logging.getLogger(__name__)

_ROUTED = metrics.counter("route_decisions", "requests routed, by policy and why", ["policy", "why"])
_EVENTS = metrics.counter("route_events", "KV event batches the router took in, by outcome",
                          ["outcome"])  # applied, duplicate, gap, restart
LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
MAX_METRICS_BYTES = 8 << 20  # an engine's /metrics answer is read up to this


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one publisher's events come from: ``ENDPOINT[,REPLAY]`` (ipc://, tcp://)."""

    endpoint: str
    replay: str | None = None

    @classmethod
    def parse(cls, spec: str) -> EventSource:
        parts = [p.strip() for p in spec.split(",")]
        if not 1 <= len(parts) <= 2 or not all(_endpoint_ok(p) for p in parts):
            raise ConfigError(f"a KV event source is ENDPOINT[,REPLAY_ENDPOINT], each tcp://HOST:PORT or ipc://PATH, "
                              f"got {spec!r}")
        return cls(parts[0], parts[1] if len(parts) == 2 else None)


def _endpoint_ok(e: str) -> bool:
    if e.startswith("ipc://"):
        return len(e) > len("ipc://")
    if e.startswith("tcp://"):
        host, _, port = e[len("tcp://"):].rpartition(":")
        return bool(host) and port.isdigit() and 0 < int(port) < 65536
    return False


def load_of(text: str) -> int:
    """Requests running and waiting on a vLLM engine, from its ``/metrics`` text (every sample summed)."""
    n = 0.0
    for line in text.splitlines():
        if line.startswith(LOAD_METRICS) and line.split("{", 1)[0].split(" ", 1)[0] in LOAD_METRICS:
            try:  # the name exactly: vllm:num_requests_waiting_by_reason would count the waiting twice
                n += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return max(0, round(n))


class Engines:
    """The routing proxy's engines (every role's URLs), their events and load."""

    def __init__(self, urls: Sequence[str], events: dict[str, EventSource], *, policy: str,
                 block_size: int | None = None, stale_s: float = 30.0,
                 poll_s: float = 1.0, max_blocks_per_engine: int = 1_000_000, profile: Profile | None = None,
                 kv_bytes_per_token: int | None = None) -> None:
        """``profile``: the planner's calibration (``kvport calibrate``) the policy's costs come from
        (:meth:`~kvport.route.policy.Costs.from_profile`, with ``kv_bytes_per_token`` for the loads),
        else its defaults."""
        if block_size is not None and block_size <= 0:
            raise ConfigError(f"a block size is positive, got {block_size}")
        if not 0 < poll_s < stale_s:
            raise ConfigError(f"the load poll ({poll_s} s) must be shorter than the staleness timeout ({stale_s} s)")
        self.urls = list(urls)
        self.events = dict(events)
        self.policy = policy
        self.stale_s, self.poll_s = stale_s, poll_s
        self.block_size = block_size  # learned from the events when not given
        self.index = PrefixIndex(max_blocks_per_engine=max_blocks_per_engine,
                                 max_blocks=max_blocks_per_engine * (len(self.urls) + 1), stale_s=stale_s)
        self.lock = threading.Lock()
        self.load = {u: 0 for u in self.urls}  # running + waiting, as the engine last said
        self.up = {u: True for u in self.urls}
        self.polled: dict[str, float] = {}  # url -> monotonic time of its last /metrics answer
        self._slow: dict[str, int] = {}  # url -> polls in a row that failed
        self.since = time.monotonic()  # an engine not heard from yet counts as heard at the start
        self._routers: dict[str, PrefixRouter] = {}
        self.profile, self.kv_bytes_per_token = profile, kv_bytes_per_token
        self._costs: tuple[int | None, Costs] | None = None  # (block size, costs)
        self.counts: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def router(self, role: str) -> PrefixRouter:
        r = self._routers.get(role)
        if r is None:
            r = self._routers[role] = PrefixRouter(self.policy, stale_s=self.stale_s)
        bs = self.block_size
        if self.profile is not None and (self._costs is None or self._costs[0] != bs):
            per_block = None if bs is None or self.kv_bytes_per_token is None else bs * self.kv_bytes_per_token
            self._costs = (bs, Costs.from_profile(self.profile, per_block))
        if self._costs is not None:
            r.costs = self._costs[1]
        return r

    # ---------------------------------------------------------------- events
    def start(self) -> None:
        if self.events:
            from kvport.events.bus import Subscription  # pyzmq: kvport[events]

            subs = {url: Subscription(src.endpoint, src.replay, from_start=True) for url, src in self.events.items()}
            self._thread = threading.Thread(target=self._read, args=(subs,), name="kvport-route-events", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def _read(self, subs: dict[str, Any]) -> None:
        import zmq

        poller = zmq.Poller()
        names = {}
        for name, sub in subs.items():
            poller.register(sub.socket, zmq.POLLIN)
            names[sub.socket] = name
        next_expire = time.monotonic() + 1.0
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(100):
                    name = names[sock]
                    for d in subs[name].poll(0):
                        self._apply(name, d)
                for name, sub in subs.items():  # a restarted engine holds nothing: forgotten at once
                    if sub.reconnected():
                        with self.lock:
                            self.index.forget(name)
                        _EVENTS.labels("restart").inc()
                if time.monotonic() >= next_expire:
                    next_expire = time.monotonic() + 1.0
                    with self.lock:
                        self.index.expire()
        except Exception:  # a bug here must not leave the proxy routing on a frozen index unnoticed
            log.exception("kvport proxy: the KV event reader stopped; routing goes on load alone")
            with self.lock:
                for name in subs:
                    self.index.forget(name)
            self.events.clear()
        finally:
            for sub in subs.values():
                sub.close()

    def _apply(self, name: str, d: Any) -> None:
        with self.lock:
            if d.restart:
                self.index.forget(name)
                _EVENTS.labels("restart").inc()
            applied = self.index.apply(name, d.batch, d.seq)
        if self.block_size is None:
            for ev in d.batch.events:
                if isinstance(ev, BlockStored) and ev.block_size > 0:
                    self.block_size = ev.block_size
                    break
        _EVENTS.labels("duplicate" if applied.duplicate else "gap" if applied.gap else "applied").inc()

    # ---------------------------------------------------------------- load
    async def poll_load(self, session: Any) -> None:
        """Forever: every engine's /metrics, every ``poll_s``."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=min(5.0, self.stale_s / 2))

        async def one(url: str) -> None:
            try:
                async with session.get(url + "/metrics", timeout=timeout) as r:
                    # any answer is a heartbeat; a load only from vLLM's (an engine without /metrics: none)
                    text = (await r.content.read(MAX_METRICS_BYTES)).decode("utf-8", "replace") \
                        if r.status == 200 else ""
                self.load[url] = load_of(text)
                self.polled[url] = time.monotonic()
                with self.lock:
                    self.index.touch(url)  # alive: an idle engine publishes nothing, its blocks stay
                self._slow[url] = 0
                if not self.up[url]:
                    log.info("kvport proxy: %s answers again", url)
                self.up[url] = True
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                # refused (the engine is gone): down at once; slow (a busy host): down after 3 in a row
                self._slow[url] = self._slow.get(url, 0) + 1
                if self.up[url] and (not isinstance(exc, TimeoutError) or self._slow[url] >= 3):
                    log.warning("kvport proxy: %s is down for routing (%s)", url, type(exc).__name__)
                    self.up[url] = False
            except Exception:  # never the poller's end: routing would freeze on stale loads
                log.exception("kvport proxy: polling %s failed", url)

        while True:
            await asyncio.gather(*(one(u) for u in self.urls))
            await asyncio.sleep(self.poll_s)

    def heard_s_ago(self, url: str, now: float) -> float:
        with self.lock:
            heard = self.index.heard(url)
        times = [t for t in (self.polled.get(url), heard, self.since) if t is not None]
        return now - max(times)

    def useful(self, urls: Sequence[str]) -> bool:
        """Whether a request's tokens can change the choice among ``urls``: the prefix policy, more
        than one engine, and a block size known (from the events, or configured)."""
        return self.policy == "prefix" and len(urls) > 1 and self.block_size is not None and bool(self.events)

    def held_hashes(self, tokens: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
        """vLLM's hashes of the request's blocks, up to the first one no engine holds (nor the shared
        tier): what a lookup can use, hashed once per request and no further."""
        bs = self.block_size
        if not bs:
            return []
        out: list[BlockHash] = []
        with self.lock:
            for h in iter_block_hashes(tokens, bs, cache_salt=cache_salt):
                out.append(h)
                if not self.index.anyone_holds(h):
                    break
        return out

    # ---------------------------------------------------------------- choice
    def choose(self, role: str, urls: Sequence[str], busy: dict[str, int], tokens: int,
               hashes: Sequence[BlockHash]) -> Route | None:
        """The engine among ``urls`` for a request of ``tokens`` prompt tokens whose leading blocks
        are ``hashes`` (:meth:`held_hashes`; empty: unknown)."""
        router = self.router(role)
        now = time.monotonic()
        states = [EngineState(u, max(busy.get(u, 0), self.load.get(u, 0)), self.heard_s_ago(u, now),
                              self.up.get(u, True)) for u in urls]
        matches = []
        if router.policy == "prefix" and hashes:
            with self.lock:
                matches = self.index.match_all(hashes, urls)
        route = router.choose(states, matches, tokens, self.block_size or 1)
        if route is not None:
            _ROUTED.labels(router.policy, route.why).inc()
            self.counts[route.why] = self.counts.get(route.why, 0) + 1
        return route

    def state(self) -> dict[str, Any]:
        now = time.monotonic()
        with self.lock:
            idx = self.index.stats()
        costs = self._costs[1] if self._costs is not None else Costs()
        return {"policy": self.policy, "block_size": self.block_size, "decisions": dict(self.counts),
                "costs": {"prefill_fixed_s": costs.prefill_fixed_s, "prefill_token_s": costs.prefill_token_s,
                          "load_block_s": dict(zip(Place.NAMES, costs.load_block_s, strict=True)),
                          "from": "profile" if self._costs is not None else "defaults"},
                "engines": {u: {"load": self.load.get(u), "up": self.up.get(u), "heard_s_ago": self.heard_s_ago(u, now),
                                "events": u in self.events} for u in self.urls},
                "index": idx}


__all__ = ["LOAD_METRICS", "Engines", "EventSource", "load_of"]
