"""``kvport simulate``: replay a request trace through a simulated prefill/decode deployment."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from kvport.cli._params import as_bandwidth, as_device, as_fraction, as_seconds, as_seconds_or_zero
from kvport.config import Settings
from kvport.spec import preset_names


@click.command("simulate")
@click.option("--trace", "trace_path", default=None, type=click.Path(dir_okay=False),
              help="Mooncake-format JSONL (.xz too); default: the conversation trace of a checkout")
@click.option("--limit", default=None, type=click.IntRange(min=1), help="first N requests only")
@click.option("--scale", default=1.0, type=float, show_default=True,
              help="multiply arrival times (0.5: twice the trace's rate)")
@click.option("--model", default="llama-3.1-8b", show_default=True,
              help=f"preset ({', '.join(preset_names())}) or a config.json path")
@click.option("--device", default="h100", show_default=True, callback=as_device,
              help="accelerator of every engine (h100, h200, h800, a100, l40s, mi300x, cpu)")
@click.option("--dtype", default=None, help="weights/compute dtype (default: the model's; cpu: fp32)")
@click.option("--tp", default=1, type=click.IntRange(min=1), show_default=True, help="tensor-parallel size per engine")
@click.option("--efficiency", default=0.5, type=float, callback=as_fraction, show_default=True,
              help="fraction of peak FLOP/s a prefill reaches (the roofline's MFU assumption)")
@click.option("--prefill", "n_prefill", default=1, type=click.IntRange(min=1), show_default=True,
              help="prefill engines (colocated: engines)")
@click.option("--decode", "n_decode", default=None, type=click.IntRange(min=1),
              help="decode engines [default: 1; not with --colocated]")
@click.option("--colocated", is_flag=True, help="no disaggregation: --prefill engines do prefill and decode")
@click.option("--link", "link_bps", default=None, callback=as_bandwidth, metavar="BANDWIDTH",
              help="prefill -> decode link per decode engine, e.g. 25Gbps (default: the device's interconnect)")
@click.option("--link-latency", default=0.0, type=float, callback=as_seconds_or_zero, show_default=True,
              help="seconds before a hand-off's first byte")
@click.option("--stream", default="layerwise", type=click.Choice(["layerwise", "after"]), show_default=True,
              help="hand-off overlapped with the prefill, or after it")
@click.option("--tier", "tiers", multiple=True, metavar="NAME:SCOPE:CAPACITY:BANDWIDTH[:LATENCY_S[:POLICY]]",
              help="a cache tier below the device, top first (repeatable), e.g. pool:shared:2TiB:100Gbps:0.0002")
@click.option("--device-cache", default="auto", show_default=True,
              help="each engine's own prefix cache in tokens, or auto (half the KV room next to the weights)")
@click.option("--max-batch", default=256, type=click.IntRange(min=1), show_default=True)
@click.option("--no-planner", is_flag=True, help="always load what a tier holds (no load-vs-recompute choice)")
@click.option("--codec-ratio", default=None, type=float, help="hand-off codec: bytes ratio (e.g. 2 for int8 of bf16)")
@click.option("--codec-speed", default=None, callback=as_bandwidth, metavar="BANDWIDTH",
              help="hand-off codec: encode and decode speed")
@click.option("--slo-ttft", default=2.0, type=float, callback=as_seconds, show_default=True, help="TTFT limit, s")
@click.option("--slo-tpot", default=0.1, type=float, callback=as_seconds, show_default=True, help="TPOT limit, s")
@click.option("--profile", "profile_path", default=None, type=click.Path(dir_okay=False),
              help="calibration profile for --device cpu (default: $KVPORT_PROFILE)")
@click.option("--sweep", "sweep_spec", default=None, metavar="SPEC",
              help="grid: 'ratio=1:1,1:2,2:1,2c;tier=1TiB,4TiB;link=25Gbps,100Gbps' -> the most goodput per device")
@click.option("--max-goodput", is_flag=True, help="also find the highest rate multiple still meeting the SLO")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def simulate_cmd(trace_path: str | None, limit: int | None, scale: float, model: str, device: str, dtype: str | None,
                 tp: int, efficiency: float, n_prefill: int, n_decode: int | None, colocated: bool,
                 link_bps: float | None, link_latency: float, stream: str, tiers: tuple[str, ...], device_cache: str,
                 max_batch: int,
                 no_planner: bool, codec_ratio: float | None, codec_speed: float | None, slo_ttft: float,
                 slo_tpot: float, profile_path: str | None, sweep_spec: str | None, max_goodput: bool,
                 as_json: bool) -> None:
    """TTFT/TPOT percentiles, goodput at the SLO, hits per tier, bytes per link and backpressure of a
    deployment replaying a trace; --sweep finds the P:D ratio, tier size and link with the most goodput
    per device."""
    from dataclasses import replace

    from kvport.bench.trace import find_trace
    from kvport.sim import SLO, CodecSpec, Deployment, Simulator, read_trace, summarize
    from kvport.sim import max_goodput as find_max
    from kvport.sim.build import compute_for, device_cache_tokens, link_of, parse_tier
    from kvport.sim.sweep import Grid, sweep
    from kvport.units import parse_bandwidth

    if colocated and n_decode is not None:
        raise click.BadParameter("colocated engines decode themselves: leave --decode out", param_hint="'--decode'")
    if (codec_ratio is None) != (codec_speed is None):
        raise click.BadParameter("give --codec-ratio and --codec-speed together", param_hint="'--codec-ratio'")
    settings = Settings.from_env()
    path = find_trace(trace_path, settings)
    t0 = time.perf_counter()
    trace = read_trace(path, limit=limit, scale=scale)
    compute, roof, why = compute_for(model, device, dtype=dtype, tp=tp, efficiency=efficiency,
                                     profile_path=Path(profile_path) if profile_path else settings.profile_path,
                                     explicit_profile=profile_path is not None)
    link, link_from = link_of(link_bps, link_latency, roof)
    codec = None if codec_ratio is None or codec_speed is None else CodecSpec("codec", codec_ratio, codec_speed,
                                                                               codec_speed)
    dep = Deployment(roof.kv_spec, compute, compute, prefill=n_prefill, decode=n_decode or 1,
                     mode="colocated" if colocated else "pd", link=link,
                     tiers=tuple(parse_tier(t) for t in tiers),
                     device_cache_tokens=device_cache_tokens(device_cache, roof),
                     decode_kv_tokens=roof.kv_capacity_tokens(), max_batch=max_batch, stream=stream,
                     codec=codec, planner=not no_planner, slo=SLO(slo_ttft, slo_tpot))
    conditions: dict[str, Any] = {
        "trace": str(path), "requests": len(trace), "scale": scale, "model": roof.arch.model_id,
        "device": roof.accelerator.as_dict(), "dtype": roof.dtype, "tp": tp, "compute": compute.basis,
        **({"why_not_calibrated": why} if why else {}),
        "mode": dep.mode, "prefill": dep.prefill, "decode": dep.decode if dep.mode == "pd" else 0,
        "link": {"bytes_per_second": link.bandwidth, "latency_s": link.latency, "from": link_from},
        "tiers": [{"name": t.name, "scope": t.scope, "capacity_bytes": t.capacity_bytes,
                   "bytes_per_second": t.read.bandwidth, "latency_s": t.read.latency, "policy": t.policy}
                  for t in dep.tiers],
        "device_cache_tokens": dep.device_cache_tokens, "decode_kv_tokens": dep.decode_kv_tokens,
        "stream": stream, "planner": dep.planner, "block_tokens": dep.block_tokens}
    out: dict[str, Any] = {"conditions": conditions}
    say = (lambda m: None) if as_json else (lambda m: click.echo(m, err=True))
    if sweep_spec:
        grid = Grid.parse(sweep_spec, parse_bandwidth)
        out["sweep"] = sweep(dep, grid, trace, progress=say)
    else:
        sim = Simulator(dep)
        out["results"] = summarize(sim, sim.run(trace))
        if max_goodput:
            span = trace[-1].arrival_s - trace[0].arrival_s
            base = len(trace) / span if span > 0 else 0.0

            def run_at(x: float) -> dict[str, Any]:
                s = Simulator(dep)
                return summarize(s, s.run([replace(r, arrival_s=r.arrival_s / x) for r in trace]))

            out["max_goodput"] = find_max(run_at, base_rps=base)
    out["wall_seconds"] = round(time.perf_counter() - t0, 3)
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(_text(out))


def _text(out: dict[str, Any]) -> str:
    c = out["conditions"]
    head = (f"{c['requests']} requests of {Path(c['trace']).name} (x{c['scale']:g} time) on "
            f"{c['model']}, {c['device']['name']} {c['dtype']} tp={c['tp']}: {c['compute']}\n"
            f"{c['mode']}: {c['prefill']} prefill + {c['decode']} decode engines, link "
            f"{c['link']['bytes_per_second'] / 1e9:.1f} GB/s ({c['link']['from']}), tiers "
            f"{', '.join(t['name'] for t in c['tiers']) or 'none'}")
    if "sweep" in out:
        rows = [f"{'cell':>6} {'devices':>7} {'tier':>12} {'link GB/s':>9} {'goodput/dev':>11} {'SLO met':>7} "
                f"{'TTFT p90':>9}"]
        for r in out["sweep"]["cells"]:
            tier = "-" if r["shared_tier_bytes"] is None else f"{r['shared_tier_bytes'] / 2**40:.2f}TiB"
            link = "-" if r["link_bytes_per_second"] is None else f"{r['link_bytes_per_second'] / 1e9:.1f}"
            rows.append(f"{r['ratio']:>6} {r['devices']:>7} {tier:>12} {link:>9} {r['goodput_rps_per_device']:>11.4f} "
                        f"{r['slo_attainment']:>7.1%} {r['ttft_p90_s'] or 0:>8.3f}s")
        b = out["sweep"]["best"]
        return "\n".join([head, "", *rows, "", f"best: {b['ratio']} ({b['goodput_rps_per_device']} req/s per device)",
                          f"simulated in {out['wall_seconds']} s"])
    r = out["results"]
    lines = [head, "",
             f"TTFT   mean {r['ttft_s']['mean']:.3f} s  p50 {r['ttft_s']['p50']:.3f}  p90 {r['ttft_s']['p90']:.3f}  "
             f"p99 {r['ttft_s']['p99']:.3f}",
             f"TPOT   mean {(r['tpot_s']['mean'] or 0) * 1e3:.1f} ms  p90 {(r['tpot_s']['p90'] or 0) * 1e3:.1f} ms",
             f"SLO    {r['slo_met']}/{r['requests']} within TTFT <= {r['slo']['ttft_s']} s and TPOT <= "
             f"{r['slo']['tpot_s']} s ({r['slo_attainment']:.1%}); goodput {r['goodput_rps']} req/s, "
             f"{r['goodput_rps_per_device']} per device",
             f"hits   {r['hit_rate_tokens']:.1%} of prompt tokens: "
             + ", ".join(f"{k} {v:.1%}" for k, v in r["hit_rate_by_tier"].items()),
             f"choice {r['planner_choices']}",
             "bytes  " + ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in r["bytes"].items()),
             f"queue  prefill wait p90 {r['queueing']['prefill_wait_s']['p90'] or 0:.3f} s, decode busy "
             f"{r['queueing']['decode_busy_share']:.0%}, max batch {r['queueing']['decode_max_batch']}",
             f"backpressure {r['backpressure']}"]
    if "max_goodput" in out:
        m = out["max_goodput"]
        lines.append(f"max rate meeting the SLO: {m['rate_multiple']}x the trace ({m['rate_rps']} req/s)")
    lines.append(f"simulated in {out['wall_seconds']} s")
    return "\n".join(lines)
