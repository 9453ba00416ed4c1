"""``kvport plan``: what-if: the planner's options, predicted times, choice and crossover for one request.

Where the prefill model comes from (``basis``)::

    no --device                  the calibration profile's (unknown without one: recompute, safe default)
    --device h100 (any preset)   the roofline of the model on that preset (kvport.planner.roofline)
    --device cpu                 the profile's, when it holds a fresh one of this model on this machine
                                 ("calibrated"); else the roofline of this CPU, measured now

With the roofline, the link is ``--bandwidth`` (what-if) or else the device's interconnect, and the
profile holds nothing else (no codecs, no install rate: those were measured on this CPU).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from kvport.cli._params import as_bandwidth, as_device, as_dtype, as_fraction, as_seconds_or_zero
from kvport.config import Settings
from kvport.errors import DeviceDTypeError, PlanInputError, ProfileError, UserInputError
from kvport.planner import (
    Cached,
    Freshness,
    Link,
    LinkKind,
    Load,
    Planner,
    Profile,
    Request,
    Roofline,
    accelerator,
    crossover,
    machine_id,
    model_arch,
)
from kvport.planner.cost import usable_prefill
from kvport.planner.devices import CPU, measure_cpu
from kvport.planner.roofline import DEFAULT_PREFILL_EFFICIENCY
from kvport.spec import preset_names, resolve
from kvport.units import format_bytes, format_seconds


def _load_profile(profile_path: str | None) -> tuple[Path, Profile | None]:
    path = Path(profile_path) if profile_path else Settings.from_env().profile_path
    try:
        return path, Profile.load(path)
    except ProfileError as exc:
        if profile_path:  # asked for this file explicitly: a bad one is the user's error
            raise UserInputError(str(exc)) from exc
        return path, None


def _what_if(profile: Profile | None, bandwidth: float | None, latency: float | None,
             now: float) -> tuple[Profile | None, str]:
    """The profile with a what-if link ``peer`` (--bandwidth; latency default: the measured loopback's)
    and the name of the link the cached KV sits on."""
    if bandwidth is None or profile is None:
        return profile, "loopback"
    measured = profile.link("loopback")
    lat = latency if latency is not None else (measured.latency if measured else 0.0)
    return profile.with_link(Link("peer", LinkKind.PEER, bandwidth, lat, now, source="what-if")), "peer"


def _roofline_profile(roof: Roofline, bandwidth: float | None, latency: float | None, now: float) -> Profile:
    """The roofline's prefill model and one link ``peer``: --bandwidth, else the device's interconnect."""
    acc = roof.accelerator
    bw, src = (acc.interconnect, f"{acc.name} interconnect") if bandwidth is None else (bandwidth, "what-if")
    link = Link("peer", LinkKind.PEER, bw, latency or 0.0, now, source=src)
    return Profile(machine=machine_id(), created=now, prefill=roof.prefill_model(now), links=(link,))


def _roofline_lines(roof: Roofline, capacity: int, tokens: int) -> list[str]:
    acc = roof.accelerator
    peak = acc.peak_flops(roof.dtype) / 1e12
    over = f" (this prompt's {tokens:,} do not fit)" if tokens > capacity else ""
    return [f"basis     {roof.basis}: {acc.product}, {roof.dtype} {peak:,.1f} TFLOP/s dense x "
            f"{roof.prefill_efficiency:g}, {acc.memory_bandwidth / 1e12:.3g} TB/s x "
            f"{roof.decode_bandwidth_efficiency:g}, tp {roof.tp}",
            f"memory    {format_bytes(roof.weight_bytes_per_device)} of weights, room for {capacity:,} tokens of KV "
            f"per device{over}",
            f"source    {acc.source}"]


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
@click.option("--device", default=None, callback=as_device, metavar="NAME",
              help="predict the prefill from the roofline of this accelerator (h100, h200, h800, a100, l40s, "
              "mi300x) or of this CPU (cpu: its calibration when one fits the model)")
@click.option("--efficiency", default=None, type=float, callback=as_fraction,
              help=f"with --device: fraction of peak FLOP/s a prefill reaches (default {DEFAULT_PREFILL_EFFICIENCY})")
@click.option("--tp", default=None, type=click.IntRange(min=1),
              help="with --device: tensor-parallel devices (default 1); KV moves per device")
@click.option("--weights-dtype", default=None, help="with --device: dtype of the weights and matmuls "
              "(default: the model's)")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def plan(model: str, tokens: int, cached: int, bandwidth: float | None, latency: float | None, dtype: str | None,
         profile_path: str | None, compute_queue: int, max_quality_cost: float, device: str | None,
         efficiency: float | None, tp: int | None, weights_dtype: str | None, as_json: bool) -> None:
    """Options (recompute, load, load+codec, split), predicted seconds, the choice and the crossover length."""
    for flag, value in (("--efficiency", efficiency), ("--tp", tp), ("--weights-dtype", weights_dtype)):
        if value is not None and device is None:
            raise click.BadParameter("applies to the roofline: give --device too", param_hint=f"'{flag}'")
    if device == CPU and tp not in (None, 1):
        raise click.BadParameter("cpu is one device: --tp applies to accelerator presets", param_hint="'--tp'")
    if weights_dtype is not None:
        weights_dtype = as_dtype(weights_dtype, "--weights-dtype")
    spec = resolve(model, dtype=dtype, tp_size=tp or 1)
    now = time.time()
    path, profile = (None, None) if device not in (None, CPU) else _load_profile(profile_path)
    calibrated, why = usable_prefill(profile, spec, Freshness(now=now, machine=machine_id()))
    roof: Roofline | None = None
    if device is None or calibrated is not None:
        if latency is not None and bandwidth is None:
            raise click.BadParameter("is the what-if link's latency (the prefill is calibrated, the link measured): "
                                     "give --bandwidth too", param_hint="'--latency'")
        profile, source = _what_if(profile, bandwidth, latency, now)
        basis: dict[str, object] = {"basis": f"calibrated ({path})" if calibrated else f"unknown ({why})",
                                    "calibrated": calibrated is not None, "device": device}
    else:
        arch = model_arch(model)
        try:
            roof = Roofline(arch, measure_cpu() if device == CPU else accelerator(device),
                            weights_dtype or arch.dtype.value, tp=tp or 1, kv_dtype=spec.dtype.value,
                            prefill_efficiency=efficiency or DEFAULT_PREFILL_EFFICIENCY)
        except DeviceDTypeError as exc:
            raise click.BadParameter(f"{exc} (the model's weights are {arch.dtype.value}): pick one",
                                     param_hint="'--weights-dtype'") from exc
        capacity = roof.kv_capacity_tokens()  # ModelTooLargeError: the weights leave no room for KV
        profile, source = _roofline_profile(roof, bandwidth, latency, now), "peer"
        basis = {**roof.as_dict(), "kv_capacity_tokens": capacity, "prompt_fits": tokens <= capacity,
                 "why_not_calibrated": why if device == CPU else None}
    link = profile.link(source) if profile else None
    if link is not None:
        basis["link"] = {"name": link.name, "bandwidth_bytes_per_second": link.bandwidth, "latency": link.latency,
                         "source": link.source}
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
               "profile": None if path is None else str(path), "basis": basis, **decision.as_dict(),
               "crossover": {"suffix_tokens": suffix, "lengths": list(cross.lengths),
                             "recompute_wins_at_shortest": cross.recompute_wins_at_lo, "text": cross.describe()}}
        click.echo(json.dumps(out, indent=2))
        return
    where = f"{format_bytes(link.bandwidth)}/s ({link.source})" if link else "unmeasured link"
    lines = [f"model     {spec.model_id} ({spec.dtype.value}), {tokens} prompt tokens, {cached} cached on "
             f"{source} at {where}",
             f"KV        {format_bytes(spec.request_bytes(cached))} cached",
             *(_roofline_lines(roof, capacity, tokens) if roof is not None else [f"basis     {basis['basis']}"]),
             *([] if path is None else [f"profile   {path}: {decision.status.value}"
                                        + (f" ({'; '.join(decision.warnings)})" if decision.warnings else "")]),
             "", f"{'option':22} {'predicted':>12}  note"]
    for o in decision.options:
        secs = "unknown" if o.seconds is None else format_seconds(o.seconds)
        mark = "*" if o == decision.choice else " "
        lines.append(f"{mark} {o.label:20} {secs:>12}  {o.note}")
    lines += ["", f"choice    {decision.choice.label}: {decision.reason}",
              f"crossover (uncached suffix fixed at {suffix} tokens): {cross.describe()}"]
    click.echo("\n".join(lines))
