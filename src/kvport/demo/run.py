"""``kvport demo``: prefill/decode disaggregation of long multi-turn sessions on the reference model.

Processes (all on 127.0.0.1, started and stopped here)::

    router (this process) ---- control pipes (msgpack) ----+----------------------+
       |  baseline: the same chat, single process,         |                      |
       |  no kvport (the outputs every turn must equal)    v                      v
       |                                           prefill worker  ==TCP==>  decode worker
       |                                           (planner, load,  layer by   (receive, decode,
       |                                            compute, send)  layer,     store the session)
       |                                                 |          credits         |
       +-- shared tier: `kvport serve` (host + disk) <---+--- lookup/get      put ---+

The workload (:func:`kvport.workers.workload.default_workload`): chats about a pasted incident log
or code module and agent sessions on a shared tool catalogue, 2-4k tokens of history each. Per turn
the router sends ``expect`` to the decode worker and ``prefill`` to the prefill worker, then
``decode`` with the first token. Turn n+1 of a session extends turn n's tokens, so its prompt's KV is
found in the shared tier (stored there by the decode worker) and only the new message is computed; a
session's first turn waits for the decode of the last session with the same system prompt, whose
blocks of it it then finds. Before round ``restart_before_round`` the decode worker is killed and
started again; the session KV survives in the shared tier. Memory is sized before anything starts
(:mod:`kvport.demo.sizing`). Everything runs with embedded defaults (no external service).
"""

from __future__ import annotations

import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvport.bench.harness import conditions
from kvport.bench.run import source_commit
from kvport.codec.envelope import stored_bytes
from kvport.config import Settings
from kvport.demo.report import Turn, render, summarize
from kvport.demo.sizing import Sizing, size_run
from kvport.errors import KVPortError, PeerError
from kvport.evidence.limits import raw_socket_gbps
from kvport.spec import DType, KVSpec, from_hf_config
from kvport.workers.decode import main as decode_main
from kvport.workers.prefill import main as prefill_main
from kvport.workers.process import Worker
from kvport.workers.quiet import quiet_transformers
from kvport.workers.workload import Conversation, Workload, default_workload

EOS_ID = 2  # <|im_end|>: closes a turn the answer cut off


@dataclass(frozen=True, slots=True)
class DemoOptions:
    users: int = 3  # sessions: chat-log, agent-backup, agent-upload, chat-code (the first ``users``)
    rounds: int = 3
    max_new_tokens: int = 12
    excerpt_lines: int | None = None  # cut the pasted texts to their first lines (small runs); None: full
    restart_before_round: int | None = 3  # 1-based; None or > rounds: never restart
    threads: int = 1  # intra-op threads per process (two processes share 2 cores)
    receive_budget_bytes: int | None = None  # the decode worker's credit budget; None: sized from the spec
    measure_link: bool = True  # raw socket bandwidth for the ideal bound (off: the bound is reported None)
    show_progress: bool = True


def _sizing(tok: Any, spec: KVSpec, wl: Workload, budget: int | None) -> Sizing:
    """The run's buffers and tiers, from the spec and each session's token bound."""
    bounds = wl.token_bounds(lambda text: len(tok(text, add_special_tokens=False)["input_ids"]))
    return size_run(spec, bounds, stored_bytes(spec), budget)


