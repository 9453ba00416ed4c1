"""A small prefill/decode proxy speaking the OpenAI API, in front of vLLM engines running KVPortConnector.

``kvport proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200``: any OpenAI client
points at it (``/v1/completions``, ``/v1/chat/completions``, streamed or not; ``/v1/models`` and
``/health`` pass through). Per request, the pattern vLLM's disaggregated connectors use::

    client --> proxy --1--> prefill engine   same body, max_tokens 1, stream off,
                                             kv_transfer_params {"do_remote_decode": true}
                     <----- its answer's kv_transfer_params (where the KV is: kvport's hand-off)
                     --2--> decode engine    the client's body + those kv_transfer_params
                     <----- streamed back to the client as it comes

Failures never hang a client and never give a wrong answer, since the decode engine recomputes
what it cannot load:

* prefill fails (refused, killed mid-request, an error status, past ``prefill_timeout_s``): the
  decode request goes without a hand-off and the decode engine computes the prompt itself;
* decode fails before its answer started (refused, killed before loading): the request goes,
  whole, to a prefill engine (a vLLM engine like any other), which computes it;
* decode fails mid-stream: the stream ends with an OpenAI-style error event (bytes already sent
  cannot be taken back).

Counters: ``kvport_pd_proxy_requests_total{path}`` with path ``pd`` (handed over), ``no_handoff``
(prefill failed), ``fallback`` (decode failed, served by a prefill engine) and ``failed``.
Engines are taken round-robin. Binds 127.0.0.1 by default; another address needs ``auth_token``,
which every request must then carry as ``Authorization: Bearer``.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvport import metrics
from kvport.errors import ConfigError
from kvport.extras import require
from kvport.protocol.net import is_loopback

from .stream_addr import DEST_KEY, parse_dest

try:
    import aiohttp
    from aiohttp import web
except ImportError:
    require("vllm", __name__)  # aiohttp comes with vLLM
    raise

log = logging.getLogger(__name__)

_REQUESTS = metrics.counter("pd_proxy_requests", "requests through the PD proxy, by path taken", ["path"])
MAX_BODY_BYTES = 16 << 20  # a request body from a client is capped
_PD_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    prefill: Sequence[str]  # base URLs of the prefill engines (kv_role kv_producer)
    decode: Sequence[str]  # base URLs of the decode engines (kv_role kv_consumer)
    host: str = "127.0.0.1"
    port: int = 8000
    auth_token: str | None = field(default=None, repr=False)
    prefill_timeout_s: float = 300.0
    decode_timeout_s: float = 600.0
    # the decode engines' inboxes (kvport_pd_inbox, HOST:PORT or shm:NAME), in the order of ``decode``: the prefill
    # engine streams the prompt's KV there during the prefill; empty: hand-offs go through the store
    decode_inbox: Sequence[str] = ()

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ConfigError("the proxy needs at least one prefill and one decode engine URL")
        for url in [*self.prefill, *self.decode]:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"engine URL must start with http:// or https://, got {url!r}")
        if self.decode_inbox and len(self.decode_inbox) != len(self.decode):
            raise ConfigError(f"{len(self.decode_inbox)} decode inboxes for {len(self.decode)} decode engines: "
                              "give one per engine, in the same order")
        for addr in self.decode_inbox:
            if parse_dest(addr) is None:
                raise ConfigError(f"a decode inbox is HOST:PORT or shm:NAME, got {addr!r}")
        if not is_loopback(self.host) and not self.auth_token:
            raise ConfigError(f"the proxy binds {self.host}, beyond this machine: it needs an auth token "
                              "(--auth-token or KVPORT_AUTH_TOKEN)")


class _Failed(Exception):
    """An engine did not answer usefully (the message says why)."""


class PDProxy:
    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self._prefill = itertools.cycle([u.rstrip("/") for u in cfg.prefill])
        inboxes: list[str | None] = [*cfg.decode_inbox] or [None] * len(cfg.decode)
        self._decode = itertools.cycle(list(zip([u.rstrip("/") for u in cfg.decode], inboxes, strict=True)))
        self._session: aiohttp.ClientSession | None = None
        self.counts: dict[str, int] = {}

    # ---------------------------------------------------------------- app
    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._auth])
        for path in _PD_PATHS:
            app.router.add_post(path, self._handle)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        token = self.cfg.auth_token
        if token and not hmac.compare_digest(request.headers.get("Authorization", ""), f"Bearer {token}"):
            return _error(401, "missing or wrong bearer token")
        resp: web.StreamResponse = await handler(request)
        return resp

    async def _start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))

    async def _stop(self, app: web.Application) -> None:
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

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _models(self, request: web.Request) -> web.Response:
        try:
            async with self.session.get(next(self._decode)[0] + "/v1/models",
                                        timeout=aiohttp.ClientTimeout(total=30)) as r:
                return web.Response(status=r.status, body=await r.read(), content_type="application/json")
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _error(502, f"decode engine unreachable: {exc}")

    # ---------------------------------------------------------------- one request
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, web.HTTPException):
            return _error(400, "the body must be a JSON object")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        path = request.path
        decode, inbox = next(self._decode)  # chosen first: the prefill streams the KV to its inbox
        handed = await self._prefill_step(path, body, inbox)
        decode_body = dict(body)
        if handed is not None:
            decode_body["kv_transfer_params"] = handed
        else:
            decode_body.pop("kv_transfer_params", None)
        try:
            resp = await self._forward(request, decode + path, decode_body)
            self._count("pd" if handed is not None else "no_handoff")
            return resp
        except _Failed as exc:
            log.warning("kvport proxy: decode engine failed before answering (%s); a prefill engine computes "
                        "the request", exc)
        plain = dict(body)
        plain.pop("kv_transfer_params", None)
        try:
            resp = await self._forward(request, next(self._prefill) + path, plain)
            self._count("fallback")
            return resp
        except _Failed as exc:
            self._count("failed")
            return _error(502, f"no engine could answer: {exc}")

    async def _prefill_step(self, path: str, body: dict[str, Any], inbox: str | None) -> dict[str, Any] | None:
        """Step 1: the prompt computed on a prefill engine (streaming its KV to ``inbox`` when given);
        its hand-off, or None when it failed."""
        pre = dict(body)
        ask: dict[str, Any] = {"do_remote_decode": True}
        if inbox is not None:
            ask[DEST_KEY] = inbox
        pre.update(max_tokens=1, stream=False, kv_transfer_params=ask)
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        pre.pop("stream_options", None)
        url = next(self._prefill) + path
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
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        return params if isinstance(params, dict) else None

    async def _forward(self, request: web.Request, url: str, body: dict[str, Any]) -> web.StreamResponse:
        """POST ``body`` to ``url`` and relay the answer (streamed as it comes). _Failed when nothing
        was sent to the client yet; an error event ends a stream that broke midway."""
        try:
            upstream = await self.session.post(url, json=body,
                                               timeout=aiohttp.ClientTimeout(total=self.cfg.decode_timeout_s))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _Failed(f"{url}: {type(exc).__name__}: {exc}") from None
        async with upstream:
            if upstream.status >= 500:
                raise _Failed(f"{url} answered {upstream.status}")
            ctype = upstream.headers.get("Content-Type", "application/json")
            if not body.get("stream"):
                try:
                    data = await upstream.read()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    raise _Failed(f"{url}: answer cut: {exc}") from None
                return web.Response(status=upstream.status, body=data, headers={"Content-Type": ctype})
            out = web.StreamResponse(status=upstream.status, headers={"Content-Type": ctype,
                                                                      "Cache-Control": "no-cache"})
            started = False
            try:
                async for chunk in upstream.content.iter_any():
                    if not started:
                        await out.prepare(request)
                        started = True
                    await out.write(chunk)
            except (aiohttp.ClientError, TimeoutError) as exc:
                if not started:
                    raise _Failed(f"{url}: stream cut before its first byte: {exc}") from None
                msg = json.dumps({"error": {"message": f"decode engine stream broke: {exc}", "type": "kvport_proxy"}})
                await out.write(f"data: {msg}\n\n".encode())
                self._count("failed")
            if not started:
                await out.prepare(request)
            await out.write_eof()
            return out


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "kvport_proxy", "code": status}}, status=status)


async def serve_proxy(cfg: ProxyConfig, ready: asyncio.Event | None = None) -> None:
    """Run the proxy until cancelled."""
    runner = web.AppRunner(PDProxy(cfg).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    log.info("kvport proxy on %s:%d: prefill %s, decode %s", cfg.host, cfg.port, list(cfg.prefill), list(cfg.decode))
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
