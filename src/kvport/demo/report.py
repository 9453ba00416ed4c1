"""The demo's final report: a per-turn table and a summary, as a dict (``--json``) and as rich text.

Bytes moved are set against the size calculator's ideal (:meth:`KVSpec.request_bytes`, as
``kvport size`` computes it): each path's ideal is the KV of the tokens that had to take it, once::

    prefill -> decode      every prompt token (the decode worker holds nothing of the session)
    shared tier -> prefill the tokens loaded instead of computed
    decode -> shared tier  the tokens the tier did not hold yet (prompt + answer - found)

what moved adds whole-block padding, each stored block's sealed header and blocks stored again.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from kvport.spec import KVSpec

PATHS = ("prefill_to_decode", "loaded_from_tiers", "stored_to_shared_tier")


@dataclass(slots=True)
class Turn:
    round: int  # 1-based
    user: int  # 1-based
    rid: str
    prompt_tokens: int  # the baseline's prompt length
    baseline_tokens: list[int]
    baseline_ttft_s: float
    tokens: list[int] | None = None
    prefill: dict[str, Any] = field(default_factory=dict)
    decode: dict[str, Any] = field(default_factory=dict)
    after_restart: bool = False
    error: str | None = None
    prompt: list[int] = field(default_factory=list)  # the kvport run's prompt
    session: str = ""
    history_tokens: int = 0  # the session's tokens before this turn (the baseline's)
    started_s: float | None = None  # when its prefill was asked, from the first turn's (kvport run)

    @property
    def equal(self) -> bool:
        return self.tokens is not None and self.tokens == self.baseline_tokens


def _sum(turns: list[Turn], side: str, key: str) -> float:
    return float(sum((getattr(t, side).get(key) or 0) for t in turns))


def _bytes(t: Turn, spec: KVSpec, sealed_block_bytes: int) -> dict[str, tuple[int, int]]:
    """(moved, ideal) bytes of each path for one turn (see the module docstring)."""
    p, d, bs = t.prefill, t.decode, spec.block_size
    loaded = int(p.get("loaded_tokens") or 0)
    answer = len(t.tokens or ())
    new_in_tier = max(0, t.prompt_tokens + max(0, answer - 1) - int(p.get("hit_tokens") or 0))
    return {"prefill_to_decode": (int(p.get("transfer_bytes") or 0), spec.request_bytes(t.prompt_tokens)),
            "loaded_from_tiers": (loaded // bs * sealed_block_bytes, spec.request_bytes(loaded)),
            "stored_to_shared_tier": (int(d.get("stored_blocks") or 0) * sealed_block_bytes,
                                      spec.request_bytes(new_in_tier) if d else 0)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 2)


def block_ids(turns: list[Turn], block_size: int) -> dict[str, list[int]]:
    """Each turn's full prompt blocks as small chained ids, equal where two prompts share the whole
    prefix up to that block: a Mooncake-format trace of the run (``kvport bench simulate`` replays it)."""
    seen: dict[tuple[int, tuple[int, ...]], int] = {}
    out: dict[str, list[int]] = {}
    for t in turns:
        parent, row = -1, []
        for i in range(len(t.prompt) // block_size):
            key = (parent, tuple(t.prompt[i * block_size:(i + 1) * block_size]))
            parent = seen.setdefault(key, len(seen))
            row.append(parent)
        out[t.rid] = row
    return out


def summarize(turns: list[Turn], *, spec: KVSpec, raw_socket_gbps: float | None, restarts: int,
              errors: list[str], conditions: dict[str, Any]) -> dict[str, Any]:
    sealed = int(conditions.get("stored_bytes_per_block") or spec.bytes_per_block)
    done = [t for t in turns if t.prefill]
    ids = block_ids(done, spec.block_size)
    later = [t for t in done if t.round > 1]
    xfer_bytes = _sum(done, "prefill", "transfer_bytes")
    busy = _sum(done, "prefill", "transfer_busy_s")
    waited = _sum(done, "prefill", "credit_wait_s")
    sending = max(0.0, busy - waited)
    ideal = xfer_bytes / (raw_socket_gbps * 1e9) if raw_socket_gbps else None
    hit_tokens = _sum(done, "prefill", "hit_tokens")
    tiers: Counter[str] = Counter()
    for t in done:
        tiers.update(t.prefill.get("hit_tiers") or {})

    def ttft(ts: list[Turn], key: str) -> float | None:
        vals = [t.prefill["ttft_s"] if key == "kvport" else t.baseline_ttft_s for t in ts]
        return round(sum(vals) / len(vals), 4) if vals else None

    per_path = {t.rid: _bytes(t, spec, sealed) for t in done}
    moved = {k: sum(b[k][0] for b in per_path.values()) for k in PATHS}
    least = {k: sum(b[k][1] for b in per_path.values()) for k in PATHS}
    moved["total"], least["total"] = sum(moved.values()), sum(least.values())
    base2, kv2 = ttft(later, "baseline"), ttft(later, "kvport")
    hist = [t.history_tokens for t in later]

    return {
        "conditions": conditions,
        "turns": len(turns),
        "completed": len(done),
        "outputs_equal_baseline": bool(turns) and all(t.equal for t in turns),
        "mismatched_turns": [t.rid for t in turns if not t.equal],
        "hit_rate_tokens": round(hit_tokens / max(1.0, _sum(done, "prefill", "prompt_tokens")), 4),
        "hit_rate_tokens_after_round_1": round(_sum(later, "prefill", "hit_tokens")
                                               / max(1.0, _sum(later, "prefill", "prompt_tokens")), 4),
        "hit_blocks_by_tier": dict(tiers),
        "ttft_round2plus_s": {"baseline_recompute": base2, "kvport": kv2},
        "ttft_round2plus_speedup": _ratio(base2, kv2),
        "history_tokens_round2plus": {"min": min(hist, default=0), "max": max(hist, default=0),
                                      "mean": round(sum(hist) / len(hist)) if hist else 0},
        "mean_ttft_s": {"baseline_no_reuse": ttft(done, "baseline"), "kvport": ttft(done, "kvport"),
                        "baseline_no_reuse_after_round_1": ttft(later, "baseline"),
                        "kvport_after_round_1": ttft(later, "kvport")},
        "bytes_moved": moved,
        "bytes_ideal": least,  # the size calculator's KV bytes of the tokens that had to move, per path
        "bytes_moved_vs_ideal": {k: _ratio(moved[k], least[k]) for k in moved},
        "transfer": {"busy_s": round(busy, 4), "credit_wait_s": round(waited, 4), "sending_s": round(sending, 4),
                     "ideal_s": None if ideal is None else round(ideal, 4),
                     "sending_vs_ideal": None if not ideal or not sending else round(sending / ideal, 2),
                     "raw_socket_gbps": raw_socket_gbps,
                     "exposed_after_first_token_s": round(_sum(done, "prefill", "transfer_tail_s"), 4),
                     "committed": sum(1 for t in done if t.prefill.get("committed")),
                     "failed": [t.prefill["transfer_error"] for t in done if t.prefill.get("transfer_error")]},
        "planner": dict(Counter(t.prefill.get("choice", "?") for t in done)),
        "planner_reasons": sorted({t.prefill.get("reason", "") for t in done}),
        "backpressure": {"credit_waits": int(_sum(done, "prefill", "credit_waits")),
                         "credit_wait_s": round(_sum(done, "prefill", "credit_wait_s"), 4),
                         "admission_rejections": int(_sum(done, "prefill", "admission_rejections"))},
        "ownership": {"handed_off_blocks": int(_sum(done, "prefill", "handed_off_blocks")),
                      "acquired_blocks": int(_sum(done, "decode", "acquired_blocks")),
                      "engine_blocks_owned_after_requests": int(max(
                          [t.prefill.get("owned_after", 0) for t in done]
                          + [t.decode.get("owned_after", 0) for t in done], default=0))},
        "decode_restarts": restarts,
        "after_restart": {"turns": sum(1 for t in done if t.after_restart),
                          "hit_tokens": int(sum(t.prefill.get("hit_tokens", 0) for t in done if t.after_restart)),
                          "outputs_equal": all(t.equal for t in done if t.after_restart)},
        "decode_fallbacks": [t.decode["fallback"] for t in done if t.decode.get("fallback")],
        "store_errors": [f"{t.rid}: {t.decode['store_error']}" for t in done if t.decode.get("store_error")],
        "errors": errors,
        "per_turn": [{"rid": t.rid, "start_s": None if t.started_s is None else round(t.started_s, 4),
                      "block_ids": ids.get(t.rid, []), "round": t.round, "user": t.user, "session": t.session,
                      "history_tokens": t.history_tokens, "prompt_tokens": t.prompt_tokens,
                      "hit_tokens": t.prefill.get("hit_tokens"), "loaded_tokens": t.prefill.get("loaded_tokens"),
                      "choice": t.prefill.get("choice"), "ttft_baseline_s": round(t.baseline_ttft_s, 4),
                      "ttft_kvport_s": t.prefill.get("ttft_s"),
                      "ttft_speedup": _ratio(t.baseline_ttft_s, t.prefill.get("ttft_s")),
                      "bytes_moved": {k: v[0] for k, v in per_path[t.rid].items()} if t.rid in per_path else None,
                      "bytes_ideal": {k: v[1] for k, v in per_path[t.rid].items()} if t.rid in per_path else None,
                      "load_s": t.prefill.get("load_s"),
                      "compute_s": t.prefill.get("compute_s"), "transfer_bytes": t.prefill.get("transfer_bytes"),
                      "credit_waits": t.prefill.get("credit_waits"), "after_restart": t.after_restart,
                      "equal": t.equal} for t in turns],
    }


def render(console: Console, turns: list[Turn], summary: dict[str, Any]) -> None:
    tab = Table(title="kvport demo: prefill/decode disaggregation, long chats and agent sessions "
                      "(SmolLM2-135M-Instruct)")
    for col in ("turn", "session", "history", "prompt", "reused", "planner", "TTFT recompute", "TTFT kvport",
                "speedup", "KV moved / ideal", "waits", "output"):
        tab.add_column(col, justify="left" if col in ("turn", "session", "planner", "output") else "right")
    rows = {r["rid"]: r for r in summary["per_turn"]}
    for t in turns:
        p, row = t.prefill, rows[t.rid]
        ttft = p.get("ttft_s")
        mv, ie = row["bytes_moved"], row["bytes_ideal"]
        tab.add_row(
            f"r{t.round} u{t.user}" + (" *" if t.after_restart else ""), t.session, str(t.history_tokens),
            str(t.prompt_tokens), str(p.get("hit_tokens", "-")), str(p.get("choice", "-")),
            f"{t.baseline_ttft_s * 1e3:.0f} ms", f"{ttft * 1e3:.0f} ms" if ttft else "-",
            f"{t.baseline_ttft_s / ttft:.1f}x" if ttft else "-",
            f"{sum(mv.values()) / 2**20:.0f} / {sum(ie.values()) / 2**20:.0f} MiB" if mv and ie else "-",
            str(int(p.get("credit_waits") or 0)),
            "[green]= baseline[/]" if t.equal else f"[red]DIFFERS[/] {t.error or ''}")
    console.print(tab)
    s = summary
    m, x, b, ib = s["mean_ttft_s"], s["transfer"], s["bytes_moved"], s["bytes_ideal"]
    h, r2 = s["history_tokens_round2plus"], s["ttft_round2plus_s"]
    console.print("* = after the decode worker was restarted; KV moved = prefill->decode + loaded + stored")
    lines = [
        f"outputs equal to a single-process run without kvport: "
        f"{'[green]yes, every turn[/]' if s['outputs_equal_baseline'] else '[red]NO[/] ' + str(s['mismatched_turns'])}",
        f"hit rate (prompt tokens whose KV was found): {s['hit_rate_tokens']:.1%} overall, "
        f"{s['hit_rate_tokens_after_round_1']:.1%} from round 2 on; blocks by tier {s['hit_blocks_by_tier']}",
        f"[bold]mean TTFT from round 2 on: {_ms(r2['baseline_recompute'])} recomputing, "
        f"{_ms(r2['kvport'])} with kvport: {_num(s['ttft_round2plus_speedup'])}x lower[/] "
        f"(history {h['min']}-{h['max']} tokens, mean {h['mean']}); all rounds: "
        f"{_ms(m['baseline_no_reuse'])} vs {_ms(m['kvport'])}",
        "bytes moved vs the size calculator's ideal (KV of the tokens that had to move): "
        + ", ".join(f"{k.replace('_', ' ')} {b[k] / 2**20:.1f} / {ib[k] / 2**20:.1f} MiB"
                    for k in (*PATHS, "total"))
        + f" (x{_num(s['bytes_moved_vs_ideal']['total'])})",
        f"transfer: {x['sending_s']:.3f} s sending, streamed during prefill (+{x['credit_wait_s']:.3f} s waiting "
        f"for credits while the decode worker was busy; streams ended {x['exposed_after_first_token_s']:.3f} s "
        f"after the first tokens in all) vs the calculator's ideal "
        f"{_num(x['ideal_s'])} s at the raw socket's {_num(x['raw_socket_gbps'])} GB/s measured now "
        f"(x{x['sending_vs_ideal']}); {x['committed']} committed, {len(x['failed'])} failed",
        f"planner decisions: {s['planner']}",
        f"backpressure: {s['backpressure']['credit_waits']} credit waits "
        f"({s['backpressure']['credit_wait_s']:.3f} s), {s['backpressure']['admission_rejections']} admission "
        "rejections",
        f"ownership: {s['ownership']['handed_off_blocks']} blocks handed off prefill -> decode and "
        f"{s['ownership']['acquired_blocks']} acquired (each commit recorded in both engines' ledgers with "
        f"its transfer id); blocks an engine still owned after its request: "
        f"{s['ownership']['engine_blocks_owned_after_requests']}",
        f"decode worker restarts: {s['decode_restarts']}; after restart {s['after_restart']['turns']} turns reused "
        f"{s['after_restart']['hit_tokens']} tokens from the shared tier, outputs equal: "
        f"{s['after_restart']['outputs_equal']}",
    ]
    if s["errors"] or s["decode_fallbacks"] or s["store_errors"]:
        lines.append(f"[yellow]errors/fallbacks/saves that failed[/]: "
                     f"{s['errors'] + s['decode_fallbacks'] + s['store_errors']}")
    for line in lines:
        console.print(line)


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f} ms"