def _warm_up(pw: Worker, dw: Worker, tok: Any, block_size: int) -> None:
    """One short untimed turn through both workers (not in the report): first-call allocations, and
    the decode worker's first save measured, so that its save deadlines follow the shared tier's
    speed rather than the raw link's."""
    prompt = Conversation(tok, "", EOS_ID).prompt(" ".join(["warm up"] * 48))  # a few whole blocks
    dw.call({"op": "expect", "rid": "warm-up", "n_tokens": len(prompt)})
    pre = pw.call({"op": "prefill", "rid": "warm-up", "prompt": prompt})
    dw.call({"op": "decode", "rid": "warm-up", "prompt": prompt, "first_token": pre["first_token"], "max_new": 2,
             "hit_blocks": pre["hit_tokens"] // block_size, "shared_prefix_tokens": 0, "expected_s": None}, 600)


def _baseline(model_dir: Path, wl: Workload, threads: int, progress: Progress | None) -> list[Turn]:
    """The same sessions in this process with plain transformers and no kvport: outputs and TTFT per turn."""
    from kvport.engines.hf import HFEngine
    from kvport.refmodel import load

    torch.set_num_threads(threads)
    quiet_transformers()
    model, tok = load(model_dir)
    plain = HFEngine(model, from_hf_config(model_dir, dtype=DType.FP32), None)
    task = progress.add_task("baseline (single process, no kvport)", total=wl.users * wl.rounds) if progress else None
    convs = [Conversation(tok, s.system, EOS_ID) for s in wl.sessions]
    plain.generate(Conversation(tok, "", EOS_ID).prompt("warm up"), 2)  # first-call allocations untimed
    turns: list[Turn] = []
    for r in range(wl.rounds):
        for u, sess in enumerate(wl.sessions):
            history = len(convs[u].tokens)
            prompt = convs[u].prompt(sess.turns[r])
            res = plain.generate(prompt, wl.max_new_tokens)
            convs[u].commit(prompt, list(res.tokens))
            turns.append(Turn(r + 1, u + 1, f"u{u + 1}-r{r + 1}", len(prompt), list(res.tokens), res.ttft_s,
                              session=sess.name, history_tokens=history))
            if progress is not None and task is not None:
                progress.advance(task)
    return turns


def run(opts: DemoOptions | None = None, json_path: Path | None = None,
        console: Console | None = None) -> dict[str, Any]:
    """Run the scenario end to end and print the report; returns the summary (also written to ``json_path``)."""
    import json

    from kvport.demo.shared_tier import SharedTier
    from kvport.refmodel import prepare

    opts = opts or DemoOptions()
    if console is None:
        console = Console()
        if not console.is_terminal:  # a log file or a pipe: wide enough for the report table
            console = Console(width=160)
    settings = Settings.from_env()
    model_dir = prepare(settings.model_dir)
    spec = from_hf_config(model_dir, dtype=DType.FP32)
    wl = default_workload(opts.users, opts.rounds, opts.max_new_tokens, opts.excerpt_lines)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    sizing = _sizing(tok, spec, wl, opts.receive_budget_bytes)
    errors: list[str] = []
    restarts = 0
    with tempfile.TemporaryDirectory(prefix="kvport-demo-") as tmp, Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console, disable=not opts.show_progress, transient=False) as progress:
        setup = progress.add_task("start: shared tier, prefill and decode workers, a warm-up turn", total=5)
        shared = SharedTier(Path(tmp) / "shared", capacity=sizing.server_capacity)
        workers: list[Worker] = []
        turns: list[Turn] = []
        raw_gbps: float | None = None
        try:
            port = shared.start()
            progress.advance(setup)
            dl = settings.load_deadline
            deadline_cfg = (dl.min_s, dl.factor, dl.max_s)
            secret = secrets.token_hex(32)  # the hand-off's: the two workers authenticate their link with it
            dcfg = {"model_dir": str(model_dir), "shared_port": port, "threads": opts.threads,
                    "budget_bytes": sizing.receive_budget_bytes, "max_blocks": sizing.receive_blocks,
                    "owner": "decode-1", "secret": secret, "load_deadline": deadline_cfg}
            pcfg = {"model_dir": str(model_dir), "shared_port": port, "threads": opts.threads,
                    "host_bytes": sizing.tier_bytes, "owner": "prefill", "secret": secret,
                    "load_deadline": deadline_cfg}
            pw = Worker("prefill-worker", prefill_main, pcfg)
            dw = Worker("decode-worker", decode_main, dcfg)
            workers += [pw, dw]
            pw.ready(600)
            progress.advance(setup)
            pw.call({"op": "connect", "address": dw.ready(600)["address"]})
            progress.advance(setup)
            _warm_up(pw, dw, tok, spec.block_size)
            progress.advance(setup)
            raw_gbps = raw_socket_gbps(32 << 20, trials=2) if opts.measure_link else None
            progress.advance(setup)
            turns = _baseline(model_dir, wl, opts.threads, progress)
            task = progress.add_task("kvport (prefill worker -> decode worker)", total=len(turns))
            convs = [Conversation(tok, s.system, EOS_ID) for s in wl.sessions]
            shared_prefix = [c.shared_prefix_tokens() for c in convs]
            restarted = False
            d_replies: list[tuple[str, Turn | None]] = []  # answers the decode worker still owes, in order

            def drain(until: Turn | None = None) -> None:
                """Read the decode worker's answers up to ``until``'s decode (all when None)."""
                while d_replies:
                    kind, turn = d_replies.pop(0)
                    ans = dw.recv(600)
                    if not ans.get("ok"):
                        raise PeerError(f"decode worker: {ans.get('error')}")
                    if kind == "decoded" and turn is not None:
                        turn.decode = ans
                        turn.tokens = list(ans["tokens"])
                        convs[turn.user - 1].commit(turn.prompt, turn.tokens)
                        progress.advance(task)
                        if turn is until:
                            return

            t_first: float | None = None  # when the first turn's prefill was asked
            by_user: dict[int, Turn] = {}
            by_system: dict[str, Turn] = {}  # the last turn of any session with this system prompt
            for t in turns:
                if opts.restart_before_round is not None and t.round == opts.restart_before_round and not restarted:
                    drain()
                    progress.update(task, description="restarting the decode worker")
                    dw.kill()
                    workers.remove(dw)
                    dcfg = {**dcfg, "owner": f"decode-{restarts + 2}"}  # a new engine: a new owner
                    dw = Worker("decode-worker", decode_main, dcfg)
                    workers.append(dw)
                    pw.call({"op": "connect", "address": dw.ready(600)["address"]})
                    _warm_up(pw, dw, tok, spec.block_size)
                    restarts += 1
                    restarted = True
                    progress.update(task, description="kvport (prefill worker -> decode worker)")
                sess = wl.sessions[t.user - 1]
                # the session's next prompt extends its previous answer; its first one may find the
                # system prompt that another session's decode stores
                prev = by_user.get(t.user) or by_system.get(sess.system)
                if prev is not None and prev.tokens is None:
                    drain(prev)
                by_user[t.user] = by_system[sess.system] = t
                t.prompt = convs[t.user - 1].prompt(sess.turns[t.round - 1])
                t.after_restart = restarted
                try:
                    # pipelined: the decode worker may still be decoding the previous turn while this
                    # prefill streams; its receive budget then fills and the prefill waits for credits
                    dw.send({"op": "expect", "rid": t.rid, "n_tokens": len(t.prompt)})
                    d_replies.append(("expecting", None))
                    asked = time.perf_counter()
                    t_first = asked if t_first is None else t_first
                    t.started_s = asked - t_first
                    t.prefill = pw.call({"op": "prefill", "rid": t.rid, "prompt": t.prompt})
                    # the rest of the stream after the first token: its bytes over the link measured
                    # now (None when not measured: the deadline policy's maximum)
                    expected = None if raw_gbps is None else t.prefill["transfer_bytes"] / (raw_gbps * 1e9)
                    dw.send({"op": "decode", "rid": t.rid, "prompt": t.prompt,
                             "first_token": t.prefill["first_token"], "max_new": wl.max_new_tokens,
                             "hit_blocks": t.prefill["hit_tokens"] // spec.block_size,
                             "shared_prefix_tokens": shared_prefix[t.user - 1], "expected_s": expected})
                    d_replies.append(("decoded", t))
                except KVPortError as exc:
                    t.error = f"{type(exc).__name__}: {exc}"
                    errors.append(f"{t.rid}: {t.error}")
                    break
            drain()
        except KVPortError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            for w in workers:
                w.stop()
            shared.stop()
    cond = {**conditions(), "mode": "full", "commit": source_commit(),
            "command": f"kvport demo --users {wl.users} --rounds {wl.rounds} --max-new-tokens {wl.max_new_tokens}",
            "model": "SmolLM2-135M-Instruct fp32 (transformers)", "users": wl.users, "rounds": wl.rounds,
            "sessions": {s.name: s.kind.value for s in wl.sessions}, "excerpt_lines": opts.excerpt_lines,
            "max_new_tokens": wl.max_new_tokens, "threads_per_process": opts.threads,
            "baseline": "the same sessions in the router process, plain transformers, full prefill every turn, "
                        f"{opts.threads} thread(s) like each worker",
            **sizing.as_dict(), "block_size": spec.block_size,
            "bytes_per_token": spec.bytes_per_token, "bytes_per_block": spec.bytes_per_block,
            "stored_bytes_per_block": stored_bytes(spec),
            "link": "tcp 127.0.0.1", "shared_tier": "kvport serve (host + disk), 127.0.0.1"}
    summary = summarize(turns, spec=spec, raw_socket_gbps=raw_gbps, restarts=restarts, errors=errors,
                        conditions=cond)
    render(console, turns, summary)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main_cli(json_path: str | None, users: int, rounds: int, max_new_tokens: int) -> None:
    summary = run(DemoOptions(users=users, rounds=rounds, max_new_tokens=max_new_tokens),
                  Path(json_path) if json_path else None)
    if not summary["outputs_equal_baseline"]:
        click.echo("kvport demo: outputs differ from the baseline or the run failed (see above)", err=True)
        raise SystemExit(1)  # `make demo` must fail, not print a report that hides it

