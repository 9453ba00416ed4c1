"""``kvport calibrate``: measure this machine and save the planner's profile (``Settings.profile_path``).

Codec quality costs come from ``kvport eval quality`` results: ``--quality PATH`` (repeatable, the
last file wins for a codec measured twice), else the measured defaults shipped with kvport; a codec
with no result is left out of the profile and the output says so."""

from __future__ import annotations

import json

import click

from kvport.cli._params import writable_file
from kvport.config import Settings
from kvport.errors import ProfileError, UserInputError
from kvport.spec import from_hf_config
from kvport.units import format_bytes, format_seconds


@click.command()
@click.option("--profile", "profile_path", default=None, type=click.Path(dir_okay=False),
              help="where to save (default: $KVPORT_PROFILE or ~/.cache/kvport/profile.json)")
@click.option("--threads", default=None, type=click.IntRange(1, 256), help="torch threads (default: the engine's)")
@click.option("--quick", is_flag=True, help="short prompts, one trial (a smoke run, not a usable profile)")
@click.option("--no-codecs", is_flag=True, help="skip codec speed measurements")
@click.option("--quality", "quality_paths", multiple=True, type=click.Path(dir_okay=False), metavar="PATH",
              help="`kvport eval quality --json` result for codec quality costs (repeatable; "
                   "default: kvport's measured defaults)")
@click.option("--json", "as_json", is_flag=True, help="print the profile as JSON")
def calibrate_cmd(profile_path: str | None, threads: int | None, quick: bool, no_codecs: bool,
                  quality_paths: tuple[str, ...], as_json: bool) -> None:
    """Measure prefill speed of the reference model, tier and link bandwidths, codec speeds; save a profile."""
    import torch

    from kvport.planner.quality import default_results, load_results

    settings = Settings.from_env()
    path = profile_path or str(settings.profile_path)
    writable_file(path, "--profile")  # now, not after minutes of measuring
    try:  # read before any measurement: a bad file fails at once
        quality = load_results(quality_paths) if quality_paths else default_results()
    except ProfileError as exc:
        raise UserInputError(str(exc)) from exc
    if threads is not None:
        torch.set_num_threads(threads)
    from kvport.engines.hf.cache import use_gqa_attention  # torch: lazily
    from kvport.planner.calibrate import PrefillPlan, calibrate, codecs_left_out, reference_ids
    from kvport.refmodel import MODEL_ID, load

    model, tok = load(settings.model_dir)
    use_gqa_attention(model)  # measure the attention kvport's transformers engine runs, not stock sdpa
    spec = from_hf_config(settings.model_dir, dtype="fp32", model_id=MODEL_ID)
    plan = PrefillPlan(lengths=(16, 32, 64), incremental=((32, 16),), trials=1) if quick else PrefillPlan()
    ids = reference_ids(tok, plan.max_tokens)
    say = (lambda m: None) if as_json else (lambda m: click.echo(f"measuring {m} ...", err=True))
    try:
        prof = calibrate(model, ids, spec, plan=plan, tier_folder=settings.home / "calibrate",
                         link_probe_bytes=(4 << 20) if quick else (32 << 20),
                         tier_bytes=(8 << 20) if quick else (64 << 20), codecs=not no_codecs, quality=quality,
                         progress=say)
    except ProfileError as exc:  # results of another model than the one calibrated
        raise UserInputError(str(exc)) from exc
    try:
        prof.save(path)
    except ProfileError as exc:
        raise UserInputError(f"--profile {path}: {exc}") from exc
    left_out = {} if no_codecs else codecs_left_out(quality)
    if as_json:
        click.echo(json.dumps(prof.as_dict(), indent=2))
        for name, why in left_out.items():  # stdout stays the profile alone
            click.echo(f"codec {name} left out of the profile: {why}", err=True)
        return
    pf = prof.prefill
    lines = [f"profile saved to {path} (machine {prof.machine})"]
    if pf is not None:
        lines.append(f"prefill {pf.model_id} ({pf.threads} threads): t(s,e) = {pf.a:.4g} + {pf.x:.4g} [s>0] + "
                     f"{pf.b:.4g} q + {pf.c:.4g} q^2 + {pf.d:.4g} q s   (q = e - s)")
        for p in pf.points:
            lines.append(f"  [{p.start:5d}, {p.end:5d})  measured {format_seconds(p.seconds):>11}  "
                         f"model {format_seconds(pf.seconds(p.start, p.end)):>11}")
    for lk in prof.links:
        lines.append(f"{lk.kind.value:4} {lk.name:9} {format_bytes(lk.bandwidth)}/s, "
                     f"latency {format_seconds(lk.latency)}")
    for c in prof.codecs:
        lines.append(f"codec {c.name:8} ratio {c.ratio:.2f}x  encode {format_bytes(c.encode_bps)}/s  "
                     f"decode {format_bytes(c.decode_bps)}/s  quality +{c.quality_cost:.2%}  [{c.quality_source}]")
    for name, why in left_out.items():
        lines.append(f"codec {name:8} left out: {why}")
    if prof.install_bps:
        lines.append(f"install (block bytes -> DynamicCache) {format_bytes(prof.install_bps)}/s")
    click.echo("\n".join(lines))
