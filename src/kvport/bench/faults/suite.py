"""``kvport bench faults``: no fault changes an answer, nothing hangs, nothing committed is lost.

The demo's real worker processes (:mod:`kvport.workers`) on the reference model (SmolLM2-135M fp32,
one thread each)::

    bench (router + oracle) --pipes--> prefill worker --TCP--> fault proxy [netns] --> decode worker
                                            |                                             |
                                            +---- kvport serve (host pool + disk) / Redis -+

For each fault class (:mod:`kvport.bench.faults.link`, :mod:`kvport.bench.faults.storage`), for
``injections`` fresh chats (``--quick``: 3, else 20; ``--set injections=N``): the chat's turns run
one request each through the workers, the fault injected at the real component into the last turn;
every generated token and its logprob is compared with the oracle (plain transformers, computed
once per prompt in this process: :mod:`kvport.bench.faults.oracle`). ``--set classes=a,b`` runs a
subset; ``--set hang_s=S`` is the per-request deadline (default 60 s): a request not answered by
then is hung, and faults that hold (a stopped server, a cut link) are lifted only after it.

``results.classes.NAME``: ``injected`` (faults that really happened), ``wrong_outputs`` (answers
whose tokens differ from the oracle's, or a logprob by more than the tolerance), ``recomputed``
(requests where kvport fell back: a failed, refused or late load or transfer recomputed, or a retry
after a worker died), ``hung``, ``lost_committed`` (the class's rule: docs/faults.md), ``failed``
(requests answered with an error), ``requests`` (fault and setup turns). Totals:
``results.wrong_outputs``, ``hung``, ``lost_committed``, ``failed``, ``classes_tested``.
``results.control``: the same chats with no fault. ``limits.raw_socket_gbps``: the loopback link
measured in the same run (the decode worker's deadline scales the stream's bytes by it).

``--set engine=vllm`` runs the vLLM rows instead (:mod:`kvport.bench.faults.vllm`): real ``vllm
serve`` prefill and decode engines behind ``kvport proxy``, the same fields per class.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from kvport.bench.faults.classes import Control, FaultClass, Injection
from kvport.bench.faults.env import Env, Setup, describe
from kvport.bench.faults.link import LINK_CLASSES
from kvport.bench.faults.oracle import Oracle, compare
from kvport.bench.faults.router import RoutedAnswer
from kvport.bench.faults.storage import STORE_CLASSES
from kvport.bench.harness import Report, SuiteOptions, conditions, finish
from kvport.errors import ConfigError, KVPortError
from kvport.evidence.limits import raw_socket_gbps

# link classes, then storage classes, then those that need processes set up their own way
ORDER: tuple[type[FaultClass], ...] = tuple(c for c in (*LINK_CLASSES, *STORE_CLASSES) if c.setup == Setup()) + \
    tuple(c for c in (*STORE_CLASSES, *LINK_CLASSES) if c.setup != Setup())
CLASSES: dict[str, type[FaultClass]] = {c.name: c for c in ORDER}
MAX_SAMPLES = 5


class Tally:
    """Counts of one class; every answer is checked against the oracle here."""

    def __init__(self) -> None:
        self.c: dict[str, int] = dict.fromkeys(
            ("injected", "attempts", "requests", "wrong_outputs", "recomputed", "hung", "lost_committed", "failed",
             "retried", "store_errors", "transfers_refused_or_failed", "loads_fell_back", "fault_turn_prompt_tokens",
             "fault_turn_loaded_tokens", "links_lost", "not_recovered"), 0)
        self.fault_s: list[float] = []
        self.samples: list[dict[str, Any]] = []
        self.not_applied: list[str] = []
        self.errors: list[str] = []
        self.hung_where: list[dict[str, Any]] = []
        self.link_lost_why: list[str] = []
        self.store_error_samples: list[str] = []
        self.not_recovered_why: list[str] = []
        self.max_logprob_diff = 0.0

    def answer(self, ans: RoutedAnswer, chat_turn: tuple[Any, int], fault: bool) -> None:
        chat, t = chat_turn
        c = self.c
        c["requests"] += 1
        if fault:
            self.fault_s.append(ans.seconds)
            c["fault_turn_prompt_tokens"] += len(chat.prompts[t])
            c["fault_turn_loaded_tokens"] += int(ans.prefill.get("loaded_tokens") or 0) if not ans.retries else 0
        c["recomputed"] += int(ans.recomputed)
        c["retried"] += int(ans.retries > 0)
        store_error = ans.decode.get("store_error")
        c["store_errors"] += int(bool(store_error))
        if store_error and len(self.store_error_samples) < 3 and str(store_error)[:80] not in \
                [e[:80] for e in self.store_error_samples]:
            self.store_error_samples.append(str(store_error)[:300])
        c["transfers_refused_or_failed"] += int(bool(ans.prefill) and not ans.prefill.get("committed"))
        c["loads_fell_back"] += int(bool(ans.prefill.get("fallback")))
        c["lost_committed"] += ans.handoff_lost
        if ans.hung is not None:
            c["hung"] += 1
            return
        if ans.failed is not None:
            c["failed"] += 1
            self._sample(ans, ans.failed)
            return
        v = compare(chat.expected[t], ans.tokens, ans.logprobs)
        if v.max_logprob_diff is not None:
            self.max_logprob_diff = max(self.max_logprob_diff, v.max_logprob_diff)
        if not v.ok:
            c["wrong_outputs"] += 1
            self._sample(ans, v.detail)

    def _sample(self, ans: RoutedAnswer, why: str) -> None:
        if len(self.samples) < MAX_SAMPLES:
            self.samples.append({"rid": ans.rid, "why": why, "prefill_fallback": ans.prefill.get("fallback"),
                                 "transfer_error": ans.prefill.get("transfer_error"),
                                 "decode_fallback": ans.decode.get("fallback")})

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.c)
        fs = self.fault_s
        out["fault_turn_s"] = ({"median": round(statistics.median(fs), 3), "max": round(max(fs), 3)} if fs else None)
        out["max_logprob_diff"] = self.max_logprob_diff
        for name in ("not_applied", "errors", "samples", "hung_where", "link_lost_why", "store_error_samples",
                     "not_recovered_why"):
            if getattr(self, name):
                out[name] = getattr(self, name)[:MAX_SAMPLES]
        return out


def _where(env: Env, tally: Tally, ans: RoutedAnswer) -> None:
    """Where a hung request waits (py-spy of both workers, when installed), taken before the fault
    is lifted."""
    where: dict[str, Any] = {"rid": ans.rid, "waiting_on": ans.hung}
    if len(tally.hung_where) < 2:
        for role in ("prefill", "decode"):
            with contextlib.suppress(Exception):
                where[f"{role}_stack"] = env.stack_of(env.workers.pid(role))
    tally.hung_where.append(where)


def run_class(env: Env, cls: FaultClass, n: int, hang_s: float, log: Any = None, fresh: bool = False) -> dict[str, Any]:
    t0 = time.monotonic()
    env.use(cls.setup, fresh)
    tally = Tally()
    cls.prepare(env)
    try:
        while tally.c["injected"] < n and tally.c["attempts"] < n + max(3, n // 2):
            tally.c["attempts"] += 1
            inj = Injection(tally.c["attempts"], env.chat(cls.name, cls.turns))
            try:
                _inject(env, cls, inj, tally, hang_s)
            except (KVPortError, OSError, RuntimeError) as exc:
                where = traceback.extract_tb(exc.__traceback__)[-1]
                tally.errors.append(f"{type(exc).__name__}: {exc} ({Path(where.filename).name}:{where.lineno})")
                if len(tally.errors) >= 3:
                    break
            if log is not None:
                log(f"  {cls.name} {tally.c['injected']}/{n}")
    finally:
        cls.finish(env)
    out = tally.as_dict()
    out.update(setup=describe(cls.setup), details=cls.details, elapsed_s=round(time.monotonic() - t0, 1))
    return out


def _inject(env: Env, cls: FaultClass, inj: Injection, tally: Tally, hang_s: float) -> None:
    chat = inj.chat
    for t in range(cls.turns - 1):  # setup turns, no fault
        setup_ans = env.start_turn(chat, t, hang_s).result()
        tally.answer(setup_ans, (chat, t), fault=False)
        if setup_ans.hung is not None:
            _where(env, tally, setup_ans)
            env.recover()
            return
    cls.before(env, inj)
    turn = env.start_turn(chat, cls.turns - 1, hang_s)
    ans: RoutedAnswer | None = None
    try:
        cls.during(env, inj, turn)
        ans = turn.result(timeout=hang_s + 600)
        if ans.hung is not None:
            _where(env, tally, ans)
    finally:
        cls.after(env, inj, ans)  # lift the fault (also after a failure) before anything else
        if ans is None:  # during() failed: the turn runs on; nothing else starts before it ended
            with contextlib.suppress(Exception):
                turn.result(timeout=hang_s + 60)
    if ans is None:
        return
    tally.answer(ans, (chat, cls.turns - 1), fault=True)
    tally.c["lost_committed"] += inj.lost
    if inj.applied:
        tally.c["injected"] += 1
    elif len(tally.not_applied) < MAX_SAMPLES:
        tally.not_applied.append(inj.detail)
    if ans.hung is not None:
        env.recover()
        return
    if not env.link_alive():
        tally.c["links_lost"] += 1
        if len(tally.link_lost_why) < MAX_SAMPLES:
            tally.link_lost_why.append(env.link_closed_why())
    _probe(env, cls, tally, hang_s)


def _probe(env: Env, cls: FaultClass, tally: Tally, hang_s: float) -> None:
    """After the fault was lifted, kvport must be back to normal by itself: the next request (a fresh
    one-turn chat, checked like any) is answered right with its transfer committed and nothing
    recomputed. If not, both workers start again, as an operator would (``not_recovered``), so the
    next injection starts from a working system."""
    chat = env.chat(f"{cls.name}-after", 1)
    ans = env.start_turn(chat, 0, hang_s).result()
    tally.answer(ans, (chat, 0), fault=False)
    ok = ans.hung is None and ans.failed is None and bool(ans.prefill.get("committed")) and not ans.recomputed
    if not ok:
        tally.c["not_recovered"] += 1
        if len(tally.not_recovered_why) < MAX_SAMPLES:
            why = (ans.hung or ans.failed or ans.prefill.get("transfer_error") or ans.decode.get("fallback")
                   or ans.prefill.get("fallback")
                   or f"committed={ans.prefill.get('committed')} retries={ans.retries} "
                      f"action={ans.prefill.get('action')} reason={ans.prefill.get('reason')}")
            tally.not_recovered_why.append(str(why)[:300])
        env.recover()


def _classes(opts: SuiteOptions) -> list[type[FaultClass]]:
    raw = opts.extra.get("classes")
    if raw is None or raw in {"", "all"}:
        return list(ORDER)
    names = [s.strip() for s in str(raw).split(",") if s.strip()]
    unknown = [s for s in names if s not in CLASSES]
    if unknown:
        raise ConfigError(f"--set classes={raw!r}: unknown {unknown}; expected some of {', '.join(CLASSES)}")
    return [c for c in ORDER if c.name in names]


def run(opts: SuiteOptions) -> Report:
    engine = opts.extra.get("engine", "transformers")
    if engine == "vllm":  # the vLLM rows: real vllm serve engines behind kvport proxy
        from kvport.bench.faults import vllm

        return vllm.run(opts)
    if engine != "transformers":
        raise ConfigError(f"--set engine={engine!r}: expected transformers (the kvport.workers processes) or vllm")
    from kvport.config import Settings
    from kvport.refmodel import prepare
    from kvport.spec import DType, from_hf_config

    n = opts.number("injections", 3 if opts.quick else 20, lo=1, integer=True)
    hang_s = opts.number("hang_s", 30.0 if opts.quick else 60.0, lo=5.0)
    seed = opts.number("seed", 1, integer=True)
    n_control = opts.number("control", 2 if opts.quick else 5, lo=0, integer=True)
    lo = opts.number("min_tokens", 100, lo=40, integer=True)
    hi = opts.number("max_tokens", 250 if opts.quick else 450, lo=lo, integer=True)
    max_new = opts.number("max_new_tokens", 4, lo=1, integer=True)
    chosen = _classes(opts)
    rng = random.Random(seed)
    verbose = bool(opts.extra.get("progress", True)) and sys.stderr.isatty()

    def log(msg: str) -> None:
        if verbose:
            sys.stderr.write(msg + "\n")

    model_dir = prepare(Settings.from_env().model_dir)
    spec = from_hf_config(model_dir, dtype=DType.FP32)
    link = raw_socket_gbps(32 << 20, trials=2) or 0.0
    oracle = Oracle(model_dir, max_new, threads=2)
    cond = conditions(
        model="SmolLM2-135M-Instruct fp32 (transformers), 1 thread per worker, oracle 2 threads",
        prompt_tokens_turn1=[lo, hi], prompt_tokens_max=int(hi * 4 / 3) + 40,
        injections_per_class=n, hang_s=hang_s, seed=seed, classes=[c.name for c in chosen],
        link="prefill worker -> TCP 127.0.0.1 -> fault proxy -> decode worker (partition: via a netns veth)",
        shared_tier="kvport serve, ~36 one-MiB host pages + disk (per class: see results.classes.NAME.setup)",
        receive_budget_bytes=4 << 20, block_size=spec.block_size, bytes_per_block=spec.bytes_per_block,
        **oracle.describe())  # at the start: its load average is the start's
    t0 = time.monotonic()
    results: dict[str, Any] = {"classes": {}}
    with contextlib.ExitStack() as stack:
        env = Env(stack, oracle, model_dir, spec, link, seed, (lo, hi))
        if n_control:
            results["control"] = run_class(env, Control(rng), n_control, hang_s, log)
        dirty = False
        for cls in chosen:
            log(f"faults: {cls.name}")
            results["classes"][cls.name] = run_class(env, cls(rng), n, hang_s, log, fresh=dirty)
            dirty = cls.dirties_server
        worker_starts = env.workers.starts
    per = results["classes"].values()
    for key in ("wrong_outputs", "hung", "lost_committed", "failed", "not_recovered", "recomputed", "requests",
                "injected"):
        results[key] = sum(int(c[key]) for c in per)
    results["classes_tested"] = sum(1 for c in per if c["injected"] > 0)
    results["classes_at_target"] = sum(1 for c in per if c["injected"] >= n)
    results["injections_per_class"] = n
    results["worker_starts"] = worker_starts
    results["elapsed_s"] = round(time.monotonic() - t0, 1)
    return finish(Report("faults", cond, {"raw_socket_gbps": link}, results))
