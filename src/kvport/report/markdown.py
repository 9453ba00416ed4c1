"""The benchmarks as a Markdown reference: per suite, its current figures, conditions and command.

Written from the suites' JSON alone (no plots, no extra): each section says what the suite measures,
the command that regenerates it, when, on which commit and CPU, in which mode, and its headline
figures (:data:`HEADLINES`; a suite without an entry shows its top-level numbers). A figure the
report lacks reads ``unknown``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kvport.bench
from kvport.report.results import Fields, Inputs, SuiteReport, finite

# suite -> (label, field): the figures a reader looks for first
HEADLINES: dict[str, tuple[tuple[str, str], ...]] = {
    "hash": (("chained keys/s, 16 tokens a block", "results.blocks_per_second_16"),
             ("vs raw xxh3-128, 16 tokens", "results.vs_raw_hash_16"),
             ("chained keys/s, 256 tokens a block", "results.blocks_per_second_256"),
             ("vs raw xxh3-128, 256 tokens", "results.vs_raw_hash_256")),
    "tiers": (("host put vs memcpy", "results.host_put_vs_memcpy"),
              ("host get vs memcpy", "results.host_get_vs_memcpy"),
              ("disk write vs raw disk", "results.disk_write_vs_raw"),
              ("disk read vs raw disk", "results.disk_read_vs_raw"),
              ("Redis put vs raw Redis", "results.redis_put_vs_raw"),
              ("Redis get vs raw Redis", "results.redis_get_vs_raw")),
    "transfer": (("TCP GB/s", "results.tcp_gbps"), ("TCP vs raw socket", "results.tcp_vs_raw_socket"),
                 ("shared memory GB/s", "results.shm_gbps"), ("shared memory vs memcpy", "results.shm_vs_memcpy"),
                 ("layer-wise streamed vs bound", "results.layerwise.streamed_vs_bound"),
                 ("overload: peak memory / budget (backpressure)", "results.overload.peak_memory_vs_budget"),
                 ("overload: goodput / capacity (backpressure)", "results.overload.goodput_vs_capacity"),
                 ("overload: blocks lost (backpressure)", "results.overload.lost_blocks"),
                 ("overload: blocks lost (no backpressure)", "results.overload_no_backpressure.lost_blocks")),
    "planner": (("choices within 10% of the best", "results.within_10pct_of_best"),
                ("max regret", "results.max_regret"),
                ("static profile: within 10% of the best", "results.static_profile.within_10pct_of_best")),
    "server": (("GB/s, 4 client processes", "results.throughput_gbps"),
               ("vs raw socket", "results.throughput_vs_raw_socket"),
               ("one client vs raw socket", "results.single_client_vs_raw_socket"),
               ("p50 ms", "results.p50_ms"), ("p99 ms", "results.p99_ms"),
               ("lost or corrupt", "results.lost_or_corrupt"),
               ("peak RSS / capacity at 2x capacity written", "results.peak_memory_vs_capacity")),
    "prefix": (("transformers: TTFT speedup at 1920 of 2048 tokens cached", "results.hf.ttft_speedup"),
               ("transformers: zero-hit overhead", "results.hf.zero_hit_overhead"),
               ("transformers: load vs memcpy", "results.hf.load_vs_memcpy"),
               ("vLLM: TTFT speedup, loaded from kvport", "results.vllm.ttft_speedup"),
               ("vLLM: loaded vs vLLM's own prefix cache", "results.vllm.loaded_vs_vllm_prefix_cache"),
               ("vLLM: zero-hit overhead", "results.vllm.zero_hit_overhead"),
               ("vLLM: tokens equal", "results.vllm.tokens_equal")),
    "pd": (("tokens equal to the colocated engine", "results.tokens_equal"),
           ("logprob max abs diff", "results.logprob_max_abs_diff"),
           ("end to end at 0.2 req/s: mean TTFT, PD over colocated", "results.e2e_ttft_vs_colocated"),
           ("end to end at 0.2 req/s: goodput, PD over colocated", "results.e2e_goodput_vs_colocated"),
           ("end to end: kvport's own s per request (proxy + connectors)", "results.e2e_kvport_own_s"),
           ("end to end: kvport's own time over PD's mean TTFT", "results.e2e_kvport_own_vs_ttft"),
           ("end to end: prefill compute, one core over the colocated engine's",
            "results.e2e.verdict.prefill_compute_vs_colocated"),
           ("decode TTFT after a hand-off over recomputing (the prefill left out)", "results.decode_ttft_vs_recompute"),
           ("exposed transfer vs ideal", "results.exposed_transfer_vs_ideal"),
           ("history hit rate on the other prefill engine", "results.turn2_hit_rate"),
           ("multi-turn TTFT speedup", "results.multi_turn_ttft_speedup"),
           ("decode TTFT over vLLM NixlConnector's", "results.ttft_vs_nixl_connector"),
           ("overload: lost requests", "results.lost_requests"),
           ("overload: server peak RSS / capacity", "results.peak_memory_vs_budget")),
    "simulate": (("demo: median error of predicted per-turn TTFT", "results.demo_ttft_error"),
                 ("bench pd's rates: largest goodput error", "results.load_goodput_error"),
                 ("published cases within 2x (of those predicted)", "results.published.within_2x"),
                 ("published cases within 1.3x", "results.published.within_1_3x"),
                 ("published: worst ratio", "results.published.worst_ratio"),
                 ("seconds to simulate the conversation trace", "results.trace_seconds")),
    "route": (("prefix routing: mean TTFT over round-robin's", "results.ttft_vs_round_robin"),
              ("prefix routing: engine cache hit rate", "results.hit_rate"),
              ("round-robin: engine cache hit rate", "results.round_robin_hit_rate"),
              ("KV events per second", "results.events_per_second"),
              ("events vs raw ZeroMQ", "results.events_vs_raw_zmq"),
              ("index bytes per block", "results.index_bytes_per_block")),
    "reshard": (("every case's tokens equal", "results.all_tokens_equal"),
                ("TP1 -> TP1: decode TTFT over one process", "results.tp1_to_tp1.decode_ttft_vs_one_process"),
                ("TP3 -> TP1: decode TTFT over one process", "results.tp3_to_tp1.decode_ttft_vs_one_process"),
                ("TP1 -> TP3: decode TTFT over one process", "results.tp1_to_tp3.decode_ttft_vs_one_process"),
                ("TP3 -> TP3: decode TTFT over one process", "results.tp3_to_tp3.decode_ttft_vs_one_process")),
    "scaleout": (("NIXL: kvport vs bare NIXL", "results.nixl_vs_bare_nixl"),
                 ("NIXL over TCP vs raw socket", "results.nixl_tcp_vs_raw_socket"),
                 ("Redis Cluster put / get vs raw", "results.redis_cluster_put_vs_raw"),
                 ("Redis Cluster get vs raw", "results.redis_cluster_get_vs_raw"),
                 ("failover: wrong outputs", "results.failover.wrong_outputs"),
                 ("failover: acknowledged lost (with WAIT)", "results.failover.acknowledged_lost_with_wait"),
                 ("slot migration: lost", "results.reshard.lost")),
    "soak": (("leaked pins", "results.leaked_pins"), ("leaked leases", "results.leaked_leases"),
             ("blocks without owner", "results.blocks_without_owner"), ("orphan children", "results.orphan_children"),
             ("lost committed", "results.lost_committed"),
             ("peak memory / capacity", "results.peak_memory_vs_capacity"),
             ("ops per second", "results.ops_per_second")),
    "faults": (("fault classes tested", "results.classes_tested"), ("requests", "results.requests"),
               ("faults injected", "results.injected"), ("wrong outputs", "results.wrong_outputs"),
               ("hung", "results.hung"), ("lost committed", "results.lost_committed"),
               ("not recovered", "results.not_recovered"), ("recomputed", "results.recomputed")),
    "demo": (("turns completed", "results.completed"),
             ("outputs equal to recomputing", "results.outputs_equal_baseline"),
             ("TTFT from round 2: kvport over recomputing, speedup", "results.ttft_round2plus_speedup"),
             ("history found from round 2", "results.hit_rate_tokens_after_round_1")),
    "trace": (("default policy", "results.policy"),
              ("mean gain over LRU (of the optimum)", "results.mean_gain_over_lru"),
              ("worst cell vs LRU", "results.worst_cell_vs_lru"),
              ("int8 at 10% of bytes vs optimum", "results.int8_same_bytes_10pct_vs_optimal")),
}


def suite_titles() -> dict[str, str]:
    """What each suite measures, from the bench package's module map (one source for both)."""
    out: dict[str, str] = {"demo": "the main job: long chats and agent sessions, prefill/decode disaggregation "
                                   "with kvport against recomputing (kvport demo --json)"}
    for line in (kvport.bench.__doc__ or "").splitlines():
        m = re.match(r"^    ([a-z_]+)\s{2,}(\S.*)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "unknown"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int | float):
        f = finite(v)
        return "unknown" if f is None else (f"{f:.4g}" if isinstance(v, float) else str(v))
    return str(v)


def _cell(text: str) -> str:
    """A table cell: one line, no column break, bounded."""
    return " ".join(text.split()).replace("|", "\\|")[:200]


def _codec_rows(rep: SuiteReport) -> list[tuple[str, str]]:
    codecs = rep.results.get("codecs")
    rows = []
    for name, r in sorted(codecs.items()) if isinstance(codecs, dict) else []:
        if isinstance(r, dict):
            rows.append((f"{name}: size ratio, perplexity change prose / code (%), encode / decode GB/s",
                         " / ".join(_fmt(r.get(k)) for k in ("ratio", "ppl_delta_pct_prose", "ppl_delta_pct_code",
                                                             "encode_gbps", "decode_gbps"))))
    return rows


def _trace_rows(rep: SuiteReport) -> list[tuple[str, str]]:
    traces = rep.results.get("traces")
    policy = rep.results.get("policy")
    rows = []
    for name, tab in sorted(traces.items()) if isinstance(traces, dict) else []:
        cells = tab.get("capacities") if isinstance(tab, dict) else None
        for cap, row in cells.items() if isinstance(cells, dict) else []:
            if isinstance(row, dict):
                rows.append((f"{name} at {cap}: optimum, {policy} / optimum, lru / optimum",
                             " / ".join(_fmt(row.get(k)) for k in ("optimal_hit_rate", f"{policy}_vs_optimal",
                                                                   "lru_vs_optimal"))))
    return rows


EXPANDED = {"codec": _codec_rows, "trace": _trace_rows}


def _rows(rep: SuiteReport) -> list[tuple[str, str]]:
    f = Fields(rep)
    spec = HEADLINES.get(rep.suite)
    if spec is None:
        rows = [(k, _fmt(v)) for k, v in rep.results.items() if isinstance(v, int | float | str | bool)][:24]
    else:
        rows = [(label, _fmt(f.get(path))) for label, path in spec]
    more = EXPANDED.get(rep.suite)
    return rows + (more(rep) if more else [])


MAX_LIMITS = 8  # limits named in a section: the first ones the report gives


def _limits(rep: SuiteReport) -> str | None:
    """The physical limits measured in the same run (numbers at the top of ``limits``), one line."""
    got = [(k, v) for k, v in rep.limits.items() if isinstance(v, int | float) and not isinstance(v, bool)]
    if not got:
        return None
    more = f" (and {len(got) - MAX_LIMITS} more in the JSON)" if len(got) > MAX_LIMITS else ""
    return "Limits measured in the same run: " + ", ".join(f"`{k}` {_fmt(v)}" for k, v in got[:MAX_LIMITS]) + more


def section(rep: SuiteReport, titles: dict[str, str]) -> str:
    lines = [f"## {rep.suite}: {_cell(titles.get(rep.suite, 'suite'))}", ""]
    cmd = rep.conditions.get("command")
    lines.append(f"Regenerate: `{_cell(str(cmd)).replace('`', '')}`" if cmd else
                 "Regenerate: unknown (the report does not name its command)")
    lines += ["", _cell(rep.summary()), ""]
    lim = _limits(rep)
    if lim:
        lines += [" ".join(lim.split()), ""]
    lines += [f"> {_cell(n)}" for n in rep.notes] + ([""] if rep.notes else [])
    lines += ["| figure | value |", "|---|---|"]
    lines += [f"| {_cell(label)} | {_cell(value)} |" for label, value in _rows(rep)]
    return "\n".join(lines) + "\n"


# in a file --markdown writes over, what is above this line is kept (a document's own introduction)
MARKER = "<!-- kvport report --markdown writes everything below this line: edit above it -->"
INTRO = ("The current figures of each suite, written by `kvport report --markdown` from the suites' JSON. Each "
         "section names its conditions and the command that regenerates it; a figure a report lacks reads "
         "*unknown*. Older figures live in git history.")


def body(inputs: Inputs, order: Sequence[str] | None = None) -> str:
    """Every suite's section (and the files not read)."""
    titles = suite_titles()
    names = [s for s in (order or sorted(inputs.reports)) if s in inputs.reports]
    parts = [section(inputs.reports[s], titles) for s in names]
    if inputs.refused:
        parts += ["## Files not read", ""] + [f"- `{p}`: {why}" for p, why in inputs.refused] + [""]
    return "\n".join(parts)


def render(inputs: Inputs, order: Sequence[str] | None = None, intro: str = "") -> str:
    return "\n".join(["# Benchmarks", "", intro or INTRO, "", body(inputs, order)])


def write(path: Path, inputs: Inputs) -> None:
    """The reference to ``path``: when the file holds :data:`MARKER`, what is above it is kept and
    everything below rewritten; otherwise the whole file is written."""
    try:
        old = path.read_text()
    except (OSError, UnicodeDecodeError):
        old = ""
    if MARKER in old:
        head = old[: old.index(MARKER)]
        path.write_text(f"{head}{MARKER}\n\n{INTRO}\n\n{body(inputs)}")
    else:
        path.write_text(render(inputs))
