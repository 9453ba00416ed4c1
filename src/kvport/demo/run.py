"""``kvport demo``: prefill/decode disaggregation of a multi-turn chat on the reference model.

Processes (all on 127.0.0.1, started and stopped here)::

    router (this process) ---- control pipes (msgpack) ----+----------------------+
       |  baseline: the same chat, single process,         |                      |
       |  no kvport (the outputs every turn must equal)    v                      v
       |                                           prefill worker  ==TCP==>  decode worker
       |                                           (planner, load,  layer by   (receive, decode,
       |                                            compute, send)  layer,     store the session)
       |                                                 |          credits         |
       +-- shared tier: `kvport serve` (host + disk) <---+--- lookup/get      put ---+

Per turn the router sends ``expect`` to the decode worker and ``prefill`` to the prefill worker, then
``decode`` with the first token. Turn n+1 of a user extends turn n's tokens, so its prompt's KV is
found in the shared tier (stored there by the decode worker) and only the new question is computed.
Before round ``restart_before_round`` the decode worker is killed and started again; the session KV
survives in the shared tier. Everything runs with embedded defaults (no external service).
"""

from __future__ import annotations

import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvport.config import Settings
from kvport.demo.report import Turn, render, summarize
from kvport.errors import KVPortError, PeerError
from kvport.evidence.limits import raw_socket_gbps
from kvport.spec import DType, from_hf_config
from kvport.workers.decode import main as decode_main
from kvport.workers.prefill import main as prefill_main
from kvport.workers.process import Worker
from kvport.workers.quiet import quiet_transformers
from kvport.workers.workload import Conversation, Workload, default_workload


@dataclass(frozen=True, slots=True)
class DemoOptions:
    users: int = 3
    rounds: int = 3
    max_new_tokens: int = 24
    restart_before_round: int | None = 3  # 1-based; None or > rounds: never restart
    threads: int = 1  # intra-op threads per process (two processes share 2 cores)
    receive_budget_bytes: int = 4 << 20  # decode worker's receive buffer: the credit budget
    measure_link: bool = True  # raw socket bandwidth for the ideal bound (off: the bound is reported None)
    show_progress: bool = True


