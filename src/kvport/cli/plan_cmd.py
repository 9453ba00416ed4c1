"""``kvport plan``: what-if: the planner's options, predicted times, choice and crossover for one request."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from kvport.cli._params import as_bandwidth, as_seconds_or_zero
from kvport.config import Settings
from kvport.errors import PlanInputError, ProfileError, UserInputError
from kvport.planner import Cached, Link, LinkKind, Load, Planner, Profile, Request, crossover, machine_id
from kvport.spec import preset_names, resolve
from kvport.units import format_bytes, format_seconds


@click.command()
@click.option("--model", required=True, help=f"preset ({', '.join(preset_names())}) or a config.json path")
@click.option("--tokens", required=True, type=click.IntRange(min=1), help="prompt length")
@click.option("--cached", required=True, type=click.IntRange(min=0),
              help="leading prompt tokens whose KV a peer holds")
@click.option("--bandwidth", default=None, callback=as_bandwidth, metavar="BANDWIDTH",
              help="what-if link bandwidth, e.g. 100MB/s, 25Gbps "
              "(default: the profile's measured loopback link)")
@click.option("--latency", default=None, type=float, callback=as_seconds_or_zero,
              help="what-if link latency in seconds, with --bandwidth (default: measured)")
@click.option("--dtype", default=None, help="KV dtype (default: the model's; the reference model runs fp32)")
@click.option("--profile", "profile_path", default=None, type=click.Path(dir_okay=False),
              help="calibration profile (default: $KVPORT_PROFILE)")
@click.option("--compute-queue", default=0, type=click.IntRange(min=0), show_default=True,
              help="requests sharing the prefill compute")
@click.option("--max-quality-cost", default=0.0, type=float, show_default=True,
              help="relative perplexity increase a codec may cost (0: lossless only)")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def plan(model: str, tokens: int, cached: int, bandwidth: float | None, latency: float | None, dtype: str | None,
         profile_path: str | None, compute_queue: int, max_quality_cost: float, as_json: bool) -> None:
    """Options (recompute, load, load+codec, split), predicted seconds, the choice and the crossover length."""
    if latency is not None and bandwidth is None:
        raise click.BadParameter("is the what-if link's latency: give --bandwidth too", param_hint="'--latency'")
    spec = resolve(model, dtype=dtype)
    path = Path(profile_path) if profile_path else Settings.from_env().profile_path
    try:
        profile: Profile | None = Profile.load(path)
    except ProfileError as exc:
        if profile_path:  # asked for this file explicitly: a bad one is the user's error
            raise UserInputError(str(exc)) from exc
        profile = None
    source = "loopback"
    if bandwidth is not None and profile is not None:
        measured = profile.link("loopback")
        lat = latency if latency is not None else (measured.latency if measured else 0.0)
        profile = profile.with_link(Link("peer", LinkKind.PEER, bandwidth, lat, time.time(),
                                         source="what-if"))
        source = "peer"
    try:
        req = Request(tokens, spec, (Cached(source, cached),), max_quality_cost=max_quality_cost)
        planner = Planner(profile, machine=machine_id())
        decision = planner.decide(req, Load(compute_queue=compute_queue))
        suffix = max(1, tokens - cached)
        cross = crossover(profile, spec, source, suffix, hi=max(131072, 4 * tokens),
                          load=Load(compute_queue=compute_queue), fresh=planner.freshness())
    except PlanInputError as exc:
        raise UserInputError(str(exc)) from exc
    if as_json:
        out = {"model": spec.model_id, "dtype": spec.dtype.value, "tokens": tokens, "cached": cached,
               "source": source, "bandwidth_bytes_per_second": bandwidth,
               "profile": str(path), **decision.as_dict(),
               "crossover": {"suffix_tokens": suffix, "lengths": list(cross.lengths),
                             "recompute_wins_at_shortest": cross.recompute_wins_at_lo, "text": cross.describe()}}
        click.echo(json.dumps(out, indent=2))
        return
    link = profile.link(source) if profile else None
    where = f"{format_bytes(link.bandwidth)}/s ({link.source})" if link else "unmeasured link"
    lines = [f"model     {spec.model_id} ({spec.dtype.value}), {tokens} prompt tokens, {cached} cached on "
             f"{source} at {where}",
             f"KV        {format_bytes(spec.request_bytes(cached))} cached",
             f"profile   {path}: {decision.status.value}" + (f" ({'; '.join(decision.warnings)})"
                                                             if decision.warnings else ""),
             "", f"{'option':22} {'predicted':>12}  note"]
    for o in decision.options:
        secs = "unknown" if o.seconds is None else format_seconds(o.seconds)
        mark = "*" if o == decision.choice else " "
        lines.append(f"{mark} {o.label:20} {secs:>12}  {o.note}")
    lines += ["", f"choice    {decision.choice.label}: {decision.reason}",
              f"crossover (uncached suffix fixed at {suffix} tokens): {cross.describe()}"]
    click.echo("\n".join(lines))
