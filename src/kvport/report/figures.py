"""The report's figures: each reads the suites it needs and draws one matplotlib figure, or says it is unknown.

=====================  ================  ====================================================================
figure                 suites            shows
=====================  ================  ====================================================================
ttft_vs_length         planner           time to first token against prompt length for recompute, load and
                                         split, measured, at each link speed; the planner's choice circled
hit_rate_vs_capacity   trace             prefix-hit rate against capacity for each eviction policy, with the
                                         offline optimum (Belady), per trace
throughput_vs_limit    tiers, transfer,  each tier and transport's GB/s beside its physical limit measured in
                       server            the same run (memcpy, raw disk, raw Redis, raw socket)
codec_size_quality     codec             size ratio against perplexity change on the real model, per codec
overload_over_time     transfer          memory held and goodput over time under 3x overload, with and
                                         without backpressure
pd_end_to_end          pd                client-side TTFT (mean, p90) and goodput against request rate, kvport
                                         PD against one colocated engine, and where the mean TTFT went
demo_ttft_per_turn     demo              the demo's time to first token per turn, with kvport and recomputing
=====================  ================  ====================================================================

A figure is drawn from the fields it finds; a field it needs and does not find makes it *unknown*
(:class:`Drawn` ``missing``), never filled in. Drawing needs the ``report`` extra (matplotlib).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvport.extras import require
from kvport.report.results import Fields, Inputs, SuiteReport, finite

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure
except ImportError:
    require("report", __name__)
    raise


@dataclass(slots=True)
class Drawn:
    key: str
    title: str
    suites: tuple[str, ...]  # the suites it was drawn from (those present)
    caption: str
    svg: str | None = None  # None: unknown
    missing: list[str] = field(default_factory=list)  # fields (or suites) it needed and did not find


Draw = Callable[[dict[str, Fields]], Figure | None]


@dataclass(frozen=True, slots=True)
class FigureSpec:
    key: str
    title: str
    suites: tuple[str, ...]  # it is drawn when at least one of them was run
    caption: str
    draw: Draw


_num = finite
MAX_PANELS = 6  # panels of one figure (link speeds, traces): a report asking for more shows the first ones


def _dict(v: object) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _figure(n: int = 1, width: float = 5.2, height: float = 3.6) -> tuple[Figure, Sequence[Any]]:
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    return fig, list(axes[0])


# ---------------------------------------------------------------------- TTFT against prompt length
def _ttft_vs_length(f: dict[str, Fields]) -> Figure | None:
    p = f["planner"]
    cells = p.get("results.cells")
    if not isinstance(cells, list) or not cells:
        return None
    bws = sorted({b for c in cells if isinstance(c, dict) and (b := _num(c.get("bandwidth_mbps"))) is not None})
    bws = bws[:MAX_PANELS]
    if not bws:
        p.missing.append("planner: results.cells[].bandwidth_mbps")
        return None
    fig, axes = _figure(len(bws), width=4.6)
    for ax, bw in zip(axes, bws, strict=True):
        cs = sorted((c for c in cells if isinstance(c, dict) and _num(c.get("bandwidth_mbps")) == bw),
                    key=lambda c: _num(c.get("tokens")) or 0)
        for option, style in (("recompute", "o-"), ("load", "s-"), ("split", "^--")):
            pts = [(_num(c.get("tokens")), _num(_dict(c.get("measured_s")).get(option))) for c in cs]
            pts = [(x, y) for x, y in pts if x is not None and y is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=option, markersize=4)
        chosen = []
        for c in cs:
            action = str(_dict(c.get("online")).get("action", "")).split(":")[0]
            x, y = _num(c.get("tokens")), _num(_dict(c.get("measured_s")).get(action))
            if x is not None and y is not None:
                chosen.append((x, y))
        if chosen:
            ax.scatter(*zip(*chosen, strict=True), s=150, facecolors="none", edgecolors="black", linewidths=1.2,
                       label="planner's choice", zorder=3)
        for cross in p.get("results.crossover", [], need=False) or []:
            if isinstance(cross, dict) and _num(cross.get("bandwidth_mbps")) == bw:
                for key, style, what in (("measured_tokens", ":", "measured"), ("predicted_tokens", "-.", "planner's")):
                    x = _num(cross.get(key))
                    if x is not None:
                        ax.axvline(x, color="grey", linestyle=style, label=f"{what} crossover {x:g} tokens")
        ax.set_title(f"link {bw:g} MB/s")
        ax.set_xlabel("prompt tokens")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("time to first token (s)")
    axes[0].legend(fontsize=8)
    return fig


# ---------------------------------------------------------------------- hit rate against capacity
def _capacity(label: str) -> float | None:
    try:
        return float(label.rstrip("%"))
    except ValueError:
        return None


def trace_tables(t: Fields) -> dict[str, dict[str, dict[str, Any]]]:
    """``{trace: {"10%": {"optimal_hit_rate": x, "<policy>_hit_rate": y, ...}}}`` from a trace report:
    ``results.traces`` (one table per trace), else ``results.sweep.all`` (one trace, older reports)."""
    traces = t.get("results.traces", need=False)
    if isinstance(traces, dict) and traces:
        out = {}
        for name, tab in traces.items():
            rows = tab.get("capacities", tab) if isinstance(tab, dict) else None
            if isinstance(rows, dict):
                out[str(name)] = {k: v for k, v in rows.items() if isinstance(v, dict) and _capacity(str(k))}
        return out
    sweep = t.get("results.sweep.all", need=False)
    if isinstance(sweep, dict):
        return {"conversation": {k: v for k, v in sweep.items() if isinstance(v, dict)}}
    t.missing.append("trace: results.traces (or results.sweep.all: run with --set sweep=true)")
    return {}


def _hit_rate_vs_capacity(f: dict[str, Fields]) -> Figure | None:
    tables = dict(sorted((k, v) for k, v in trace_tables(f["trace"]).items() if v)[:MAX_PANELS])
    if not tables:
        return None
    fig, axes = _figure(len(tables), width=4.8)
    for ax, (name, rows) in zip(axes, sorted(tables.items()), strict=True):
        caps = sorted(rows, key=lambda k: _capacity(k) or 0)
        xs = [_capacity(k) for k in caps]
        policies = sorted({k[: -len("_hit_rate")] for r in rows.values() for k in r
                           if k.endswith("_hit_rate") and k != "optimal_hit_rate"})
        for pol in policies:
            pts = [(x, _num(rows[k].get(f"{pol}_hit_rate"))) for x, k in zip(xs, caps, strict=True)]
            pts = [(x, y) for x, y in pts if x is not None and y is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-", markersize=4, label=pol)
        opt = [(x, _num(rows[k].get("optimal_hit_rate"))) for x, k in zip(xs, caps, strict=True)]
        opt = [(x, y) for x, y in opt if x is not None and y is not None]
        if opt:
            ax.plot(*zip(*opt, strict=True), "k--", label="optimum (Belady)")
        ax.set_title(f"{name} trace")
        ax.set_xlabel("capacity (% of distinct blocks)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("prefix-hit rate")
    axes[0].legend(fontsize=8)
    return fig


# ---------------------------------------------------------------------- throughput against the limit
# (suite, label, measured field, limit field): GB/s both
THROUGHPUT_PAIRS: tuple[tuple[str, str, str, str], ...] = (
    ("tiers", "host tier put", "results.llama_host_put_gbps", "limits.llama_memcpy_gbps"),
    ("tiers", "host tier get", "results.llama_host_get_gbps", "limits.llama_memcpy_gbps"),
    ("tiers", "disk tier write", "results.llama_disk_write_gbps", "limits.llama_raw_disk_write_gbps"),
    ("tiers", "disk tier read", "results.llama_disk_read_gbps", "limits.llama_raw_disk_read_gbps"),
    ("tiers", "Redis tier put", "results.llama_redis_put_gbps", "limits.llama_raw_redis_set_gbps"),
    ("tiers", "Redis tier get", "results.llama_redis_get_gbps", "limits.llama_raw_redis_get_gbps"),
    ("transfer", "transfer TCP", "results.tcp_gbps", "limits.raw_socket_gbps"),
    ("transfer", "transfer shared memory", "results.shm_gbps", "limits.memcpy_gbps"),
)


def _throughput_vs_limit(f: dict[str, Fields]) -> Figure | None:
    bars: list[tuple[str, float, float]] = []
    for suite, label, measured, limit in THROUGHPUT_PAIRS:
        if suite not in f:
            continue
        m, lim = f[suite].num(measured), f[suite].num(limit)
        if m is not None and lim is not None:
            bars.append((label, m, lim))
    if not bars:
        return None
    fig, (ax,) = _figure(1, width=8.0, height=0.45 * len(bars) + 1.2)
    ys = list(range(len(bars)))[::-1]
    ax.barh([y + 0.2 for y in ys], [b[2] for b in bars], height=0.38, color="#c8c8c8", label="physical limit")
    ax.barh([y - 0.2 for y in ys], [b[1] for b in bars], height=0.38, color="#3b75af", label="kvport")
    for y, (_, m, lim) in zip(ys, bars, strict=True):
        ax.text(m, y - 0.2, f" {m:.2f} ({m / lim:.2f}x)" if lim else f" {m:.2f}", va="center", fontsize=8)
    ax.set_yticks(ys, [b[0] for b in bars])
    ax.set_xlabel("GB/s (same run, same bytes)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    return fig


# ---------------------------------------------------------------------- codec size against quality
def _codec_size_quality(f: dict[str, Fields]) -> Figure | None:
    codecs = f["codec"].get("results.codecs")
    if not isinstance(codecs, dict) or not codecs:
        return None
    fig, (ax,) = _figure(1, width=6.4, height=4.0)
    drawn = False
    for text, marker in (("prose", "o"), ("code", "s")):
        pts = []
        for name, r in sorted(codecs.items()):
            if not isinstance(r, dict):
                continue
            x, y = _num(r.get(f"ppl_delta_pct_{text}")), _num(r.get("ratio"))
            if x is None or y is None:
                f["codec"].missing.append(f"codec: results.codecs.{name}.ppl_delta_pct_{text} / ratio")
                continue
            pts.append((x, y, name))
        if pts:
            drawn = True
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=f"perplexity change, {text}")
            for x, y, name in pts:
                ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if not drawn:
        plt.close(fig)
        return None
    ax.axvline(0.0, color="grey", linewidth=0.8)
    ax.set_xlabel("perplexity change on the reference model (%)")
    ax.set_ylabel("size ratio (raw bytes / encoded)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


# ---------------------------------------------------------------------- overload over time
def _overload_over_time(f: dict[str, Fields]) -> Figure | None:
    t = f["transfer"]
    runs = []
    for key, label in (("overload", "with backpressure"), ("overload_no_backpressure", "without backpressure")):
        line = t.get(f"results.{key}.timeline")
        if isinstance(line, dict) and line.get("t_s"):
            runs.append((label, line, t.get(f"results.{key}", {})))
    if not runs:
        return None
    fig, (mem, good) = _figure(2, width=4.8)
    for label, line, _ in runs:
        xs = line.get("t_s") or []
        mem.plot(xs, [b / 2**20 for b in line.get("memory_bytes") or []][: len(xs)], label=label)
        good.plot(xs, (line.get("goodput_mbps") or [])[: len(xs)], label=label)
    run0 = runs[0][2]
    budget, cap = _num(run0.get("budget_bytes")), _num(run0.get("capacity_mbps"))
    if budget is not None:
        mem.axhline(budget / 2**20, color="black", linestyle="--", linewidth=0.8, label="receive budget")
    if cap is not None:
        good.axhline(cap, color="black", linestyle="--", linewidth=0.8, label="consumer capacity")
    mem.set_title("memory held by the receiver")
    mem.set_ylabel("MiB")
    good.set_title("goodput (consumed, intact)")
    good.set_ylabel("MB/s")
    for ax in (mem, good):
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


# ---------------------------------------------------------------------- the demo per turn
def _demo_ttft_per_turn(f: dict[str, Fields]) -> Figure | None:
    turns = f["demo"].get("results.per_turn")
    if not isinstance(turns, list) or not turns:
        return None
    xs, kv, base = [], [], []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            continue
        a, b = _num(t.get("ttft_kvport_s")), _num(t.get("ttft_baseline_s"))
        if a is None or b is None:
            f["demo"].missing.append(f"demo: results.per_turn[{i}].ttft_kvport_s / ttft_baseline_s")
            continue
        xs.append(i + 1)
        kv.append(a)
        base.append(b)
    if not xs:
        return None
    fig, (ax,) = _figure(1, width=min(12.0, 3.0 + 0.35 * len(xs)))
    ax.bar([x - 0.2 for x in xs], base, width=0.4, color="#c8c8c8", label="recompute (no kvport)")
    ax.bar([x + 0.2 for x in xs], kv, width=0.4, color="#3b75af", label="kvport")
    ax.set_yscale("log")
    ax.set_xlabel("turn, in the order run (round 1 of each session first)")
    ax.set_ylabel("time to first token (s)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


# ---------------------------------------------------------------------- PD end to end
_SEGMENTS = ("queue (prefill engine)", "prefill compute", "kvport (connectors + proxy)", "queue (decode engine)",
             "decode engine to first token", "queue", "engine to first token", "other (HTTP, API servers)")


def e2e_segments(row: dict[str, Any]) -> dict[str, float] | None:
    """Where one layout's mean TTFT went (seconds per request, from the engines' and the proxy's /metrics;
    the rest is HTTP and the API servers); None when a figure is missing."""
    b, ttft = _dict(row.get("breakdown")), _num(row.get("ttft_mean_s"))
    pre, ans = _dict(b.get("prefill")), _dict(b.get("answer"))
    if ttft is None or not ans:
        return None
    if pre:  # pd
        vals = [_num(x) for x in (pre.get("queue_s"), pre.get("prefill_s"), pre.get("kvport_s"), ans.get("kvport_s"),
                                  b.get("kvport_own_s"), ans.get("queue_s"), ans.get("engine_ttft_s"))]
        if any(v is None for v in vals):
            return None
        pq, pp, pk, dk, own, dq, dt = (v or 0.0 for v in vals)
        # the connectors' time is inside the engines' (the prefill engine's steps; the decode engine's
        # queue, where a hand-off loads): taken out of them, shown once as kvport's with the proxy's
        out = {"queue (prefill engine)": pq, "prefill compute": max(0.0, pp - pk), "kvport (connectors + proxy)": own,
               "queue (decode engine)": max(0.0, dq - dk), "decode engine to first token": max(0.0, dt - dq)}
    else:
        q, t = _num(ans.get("queue_s")), _num(ans.get("engine_ttft_s"))
        if q is None or t is None:
            return None
        out = {"queue": q, "engine to first token": max(0.0, t - q)}
    out["other (HTTP, API servers)"] = max(0.0, ttft - sum(out.values()))
    return out


def _pd_end_to_end(f: dict[str, Fields]) -> Figure | None:
    p = f["pd"]
    rows = p.get("results.e2e.rates")
    if not isinstance(rows, dict) or not rows:
        return None
    rates = sorted(rows, key=float)
    fig, (ttft, good, where) = _figure(3, width=4.4, height=4.4)
    for layout, color in (("pd", "#3b75af"), ("colocated", "#e1812c")):
        xs, mean, p90, gp = [], [], [], []
        for k in rates:
            r = _dict(_dict(rows[k]).get(layout))
            m, q, g = _num(r.get("ttft_mean_s")), _num(r.get("ttft_p90_s")), _num(r.get("goodput_rps"))
            if m is None or q is None or g is None:
                p.missing.append(f"pd: results.e2e.rates.{k}.{layout}.ttft_mean_s / ttft_p90_s / goodput_rps")
                continue
            xs.append(float(k))
            mean.append(m)
            p90.append(q)
            gp.append(g)
        label = "kvport PD (proxy, prefill core 0, decode core 1)" if layout == "pd" else "one colocated engine"
        ttft.plot(xs, mean, "o-", color=color, label=f"{label}: mean")
        ttft.plot(xs, p90, "o:", color=color, label=f"{layout}: p90")
        good.plot(xs, gp, "o-", color=color, label=label)
    ttft.plot([float(k) for k in rates], [float(k) for k in rates], alpha=0)  # keep the axis on the rates
    ttft.set_xlabel("request rate (req/s)")
    ttft.set_ylabel("time to first token (s), client side")
    ttft.set_yscale("log")
    ttft.legend(fontsize=7)
    good.set_xlabel("request rate (req/s)")
    good.set_ylabel("goodput (req/s within the SLOs)")
    good.plot([0, max(float(k) for k in rates)], [0, max(float(k) for k in rates)], "k--", linewidth=0.7,
              label="offered rate")
    good.legend(fontsize=7)
    at = p.get("results.e2e.verdict.rate")
    row = _dict(rows.get(at)) if isinstance(at, str) else {}
    segs = {layout: e2e_segments(_dict(row.get(layout))) for layout in ("pd", "colocated")}
    if at is None or any(v is None for v in segs.values()):
        p.missing.append("pd: results.e2e.verdict.rate and its rows' breakdown")
    else:
        colors = plt.get_cmap("tab10")
        named: set[str] = set()
        for i, layout in enumerate(("pd", "colocated")):
            left = 0.0
            for j, name in enumerate(_SEGMENTS):
                v = (segs[layout] or {}).get(name)
                if v is None:
                    continue
                where.barh(i, v, left=left, color=colors(j), label=None if name in named else name)
                named.add(name)
                left += v
        where.set_yticks([0, 1], ["kvport PD", "colocated"])
        where.set_xlabel(f"mean TTFT at {at} req/s, where it went (s)")
        where.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)
    for ax in (ttft, good, where):
        ax.grid(alpha=0.3)
    return fig


# ---------------------------------------------------------------------- the simulator against measurements
def _simulated_vs_measured(f: dict[str, Fields]) -> Figure | None:
    s = f["simulate"]
    panels: list[tuple[str, list[tuple[float, float, str]]]] = []
    pub = s.get("results.published.cases", [], need=False)
    pts = [(_num(c.get("published")), _num(c.get("predicted")), "o" if str(c.get("case", "")).startswith("ttft")
            else "s") for c in pub if isinstance(c, dict)]
    panels.append(("Mooncake vLLM v1 PD page (s)\n(circles TTFT, squares KV transfer)",
                   [(a, b, m) for a, b, m in pts if a and b]))
    demo = s.get("results.demo.turns", [], need=False)
    panels.append(("the demo run here: TTFT per turn (s)",
                   [(a, b, "o") for a, b in ((_num(t.get("measured_s")), _num(t.get("predicted_s")))
                                             for t in demo if isinstance(t, dict)) if a and b]))
    load = s.get("results.load.cells", [], need=False)
    panels.append(("bench pd's rates: goodput (req/s)\n(circles PD, squares colocated)",
                   [(a, b, "o" if c.get("layout") == "pd" else "s")
                    for c in load if isinstance(c, dict)
                    for a, b in [(_num(c.get("measured_goodput_rps")), _num(c.get("predicted_goodput_rps")))]
                    if a and b]))
    panels = [p for p in panels if p[1]]
    if not panels:
        return None
    fig, axes = _figure(len(panels), width=4.2, height=4.0)
    for ax, (title, xs) in zip(axes, panels, strict=True):
        lo = min(min(a, b) for a, b, _ in xs) / 1.5
        hi = max(max(a, b) for a, b, _ in xs) * 1.5
        ax.fill_between([lo, hi], [lo / 2, hi / 2], [lo * 2, hi * 2], color="#e8e8e8", label="within 2x")
        ax.plot([lo, hi], [lo, hi], color="#888888", lw=1)
        for marker in ("o", "s"):
            sel = [(a, b) for a, b, m in xs if m == marker]
            if sel:
                ax.scatter([a for a, _ in sel], [b for _, b in sel], marker=marker, color="#3b75af", s=22)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("measured / published")
        ax.set_ylabel("predicted by kvport simulate")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    return fig


FIGURES: tuple[FigureSpec, ...] = (
    FigureSpec("ttft_vs_length", "Time to first token against prompt length", ("planner",),
               "Each option really run at each length and link speed (medians); circled: what the planner "
               "chose, online, before running it.", _ttft_vs_length),
    FigureSpec("hit_rate_vs_capacity", "Prefix-hit rate against capacity, per eviction policy", ("trace",),
               "Real request traces replayed through the store's eviction; dashed: the offline optimum.",
               _hit_rate_vs_capacity),
    FigureSpec("throughput_vs_limit", "Each tier and transport against its physical limit",
               ("tiers", "transfer"), "The limit is measured in the same run on the same bytes.",
               _throughput_vs_limit),
    FigureSpec("codec_size_quality", "KV codecs: size against quality", ("codec",),
               "Quality measured on the reference model (perplexity change; 0 is lossless).", _codec_size_quality),
    FigureSpec("overload_over_time", "Memory and goodput over time under 3x overload", ("transfer",),
               "With backpressure memory stays within the receive budget and nothing is lost; without it the "
               "receiver fills its physical cap and drops requests.", _overload_over_time),
    FigureSpec("pd_end_to_end", "Prefill/decode disaggregation as a client sees it", ("pd",),
               "The same shared-prefix multi-turn chats at each request rate, through kvport proxy to a prefill "
               "and a decode engine, and straight to one engine on every core with vLLM's prefix cache; right: "
               "where the mean time to first token went (the engines' and the proxy's /metrics).", _pd_end_to_end),
    FigureSpec("simulated_vs_measured", "The simulator's predictions against measurements", ("simulate",),
               "kvport simulate configured as each measured deployment: the diagonal is a perfect prediction, "
               "the band a factor of 2.", _simulated_vs_measured),
    FigureSpec("demo_ttft_per_turn", "The demo: time to first token per turn", ("demo",),
               "Multi-turn chats and an agent session on the reference model, with kvport's reuse and without.",
               _demo_ttft_per_turn),
)


def _svg(fig: Figure) -> str:
    buf = io.StringIO()
    fig.tight_layout()
    fig.savefig(buf, format="svg")
    plt.close(fig)
    return buf.getvalue()


def draw_all(inputs: Inputs, figures: Sequence[FigureSpec] = FIGURES) -> list[Drawn]:
    """Every figure whose suites include one that was read; the others are listed as not run."""
    out: list[Drawn] = []
    for spec in figures:
        present = tuple(s for s in spec.suites if s in inputs.reports)
        d = Drawn(spec.key, spec.title, present, spec.caption)
        if not present:
            d.missing.append(f"not run: kvport bench {' / '.join(spec.suites)}")
            out.append(d)
            continue
        fields = {s: Fields(inputs.reports[s]) for s in present}
        try:
            fig = spec.draw(fields)
            if fig is not None:
                d.svg = _svg(fig)
        except Exception as exc:
            d.svg = None
            d.missing.append(f"unreadable fields ({type(exc).__name__}: {str(exc)[:200]})")
        finally:
            plt.close("all")
        for fl in fields.values():
            d.missing.extend(fl.missing)
        out.append(d)
    return out


def reports_of(inputs: Inputs, d: Drawn) -> list[SuiteReport]:
    return [inputs.reports[s] for s in d.suites]