def _baseline(model_dir: Path, wl: Workload, threads: int, progress: Progress | None) -> tuple[list[Turn], Any]:
    """The same chat in this process with plain transformers and no kvport: outputs and TTFT per turn."""
    from kvport.engines.hf import HFEngine
    from kvport.refmodel import load

    torch.set_num_threads(threads)
    quiet_transformers()
    model, tok = load(model_dir)
    plain = HFEngine(model, from_hf_config(model_dir, dtype=DType.FP32), None)
    task = progress.add_task("baseline (single process, no kvport)", total=wl.users * wl.rounds) if progress else None
    convs = [Conversation(tok, wl.system, 2) for _ in range(wl.users)]
    plain.generate(convs[0].prompt("warm up"), 2)  # first-call allocations out of the timed turns
    turns: list[Turn] = []
    for r in range(wl.rounds):
        for u in range(wl.users):
            prompt = convs[u].prompt(wl.questions[u][r])
            res = plain.generate(prompt, wl.max_new_tokens)
            convs[u].commit(prompt, list(res.tokens))
            turns.append(Turn(r + 1, u + 1, f"u{u + 1}-r{r + 1}", len(prompt), list(res.tokens), res.ttft_s))
            if progress is not None and task is not None:
                progress.advance(task)
    return turns, tok


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
    wl = default_workload(opts.users, opts.rounds, opts.max_new_tokens)
    errors: list[str] = []
    restarts = 0
    with tempfile.TemporaryDirectory(prefix="kvport-demo-") as tmp, Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console, disable=not opts.show_progress, transient=False) as progress:
        setup = progress.add_task("start: shared tier, prefill and decode workers", total=4)
        shared = SharedTier(Path(tmp) / "shared")
        workers: list[Worker] = []
        turns: list[Turn] = []
        raw_gbps: float | None = None
        try:
            port = shared.start()
            progress.advance(setup)
            max_blocks = 1024  # 16k tokens: the decode worker's receive buffer, allocated once
            dl = settings.load_deadline
            deadline_cfg = (dl.min_s, dl.factor, dl.max_s)
            secret = secrets.token_hex(32)  # the hand-off's: the two workers authenticate their link with it
            dcfg = {"model_dir": str(model_dir), "shared_port": port, "threads": opts.threads,
                    "budget_bytes": opts.receive_budget_bytes, "max_blocks": max_blocks, "owner": "decode-1",
                    "secret": secret, "load_deadline": deadline_cfg}
            pcfg = {"model_dir": str(model_dir), "shared_port": port, "threads": opts.threads,
                    "host_bytes": 256 << 20, "owner": "prefill", "secret": secret, "load_deadline": deadline_cfg}
            pw = Worker("prefill-worker", prefill_main, pcfg)
            dw = Worker("decode-worker", decode_main, dcfg)
            workers += [pw, dw]
            pw.ready(600)
            progress.advance(setup)
            pw.call({"op": "connect", "address": dw.ready(600)["address"]})
            progress.advance(setup)
            raw_gbps = raw_socket_gbps(32 << 20, trials=2) if opts.measure_link else None
            progress.advance(setup)
            turns, tok = _baseline(model_dir, wl, opts.threads, progress)
            task = progress.add_task("kvport (prefill worker -> decode worker)", total=len(turns))
            convs = [Conversation(tok, wl.system, 2) for _ in range(wl.users)]
            shared_prefix = convs[0].shared_prefix_tokens()
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

            by_user: dict[int, Turn] = {}
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
                    restarts += 1
                    restarted = True
                    progress.update(task, description="kvport (prefill worker -> decode worker)")
                prev = by_user.get(t.user)
                if prev is not None and prev.tokens is None:
                    drain(prev)  # the user's next prompt extends the previous answer
                by_user[t.user] = t
                t.prompt = convs[t.user - 1].prompt(wl.questions[t.user - 1][t.round - 1])
                t.after_restart = restarted
                try:
                    # pipelined: the decode worker may still be decoding the previous turn while this
                    # prefill streams; its receive budget then fills and the prefill waits for credits
                    dw.send({"op": "expect", "rid": t.rid, "n_tokens": len(t.prompt)})
                    d_replies.append(("expecting", None))
                    t.prefill = pw.call({"op": "prefill", "rid": t.rid, "prompt": t.prompt})
                    # the rest of the stream after the first token: its bytes over the link measured
                    # now (None when not measured: the deadline policy's maximum)
                    expected = None if raw_gbps is None else t.prefill["transfer_bytes"] / (raw_gbps * 1e9)
                    dw.send({"op": "decode", "rid": t.rid, "prompt": t.prompt,
                             "first_token": t.prefill["first_token"], "max_new": wl.max_new_tokens,
                             "hit_blocks": t.prefill["hit_tokens"] // spec.block_size,
                             "shared_prefix_tokens": shared_prefix, "expected_s": expected})
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
    cond = {"model": "SmolLM2-135M-Instruct fp32 (transformers)", "users": wl.users, "rounds": wl.rounds,
            "max_new_tokens": wl.max_new_tokens, "threads_per_process": opts.threads,
            "receive_budget_bytes": opts.receive_budget_bytes, "block_size": spec.block_size,
            "bytes_per_token": spec.bytes_per_token, "bytes_per_block": spec.bytes_per_block,
            "link": "tcp 127.0.0.1", "shared_tier": "kvport serve (host + disk), 127.0.0.1"}
    summary = summarize(turns, raw_socket_gbps=raw_gbps, block_size=spec.block_size, restarts=restarts,
                        errors=errors, conditions=cond)
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

