"""The vLLM rows' deployment under test: kvport serve, a prefill and a decode ``vllm serve``, kvport
proxy, and the fault proxy on the hand-off's link; one request through it at a time.

:class:`VllmEnv` starts them (engines restart when a class killed one), runs one request at a time
within the hang deadline -- through ``kvport proxy``, or a prefill then a decode by hand -- (an
:class:`Outcome`: the answer, an error, hung, the tokens the decode engine loaded), and computes
each prompt's reference answer once (the decode engine from scratch, its own ``cache_salt``).
:func:`handed`: the tokens a hand-off of a prompt carries; :func:`random_prompt`: the prompts every
class and probe is asked.
"""

from __future__ import annotations

import contextlib
import random
import secrets
import threading
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from kvport.bench.faults.procs import ProxyProc, ServerProc, Tmpfs, free_port
from kvport.bench.pd import Answer, completion_body, metric, prompt_tokens, request
from kvport.errors import KVPortError
from kvport.spec import KVSpec

BLOCK = 32  # the engines' block size (deploy.EngineServer)
INBOX_TOKENS = 4096
LEASE_S = 8.0  # hand-off leases and the inbox's ttl: a filled inbox empties by itself within this


@dataclass(slots=True)
class Outcome:
    answer: Answer | None
    error: str | None = None
    hung: bool = False
    loaded: int = 0  # tokens the decode engine loaded from kvport for it
    prompt: list[int] | None = None  # the prompt answered, when not the one the class was given


class VllmEnv:
    """The deployment under test; engines restart when a class killed one."""

    def __init__(self, stack: contextlib.ExitStack, model: Path, hang_s: float, max_tokens: int) -> None:
        from kvport.deploy.vllm_serve import EngineServer, ProxyServer, deployment_secret, listen_port

        self.model, self.hang_s, self.max_tokens = model, hang_s, max_tokens
        self.root = Path(stack.enter_context(TemporaryDirectory(prefix="kvport-faults-vllm-")))
        self.disk = Tmpfs(self.root / "disk", 1 << 30)
        stack.callback(self.disk.close)
        self.server = ServerProc(free_port(), self.root / "kvport-serve.log")
        self.server.start(["--capacity", "1GiB"])
        stack.callback(self.server.stop)
        self.inbox = f"127.0.0.1:{listen_port()}"
        host, _, port = self.inbox.rpartition(":")
        self.fproxy = ProxyProc((host, int(port)))
        stack.callback(self.fproxy.close)
        self.dest = f"127.0.0.1:{self.fproxy.port}"  # the producer dials the inbox through the fault proxy
        self.secret = deployment_secret().encode()
        extra = {"kvport_server": f"127.0.0.1:{self.server.port}", "kvport_disk_dir": str(self.disk.path),
                 "kvport_disk_capacity": "768 MiB", "kvport_pd_lease_s": LEASE_S}
        self.pre = EngineServer(model, free_port(), role="kv_producer", log=self.root / "prefill.log",
                                extra={**extra, "kvport_pd_destinations": [self.dest]}, max_model_len=4096)
        self.dec = EngineServer(model, free_port(), role="kv_consumer", log=self.root / "decode.log",
                                extra={**extra, "kvport_pd_inbox": self.inbox, "kvport_pd_inbox_names": [self.dest],
                                       "kvport_pd_inbox_tokens": INBOX_TOKENS}, max_model_len=4096)
        for e in (self.pre, self.dec):
            stack.callback(e.stop)
            e.start()
        for e in (self.pre, self.dec):
            e.wait_healthy(600)
        self.proxy = ProxyServer([self.pre.url], [self.dec.url], self.root / "proxy.log",
                                 decode_inbox=[self.dest]).start()
        stack.callback(self.proxy.stop)
        self.restarts = 0
        self._refs: dict[tuple[int, ...], Answer] = {}
        self.spec: KVSpec | None = None  # the engines' KVSpec, as the producer announces it in a hand-off

    # -- requests
    def reference(self, prompt: list[int]) -> Answer:
        """The decode engine computing ``prompt`` from scratch (once per prompt, before any fault)."""
        key = tuple(prompt)
        if key not in self._refs:
            salt = f"reference-{secrets.token_hex(8)}"
            self._refs[key] = request(self.dec.url + "/v1/completions",
                                      completion_body(prompt, self.max_tokens, cache_salt=salt), self.hang_s)
        return self._refs[key]

    def external(self) -> int:
        return int(prompt_tokens(self.dec.url, "external_kv_transfer"))

    def ask(self, fn: Callable[[], Answer], during: Callable[[], None] | None = None) -> Outcome:
        """Run one request (``fn``) on a thread, ``during`` beside it; bounded by ``hang_s``."""
        with contextlib.suppress(KVPortError, OSError):
            ext0 = self.external()
        box: dict[str, Any] = {}

        def go() -> None:
            try:
                box["answer"] = fn()
            except urllib.error.HTTPError as exc:  # an error answered: counted failed, with what it said
                body = exc.read()[:300].decode(errors="replace")
                box["error"] = f"HTTP {exc.code}: {body}"
            except Exception as exc:  # a dropped connection, a broken stream: counted failed
                box["error"] = f"{type(exc).__name__}: {exc}"[:300]

        th = threading.Thread(target=go, daemon=True)
        th.start()
        if during is not None:
            during()
        th.join(self.hang_s)
        if th.is_alive():
            return Outcome(None, hung=True)
        loaded = 0
        with contextlib.suppress(KVPortError, OSError, NameError):
            loaded = max(0, self.external() - ext0)  # a decode engine restarted meanwhile counts from 0
        return Outcome(box.get("answer"), box.get("error"), loaded=loaded)

    def decode_count(self, outcome: str) -> float:
        """The decode engine's streamed hand-offs by outcome (``kvport_vllm_pd_streams_total``)."""
        return metric(self.dec.url, "kvport_vllm_pd_streams_total", outcome=outcome)

    def via_proxy(self, prompt: list[int]) -> Answer:
        return request(self.proxy.url + "/v1/completions", completion_body(prompt, self.max_tokens), self.hang_s)

    def prefill(self, prompt: list[int]) -> dict[str, Any]:
        t = request(self.pre.url + "/v1/completions",
                    {**completion_body(prompt, 1), "stream": False, "stream_options": None,
                     "kv_transfer_params": {"do_remote_decode": True, "kvport_dest": self.dest}}, self.hang_s)
        if not isinstance(t.kv_transfer_params, dict):
            raise KVPortError("the prefill engine answered without kv_transfer_params")
        if self.spec is None:
            self.spec = KVSpec.from_dict(t.kv_transfer_params["kvport"]["spec"])
        return t.kv_transfer_params

    def decode(self, prompt: list[int], params: dict[str, Any]) -> Answer:
        return request(self.dec.url + "/v1/completions",
                       completion_body(prompt, self.max_tokens, kv_transfer_params=params), self.hang_s)

    # -- processes
    def restart(self, engine: Any) -> None:
        engine.stop(grace_s=5.0)
        engine.start()
        engine.wait_healthy(600)
        self.restarts += 1

    def healthy(self) -> bool:
        return self.pre.healthy() and self.dec.healthy() and self.server.proc is not None \
            and self.server.proc.poll() is None

    def recover(self) -> None:
        """Everything up again, as an operator would do it."""
        if self.server.proc is None or self.server.proc.poll() is not None:
            self.server.start()
        for e in (self.pre, self.dec):
            if not e.healthy():
                self.restart(e)


def handed(prompt: list[int]) -> int:
    """Tokens a hand-off of ``prompt`` carries: its full blocks, one token left to compute."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def random_prompt(rng: random.Random, lo: int, hi: int) -> list[int]:
    """A prompt of ``lo..hi`` random tokens (ids 200..39999: no special tokens)."""
    return [rng.randrange(200, 40000) for _ in range(rng.randrange(lo, hi + 1))]
